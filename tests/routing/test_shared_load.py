"""The shared in-flight view against a real redis-server: sidecars see each other's load, never their own, drop a
silent peer, make one round trip per interval, and survive Redis being killed and restarted."""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from extproc.routing.shared_load import Load, SharedLoad, SharedLoadPolicy, redis_client
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
        s = SharedLoad(redis_client(url), name, sidecar, SharedLoadPolicy(key=key, **policy))
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


async def test_since_scrape_is_the_growth_the_scrape_could_not_see(redis_server, make):
    a, b = Sidecar(), Sidecar()
    va, vb = make(redis_server.url, a, "a"), make(redis_server.url, b, "b")
    b.load = {"m": {"r1": (300, 3)}}
    await vb.sync_once()
    await va.sync_once()
    va.note_scrape("m", "r1")  # the scrape already counts b's 300
    assert va.since_scrape("m", "r1") == 0
    b.load = {"m": {"r1": (500, 5)}}
    await vb.sync_once()
    await va.sync_once()
    assert va.since_scrape("m", "r1") == 200
    b.load = {"m": {"r1": (100, 1)}}  # b's requests finished: nothing unseen to add
    await vb.sync_once()
    await va.sync_once()
    assert va.since_scrape("m", "r1") == 0


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


def test_policy_bounds():
    with pytest.raises(ValueError):
        SharedLoadPolicy(interval_s=1.0, stale_after_s=0.5)
    with pytest.raises(ValueError):
        SharedLoadPolicy(interval_s=0.1, max_backoff_s=0.05)
