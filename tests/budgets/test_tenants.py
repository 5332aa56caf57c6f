"""Tenant tokens per minute: sliding window, Retry-After from the window, correction on settle."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from extproc.budgets import BudgetExceeded
from extproc.budgets.tenants import wait_s

from .conftest import req

T0 = 1_000_020.0  # a multiple of 60: a window start


def test_wait_formula() -> None:
    assert T0 % 60 == 0
    # current window full: must reach the next window, where 800 decays to 600 after a quarter of it
    assert wait_s(800, 0, 0.0, 400, 1000) == pytest.approx(75.0)
    # room in the current window once the previous one decayed enough: 900 * (1 - f) <= 10 -> f = 0.98889
    assert wait_s(0, 900, 0.95, 990, 1000) == pytest.approx((1 - 10 / 900 - 0.95) * 60)
    assert wait_s(0, 0, 0.5, 10, 1000) == 0.0
    assert wait_s(0, 0, 0.5, 1001, 1000) is None


@pytest.mark.asyncio
async def test_tpm_window_and_retry_after(make_budgets) -> None:
    b = await make_budgets(tenants={"tokens_per_minute": {"acme": 1000}, "default": 0})
    await b.admit(req(200, 200), now=T0)
    await b.admit(req(200, 200), now=T0)
    before = REGISTRY.get_sample_value("sluice_budget_tenant_rejections_total", {"tenant": "acme"}) or 0
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(200, 200), now=T0)
    e = exc.value
    assert (e.status, e.code, e.limit) == (429, "tenant_token_limit", "tokens_per_minute")
    assert e.retry_after_s == pytest.approx(75.0) and e.should_retry is False
    assert "tenant acme exceeded 1000 tokens per minute" in e.message
    assert ("retry-after", "75") in e.headers()
    assert REGISTRY.get_sample_value("sluice_budget_tenant_rejections_total", {"tenant": "acme"}) - before == 1
    # other tenants have no limit (default 0)
    for _ in range(5):
        await b.admit(req(200, 200, tenant="free"), now=T0)
    # just before Retry-After still refused, just after admitted
    with pytest.raises(BudgetExceeded):
        await b.admit(req(200, 200), now=T0 + 74)
    await b.admit(req(200, 200), now=T0 + 75.5)


@pytest.mark.asyncio
async def test_short_wait_says_retry(make_budgets) -> None:
    b = await make_budgets(tenants={"default": 1000, "short_wait_s": 5})
    await b.admit(req(450, 450), now=T0)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(495, 495), now=T0 + 60 + 57)
    e = exc.value
    assert e.should_retry is True and e.retry_after_s == pytest.approx((1 - 10 / 900 - 0.95) * 60, abs=1e-3)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(600, 500), now=T0 + 60 + 57)   # larger than the whole limit: never
    assert exc.value.should_retry is False and exc.value.retry_after_s is None


@pytest.mark.asyncio
async def test_tpm_corrected_with_usage(make_budgets) -> None:
    b = await make_budgets(tenants={"default": 1000})
    c1 = await b.admit(req(100, 300), now=T0)
    await b.admit(req(100, 300), now=T0)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(100, 300), now=T0 + 1)
    before = REGISTRY.get_sample_value("sluice_budget_tenant_tokens_total", {"tenant": "acme"}) or 0
    await b.settle(c1, completed=True, prompt_tokens=100, completion_tokens=20, now=T0 + 2)  # 400 -> 120
    assert REGISTRY.get_sample_value("sluice_budget_tenant_tokens_total", {"tenant": "acme"}) - before == 120
    await b.admit(req(100, 300), now=T0 + 3)          # 120 + 400 + 400 = 920
    with pytest.raises(BudgetExceeded):
        await b.admit(req(50, 50), now=T0 + 3)        # 1020


@pytest.mark.asyncio
async def test_correction_lands_in_the_charged_window(make_budgets) -> None:
    b = await make_budgets(tenants={"default": 1000})
    c = await b.admit(req(400, 400), now=T0 + 59)        # window 0
    # settled in window 1: the 800 now weigh (1 - 0.5) = 400; corrected to 200 they weigh 100
    await b.settle(c, completed=True, prompt_tokens=100, completion_tokens=100, now=T0 + 90)
    await b.admit(req(450, 450), now=T0 + 90)            # 100 + 900 = 1000 fits
    with pytest.raises(BudgetExceeded):
        await b.admit(req(1, 1), now=T0 + 90)


def test_tenant_counters_use_the_gateways_bounded_label() -> None:
    """Regression: these counters capped at 256 tenants of their own, ignoring `tenants.label_tenants`, so they named
    tenants the other tenant metrics had collapsed into "other"."""
    from extproc.budgets.policy import TenantPolicy
    from extproc.budgets.tenants import TenantBudget
    from extproc.identity import Identity, TenantPolicy as IdentityPolicy

    identity = Identity(IdentityPolicy(label_tenants=1))
    budget = TenantBudget(TenantPolicy(), label=identity.label)
    sample = REGISTRY.get_sample_value
    named = sample("sluice_budget_tenant_tokens_total", {"tenant": "first-labelled"}) or 0
    other = sample("sluice_budget_tenant_tokens_total", {"tenant": "other"}) or 0
    budget.charged("first-labelled", 10)
    budget.charged("second-tenant-xyz", 7)
    assert sample("sluice_budget_tenant_tokens_total", {"tenant": "first-labelled"}) - named == 10
    assert sample("sluice_budget_tenant_tokens_total", {"tenant": "other"}) - other == 7
    assert sample("sluice_budget_tenant_tokens_total", {"tenant": "second-tenant-xyz"}) is None
