"""Shedding at once what the queue could not start within the SLO (P1: a refused request learns it in
milliseconds, not after waiting out its wait budget)."""

import time

import pytest

from extproc.admission.placement import Placer
from extproc.admission.queue import Waiter
from extproc.admission.scheduler import BusyPace, Placement, Scheduler, Shed
from extproc.config import PoolConfig, parse_section
from extproc.request import LLMRequest
from extproc.routing.pool import Pool

RATE = 10_000.0  # prompt tokens/s: with the 1 s target, a replica has room for 10,000 tokens of predicted prefill


def scheduler(n: int = 1, **admission: object) -> Scheduler:
    """Shipped defaults (the wait budget derived from the SLO), a 1 s target, RATE tokens/s of prefill."""
    pool = Pool.from_config(PoolConfig(model="m", replicas=[f"10.0.0.{i}:8000" for i in range(n)]))
    policy = parse_section("admission", {"kv_capacity_tokens": 1_000_000, "ttft_target_s": 1.0,
                                         "prefill_tokens_per_s": RATE, "prefill_knee_tokens": 0,  # linear: plain tokens
                                         **admission})
    return Scheduler(pool, policy, Placer(pool, policy))


def req(prompt: int = 3_000, tenant: str = "t") -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=prompt,
                      max_output_tokens=10, tenant=tenant)


async def test_a_request_no_replica_could_start_within_the_target_is_shed_at_once():
    s = scheduler()
    for _ in range(3):  # 3 x 3,000 tokens: 0.9 s of the 1 s target queued on the replica
        assert isinstance(s.submit(req(), 0.0), Placement)
    # Nobody is queued, so no queue wait is predicted, yet 0.1 s of room is left for a 0.3 s prefill: refused now,
    # told to come back when the backlog has drained the missing 0.2 s
    with pytest.raises(Shed) as exc:
        s.submit(req(), 0.0)
    assert (exc.value.status, exc.value.code, exc.value.should_retry) == (429, "queue_wait_exceeds_deadline", True)
    assert exc.value.retry_after_s == pytest.approx(0.2)
    assert s.queued_total() == 0


async def test_the_refused_request_could_not_have_been_placed_before_its_wait_budget_ended():
    """The room only shrinks while a request waits: the math the early shed rests on, checked on the placer."""
    s = scheduler()
    for _ in range(3):
        s.submit(req(), 0.0)
    r = req()
    budget = s._wait_budget(r, 0.0)
    assert budget == pytest.approx(1.0 - 0.3 - 0.1)
    for step in range(1, 60):
        waited = budget * step / 60
        assert s.placer.choose(r, 1, waited, waited) is None, waited


async def test_a_request_behind_a_blocked_queue_waits_while_the_room_lasts_then_is_shed():
    # one request in flight at a time: the queue is held by the concurrency limit, not by the prefill backlog
    s = scheduler(max_concurrency_per_replica=1)
    assert isinstance(s.submit(req(prompt=5_000), 0.0), Placement)  # 0.5 s of backlog: room for 5,000 more
    first = s.submit(req(prompt=2_000), 0.0)
    second = s.submit(req(prompt=2_000), 0.0)
    assert isinstance(first, Waiter) and isinstance(second, Waiter)  # 2,000 + 2,000 of the 5,000
    with pytest.raises(Shed) as exc:  # behind those two only 1,000 tokens of room are left for its 2,000
        s.submit(req(prompt=2_000), 0.0)
    assert exc.value.code == "queue_wait_exceeds_deadline"
    assert isinstance(s.submit(req(prompt=1_000), 0.0), Waiter)  # a smaller prompt still fits behind them


async def test_a_quiet_tenant_is_not_shed_for_a_floods_queue():
    s = scheduler(max_concurrency_per_replica=1)
    s.submit(req(prompt=5_000, tenant="flood"), 0.0)
    s.submit(req(prompt=2_000, tenant="flood"), 0.0)
    s.submit(req(prompt=2_000, tenant="flood"), 0.0)
    with pytest.raises(Shed):
        s.submit(req(prompt=2_000, tenant="flood"), 0.0)
    # the fair order puts the quiet tenant's request behind one of the flood's queued requests, not both
    assert isinstance(s.submit(req(prompt=2_000, tenant="quiet"), 0.0), Waiter)


async def test_an_explicit_wait_beyond_the_prefill_floor_is_not_judged_by_the_room():
    """With max_wait_s past target - prefill - REFILL_S, the TTFT limit's floor lets the request in once the
    backlog has drained to REFILL_S: it may wait for that."""
    s = scheduler(max_wait_s=5.0)
    for _ in range(3):
        s.submit(req(), 0.0)
    assert isinstance(s.submit(req(), 0.0), Waiter)


# ---- the drain rate after a quiet spell (P1f: a flood starts) ----------------------------------------------------

async def test_the_drain_rate_follows_the_saturated_pace_not_the_quiet_seconds_before():
    s = scheduler(max_concurrency_per_replica=1, max_wait_s=5.0)
    lane = 1
    m = s.meter[lane]
    for i in range(25):  # a quiet tenant alone: 5 releases/s for 5 s, nobody waiting
        s.drain[m].tick(i * 0.2)
    s.submit(req(prompt=2_000), 5.0)  # the flood starts: the replica is taken, requests queue
    s.submit(req(prompt=2_000), 5.0)
    assert s.drain_rate(lane, 5.0) == pytest.approx(24 / 5.0)
    for i in range(1, 16):  # while they wait, the pool releases 30/s
        s.drain[m].tick(5.0 + i / 30)
        s.busy_pace[m].tick(5.0 + i / 30, s.busy_since[m])
    # the window's release rate still counts the quiet seconds; the busy pace is 15 in 0.5 s
    assert s.drain[m].current(5.5) < 10
    assert s.drain_rate(lane, 5.5) == pytest.approx(30.0)


def test_a_clump_of_releases_at_a_busy_periods_start_is_timed_from_its_start():
    pace = BusyPace()
    for i in range(12):  # requests placed together when the queue formed at t=1.2 end together at t=1.5
        pace.tick(1.5 + i * 1e-3, 1.2)
    assert pace.current(1.6) == 0.0  # 0.4 s of busy time: less than BUSY_MIN_S says nothing yet
    assert pace.current(1.8) == pytest.approx(12 / 0.6)  # 12 in the 0.6 s since the queue formed, not in 11 ms
    pace.tick(9.0, 8.0)
    assert pace.current(9.0) == 0.0  # the first period left the window: one release says nothing


async def test_lanes_sharing_the_pool_share_one_drain_rate_and_count_each_others_queues_ahead():
    """The default short and normal lanes take any replica: a request's lane may change with the learned prefill
    speed (1,000 tokens sit at the short/normal edge at 20,000 tokens/s of a 0.5 s target). Their releases are one
    pace, and `kick` serves their queues in one fair order: a normal request waits behind the short queue's."""
    s = scheduler(max_concurrency_per_replica=1)
    assert s.meter[0] == s.meter[1] != s.meter[2]  # short, normal: the pool's; long (half the replicas): its own
    assert isinstance(s.submit(req(prompt=5_000), 0.0), Placement)  # normal lane: 0.5 s of backlog
    for _ in range(4):  # short prompts (0.1 s of the 1 s target) queue: 4 x 1,000 of the 5,000 tokens of room
        assert isinstance(s.submit(req(prompt=1_000), 0.0), Waiter)
    assert s._work_ahead(1, "t", 0) == (4, 4_000)
    with pytest.raises(Shed):  # a normal 2,000-token prompt has 1,000 tokens of room left behind them
        s.submit(req(prompt=2_000), 0.0)
    assert isinstance(s.submit(req(prompt=1_000), 0.0), Waiter)  # the short lane's fifth still fits


async def test_one_fair_order_across_the_lanes_sharing_the_pool():
    """P1f: the same 1,000-token requests fall in the short or the normal lane as the learned prefill speed moves.
    A quiet tenant's request in one lane goes before the flood's queued requests in the other, and among equals the
    oldest goes first (a later arrival of the other lane does not take the room an earlier waiter was admitted for).
    """
    # room: 100,000 tokens; the flood's backlog share off (it would hold the flood's next prompt: not tested here)
    s = scheduler(max_concurrency_per_replica=1, prefill_tokens_per_s=100_000, tenant_backlog_share=1.0)
    t0 = time.monotonic()  # release() reads the clock
    a = s.submit(req(prompt=10_000, tenant="flood"), t0)  # short lane (0.1 s of the 1 s target)
    assert isinstance(a, Placement)
    b, c, d = (s.submit(req(prompt=10_000, tenant="flood"), t0) for _ in range(3))
    s.release(a, req(prompt=10_000, tenant="flood"))
    assert isinstance(b.future.result(), Placement)  # dispatched from the queue: the flood's counter advanced
    quiet = s.submit(req(prompt=20_000, tenant="quiet"), time.monotonic())  # normal lane
    assert isinstance(quiet, Waiter) and quiet.lane == 1 and c.lane == 0
    s.release(b.future.result(), req(prompt=10_000, tenant="flood"))
    assert quiet.future.done() and not c.future.done()  # not behind the flood's short queue
    late = s.submit(req(prompt=10_000, tenant="quiet"), time.monotonic())  # short lane, after c and d
    assert isinstance(late, Waiter)
    s.release(quiet.future.result(), req(prompt=20_000, tenant="quiet"))
    assert c.future.done() and not d.future.done() and not late.future.done()
