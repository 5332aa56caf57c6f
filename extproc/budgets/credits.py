"""Retry credits: a retry of a request this sidecar refused and told to retry is not a retry storm.

The retry budget (retry.py) caps retries because each retry of a request that reached a replica is more work for
the replicas (P5's `amplification`: requests that reached a replica per user request). A request the sidecar
refused itself (a shed, a full gateway, a pool with no replica up) reached none, and the refusal said
`x-should-retry: true` with a `retry-after`: the SDK's retry is that same request offered again when it was told,
and adds no load. Charging it to the budget refused the retry the gateway asked for, with `x-should-retry: false`
(real PX: 15 of 21 shed requests lost that way).

So each such refusal grants its tenant one credit, valid until

    expires = refused_at + min(retry_after, MAX_RETRY_AFTER_S) + grace      (grace: the budget's window_s)

(the openai SDK honours a retry-after of up to 60 s). A request that says it retries (`x-stainless-retry-count` > 0)
takes the tenant's earliest-expiring credit, if any, and is then neither checked against nor counted in the retry
share. Retries beyond the refusals are charged as before, so a storm stays capped: at most one free retry per
refusal.

On (`budgets.retry.credit_refused`), more requests complete, but late: a retry admitted after its shed has already
missed its SLO and takes capacity from fresh requests (measured side by side, sluice alone: P1's SLO goodput 10.7
against 12.1 req/s and its TTFT p95 1.01 against 0.54 s; P5's 4.85 against 5.0, requests completed 6.62 against 5.54
req/s, amplification 1.07 against 0.94; real PX 3.0 against 3.75). So it is off by default.

With credits off (the default), the same ledger (`RetryCredits`) holds the retries the gateway promised instead:
each 429 that says `x-should-retry: true` counts against the share in later reads until its retry arrives, so a
burst's refusals are not all told to retry what the share can take only a few of (retry.py).

The credits live in this process: a retry that reaches another sidecar is charged there as before (never looser than
one free retry per refusal). Memory is bounded: at most MAX_PER_TENANT credits per tenant (the earliest-expiring is
dropped), MAX_TENANTS tenants (the least recently refused is forgotten).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

MAX_RETRY_AFTER_S = 60.0  # the openai SDK waits out a retry-after up to this; longer, it backs off on its own
MAX_PER_TENANT = 1024
MAX_TENANTS = 4096


class RetryCredits:
    """Per tenant, the expiry times of its unused credits (a heap: the earliest first)."""

    __slots__ = ("grace_s", "_tenants")

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._tenants: OrderedDict[str, list[float]] = OrderedDict()

    def grant(self, tenant: str, now: float, retry_after_s: float | None) -> None:
        """This sidecar refused a request of `tenant` at `now` and told it to retry after `retry_after_s`."""
        wait = min(max(retry_after_s or 0.0, 0.0), MAX_RETRY_AFTER_S)
        heap = self._tenants.get(tenant)
        if heap is None:
            if len(self._tenants) >= MAX_TENANTS:
                self._tenants.popitem(last=False)
            heap = self._tenants[tenant] = []
        else:
            self._tenants.move_to_end(tenant)
        if len(heap) >= MAX_PER_TENANT:
            heapq.heappop(heap)
        heapq.heappush(heap, now + wait + self.grace_s)

    def take(self, tenant: str, now: float) -> bool:
        """A retry of `tenant` at `now`: True when it takes an unexpired credit (the earliest-expiring)."""
        heap = self._tenants.get(tenant)
        if not heap:
            return False
        while heap and heap[0] < now:
            heapq.heappop(heap)
        if not heap:
            del self._tenants[tenant]
            return False
        heapq.heappop(heap)
        return True

    def held(self, tenant: str, now: float) -> int:
        """Unexpired credits of `tenant` (the expired ones are dropped on the way)."""
        heap = self._tenants.get(tenant)
        if not heap:
            return 0
        while heap and heap[0] < now:
            heapq.heappop(heap)
        return len(heap)
