"""A bounded wait queue for one lane: strict priority classes, token-weighted fair share across tenants.

Fairness is a virtual token counter per tenant (start-time fair queueing over tokens, as in the VTC scheduler
for LLM serving): when a request is dispatched its tenant's counter advances by the request's tokens divided by
the tenant's weight, and the next request comes from the backlogged tenant with the lowest counter. A tenant
that floods at 10x its share only advances its own counter faster; a quiet tenant's next request goes first.
A tenant that was idle re-enters at the current virtual clock, so idling earns no credit. The queues of the lanes
that share the pool share one `VirtualClock`, so a tenant's dispatches in any of them count against it, and the
scheduler orders their next requests by `lag` (scheduler.py `Scheduler._kick_lanes`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from heapq import merge

from extproc.request import LLMRequest


@dataclass(slots=True, eq=False)
class Waiter:
    """A request held in the sidecar's queue. `future` resolves to the pin list when it is dispatched."""

    req: LLMRequest
    lane: int
    priority: int
    tenant: str
    deadline: float
    enqueued: float
    late_until: float = 0.0  # once `deadline` passes undispatched, it may wait on, served late, until then
    expected_wait: float = 0.0  # the queue-wait estimate it was queued with (0: none: nobody ahead, or no rate yet)
    future: asyncio.Future = field(default=None)  # type: ignore[assignment]


MAX_TRACKED_TENANTS = 10_000  # virtual counters kept for idle tenants; beyond it idle ones are forgotten


class VirtualClock:
    """The tenants' virtual token counters and the virtual clock. Queues that share one (the lanes that share the
    pool, served in one fair order by the scheduler's `kick`) charge a tenant's dispatches in any of them to the
    same counter."""

    __slots__ = ("vtime", "clock")

    def __init__(self) -> None:
        self.vtime: dict[str, float] = {}
        self.clock = 0.0


class FairQueue:
    def __init__(self, n_priorities: int, tenant_weights: dict[str, float],
                 virtual: VirtualClock | None = None) -> None:
        self.levels: list[dict[str, deque[Waiter]]] = [{} for _ in range(n_priorities)]
        self.weights = tenant_weights
        self.virtual = virtual if virtual is not None else VirtualClock()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push(self, w: Waiter) -> None:
        level = self.levels[w.priority]
        dq = level.get(w.tenant)
        if dq is None:
            dq = level[w.tenant] = deque()
            # a tenant (re)entering the backlog starts at the virtual clock: no credit for idling
            v = self.virtual
            if v.vtime.get(w.tenant, 0.0) < v.clock:
                if len(v.vtime) >= MAX_TRACKED_TENANTS:
                    self._forget_idle()
                v.vtime[w.tenant] = v.clock
        dq.append(w)
        self.size += 1

    def peek(self, skip: set[str] | None = None) -> Waiter | None:
        """The next request to dispatch: highest priority first, then the lowest virtual counter. Tenants in
        `skip` (held at their prefill share) are passed over, so the next tenant in fair order may go."""
        vt = self.virtual.vtime
        for level in self.levels:
            if not level:
                continue
            if skip is None:
                tenant = min(level, key=lambda t: vt.get(t, 0.0)) if len(level) > 1 else next(iter(level))
                return level[tenant][0]
            ready = [t for t in level if t not in skip]
            if ready:
                return level[min(ready, key=lambda t: vt.get(t, 0.0))][0]
        return None

    def behind(self, head: Waiter, limit: int) -> list[Waiter]:
        """Up to `limit` waiters after `head`: priority first, then tenants in fair order, each tenant's oldest
        first (the candidates for a backfill past a head that waits for KV)."""
        vt = self.virtual.vtime
        out: list[Waiter] = []
        for level in self.levels:
            for tenant in sorted(level, key=lambda t: vt.get(t, 0.0)):
                for w in level[tenant]:
                    if w is not head:
                        out.append(w)
                        if len(out) >= limit:
                            return out
        return out

    def ahead_of(self, tenant: str, priority: int) -> int:
        """About how many queued requests a new one of `tenant` would wait behind (`work_ahead`'s count)."""
        return self.work_ahead(tenant, priority)[0]

    def work_ahead(self, tenant: str, priority: int) -> tuple[int, int]:
        """The queued requests a new one of `tenant` would wait behind, and their prompt tokens (`work_ahead`)."""
        return work_ahead([self], tenant, priority)

    def lag(self, tenant: str) -> float:
        """How far the tenant's virtual counter is ahead of the clock (0 for a tenant that just (re)entered): what
        orders the next requests of several lanes' queues (sharing one VirtualClock) by fair share."""
        v = self.virtual
        return max(0.0, v.vtime.get(tenant, v.clock) - v.clock)

    def sizes_by_priority(self) -> list[int]:
        """Waiters per priority class, highest first."""
        return [sum(len(dq) for dq in level.values()) for level in self.levels]

    def has_waiting_at_or_above(self, priority: int) -> bool:
        return any(self.levels[p] for p in range(priority + 1))

    def pop(self, w: Waiter) -> None:
        """Remove the peeked waiter as dispatched and charge its tenant."""
        self._remove(w)
        charge = w.req.total_tokens / self.weights.get(w.tenant, 1.0)
        v = self.virtual
        v.vtime[w.tenant] = v.vtime.get(w.tenant, v.clock) + charge
        if v.vtime[w.tenant] - charge > v.clock:
            v.clock = v.vtime[w.tenant] - charge

    def remove(self, w: Waiter) -> bool:
        """Drop a waiter that left (client gone, deadline). False if it was not queued."""
        try:
            self._remove(w)
        except (KeyError, ValueError):
            return False
        return True

    def _remove(self, w: Waiter) -> None:
        level = self.levels[w.priority]
        dq = level[w.tenant]
        if dq[0] is w:
            dq.popleft()
        else:
            dq.remove(w)
        if not dq:
            del level[w.tenant]
        self.size -= 1

    def lowest_priority_newest(self, below: int) -> Waiter | None:
        """The waiter to evict when the queue is full and a more important request arrives."""
        for p in range(len(self.levels) - 1, below, -1):
            level = self.levels[p]
            if level:
                newest = max((dq[-1] for dq in level.values()), key=lambda w: w.enqueued)
                return newest
        return None

    def _forget_idle(self) -> None:
        backlogged = {t for level in self.levels for t in level}
        self.virtual.vtime = {t: v for t, v in self.virtual.vtime.items() if t in backlogged}


def work_ahead(queues: list[FairQueue], tenant: str, priority: int, footprints: bool = False) -> tuple[int, int]:
    """The requests queued in `queues` (one queue, or the lanes sharing one VirtualClock and served in one fair
    order) that a new one of `tenant` would wait behind, and their prompt tokens (the prefill they take before it):
    every one of a higher priority; of its own priority, the tenant's own queue, and of each other tenant the
    requests (oldest first across the queues) whose virtual start tags are at most the new one's:

        start(new)  = max(vtime[tenant], clock) + sum over its queued of tokens / weight[tenant]
        start(u, j) = vtime[u] + sum over u's first j queued of tokens / weight[u]

    (start-time fair queueing: the lowest tag goes next). A quiet tenant's request is not behind a flooding
    tenant's whole backlog, and an early shed must not pretend it is. `footprints`: count their footprints (prompt +
    expected output: the KV they take before it) instead of their prompts."""
    count = tokens = 0
    for q in queues:
        for p in range(priority):
            for dq in q.levels[p].values():
                count += len(dq)
                tokens += sum(_size(w, footprints) for w in dq)
    v = queues[0].virtual
    weights = queues[0].weights
    start = max(v.vtime.get(tenant, v.clock), v.clock)
    others: dict[str, list[deque[Waiter]]] = {}
    w_own = weights.get(tenant, 1.0)
    for q in queues:
        for t, dq in q.levels[priority].items():
            if t != tenant:
                others.setdefault(t, []).append(dq)
                continue
            count += len(dq)
            for w in dq:
                tokens += _size(w, footprints)
                start += w.req.total_tokens / w_own
    for t, dqs in others.items():
        weight = weights.get(t, 1.0)
        tag = v.vtime.get(t, v.clock)
        for w in (dqs[0] if len(dqs) == 1 else merge(*dqs, key=lambda x: x.enqueued)):
            if tag > start + 1e-9:
                break
            count += 1
            tokens += _size(w, footprints)
            tag += w.req.total_tokens / weight
    return count, tokens


def _size(w: Waiter, footprint: bool) -> int:
    """A waiter's prompt tokens, or its footprint (prompt + expected output)."""
    return w.req.total_tokens if footprint else w.req.prompt_tokens
