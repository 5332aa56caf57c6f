"""Retry budget (P5): recognise retries, cap their share of admitted traffic, refuse duplicates still in flight.

Recognition (any one suffices):
  - `retry_count > 0` (the SDK's `x-stainless-retry-count` header);
  - the request's idempotency key, request id, or body fingerprint (each scoped to the tenant) was seen on an
    admitted request within `dedupe_window_s` after that request finished.
If one of those identities belongs to a request STILL in flight, the new one is a duplicate: 409
`duplicate_in_flight` (the openai SDK does not retry 409), so a client that timed out cannot double the load while
the original still runs.

Share cap, per tenant and per pool (model), over a sliding window of `window_s`; with
    fits(scope)  =  retries(scope) + 1 <= max(floor, max_share * (admitted(scope) + 1))
a tenant's retry is admitted  iff  fits(tenant) and (retries(tenant) + 1 <= floor or fits(pool)),
where `admitted` counts every admitted request (retries included) in the window. `floor` lets a quiet tenant
retry at all, and it is the tenant's own: another tenant's retries never refuse it. Past its floor a tenant's retry
must fit the pool's share as well, so the floors of many tenants cannot add up to a retry storm on one pool. Over
the cap: 429 `retry_budget_exceeded` with `x-should-retry: false` (retrying cannot help: the tenant or the pool is
already retrying too much) and Retry-After = the window.

A retry of a request this sidecar refused before any replica saw it, with `x-should-retry: true`, is free: the
refusal grants the tenant a credit (credits.py), and a retry that takes one is neither checked against nor counted
in the share (policy `credit_refused`, off by default: see there). Without credits, such a refusal, when it is a
429, says `x-should-retry: false` instead while the tenant's next retry would be refused (`Budgets.retry_refused`,
a read of the same formula): a client told to retry and then refused as a retry storm waited for nothing (real
PX: 15 of 21 shed requests). A 503 keeps `true`: a business layer retries a 5xx whatever the header says, and
there it is the SDK retry's 429 that stops it (P6's outage: more attempts when the 503 said false).

The read counts the retries this sidecar has already asked for and not yet seen: each 429 that says
`x-should-retry: true` is a promise, kept (credits.py's ledger, without the credit) until its retry arrives (a
request of that tenant with `retry_count > 0` takes the earliest one) or until retry-after + PROMISE_GRACE_S, so

    told to retry  iff  fits(tenant, retries + promised(tenant)) and (... + 1 <= floor or fits(pool, the same))

Without it every refusal of a burst read the same room and was told to retry: real PX at its full length, 51 and
53 of sluice's 120 and 109 failed calls were told to retry, waited out retry-after, and their retry was refused
(`retry_budget_exceeded`). The promises are this sidecar's own (another sidecar's are not seen) and a tenant's
promises count against the pool's share only through that tenant's read. With a Redis store the read takes the
shared counts that Redis returned with this sidecar's last admit of the same pool and tenant (redis_store.py):
another sidecar's charges since then are missed, and a refusal never waits on a round trip.

The checks and the counters live in the store's combined admit (one round trip with Redis).
"""

from __future__ import annotations

from extproc.budgets import metrics
from extproc.budgets.credits import RetryCredits
from extproc.budgets.errors import BudgetExceeded
from extproc.budgets.keys import ident
from extproc.budgets.policy import RetryPolicy
from extproc.budgets.ops import DUPLICATE, AdmitOp, AdmitResult, RetryCheck
from extproc.request import LLMRequest

CODE_BUDGET = "retry_budget_exceeded"
CODE_DUPLICATE = "duplicate_in_flight"
PROMISE_GRACE_S = 2.0  # a promised retry is expected within its retry-after and this (the SDK waits retry-after)

_KIND_NAMES = {"i": "idempotency key", "r": "request id", "f": "request body"}


class RetryBudget:
    def __init__(self, policy: RetryPolicy, max_pools: int = 64) -> None:
        self.policy = policy
        self.enabled = policy.enabled
        # retries of requests this sidecar refused with x-should-retry: true are free (credits.py)
        self.credits = RetryCredits(policy.window_s) if policy.enabled and policy.credit_refused else None
        # retries this sidecar told its clients to make and has not seen yet (without credits: see the module doc)
        self.promised = RetryCredits(PROMISE_GRACE_S) if policy.enabled and not policy.credit_refused else None
        self._credited = metrics.BoundedLabels(metrics.RETRIES_CREDITED, max_pools)
        self._seen = metrics.BoundedLabels(metrics.RETRIES_SEEN, max_pools)
        self._allowed = metrics.BoundedLabels(metrics.RETRIES_ALLOWED, max_pools)
        self._rej_budget = metrics.BoundedLabels(metrics.RETRIES_REJECTED, max_pools, reason="budget")
        self._rej_dup = metrics.BoundedLabels(metrics.RETRIES_REJECTED, max_pools, reason=CODE_DUPLICATE)

    def markers(self, req: LLMRequest, tenant: str) -> tuple[str, ...]:
        p = self.policy
        out = []
        if p.use_idempotency_key and req.idempotency_key:
            out.append(f"m:{tenant}:i:{ident(req.idempotency_key)}")
        if p.use_request_id and req.request_id:
            out.append(f"m:{tenant}:r:{ident(req.request_id)}")
        if p.use_fingerprint and req.body_fingerprint:
            out.append(f"m:{tenant}:f:{req.body_fingerprint.hex()}")
        return tuple(out)

    def refused(self, tenant: str, now: float, retry_after_s: float | None) -> None:
        """This sidecar refused a request of `tenant` before any replica saw it and told it to retry: its retry
        will be free (credits.py)."""
        if self.credits is not None:
            self.credits.grant(tenant, now, retry_after_s)

    def promise(self, tenant: str, now: float, retry_after_s: float) -> None:
        """This sidecar told a refused request of `tenant` to retry after `retry_after_s` (`now`: monotonic)."""
        if self.promised is not None:
            self.promised.grant(tenant, now, retry_after_s)

    def pending(self, tenant: str, now: float) -> int:
        """Retries of `tenant` this sidecar asked for and has not seen yet."""
        return self.promised.held(tenant, now) if self.promised is not None else 0

    def prepare(self, op: AdmitOp, req: LLMRequest, tenant: str, now: float) -> None:
        """Add this request's retry checks to the combined admit. A retry that takes a credit (`now`: monotonic)
        keeps its duplicate check and is neither checked against nor counted in the retry share."""
        op.retry_hint = req.retry_count > 0
        if not self.enabled:
            return
        if op.retry_hint and self.promised is not None:
            self.promised.take(tenant, now)  # the retry a refusal asked for has come
        p = self.policy
        op.markers = self.markers(req, tenant)
        op.inflight_ttl_s = p.inflight_ttl_s
        if op.retry_hint and self.credits is not None and self.credits.take(tenant, now):
            op.retry_hint = False
            self._credited.get(req.model).inc()
            return
        op.retry = self.check(req, tenant)

    def check(self, req: LLMRequest, tenant: str) -> RetryCheck:
        """The share `req`'s retries are checked against: its pool's and its tenant's (`tenant`: ident)."""
        p = self.policy
        return RetryCheck(f"rw:p:{ident(req.model)}", f"rw:t:{tenant}", p.max_share, p.floor, p.window_s)

    def admitted(self, req: LLMRequest, is_retry: bool) -> None:
        if is_retry:
            self._seen.get(req.model).inc()
            self._allowed.get(req.model).inc()

    def seen_rejected(self, req: LLMRequest) -> None:
        """A retry refused by another budget (task, tenant): still a retry seen."""
        self._seen.get(req.model).inc()

    def rejection(self, req: LLMRequest, res: AdmitResult) -> BudgetExceeded:
        self._seen.get(req.model).inc()
        if res.code == DUPLICATE:
            self._rej_dup.get(req.model).inc()
            kind = res.detail.split(":", 3)[2] if res.detail.count(":") >= 3 else ""
            what = _KIND_NAMES.get(kind, "identity")
            return BudgetExceeded(409, CODE_DUPLICATE,
                                  f"a request with the same {what} is still in flight; wait for it instead of "
                                  f"sending it again", None, False, "in_flight")
        self._rej_budget.get(req.model).inc()
        p = self.policy
        scope = f"pool {req.model}" if res.detail == "pool" else f"tenant {req.tenant}"
        return BudgetExceeded(429, CODE_BUDGET,
                              f"retry budget exhausted for {scope}: retries are limited to {p.max_share:.0%} of "
                              f"admitted requests (at least {p.floor}) per {p.window_s:g} s window; "
                              f"{res.used:.0f} retries already admitted",
                              p.window_s, False, res.detail)
