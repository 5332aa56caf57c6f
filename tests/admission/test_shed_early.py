"""Shedding at once what the queue could not start within the SLO (P1: a refused request learns it in
milliseconds, not after waiting out its wait budget)."""

import pytest

from extproc.admission.placement import Placer
from extproc.admission.queue import Waiter
from extproc.admission.scheduler import Placement, Scheduler, Shed
from extproc.config import PoolConfig, parse_section
from extproc.request import LLMRequest
from extproc.routing.pool import Pool

RATE = 10_000.0  # prompt tokens/s: with the 1 s target, a replica has room for 10,000 tokens of predicted prefill


def scheduler(n: int = 1, **admission: object) -> Scheduler:
    """Shipped defaults (the wait budget derived from the SLO), a 1 s target, RATE tokens/s of prefill."""
    pool = Pool.from_config(PoolConfig(model="m", replicas=[f"10.0.0.{i}:8000" for i in range(n)]))
    policy = parse_section("admission", {"kv_capacity_tokens": 1_000_000, "ttft_target_s": 1.0,
                                         "prefill_tokens_per_s": RATE, **admission})
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
