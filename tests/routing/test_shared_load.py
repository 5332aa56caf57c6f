"""The shared in-flight view against a real redis-server: sidecars see each other's load, never their own, drop a
silent peer, make one round trip per interval, and survive Redis being killed and restarted."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from extproc.admission.placement import Placer
from extproc.config import PolicyError, parse_section, policy_from_dict
from extproc.request import LLMRequest
from extproc.routing.policy import SharedLoadPolicy
from extproc.routing.pool import EngineState, Pool, Replica
from extproc.routing import shared_load
from extproc.routing.shared_load import Load, SharedLoad, _encode, _merge, redis_client
from tests.budgets.conftest import redis_proc, redis_server  # noqa: F401  (fixtures: a real redis-server)
from tests.waiting import wait_for_async


class Sidecar:
    """A sidecar's in-flight accounting, as the gateway's pools would report it."""

    def __init__(self) -> None:
        self.load: dict[str, dict[str, tuple[int, int]]] = {}

    def __call__(self) -> dict[str, dict[str, tuple[int, int]]]:
        return self.load


@pytest.fixture
async def make() -> AsyncIterator:
    made: list[SharedLoad] = []
    key = f"test-{uuid.uuid4().hex[:8]}:load"

    def build(url: str, sidecar: Sidecar, name: str, **policy: float) -> SharedLoad:
        s = SharedLoad(redis_client(url), name, sidecar, SharedLoadPolicy(**policy), key=key)
        made.append(s)
        return s

    yield build
    for s in made:
        await s.stop()


async def test_each_sidecar_sees_the_others_load_and_not_its_own(redis_server, make):
    a, b, c = Sidecar(), Sidecar(), Sidecar()
    a.load = {"m": {"r1": (100, 2)}}
    b.load = {"m": {"r1": (50, 1), "r2": (10, 1)}, "n": {"x": (7, 1)}}
    c.load = {"m": {"r2": (0, 0)}}  # idle entries are not published
    views = [make(redis_server.url, s, name) for s, name in ((a, "a"), (b, "b"), (c, "c"))]
    for v in views:
        assert await v.sync_once()
    for v in views:
        await v.sync_once()
    va, vb, vc = views
    assert va.others("m", "r1") == Load(50, 1) and va.others("m", "r2") == Load(10, 1)
    assert va.others("n", "x") == Load(7, 1) and va.peers == 2
    assert vb.others("m", "r1") == Load(100, 2) and vb.others("m", "r2") == Load(0, 0)
    assert vc.others("m", "r1") == Load(150, 3)


async def test_a_silent_sidecar_drops_out_after_stale_after(redis_server, make):
    a, b = Sidecar(), Sidecar()
    b.load = {"m": {"r1": (40, 1)}}
    va = make(redis_server.url, a, "a", interval_s=0.05, stale_after_s=0.3)
    vb = make(redis_server.url, b, "b", interval_s=0.05, stale_after_s=0.3)
    await vb.sync_once()
    await va.sync_once()
    assert va.others("m", "r1") == Load(40, 1)
    await asyncio.sleep(0.4)  # b publishes nothing more (stopped, crashed, lost Redis) for longer than stale_after
    await va.sync_once()
    assert va.others("m", "r1") == Load() and va.peers == 0


def test_the_others_load_counts_in_placement_and_their_growth_between_scrapes():
    """What a replica holds with other sidecars placing on it too: the engine's own numbers at the last scrape
    (which include what everyone had placed before it), plus the other sidecars' growth since that scrape; before
    any scrape, everyone's reservations."""
    r = Replica(address="r1", pool="m", kv_capacity_tokens=10_000)
    pool = Pool(model="m", cluster="pool-m", replicas=[r])
    placer = Placer(pool, parse_section("admission", {}))
    r.place(1000)
    r.note_shared(500, 1)
    assert placer.kv_held(r, 0.5) == 1000 + 500  # never scraped: the reservations in flight
    r.on_scrape(EngineState(scraped_at=1.0, kv_usage=0.15, running=2))  # 1,500 tokens: both sidecars'
    assert placer.kv_held(r, 1.0) == 1500
    r.note_shared(3500, 3)  # the others placed 3,000 more since that scrape
    assert placer.kv_held(r, 1.0) == 1500 + 3000
    r.on_scrape(EngineState(scraped_at=2.0, kv_usage=0.45, running=4))  # the engine now shows them
    assert placer.kv_held(r, 2.0) == 4500
    r.note_shared(0, 0)  # Redis lost (or their requests ended): the engine's numbers only, as a single sidecar
    assert placer.kv_held(r, 2.0) == 4500


def test_reports_carry_the_output_still_to_decode_and_older_reports_without_it_still_count():
    view = _merge([_encode({"m": {"r1": (1100, 1, 690), "r2": (0, 0, 0)}}), b'{"m": {"r1": [300, 1]}}'])
    assert view == {"m": {"r1": Load(1400, 2, 690)}}
    r = Replica(address="r1", pool="m")
    load = view["m"]["r1"]
    r.note_shared(load.tokens, load.requests, load.growth)
    assert (r.shared_tokens, r.shared_requests, r.shared_growth) == (1400, 2, 690)


def test_the_others_requests_count_against_the_concurrency_limit():
    pool = Pool(model="m", cluster="pool-m", replicas=[Replica(address="r1", pool="m"),
                                                       Replica(address="r2", pool="m")])
    placer = Placer(pool, parse_section("admission", {"max_concurrency_per_replica": 4}))
    req = LLMRequest(request_id="x", endpoint="chat", model="m", stream=True, prompt_tokens=10, max_output_tokens=10)
    r1, r2 = pool.replicas
    r1.place(20)
    r1.note_shared(60, 3)  # 1 own + 3 from other gateways = the limit
    assert placer.why_not(r1, req, 0, 0.0, 1.0) == "concurrency"
    assert placer.choose(req, 0, 0.0) == [r2]
    r1.note_shared(0, 0)
    assert placer.why_not(r1, req, 0, 0.0, 1.0) is None


async def test_background_sync_makes_one_round_trip_per_interval(redis_server, make):
    admin = aioredis.from_url(redis_server.url)
    await admin.config_resetstat()
    a = Sidecar()
    a.load = {"m": {"r1": (1, 1)}}
    va = make(redis_server.url, a, "a", interval_s=0.05, stale_after_s=0.5)
    seen = []
    va.listeners.append(seen.append)
    await va.start()
    await asyncio.sleep(1.0)  # the window whose round trips are counted: 20 intervals of 50 ms
    await va.stop()
    stats = await admin.info("commandstats")
    await admin.aclose()
    calls = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    assert 10 <= calls <= 21  # 1 s at one round trip per 50 ms, sequential
    assert 10 <= len(seen) <= calls  # every successful round trip hands the new view to the listeners


async def test_losing_redis_empties_the_view_and_it_comes_back_by_itself(redis_proc, make):
    a, b = Sidecar(), Sidecar()
    b.load = {"m": {"r1": (80, 2)}}
    policy = {"interval_s": 0.05, "stale_after_s": 0.5, "max_backoff_s": 0.2}
    va, vb = make(redis_proc.url, a, "a", **policy), make(redis_proc.url, b, "b", **policy)
    await vb.start()
    await va.start()
    await wait_for_async(lambda: va.others("m", "r1") == Load(80, 2))
    assert va.others("m", "r1") == Load(80, 2)
    views: list[dict] = []
    va.listeners.append(views.append)

    redis_proc.kill()
    await wait_for_async(lambda: va.degraded, 2.0)
    assert va.degraded and va.others("m", "r1") == Load() and views[-1] == {}
    assert REGISTRY.get_sample_value("sluice_shared_load_degraded") == 1
    failures = REGISTRY.get_sample_value("sluice_shared_load_sync_failures_total")
    await asyncio.sleep(0.5)  # backoff: a handful of attempts, not one per 50 ms
    assert REGISTRY.get_sample_value("sluice_shared_load_sync_failures_total") - failures <= 6

    redis_proc.start()  # same port, empty: both sidecars republish on their next round
    await wait_for_async(lambda: not va.degraded and va.others("m", "r1") == Load(80, 2), 4.0)
    assert not va.degraded and va.others("m", "r1") == Load(80, 2)
    assert REGISTRY.get_sample_value("sluice_shared_load_degraded") == 0


async def test_stop_returns_while_a_round_trip_swallows_its_cancellation(redis_server, make, monkeypatch):
    """A round trip stuck in the Redis client (a pool that ignores its cancel) does not hold shutdown: stop()
    returns after STOP_WAIT_S."""
    monkeypatch.setattr(shared_load, "STOP_WAIT_S", 0.2)
    view = make(redis_server.url, Sidecar(), "a", interval_s=0.05, stale_after_s=0.5)
    await view.start()
    entered, release = asyncio.Event(), asyncio.Event()

    async def stuck_round() -> bool:
        entered.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # swallowed, as the stuck client does
        return True

    view.sync_once = stuck_round  # the loop's next round trip
    await asyncio.wait_for(entered.wait(), 2.0)
    t0 = time.monotonic()
    await view.stop()
    assert time.monotonic() - t0 < 1.0
    release.set()  # the stuck round may end now: nothing is left for the loop's teardown to wait for


@pytest.mark.parametrize("bad", [{"interval_s": 1.0, "stale_after_s": 0.5}, {"interval_s": 0.1, "max_backoff_s": 0.05},
                                 {"interval_s": 0}])
def test_policy_bounds(bad):
    with pytest.raises(PolicyError) as exc:
        parse_section("routing", {"shared_load": bad})
    assert "routing.shared_load." in str(exc.value)


async def test_two_gateways_place_around_each_other_and_alone_again_when_redis_is_lost(redis_proc):
    """Two sidecars' Fleets wired as serve() wires them (shared_load_from_policy): the second sees the first's
    requests in flight on a replica and places elsewhere; with Redis gone it is back to its own placements and the
    scrapes (today's behaviour: that replica looks empty again); Redis back, the view returns by itself."""
    from extproc.fleet import Fleet
    from extproc.routing.shared_load import shared_load_from_policy

    data = {"pools": [{"model": "m", "replicas": ["10.5.0.1:8000", "10.5.0.2:8000"]}],
            "admission": {"kv_capacity_tokens": 10_000, "max_concurrency_per_replica": 4},
            "budgets": {"store": {"kind": "redis", "redis": {"url": redis_proc.url,
                                                             "key_prefix": f"t-{uuid.uuid4().hex[:6]}:"}}},
            "routing": {"shared_load": {"interval_s": 0.05, "stale_after_s": 0.5, "max_backoff_s": 0.2}}}
    policy = policy_from_dict(data)
    fleets = [Fleet(policy), Fleet(policy)]
    views = [shared_load_from_policy(policy, i, f) for i, f in enumerate(fleets)]
    assert all(p.turns is None for f in fleets for p in f.placers.values())  # take_turns is off by default
    req = LLMRequest(request_id="x", endpoint="chat", model="m", stream=True, prompt_tokens=500,
                     max_output_tokens=1500)
    one, two = fleets
    r1 = one.pools["m"].replicas[0]
    for _ in range(3):
        one.placers["m"].commit(r1, req, 0, 0.0)  # gateway one: 3 requests, 6,000 tokens on replica 1
    two_r1, two_r2 = two.pools["m"].replicas
    try:
        for v in views:
            await v.start()
        for _ in range(100):
            if two_r1.shared_requests == 3:
                break
            await asyncio.sleep(0.02)
        assert (two_r1.shared_requests, two_r1.shared_tokens) == (3, 6000)
        assert two.placers["m"].kv_held(two_r1, 0.0) == 6000 and two.placers["m"].kv_held(two_r2, 0.0) == 0
        assert two.placers["m"].choose(req, 0, 0.0)[0] is two_r2
        two_r2.note_shared(0, 0)
        # with a fourth request replica 1 would be over the KV limit for gateway two as well
        assert two.placers["m"].why_not(two_r1, LLMRequest(
            request_id="y", endpoint="chat", model="m", stream=True, prompt_tokens=2000, max_output_tokens=2000),
            0, 0.0, 10.0) == "kv_full"

        redis_proc.kill()
        for _ in range(100):
            if views[1].degraded:
                break
            await asyncio.sleep(0.02)
        assert views[1].degraded and two_r1.shared_requests == 0 and two.placers["m"].kv_held(two_r1, 0.0) == 0
        assert two.placers["m"].why_not(two_r1, req, 0, 0.0, 10.0) is None  # alone, as a single sidecar places

        redis_proc.start()
        for _ in range(200):
            if two_r1.shared_requests == 3:
                break
            await asyncio.sleep(0.02)
        assert not views[1].degraded and two_r1.shared_tokens == 6000
    finally:
        for v in views:
            await v.stop()


def test_reports_carry_the_expected_output_so_the_others_prompts_are_known():
    """The fleet publishes (tokens, requests, growth, output); the receiving replica counts tokens - output as
    the others' prompts (kv_committed adds those since the scrape, their outputs being in the growth)."""
    fleet_view = {"m": {"r1": (1100, 1, 690, 700)}}
    view = _merge([_encode(fleet_view), b'{"m": {"r1": [300, 1, 0]}}'])
    assert view == {"m": {"r1": Load(1400, 2, 690, 700)}}
    r = Replica(address="r1", pool="m")
    load = view["m"]["r1"]
    r.note_shared(load.tokens, load.requests, load.growth, load.output)
    assert (r.shared_tokens, r.shared_prompt_tokens) == (1400, 700)  # 400 + the older report's 300 in full
    r.on_scrape(EngineState(scraped_at=1.0))
    assert r.shared_prompt_at_scrape == 700


async def test_each_round_trip_tells_the_turns_redis_clock_and_who_places_in_each_pool(redis_server, make):
    """turns.py's inputs come from the same round trip: Redis' own clock (one clock for every gateway) and, per
    pool, the other sidecars with requests in flight there (an idle one takes no share)."""
    a, b, c = Sidecar(), Sidecar(), Sidecar()
    b.load = {"m": {"r1": (1100, 1)}}
    c.load = {"n": {"x": (300, 1)}}
    va = make(redis_server.url, a, "a")
    vb, vc = make(redis_server.url, b, "b"), make(redis_server.url, c, "c")
    await vb.sync_once()
    await vc.sync_once()
    async with aioredis.from_url(redis_server.url) as client:
        seconds, micros = await client.time()
    assert await va.sync_once()
    assert va.turns.active == {"m": ("a", "b"), "n": ("a", "c")}
    assert va.turns.gateways("m") == 2 and va.turns.gateways("other") == 1
    # The view's clock is Redis' TIME in whole milliseconds: read within the same millisecond, it equals ours truncated.
    assert 0 <= va.turns.view_ms - (seconds * 1000 + micros // 1000) < 1000
    b.load = {}
    await vb.sync_once()
    await va.sync_once()
    assert va.turns.gateways("m") == 1  # b has nothing in flight any more


def test_with_take_turns_every_placer_of_the_fleet_takes_turns_and_keeps_them_across_a_reload():
    from extproc.fleet import Fleet
    from extproc.routing.shared_load import shared_load_from_policy

    policy = policy_from_dict({"pools": [{"model": "m", "replicas": ["10.5.0.1:8000"]},
                                         {"model": "n", "replicas": ["10.5.0.2:8000"]}],
                               "budgets": {"store": {"kind": "redis", "redis": {"url": "redis://127.0.0.1:1"}}},
                               "routing": {"shared_load": {"take_turns": True}}})
    fleet = Fleet(policy)
    shared = shared_load_from_policy(policy, 0, fleet)  # not started: no Redis needed
    assert shared is not None
    turns = shared.turns
    assert all(p.turns is turns for p in fleet.placers.values())
    fleet.rebuild(policy, {name: pool for name, pool in fleet.pools.items()})
    assert all(p.turns is turns for p in fleet.placers.values())
