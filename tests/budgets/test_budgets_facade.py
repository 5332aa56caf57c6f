"""The Budgets facade: hot-path properties, nothing charged on refusal, settle safety, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from extproc.budgets import BudgetExceeded, BudgetPolicy, Budgets
from extproc.config import parse_section
from tests.waiting import wait_for_async

from .conftest import req

T0 = 1_000_020.0


def test_memory_admit_and_settle_never_yield() -> None:
    """With the memory store the coroutines finish on their first step: no await that yields to the loop."""
    b = Budgets(parse_section("budgets", {"tasks": {"max_calls": 5}, "tenants": {"default": 10**6},
                                        "retry": {"use_fingerprint": True}}))
    coro = b.admit(req(task_id="t", idempotency_key="k"), now=T0)
    with pytest.raises(StopIteration) as stop:
        coro.send(None)
    charge = stop.value.value
    c = charge.charged
    assert charge.backend == "memory" and c.task is not None and c.quota is not None and len(c.markers) == 3
    coro = b.settle(charge, completed=True, prompt_tokens=10, completion_tokens=10, now=T0)
    with pytest.raises(StopIteration):
        coro.send(None)
    assert charge.settled


def test_sidecar_count_hint_sets_the_local_share() -> None:
    b = Budgets(parse_section("budgets", {"tasks": {"max_calls": 20}}), sidecar_count_hint=4)
    assert b.share == 0.25
    got = 0
    for _ in range(10):
        try:
            asyncio.run(b.admit(req(task_id="t"), now=T0))
            got += 1
        except BudgetExceeded:
            pass
    assert got == 5
    assert Budgets(parse_section("budgets", {"store": {"fallback_share": 0.5}}), sidecar_count_hint=4).share == 0.5
    with pytest.raises(ValueError, match="sidecar_count_hint"):
        Budgets(BudgetPolicy(), sidecar_count_hint=0)


@pytest.mark.asyncio
async def test_refusal_charges_nothing(make_budgets) -> None:
    """A request refused by the LAST check (tenant tokens) leaves no task call, no tokens, no marker, no retry."""
    b = await make_budgets(tasks={"max_calls": 2, "max_tokens": 10_000},
                           tenants={"default": 1000}, retry={"floor": 1, "max_share": 0.0})
    await b.admit(req(400, 400, task_id="t"), now=T0)
    body = b"\x09" * 16
    for _ in range(5):
        with pytest.raises(BudgetExceeded) as exc:
            await b.admit(req(400, 400, task_id="t", body=body, retry_count=1), now=T0)
        assert exc.value.code == "tenant_token_limit"
    # no task call charged: the second call still fits max_calls=2; no retry counted: the floor's one retry is free;
    # no marker left: the same body is not a duplicate
    c = await b.admit(req(50, 50, task_id="t", body=body, retry_count=1), now=T0)
    assert c.is_retry


@pytest.mark.asyncio
async def test_settle_is_safe(make_budgets) -> None:
    b = await make_budgets(tasks={"max_calls": 3})
    await b.settle(None, completed=False, prompt_tokens=None, completion_tokens=None)  # admit raised: nothing to do
    c = await b.admit(req(task_id="t"), now=T0)
    for _ in range(3):
        await b.settle(c, completed=True, prompt_tokens=5, completion_tokens=5, now=T0)
    assert c.settled


def test_budget_exceeded_headers() -> None:
    e = BudgetExceeded(429, "tenant_token_limit", "m", retry_after_s=2.2, should_retry=True)
    assert e.headers() == [("x-should-retry", "true"), ("retry-after", "3")]
    assert e.err_type == "rate_limit_error" and str(e) == "m"
    e = BudgetExceeded(409, "duplicate_in_flight", "dup")
    assert e.headers() == [("x-should-retry", "false")] and e.err_type == "conflict_error"


def store_idle(b: Budgets) -> bool:
    """The Redis store has no call queued or running (its batches ran, their compensations too)."""
    store = b.store
    return not store._batch and store._running == 0 and not store._kick_scheduled


@pytest.mark.asyncio
@pytest.mark.parametrize("make_budgets", ["redis"], indirect=True)
@pytest.mark.parametrize("steps, compensated", [(1, 0), (3, 1)])
async def test_cancelled_admit_does_not_pin_a_duplicate(make_budgets, steps: int, compensated: int) -> None:
    """The client leaves while its admit waits for Redis. Cancelled while still queued (1 loop step): never sent.
    Cancelled after the script was sent (3 steps: queued, batch started, sent): the charge is undone.
    Either way its retry is not a 409 and its tokens are not charged."""
    b = await make_budgets(tasks={"max_tokens": 1000})
    body = b"\x0a" * 16
    task = asyncio.ensure_future(b.admit(req(400, 400, body=body, task_id="t"), now=T0))
    for _ in range(steps):
        await asyncio.sleep(0)  # `steps` loop steps: how far the admit got when its client leaves
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for_async(lambda: store_idle(b))  # the batch ran; a compensation settle ran after it
    assert b.store.stats()["compensated"] == compensated
    c = await b.admit(req(400, 400, body=body, task_id="t"), now=T0 + 1)
    assert c.backend == "redis"
    await b.admit(req(100, 100, task_id="t"), now=T0 + 1)   # 800 + 200: the cancelled 800 were not kept


@pytest.mark.asyncio
async def test_no_checks_configured_is_free() -> None:
    b = Budgets(parse_section("budgets", {"retry": {"enabled": False}}))
    c = await b.admit(req(task_id="t", retry_count=3), now=T0)
    assert not c.charged.anything and c.is_retry
    assert b.store.stats()["windows"] == 0


@pytest.mark.asyncio
async def test_sync_variants(make_budgets) -> None:
    b = await make_budgets(tasks={"max_calls": 2})
    if make_budgets.kind == "redis":
        assert not b.is_sync
        with pytest.raises(RuntimeError, match="memory store"):
            b.admit_sync(req())
        c = await b.admit(req(idempotency_key="sync-k"), now=T0)
        b.settle_sync(c, completed=True, prompt_tokens=1, completion_tokens=1, now=T0)  # scheduled on the loop
        await wait_for_async(lambda: c.settled)
        assert c.settled and (await b.admit(req(idempotency_key="sync-k"), now=T0)).is_retry
        return
    assert b.is_sync
    c = b.admit_sync(req(task_id="s", idempotency_key="sync-k"), now=T0)
    with pytest.raises(BudgetExceeded) as exc:
        b.admit_sync(req(task_id="s2", idempotency_key="sync-k"), now=T0)
    assert exc.value.status == 409
    b.settle_sync(c, completed=True, prompt_tokens=1, completion_tokens=1, now=T0)
    assert b.admit_sync(req(task_id="s", idempotency_key="sync-k"), now=T0).is_retry
    with pytest.raises(BudgetExceeded):
        b.admit_sync(req(task_id="s"), now=T0)
