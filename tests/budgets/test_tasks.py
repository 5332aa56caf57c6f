"""Task budgets (P11): exact limits across two sidecars sharing Redis, token correction, depth, wall time, active."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from extproc.budgets import BudgetExceeded

from .conftest import req

T0 = 1_000_000.0


# These tests are about exact counts across sidecars, not about timeouts: 200 admits started at once on a loaded
# 2-core CI machine kept the event loop busy past the store's 50 ms connect timeout (a new pooled connection per
# concurrent command), the store fell back to its local share, and 37 calls were admitted instead of 20.
# Fallback on timeouts is tested in test_fallback.py and tests/reliability/test_redis_faults.py.
PATIENT = {"redis": {"connect_timeout_s": 2.0, "socket_timeout_s": 2.0}}


async def _burst(budgets: list, n: int, make_req) -> tuple[list, list[BudgetExceeded]]:
    """n concurrent admits spread over the given sidecars; returns (charges, rejections)."""
    async def one(i: int):
        await asyncio.sleep(0.001 * (i % 7))  # waves, so the sidecars' batches interleave at Redis
        return await budgets[i % len(budgets)].admit(make_req(i), now=T0)

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    charges = [r for r in results if not isinstance(r, BaseException)]
    rejected = [r for r in results if isinstance(r, BudgetExceeded)]
    others = [r for r in results if isinstance(r, BaseException) and not isinstance(r, BudgetExceeded)]
    assert not others, others
    return charges, rejected


@pytest.mark.asyncio
@pytest.mark.parametrize("make_budgets", ["redis"], indirect=True)
async def test_max_calls_exact_across_two_sidecars(make_budgets) -> None:
    a = await make_budgets(tasks={"max_calls": 20}, store=PATIENT)
    b = await make_budgets(tasks={"max_calls": 20}, store=PATIENT)
    assert a.store is not b.store and not a.degraded and not b.degraded
    before = REGISTRY.get_sample_value("sluice_budget_task_rejections_total", {"limit": "max_calls"}) or 0
    charges, rejected = await _burst([a, b], 200, lambda i: req(task_id="t-42"))
    assert len(charges) == 20 and len(rejected) == 180
    assert {c.backend for c in charges} == {"redis"}
    assert {c.token.split("-")[0] for c in charges} == {a._token_prefix[:-1], b._token_prefix[:-1]}  # both served
    e = rejected[0]
    assert (e.status, e.code, e.should_retry) == (429, "task_budget_exceeded", False)
    assert e.message == "task t-42 exceeded max_calls=20"
    assert REGISTRY.get_sample_value("sluice_budget_task_rejections_total", {"limit": "max_calls"}) - before == 180
    # another task is unaffected
    await a.admit(req(task_id="t-43"), now=T0)


@pytest.mark.asyncio
@pytest.mark.parametrize("make_budgets", ["redis"], indirect=True)
async def test_max_tokens_exact_across_two_sidecars(make_budgets) -> None:
    a = await make_budgets(tasks={"max_tokens": 1000}, store=PATIENT)
    b = await make_budgets(tasks={"max_tokens": 1000}, store=PATIENT)
    # 70 + 30 = 100 estimated tokens per call: exactly 10 fit
    charges, rejected = await _burst([a, b], 200, lambda i: req(70, 30, task_id="tok"))
    assert len(charges) == 10 and len(rejected) == 190
    assert rejected[0].message.startswith("task tok exceeded max_tokens=1000")


@pytest.mark.asyncio
async def test_max_calls_single_store(make_budgets) -> None:
    b = await make_budgets(tasks={"max_calls": 5}, store=PATIENT)
    charges, rejected = await _burst([b], 50, lambda i: req(task_id="t-1"))
    assert len(charges) == 5 and len(rejected) == 45


@pytest.mark.asyncio
async def test_token_correction_on_settle(make_budgets) -> None:
    b = await make_budgets(tasks={"max_tokens": 1000})
    c1 = await b.admit(req(100, 300, task_id="t"), now=T0)   # 400 estimated
    c2 = await b.admit(req(100, 300, task_id="t"), now=T0)   # 800
    with pytest.raises(BudgetExceeded):
        await b.admit(req(100, 300, task_id="t"), now=T0)    # 1200 > 1000
    # unknown usage keeps the estimate
    await b.settle(c1, completed=False, prompt_tokens=None, completion_tokens=None, now=T0)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(100, 300, task_id="t"), now=T0)
    # actual usage 150 instead of 400: 150 + 400 = 550, the next 400 fits (950), then nothing more
    await b.settle(c2, completed=True, prompt_tokens=100, completion_tokens=50, now=T0)
    await b.settle(c2, completed=True, prompt_tokens=100, completion_tokens=0, now=T0)  # second settle: no-op
    await b.admit(req(100, 300, task_id="t"), now=T0)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(30, 30, task_id="t"), now=T0)      # 950 + 60 > 1000
    assert "950 tokens used" in exc.value.message


@pytest.mark.asyncio
async def test_depth_and_wall_time(make_budgets) -> None:
    b = await make_budgets(tasks={"max_depth": 3, "max_wall_s": 60})
    await b.admit(req(task_id="w", task_depth=3), now=T0)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(task_id="w", task_depth=4), now=T0)
    assert exc.value.message == "task w exceeded max_depth=3 (depth 4)" and exc.value.limit == "max_depth"
    await b.admit(req(task_id="w"), now=T0 + 59)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(task_id="w"), now=T0 + 61)
    assert exc.value.message.startswith("task w exceeded max_wall_s=60") and exc.value.code == "task_budget_exceeded"
    # requests without a task id are not task-budgeted
    await b.admit(req(task_depth=99), now=T0 + 61)


@pytest.mark.asyncio
async def test_active_tasks_per_tenant(make_budgets) -> None:
    b = await make_budgets(tasks={"max_active_per_tenant": 2, "idle_s": 10})
    ca = await b.admit(req(task_id="a"), now=T0)
    await b.admit(req(task_id="b"), now=T0)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(task_id="c"), now=T0)
    assert "max_active_per_tenant=2" in exc.value.message and exc.value.limit == "max_active_tasks"
    await b.admit(req(task_id="c", tenant="another-tenant"), now=T0)  # per tenant
    ca2 = await b.admit(req(task_id="a"), now=T0 + 1)                 # known tasks continue at the cap
    # a's first call ends but its second is still in flight: a stays active, c is still refused much later
    await b.settle(ca, completed=True, prompt_tokens=1, completion_tokens=1, now=T0 + 2)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(task_id="c"), now=T0 + 20)
    # once a's last call ends, a stays active for idle_s (10 s), then its slot is free
    await b.settle(ca2, completed=True, prompt_tokens=1, completion_tokens=1, now=T0 + 20)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(task_id="c"), now=T0 + 29)
    await b.admit(req(task_id="c"), now=T0 + 30.5)


@pytest.mark.asyncio
async def test_active_task_slot_freed_after_idle(make_budgets) -> None:
    b = await make_budgets(tasks={"max_active_per_tenant": 1, "idle_s": 10})
    c = await b.admit(req(task_id="a"), now=T0)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(task_id="b"), now=T0 + 1)
    await b.settle(c, completed=True, prompt_tokens=1, completion_tokens=1, now=T0 + 2)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(task_id="b"), now=T0 + 11)   # a idle until T0 + 12
    await b.admit(req(task_id="b"), now=T0 + 12.5)
