"""Scheduler + placer: token-metered dispatch, lanes, deadlines, shedding, release."""

import asyncio
import re
import time

import pytest

from extproc.admission.policy import LanePolicy
from extproc.admission.queue import Waiter
from extproc.admission.scheduler import LATE, WAIT_SAFETY, Placement, Scheduler, Shed
from extproc.config import PoolConfig, parse_section, policy_from_dict
from extproc.request import LLMRequest
from extproc.admission.placement import Placer
from extproc.routing.pool import EJECTED, Pool


def make(n_replicas: int = 2, **admission) -> Scheduler:
    pool = Pool.from_config(PoolConfig(model="m", replicas=[f"10.0.0.{i}:8000" for i in range(n_replicas)]))
    policy = parse_section("admission", {"kv_capacity_tokens": 10_000, "kv_margin": 0.0, "max_wait_s": 5.0,
                                         "prefill_knee_tokens": 0,  # prefill linear in the prompt: plain tokens
                                         **admission})
    return Scheduler(pool, policy, Placer(pool, policy))


def req(prompt: int = 100, out: int = 100, tenant: str = "t", timeout: float | None = None,
        priority: str = "interactive") -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=prompt,
                      max_output_tokens=out, tenant=tenant, client_timeout_s=timeout, priority=priority)


async def test_dispatches_immediately_when_a_replica_fits():
    s = make()
    p = s.submit(req(), 0.0)
    assert isinstance(p, Placement)
    assert p.replica.inflight_tokens == 200 and p.replica.inflight_requests == 1
    assert len(p.pins) == 2 and p.pins[1] is not p.replica


async def test_kv_headroom_meters_tokens_not_requests():
    # 5,000 prompt tokens/s: lanes short <= 0.2 s (1,000 tokens) < normal <= 1 s < long of the 2 s target
    s = make(n_replicas=1, prefill_tokens_per_s=5000)
    t0 = time.monotonic()  # release() reads the clock
    big = s.submit(req(prompt=4000, out=4000), t0)
    assert isinstance(big, Placement)
    # never scraped, so its footprint counts in full: 8,000 of 10,000 held, a 3,000-token request waits although
    # only one request runs
    queued = s.submit(req(prompt=1500, out=1500), t0)
    assert isinstance(queued, Waiter)
    # a smaller one of the same lane would fit, but waits behind the queued one (no queue jumping) ...
    same_lane = s.submit(req(prompt=1100, out=10), t0)
    assert isinstance(same_lane, Waiter)
    # ... while a short prompt has its own lane and goes now
    assert isinstance(s.submit(req(prompt=10, out=10), t0), Placement)
    s.release(big, req(prompt=4000, out=4000))
    assert queued.future.done() and same_lane.future.done()
    assert isinstance(queued.future.result(), Placement)


async def test_never_fits_is_rejected_at_once():
    s = make()
    with pytest.raises(Shed) as exc:  # too large even were its prompt half the estimate: 8,500 + 2,000 > 10,000
        s.submit(req(prompt=17000, out=2000), 0.0)
    assert exc.value.status == 400 and exc.value.code == "context_length_exceeded"
    assert exc.value.should_retry is False


async def test_a_request_too_large_for_the_kv_margin_runs_alone_on_an_idle_replica():
    # 10,000 tokens of KV, margin 0.1. Neither request below is refused as too large, nor held to the margin line
    # forever: each waits until the replica is idle, then runs alone. (A TTFT target of 30 s: the prefill backlog
    # the first one leaves does not keep the second off the replica.)
    s = make(n_replicas=1, kv_margin=0.1, prefill_tokens_per_s=5000, ttft_target_s=30.0,
             lanes=[{"name": "all", "max_prefill_of_target": 1e6}])
    t0 = time.monotonic()
    small = s.submit(req(prompt=100, out=100), t0)
    assert isinstance(small, Placement)
    # 9,500 tokens: above the margin line, within the KV cache
    above_margin = s.submit(req(prompt=9000, out=500), t0)
    assert isinstance(above_margin, Waiter)  # beside a running request it would eat the margin: it waits
    s.release(small, req(prompt=100, out=100))
    assert above_margin.future.done() and isinstance(above_margin.future.result(), Placement)
    # 11,000 tokens by its estimate, above the whole cache: the prompt is an estimate (1.5x high on long words), so
    # the engine, which counts exactly, serves it or refuses it
    above_cache = s.submit(req(prompt=9500, out=1500), t0)
    assert isinstance(above_cache, Waiter)
    s.release(above_margin.future.result(), req(prompt=9000, out=500))
    assert above_cache.future.done() and isinstance(above_cache.future.result(), Placement)


async def test_queue_full_sheds_with_retry_after():
    s = make(n_replicas=1, max_concurrency_per_replica=1,
             lanes=[{"name": "all", "max_prefill_of_target": 1e6, "max_queue": 2}])
    assert isinstance(s.submit(req(), 0.0), Placement)
    s.submit(req(), 0.0)
    s.submit(req(), 0.0)
    with pytest.raises(Shed) as exc:
        s.submit(req(), 0.0)
    assert exc.value.status == 429 and exc.value.code == "queue_full"
    assert exc.value.retry_after_s is not None and exc.value.retry_after_s > 0
    assert exc.value.should_retry is True



async def test_retry_after_counts_the_waiters_of_every_lane_sharing_the_meter():
    """The short and normal lanes share the pool's meter: a normal request waits behind the short lane's
    waiters as well, so its Retry-After is their count over the shared drain rate, not its own lane's."""
    s = make(n_replicas=1, max_concurrency_per_replica=1)
    short, normal = 0, 1
    assert s.meter[short] == s.meter[normal]
    assert isinstance(s.submit(req(), 0.0), Placement)
    for _ in range(4):
        assert isinstance(s.submit(req(), 0.0), Waiter)
    for t in (0.5, 1.0, 1.5, 2.0):
        s.drain[s.meter[normal]].tick(t)
    rate = s.drain_rate(normal, 2.0)
    assert rate > 0
    assert s.retry_after(normal, 2.0) == pytest.approx(s.retry_after(short, 2.0))
    assert s.retry_after(normal, 2.0) == pytest.approx(5 / rate)

async def test_higher_priority_evicts_sheddable_when_full():
    s = make(n_replicas=1, max_concurrency_per_replica=1,
             lanes=[{"name": "all", "max_prefill_of_target": 1e6, "max_queue": 1}])
    s.submit(req(), 0.0)
    low = s.submit(req(priority="sheddable"), 0.0)
    high = s.submit(req(priority="interactive"), 0.0)
    assert isinstance(high, Waiter)
    assert isinstance(low.future.exception(), Shed)
    assert low.future.exception().code == "evicted"


async def test_client_deadline_that_cannot_be_met_is_rejected_without_retry():
    s = make()
    with pytest.raises(Shed) as exc:
        s.submit(req(timeout=0.0), 0.0)
    assert exc.value.code == "deadline_unmeetable" and exc.value.should_retry is False


async def test_expired_waiter_becomes_429_and_leaves_the_queue():
    s = make(n_replicas=1, max_concurrency_per_replica=1)
    s.submit(req(), 0.0)
    w = s.submit(req(), 0.0)
    shed = s.expired(w, 10.0)
    assert shed.status == 429 and shed.code == "queue_timeout"
    assert s.queued_total() == 0


async def test_a_waiter_past_its_wait_budget_is_served_late_behind_on_time_requests():
    """P1: a queued request whose SLO wait ended waits on, late, behind every request that can still meet the SLO,
    and is served rather than refused after a futile wait (its SDK retry would come later still, or be refused by
    the retry budget)."""
    s = make(n_replicas=1, max_concurrency_per_replica=1)  # max_wait_s 5, ttft_target_s 2: 4 s more, late
    first = s.submit(req(), 0.0)
    late = s.submit(req(tenant="a"), 0.0)
    assert isinstance(first, Placement) and isinstance(late, Waiter)
    assert late.deadline == 5.0 and late.late_until == 9.0
    assert s.serve_late(late, 5.0)
    assert late.priority == LATE and late.deadline == 9.0 and not late.future.done()
    assert not s.serve_late(late, 5.5)  # once
    assert s._work_ahead(0, "b", 0) == (0, 0)  # a new request does not wait behind the late one
    on_time = s.submit(req(tenant="b"), 5.0)
    assert isinstance(on_time, Waiter)
    s.release(first, req())
    assert on_time.future.done() and not late.future.done()
    s.release(on_time.future.result(), req(tenant="b"))
    assert late.future.done() and isinstance(late.future.result(), Placement)
    assert s.queued_total() == 0


async def test_no_late_wait_past_its_limit_the_clients_deadline_or_when_off():
    s = make(n_replicas=1, max_concurrency_per_replica=1)
    s.submit(req(), 0.0)
    w = s.submit(req(timeout=6.0), 0.0)  # 0.9 x 6 s - its 0.01 s prefill: 5.39 s in all, 5 of them on time
    assert isinstance(w, Waiter) and abs(w.late_until - 5.39) < 1e-9
    assert not s.serve_late(w, 5.4)
    assert s.expired(w, 5.4).code == "queue_timeout" and s.queued_total() == 0
    long = s.submit(req(prompt=2_000), 0.0)  # 0.2 s of prefill at 10,000 tokens/s: more than REFILL_S
    assert isinstance(long, Waiter) and long.late_until > long.deadline and not s.serve_late(long, long.deadline)
    off = make(n_replicas=1, max_concurrency_per_replica=1, late_wait_of_target=0)
    off.submit(req(), 0.0)
    w = off.submit(req(), 0.0)
    assert isinstance(w, Waiter) and w.late_until == w.deadline and not off.serve_late(w, 5.0)


async def test_a_request_that_misses_the_slo_by_its_own_prefill_waits_late_rather_than_being_refused():
    """PX's cold prompts: a prompt whose own prefill takes longer than the TTFT target misses the SLO however short
    its wait, and a refusal only loses its call (and the prefix it would have cached for the requests after it).
    So the queue ahead refuses it only past its wait and its late wait, late_wait_of_target x its own prefill, and
    it is served late; a prompt that could still meet the SLO is refused behind the same queue, as before."""
    s = make(n_replicas=1, max_concurrency_per_replica=1, kv_capacity_tokens=1_000_000, max_wait_s=0.0)
    assert isinstance(s.submit(req(), 0.0), Placement)
    long = s.policy.lane_for(3.0)
    for t in (0.5, 1.0, 1.5, 2.0):  # about 2 releases/s from the long lane's queue, as in the test above
        s.drain[s.meter[long]].tick(t)
    # 30,000 tokens at 10,000/s: 3 s of prefill against the 2 s target. Its wait: max(0.1, 2 - 0.1 - 1) = 0.9 s;
    # then late, 2 x 3 s
    lost = [s.submit(req(prompt=30_000, out=10), 2.0) for _ in range(3)]
    assert all(isinstance(w, Waiter) for w in lost)
    assert lost[0].deadline == pytest.approx(2.9) and lost[0].late_until == pytest.approx(8.9)
    # 15,000 tokens (1.5 s, the same long lane) could meet the target: behind the 3 queued (2 s, 2.8 s with the
    # margin) its 0.9 s wait is too short, and it is refused at once
    with pytest.raises(Shed) as exc:
        s.submit(req(prompt=15_000, out=10), 2.0)
    assert exc.value.code == "queue_wait_exceeds_deadline"
    # the lost ones queue until the wait ahead, with the margin, passes 6.9 s: (ahead + 1) / 2 x 1.4 > 6.9 at 9 ahead
    with pytest.raises(Shed) as exc:
        for _ in range(20):
            lost.append(s.submit(req(prompt=30_000, out=10), 2.0))
    assert exc.value.code == "queue_wait_exceeds_deadline" and len(lost) == 9
    assert "may wait (6.9s)" in exc.value.message
    assert s.serve_late(lost[0], lost[0].deadline) and lost[0].priority == LATE


async def test_pool_down_sheds_503_at_once_with_a_short_retry_after():
    """P6: during an outage nothing is queued (a request held through it reached the recovered replicas too late
    for its SLO); the client is told to retry in a second."""
    s = make(n_replicas=1)
    s.pool.replicas[0].state = EJECTED
    with pytest.raises(Shed) as exc:
        s.submit(req(), 0.0)
    assert exc.value.status == 503 and exc.value.code == "pool_unavailable"
    assert exc.value.retry_after_s == 1.0 and exc.value.should_retry


async def test_waiters_are_shed_when_the_pool_goes_down():
    s = make(n_replicas=1, max_concurrency_per_replica=1)
    first = s.submit(req(), 0.0)
    w = s.submit(req(), 0.0)
    assert isinstance(first, Placement) and isinstance(w, Waiter)
    s.on_scrape(0.5)
    assert not w.future.done()               # the pool is up: it waits
    s.pool.replicas[0].state = EJECTED
    s.on_scrape(0.7)
    assert w.future.done() and w.future.exception().code == "pool_unavailable"
    assert s.queued_total() == 0


async def test_long_lane_confined_to_a_share_of_replicas():
    """P3: long prompts prefill on at most half of the replicas at once; short ones always find one free of a long
    prefill. P7: a second long prompt waits for that prefill to end instead of stacking behind it."""
    s = make(n_replicas=2, prefill_tokens_per_s=20_000.0, kv_capacity_tokens=1_000_000,
             lanes=[{"name": "short", "max_prefill_of_target": 0.5},  # up to 1 s of the 2 s target: 20,000 tokens
                    {"name": "long", "max_prefill_of_target": 1e6, "max_replica_share": 0.5}])
    early = s.submit(req(prompt=100, out=10), 0.0)  # short requests come: the long lane's share holds
    first = s.submit(req(prompt=50_000, out=10), 0.0)  # 2.5 s of prefill
    second = s.submit(req(prompt=50_000, out=10), 0.0)
    assert isinstance(early, Placement) and isinstance(first, Placement)
    assert isinstance(second, Waiter)  # not on the other replica, and not stacked on the first
    short = s.submit(req(prompt=100, out=10), 0.0)
    assert isinstance(short, Placement) and short.replica is not first.replica
    assert s.kick(now=3.0) == 1  # the first prefill is done: the second goes to the replica with less KV
    assert second.future.result().replica is not first.replica


async def test_prefill_backlog_spreads_and_predicts_ttft():
    s = make(n_replicas=2, prefill_tokens_per_s=1000.0, ttft_target_s=2.0, kv_capacity_tokens=1_000_000,
             lanes=[{"name": "all", "max_prefill_of_target": 1e6}])
    a = s.submit(req(prompt=1500, out=1), 0.0)
    b = s.submit(req(prompt=1500, out=1), 0.0)
    assert a.replica is not b.replica
    # both replicas have 1.5 s of prefill queued: a third 1,500-token prompt would exceed the 2 s target
    c = s.submit(req(prompt=1500, out=1), 0.0)
    assert isinstance(c, Waiter)
    # 1 s later the backlog has drained to 0.5 s, but 1 s waited + 0.5 + 1.5 s of prefill is past the 2 s target:
    # it waits on, and goes once at most REFILL_S (0.1 s) of backlog is ahead of its own prefill
    assert s.kick(now=1.0) == 0 and not c.future.done()
    assert s.kick(now=1.41) == 1 and c.future.done()


async def test_release_restores_every_counter():
    s = make()
    r = req()
    p = s.submit(r, 0.0)
    s.release(p, r)
    assert all(x.inflight_requests == 0 and x.inflight_tokens == 0 for x in s.pool.replicas)
    assert s.lane_requests == [0] * len(s.lane_requests) and s.lane_tokens == [0] * len(s.lane_tokens)
    assert all(x.lane_inflight == [0] * len(x.lane_inflight) for x in s.pool.replicas)


async def test_fairness_across_tenants_in_dispatch_order():
    s = make(n_replicas=1, max_concurrency_per_replica=1)
    hold = s.submit(req(tenant="x"), 0.0)
    flood = [s.submit(req(tenant="flood"), 0.0) for _ in range(10)]
    quiet = s.submit(req(tenant="quiet"), 0.0)
    order = []
    current = hold
    for _ in range(3):
        s.release(current, req())
        done = [w for w in flood + [quiet] if w.future.done() and w not in order]
        order.extend(done)
        current = done[0].future.result()
    assert quiet in order[:2]


def test_policy_validation_names_fields():
    with pytest.raises(ValueError, match="admission.kv_margin"):
        parse_section("admission", {"kv_margin": 1.5})
    with pytest.raises(ValueError, match="lanes must be ordered"):
        parse_section("admission", {"lanes": [{"name": "a", "max_prefill_of_target": 0.5},
                                               {"name": "b", "max_prefill_of_target": 0.1}]})
    with pytest.raises(ValueError, match="unknown field"):
        parse_section("admission", {"bogus": 1})
    assert isinstance(parse_section("admission", {}).lanes[0], LanePolicy)
    pools = [{"model": "m", "replicas": ["10.0.0.1:8000"]}]
    derived = policy_from_dict({"pools": pools, "sidecar": {"max_queue_wait_ms": 3000}})
    assert derived.admission.max_wait_s == 0.0  # 0 = from the SLO (the scheduler), within the queue wait ...
    capped = policy_from_dict({"pools": pools, "sidecar": {"max_queue_wait_ms": 3000},
                               "admission": {"ttft_target_s": 5.0}})
    assert capped.admission.max_wait_s == 3.0  # ... which Envoy holds a request for at most


async def test_sheds_at_once_when_the_queue_ahead_outlasts_the_wait_budget():
    """P1: with a known drain rate, a request that would wait past its budget is refused on arrival."""
    s = make(n_replicas=1, max_concurrency_per_replica=1, max_wait_s=2.0)
    first = s.submit(req(), 0.0)
    assert isinstance(first, Placement)
    # establish a drain rate of about 2 releases/s
    for t in (0.5, 1.0, 1.5, 2.0):
        s.drain[0].tick(t)
    s.service_s[0] = 0.5  # one in flight / 0.5 s = 2/s as well
    # 2 releases/s and a 2 s budget, with the safety factor: about two may queue
    queued = [s.submit(req(), 2.0) for _ in range(2)]
    assert all(isinstance(w, Waiter) for w in queued)
    with pytest.raises(Shed) as exc:
        for _ in range(10):
            s.submit(req(), 2.0)
    assert exc.value.code == "queue_wait_exceeds_deadline"
    assert exc.value.status == 429 and exc.value.retry_after_s >= 1.0
    # the message names the wait with the estimate's margin, which is what exceeded the budget
    m = re.search(r"about ([\d.]+)s of queue ahead on m \(([\d.]+)s with the estimate's margin\), more than this "
                  r"request may wait \(([\d.]+)s\)", exc.value.message)
    assert m is not None, exc.value.message
    assert float(m[2]) == pytest.approx(float(m[1]) * WAIT_SAFETY, abs=0.1) and float(m[2]) > float(m[3])


async def test_a_flood_held_at_its_prefill_share_stays_queued_and_a_quiet_tenant_goes_first():
    """P1f: the dominant tenant waits in the fair queue (not shed) while it prefills on its share of the
    replicas; a quiet tenant's request arriving behind that backlog is dispatched at once, on a free replica."""
    s = make(n_replicas=2, prefill_tokens_per_s=10_000.0, kv_capacity_tokens=1_000_000, ttft_target_s=0.3,
             tenant_prefill_share=0.5, tenant_backlog_share=1.0,
             lanes=[{"name": "all", "max_prefill_of_target": 1e6}])
    s.submit(req(tenant="quiet"), 0.0)  # the quiet tenant is active (its 100-token prefill ends at 0.01 s)
    first = s.submit(req(prompt=2000, tenant="flood"), 0.1)
    assert isinstance(first, Placement)
    held = [s.submit(req(prompt=2000, tenant="flood"), 0.1 + 0.001 * i) for i in range(4)]
    assert all(isinstance(w, Waiter) and not w.future.done() for w in held)  # queued at its share (1 of 2)
    quiet = s.submit(req(prompt=2000, tenant="quiet"), 0.11)
    placed = quiet.future.result() if isinstance(quiet, Waiter) else quiet
    assert placed.replica is not first.replica
    # at its share the flood may still queue behind its own prefill (0.1 s of it left), never on quiet's replica
    assert s.kick(0.2) == 1 and held[0].future.result().replica is first.replica
    assert not held[1].future.done()


def test_tenant_prefill_share_is_validated():
    with pytest.raises(ValueError, match="admission.tenant_prefill_share"):
        parse_section("admission", {"tenant_prefill_share": 0})
    assert parse_section("admission", {"tenant_prefill_share": 1.0}).tenant_prefill_share == 1.0


async def test_a_replica_whose_first_token_would_come_after_the_client_left_is_not_used():
    """P4/P5: the predicted TTFT must fit in the client's own time left, not only in the policy's target."""
    s = make(n_replicas=1, prefill_tokens_per_s=1000, ttft_target_s=5.0, max_wait_s=10.0)
    first = s.submit(req(prompt=1500, out=10), 0.0)  # 1.5 s of predicted prefill backlog on the only replica
    assert isinstance(first, Placement)
    # No client timeout: 1.5 + 0.5 s predicted is within the 5 s target.
    assert isinstance(s.submit(req(prompt=500, out=10), 0.0), Placement)
    # A client that gives up after 3 s: 2.0 + 0.5 s predicted TTFT is past 75% of its time, so it waits ...
    late = s.submit(req(prompt=500, out=10, timeout=3.0), 0.0)
    assert isinstance(late, Waiter)
    # ... until the backlog has drained enough (prefilling at 1,000 tokens/s): 2.5 - t <= 0.75 x (3 - t) from t = 1
    assert s.kick(0.5) == 0 and not late.future.done()
    assert s.kick(1.1) == 1 and isinstance(late.future.result(), Placement)
    assert s.placer.ttft_limit_s(req(timeout=2.0), 0.0) == 1.5
    assert s.placer.ttft_limit_s(req(timeout=None), 0.0) == 5.0


async def test_an_unmeasured_decode_speed_refuses_only_what_no_engine_within_its_bounds_could_answer():
    """Real P5: engines 5x faster than the configured 0.02 s per token, a non-streaming client allowing 0.75 s for
    48 tokens. Judged on the start value (0.96 s of decode) every request was refused deadline_unmeetable, so
    nothing decoded and nothing was learned. Before a measurement the fastest speed within decode_time's bounds
    counts; once the engines show their speed, it does."""
    s = make(max_wait_s=0.0)
    fast = LLMRequest(request_id="", endpoint="chat", model="m", stream=False, prompt_tokens=800,
                      max_output_tokens=48, tenant="t", client_timeout_s=0.75)
    assert isinstance(s.submit(fast, 0.0), Placement)
    impossible = LLMRequest(request_id="", endpoint="chat", model="m", stream=False, prompt_tokens=800,
                            max_output_tokens=2000, tenant="t", client_timeout_s=0.75)
    with pytest.raises(Shed) as exc:  # 2,000 tokens at 2 ms each: no engine within the bounds answers in time
        s.submit(impossible, 0.0)
    assert exc.value.code == "deadline_unmeetable"
    s.decode.learned, s.decode.value = True, 0.02  # the engines showed 0.02 s per token: the same client is late
    s.placer.decode_s, s.placer.decode_measured = s.decode.value, s.decode.learned
    with pytest.raises(Shed) as exc:
        s.submit(LLMRequest(request_id="", endpoint="chat", model="m", stream=False, prompt_tokens=800,
                            max_output_tokens=48, tenant="t", client_timeout_s=0.75), 0.0)
    assert exc.value.code == "deadline_unmeetable"


def _over_estimate() -> tuple[float, float]:
    """(count, sum) of sluice_queue_wait_over_estimate over every pool and lane."""
    from prometheus_client import REGISTRY
    count = total = 0.0
    for metric in REGISTRY.collect():
        if metric.name == "sluice_queue_wait_over_estimate":
            for sample in metric.samples:
                if sample.name.endswith("_count"):
                    count += sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
    return count, total


async def test_a_queued_request_reports_its_wait_over_the_estimate_it_was_queued_with():
    """WAIT_SAFETY made observable: each queued request that had a queue-wait estimate reports wait / estimate
    once, when it is dispatched or shed at the end of its wait."""
    s = make(n_replicas=1, max_concurrency_per_replica=1, max_wait_s=5.0)
    t0 = time.monotonic()  # release() reads the clock
    first = s.submit(req(), t0)
    assert isinstance(first, Placement)
    for t in (0.5, 1.0, 1.5, 2.0):  # about 2 releases/s
        s.drain[0].tick(t0 - 2.0 + t)
    s.service_s[0] = 0.5
    count0, sum0 = _over_estimate()
    nobody_ahead = s.submit(req(), t0)  # no estimate: nothing queued ahead of it
    behind_one = s.submit(req(), t0)  # one ahead, 2/s: (1 + 1) / 2 = 1 s expected
    behind_two = s.submit(req(), t0)  # 1.5 s expected
    assert all(isinstance(w, Waiter) for w in (nobody_ahead, behind_one, behind_two))
    assert behind_one.expected_wait == pytest.approx(1.0, rel=0.2) and nobody_ahead.expected_wait == 0.0
    s.release(first, req())  # nobody_ahead dispatched: no estimate, nothing reported
    assert nobody_ahead.future.done() and _over_estimate()[0] == count0
    s.release(nobody_ahead.future.result(), req())  # behind_one dispatched at once: far under its estimate
    assert behind_one.future.done()
    count, total = _over_estimate()
    assert count == count0 + 1 and total - sum0 < 0.25
    shed = s.expired(behind_two, t0 + 3.0)  # its wait ended 3 s in: twice the 1.5 s it was queued with
    assert shed.code == "queue_timeout"
    count, total2 = _over_estimate()
    assert count == count0 + 2
    assert total2 - total == pytest.approx(3.0 / behind_two.expected_wait)
