"""Tenant tokens-per-minute limits over a sliding 60 s window in the store.

Charged at admission with the estimate (prompt + expected output), corrected to actual usage at settle (the
correction lands in the window the charge was made in, while that window still counts). The sliding window is
approximated from two fixed windows: used = cur + prev * (1 - f), f the elapsed fraction of the current window.

Over the limit: 429 `tenant_token_limit`. Retry-After is the time until the window frees enough room for this
request assuming no further traffic (see `wait_s`); `x-should-retry: true` only when that is within
`short_wait_s`. A request larger than the whole limit can never pass: `should_retry` false, no Retry-After.
"""

from __future__ import annotations

from typing import Callable

from extproc.budgets import metrics
from extproc.budgets.errors import BudgetExceeded
from extproc.budgets.policy import TenantPolicy
from extproc.budgets.ops import BACKEND_LOCAL, AdmitOp, AdmitResult, QuotaCheck
from extproc.request import LLMRequest

CODE = "tenant_token_limit"
WINDOW_S = 60.0


def wait_s(cur: float, prev: float, frac: float, cost: float, limit: float, window_s: float = WINDOW_S) -> float | None:
    """Seconds until cur + prev * (1 - f') + cost <= limit, with no new traffic; None if cost > limit."""
    if cost > limit:
        return None
    room = limit - cost - cur
    if room >= 0:
        if prev <= 0:
            return 0.0
        need = 1.0 - room / prev          # elapsed fraction at which the previous window has decayed enough
        return max(0.0, (need - frac) * window_s)
    # Only the next window helps: there the current count becomes `prev` and decays.
    g = 1.0 - (limit - cost) / cur if cur > 0 else 0.0
    return (1.0 - frac) * window_s + max(0.0, g) * window_s


def _same(tenant: str) -> str:
    return tenant


class TenantBudget:
    def __init__(self, policy: TenantPolicy, max_tenants: int = 256,
                 label: Callable[[str], str] | None = None) -> None:
        """`label` is the gateway's bounded tenant label (`Identity.label`, `tenants.label_tenants`), so these
        counters name the same tenants as every other tenant metric; `max_tenants` stays as a backstop."""
        self.policy = policy
        self.enabled = policy.enabled
        self._label = label or _same
        self._tokens = metrics.BoundedLabels(metrics.TENANT_TOKENS, max_tenants)
        self._rejections = metrics.BoundedLabels(metrics.TENANT_REJECTIONS, max_tenants)

    def prepare(self, op: AdmitOp, req: LLMRequest, tenant: str) -> bool:
        if not self.enabled:
            return False
        limit = self.policy.limit_for(req.tenant)
        if limit <= 0:
            return False
        op.quota = QuotaCheck(f"q:{tenant}", req.total_tokens, limit, WINDOW_S)
        return True

    def charged(self, tenant: str, tokens: int) -> None:
        self._tokens.get(self._label(tenant)).inc(tokens)

    def rejection(self, req: LLMRequest, res: AdmitResult) -> BudgetExceeded:
        self._rejections.get(self._label(req.tenant)).inc()
        configured = self.policy.limit_for(req.tenant)
        cost = req.total_tokens
        wait = wait_s(res.cur, res.prev, res.frac, cost, res.limit)
        local = ""
        if res.backend == BACKEND_LOCAL and res.limit != configured:
            local = f" (local share {res.limit:.0f} while the shared store is unreachable)"
        if wait is None:
            return BudgetExceeded(429, CODE, f"tenant {req.tenant}: request needs about {cost} tokens, more than "
                                             f"its limit of {configured} tokens per minute{local}",
                                  None, False, "tokens_per_minute")
        return BudgetExceeded(429, CODE, f"tenant {req.tenant} exceeded {configured} tokens per minute{local}: "
                                         f"{res.used:.0f} used in the last minute, this request needs about {cost}",
                              wait, wait <= self.policy.short_wait_s, "tokens_per_minute")
