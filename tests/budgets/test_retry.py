"""Retry budget (P5) on both stores: share cap with floor, window slide, detection, duplicates in flight (409)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from extproc.budgets import BudgetExceeded

from .conftest import req

T0 = 1_000_000.0  # a window boundary for 10 s and 60 s windows: fraction 0


@pytest.mark.asyncio
async def test_share_cap_with_floor(make_budgets) -> None:
    b = await make_budgets()
    # A quiet pool: only the floor (3 retries per window) applies.
    for _ in range(2):
        await b.admit(req(model="quiet"), now=T0)
    admitted = 0
    with pytest.raises(BudgetExceeded) as exc:
        for _ in range(10):
            await b.admit(req(model="quiet", retry_count=1), now=T0)
            admitted += 1
    assert admitted == 3
    e = exc.value
    assert (e.status, e.code, e.should_retry) == (429, "retry_budget_exceeded", False)
    assert "pool quiet" in e.message and e.retry_after_s == 10.0
    assert ("x-should-retry", "false") in e.headers()

    # A busy pool: 100 first attempts, then retries while retries + 1 <= 0.1 * (admitted + 1): exactly 11.
    for _ in range(100):
        await b.admit(req(model="busy", tenant="t1"), now=T0 + 1)
    labels = {"pool": "busy", "reason": "budget"}
    before = REGISTRY.get_sample_value("sluice_budget_retries_rejected_total", labels) or 0
    admitted = 0
    for _ in range(30):
        try:
            await b.admit(req(model="busy", tenant="t1", retry_count=2), now=T0 + 1)
            admitted += 1
        except BudgetExceeded as e:
            assert e.code == "retry_budget_exceeded"
    assert admitted == 11
    after = REGISTRY.get_sample_value("sluice_budget_retries_rejected_total", labels)
    assert after - before == 19


@pytest.mark.asyncio
async def test_window_slides(make_budgets) -> None:
    b = await make_budgets(retry={"floor": 2, "max_share": 0.0})
    for _ in range(2):
        await b.admit(req(retry_count=1), now=T0)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(retry_count=1), now=T0 + 9.9)
    # Half a window later the previous window still weighs 0.5 * 2 = 1 retry: one more fits the floor of 2.
    await b.admit(req(retry_count=1), now=T0 + 15)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(retry_count=1), now=T0 + 15)
    # Two windows later everything has decayed.
    await b.admit(req(retry_count=1), now=T0 + 30)
    await b.admit(req(retry_count=1), now=T0 + 30)


@pytest.mark.asyncio
async def test_tenant_share_is_separate_from_pool(make_budgets) -> None:
    b = await make_budgets(retry={"floor": 1, "max_share": 0.1})
    for _ in range(200):  # tenant "big" makes the pool busy
        await b.admit(req(tenant="big"), now=T0)
    # tenant "small" has no admitted traffic of its own: the pool share would allow ~20, its own share allows 1
    await b.admit(req(tenant="small", retry_count=1), now=T0)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(tenant="small", retry_count=1), now=T0)
    assert "tenant small" in exc.value.message


@pytest.mark.asyncio
async def test_detection_by_key_fingerprint_and_request_id(make_budgets) -> None:
    b = await make_budgets(retry={"use_fingerprint": True})
    first = await b.admit(req(idempotency_key="idem-1"), now=T0)
    assert not first.is_retry
    await b.settle(first, completed=False, prompt_tokens=None, completion_tokens=None, now=T0 + 1)
    again = await b.admit(req(idempotency_key="idem-1"), now=T0 + 2)
    assert again.is_retry

    body = b"\x01" * 16
    c1 = await b.admit(req(body=body), now=T0)
    await b.settle(c1, completed=True, prompt_tokens=100, completion_tokens=5, now=T0 + 1)
    assert (await b.admit(req(body=body), now=T0 + 2)).is_retry
    # the same body from another tenant is not a retry of it
    assert not (await b.admit(req(body=body, tenant="someone-else"), now=T0 + 2)).is_retry

    c2 = await b.admit(req(request_id="rid-7"), now=T0)
    await b.settle(c2, completed=True, prompt_tokens=1, completion_tokens=1, now=T0)
    assert (await b.admit(req(request_id="rid-7"), now=T0 + 1)).is_retry
    assert not (await b.admit(req(), now=T0 + 1)).is_retry


@pytest.mark.asyncio
async def test_duplicate_in_flight_is_409_and_charges_nothing(make_budgets) -> None:
    b = await make_budgets(tasks={"max_calls": 2}, retry={"use_fingerprint": True})
    body = b"\x02" * 16
    running = await b.admit(req(body=body, task_id="t-1"), now=T0)
    before = REGISTRY.get_sample_value("sluice_budget_retries_rejected_total",
                                       {"pool": "m", "reason": "duplicate_in_flight"}) or 0
    for _ in range(3):
        with pytest.raises(BudgetExceeded) as exc:
            await b.admit(req(body=body, task_id="t-1", retry_count=1), now=T0 + 1)
        e = exc.value
        assert (e.status, e.code, e.should_retry, e.retry_after_s) == (409, "duplicate_in_flight", False, None)
        assert "request body" in e.message
    assert REGISTRY.get_sample_value("sluice_budget_retries_rejected_total",
                                     {"pool": "m", "reason": "duplicate_in_flight"}) - before == 3
    # the three 409s charged no task call: the task's second call still fits max_calls=2
    await b.admit(req(task_id="t-1"), now=T0 + 1)
    # same idempotency key in flight -> 409 too
    await b.admit(req(idempotency_key="k-9"), now=T0)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(idempotency_key="k-9"), now=T0)
    assert exc.value.status == 409 and "idempotency key" in exc.value.message
    # once the original finished, the duplicate is an ordinary (admitted) retry
    await b.settle(running, completed=False, prompt_tokens=None, completion_tokens=None, now=T0 + 2)
    c = await b.admit(req(body=body, task_id="t-2"), now=T0 + 3)
    assert c.is_retry


@pytest.mark.asyncio
async def test_rejected_request_leaves_no_marker(make_budgets) -> None:
    b = await make_budgets(tasks={"max_calls": 1})
    await b.admit(req(task_id="full"), now=T0)
    body = b"\x03" * 16
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(body=body, task_id="full"), now=T0)
    assert exc.value.code == "task_budget_exceeded"
    # had the refused request left an in-flight marker this would be a 409; had it left a seen marker, a retry
    c = await b.admit(req(body=body, task_id="other"), now=T0)
    assert not c.is_retry


@pytest.mark.asyncio
async def test_fingerprint_detection_can_be_disabled(make_budgets) -> None:
    b = await make_budgets(retry={"use_fingerprint": False})
    body = b"\x04" * 16
    await b.admit(req(body=body), now=T0)
    c = await b.admit(req(body=body), now=T0)  # identical concurrent bodies are fine then
    assert not c.is_retry
