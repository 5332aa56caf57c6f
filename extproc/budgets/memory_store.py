"""Budget state in this process: the reference algorithm the Lua scripts (lua/admit.lua, lua/settle.lua) mirror,
and the Redis store's fallback while Redis is unreachable.

State kept (the Redis store keeps the same things in keys):
  markers     identity -> the charge's token while the request is in flight (expires after inflight_ttl_s), then
              "done" for dedupe_window_s. Token present => duplicate in flight (409); "done" => a retry.
  windows     name -> two fixed-window counters (current, previous): used = cur + prev x (1 - elapsed fraction).
  tasks       key -> {calls, tokens, first call, calls in flight}, forgotten ttl_s after its last admitted call.
  active sets tenant -> {task: expiry} (now + inflight_ttl while a call runs, now + idle_s after).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from extproc.budgets.ops import (
    BACKEND_MEMORY,
    DUPLICATE,
    OK,
    RETRY_BUDGET,
    TASK_LIMIT,
    TENANT_LIMIT,
    AdmitOp,
    AdmitResult,
    RetryCheck,
    SettleOp,
    scaled,
    window_index,
)


class _Window:
    __slots__ = ("idx", "cur", "prev", "window_s")

    def __init__(self, idx: int, window_s: float) -> None:
        self.idx = idx
        self.cur = 0.0
        self.prev = 0.0
        self.window_s = window_s

    def roll(self, idx: int) -> None:
        if idx != self.idx:
            self.prev = self.cur if idx == self.idx + 1 else 0.0
            self.cur = 0.0
            self.idx = idx


class _Task:
    __slots__ = ("calls", "tokens", "first", "inflight", "expires")

    def __init__(self, first: float) -> None:
        self.calls = 0
        self.tokens = 0
        self.first = first
        self.inflight = 0
        self.expires = 0.0


class MemoryStore:
    """State in this process. Every method is synchronous underneath (the async ones never yield).

    `share` scales every global limit (see `scaled`): 1 for a lone sidecar, 1/N for N sidecars without Redis, the
    fallback share inside RedisStore. Memory is bounded by TTLs: expired entries are dropped lazily on access and
    by an incremental sweep of the oldest entries (dicts kept in expiry order), so no per-request scan.
    """

    backend = BACKEND_MEMORY

    def __init__(self, share: float = 1.0, backend: str = BACKEND_MEMORY) -> None:
        self.share = share
        self.backend = backend
        self.degraded = False
        # OrderedDicts, not dicts: popping the oldest entry of a plain dict rescans its deleted slots every time.
        self._inflight: OrderedDict[str, tuple[str, float]] = OrderedDict()  # marker -> (token, expires)
        self._done: OrderedDict[str, float] = OrderedDict()      # marker -> expires
        self._windows: dict[str, _Window] = {}
        self._tasks: OrderedDict[str, _Task] = OrderedDict()    # key -> task; LRU = expiry order
        self._active: dict[str, dict[str, float]] = {}          # tenant key -> {task: expires}
        self._active_min: dict[str, float] = {}                 # tenant key -> earliest expiry in its set
        self._next_window_sweep = 0.0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    # ------------------------------------------------------------------------------------------------ helpers
    def _sweep(self, now: float) -> None:
        inflight = self._inflight
        while inflight:
            key = next(iter(inflight))
            if inflight[key][1] > now:
                break
            del inflight[key]
        done = self._done
        while done:
            key, exp = next(iter(done.items()))
            if exp > now:
                break
            del done[key]
        tasks = self._tasks
        while tasks:
            key, task = next(iter(tasks.items()))
            if task.expires > now:
                break
            del tasks[key]
        if now >= self._next_window_sweep:  # a handful of pools/tenants: a full pass every few seconds is cheap
            self._next_window_sweep = now + 5.0
            stale = [k for k, w in self._windows.items() if (now / w.window_s) - w.idx >= 2.0]
            for k in stale:
                del self._windows[k]
            for k in [k for k, s in self._active.items() if not s]:
                del self._active[k]
                self._active_min.pop(k, None)

    def _window(self, name: str, idx: int, window_s: float) -> _Window:
        w = self._windows.get(name)
        if w is None:
            w = self._windows[name] = _Window(idx, window_s)
        else:
            w.roll(idx)
        return w

    def _active_count(self, key: str, now: float) -> int:
        members = self._active.get(key)
        if not members:
            return 0
        if self._active_min.get(key, 0.0) <= now:
            for m in [m for m, exp in members.items() if exp <= now]:
                del members[m]
            self._active_min[key] = min(members.values(), default=math.inf)
        return len(members)

    def _set_active(self, key: str, member: str, expires: float) -> None:
        members = self._active.get(key)
        if members is None:
            members = self._active[key] = {}
        members[member] = expires
        if expires < self._active_min.get(key, math.inf):
            self._active_min[key] = expires

    def _retry_windows(self, r: RetryCheck, now: float) -> list[_Window]:
        """The pool's admitted and retries windows, then the tenant's."""
        idx = window_index(now, r.window_s)[0]
        return [self._window(n + s, idx, r.window_s) for n in (r.pool, r.tenant) for s in (":a", ":r")]

    def _retry_over(self, r: RetryCheck, wins: list[_Window], now: float,
                    pending: float = 0.0) -> tuple[str, float, float] | None:
        """Would one more retry exceed the share (retry.py's formula), after `pending` retries already asked for?
        (scope, retries, allowed) if so."""
        floor = scaled(r.floor, self.share)
        keep = 1.0 - window_index(now, r.window_s)[1]
        for j, scope in ((2, "tenant"), (0, "pool")):
            adm = wins[j].cur + wins[j].prev * keep
            ret = wins[j + 1].cur + wins[j + 1].prev * keep + pending
            if j == 2 and ret + 1 <= floor:
                return None  # within the tenant's own floor: no other tenant's retries can refuse it
            allowed = max(floor, r.share * (adm + 1))
            if ret + 1 > allowed:
                return scope, ret, allowed
        return None

    def mirror_retry_windows(self, r: RetryCheck, now: float, counts: Sequence[Any]) -> None:
        """Set `r`'s four retry windows to counts another store reported at `now` (pool admitted cur/prev, pool
        retries cur/prev, then the tenant's: lua/admit.lua's KEYS order; numbers, or their str / bytes), so
        `retry_refused` reads them."""
        self._sweep(now)
        for j, w in enumerate(self._retry_windows(r, now)):
            w.cur = float(counts[2 * j])
            w.prev = float(counts[2 * j + 1])

    def retry_refused(self, r: RetryCheck, now: float, pending: float = 0.0) -> bool:
        """Would a retry in `r`'s scopes be refused now, after `pending` retries this sidecar has asked for? A read:
        nothing is charged."""
        return self._retry_over(r, self._retry_windows(r, now), now, pending) is not None

    # ------------------------------------------------------------------------------------------------ operations
    async def admit(self, op: AdmitOp) -> AdmitResult:
        return self.admit_sync(op)

    async def settle(self, op: SettleOp, backend: str = BACKEND_MEMORY) -> None:
        self.settle_sync(op)

    def admit_sync(self, op: AdmitOp) -> AdmitResult:
        now = op.now
        self._sweep(now)
        backend = self.backend
        share = self.share
        is_retry = op.retry_hint
        inflight = self._inflight
        done = self._done
        # 1. duplicates in flight / identities seen recently
        for key in op.markers:
            entry = inflight.get(key)
            if entry is not None and entry[1] > now:
                return AdmitResult(DUPLICATE, True, backend, detail=key)
            exp = done.get(key)
            if exp is not None and exp > now:
                is_retry = True
        # 2. retry share: the tenant's own, then the pool's for a retry past the tenant's floor
        r = op.retry
        if r is not None:
            wins = self._retry_windows(r, now)
            if is_retry:
                over = self._retry_over(r, wins, now)
                if over is not None:
                    scope, ret, allowed = over
                    return AdmitResult(RETRY_BUDGET, True, backend, detail=scope, used=ret, limit=allowed)
        # 3. task budget
        t = op.task
        task = None
        if t is not None:
            ref = t.ref
            task = self._tasks.get(ref.key)
            if task is not None and task.expires <= now:
                del self._tasks[ref.key]
                task = None
            calls = task.calls if task else 0
            tokens = task.tokens if task else 0
            first = task.first if task else now
            lim = scaled(t.max_calls, share)
            if lim and calls + 1 > lim:
                return AdmitResult(TASK_LIMIT, is_retry, backend, "max_calls", calls, lim)
            lim = scaled(t.max_tokens, share)
            if lim and tokens + t.cost > lim:
                return AdmitResult(TASK_LIMIT, is_retry, backend, "max_tokens", tokens, lim)
            if t.max_wall_s and now - first > t.max_wall_s:
                return AdmitResult(TASK_LIMIT, is_retry, backend, "max_wall_s", now - first, t.max_wall_s)
            if t.max_active:
                members = self._active.get(ref.active_key)
                exp = members.get(ref.member) if members else None
                if exp is None or exp <= now:
                    lim = scaled(t.max_active, share)
                    count = self._active_count(ref.active_key, now)
                    if count >= lim:
                        return AdmitResult(TASK_LIMIT, is_retry, backend, "max_active_tasks", count, lim)
        # 4. tenant tokens per window
        q = op.quota
        qwin = None
        if q is not None:
            idx, frac = window_index(now, q.window_s)
            qwin = self._window(q.name, idx, q.window_s)
            lim = scaled(q.limit, share)
            used = qwin.cur + qwin.prev * (1.0 - frac)
            if used + q.cost > lim:
                return AdmitResult(TENANT_LIMIT, is_retry, backend, "", used, lim, qwin.cur, qwin.prev, frac)
        # ---- every check passed: charge everything
        if op.markers:
            exp = now + op.inflight_ttl_s
            for key in op.markers:
                done.pop(key, None)
                inflight[key] = (op.token, exp)
                inflight.move_to_end(key)  # insertion order = expiry order
        if r is not None:
            wins[0].cur += 1
            wins[2].cur += 1
            if is_retry:
                wins[1].cur += 1
                wins[3].cur += 1
        if t is not None:
            ref = t.ref
            if task is None:
                task = self._tasks[ref.key] = _Task(now)
            else:
                self._tasks.move_to_end(ref.key)
            task.calls += 1
            task.tokens += t.cost
            task.inflight += 1
            task.expires = now + t.ttl_s
            if t.max_active:
                self._set_active(ref.active_key, ref.member, now + op.inflight_ttl_s)
        if qwin is not None:
            qwin.cur += q.cost  # type: ignore[union-attr]
        return AdmitResult(OK, is_retry, backend)

    def settle_sync(self, op: SettleOp) -> None:
        now = op.now
        c = op.charged
        inflight = self._inflight
        for key in c.markers:
            entry = inflight.get(key)
            if entry is not None and entry[0] == c.token:
                del inflight[key]
                self._done.pop(key, None)
                self._done[key] = now + op.dedupe_ttl_s
        ref = c.task
        if ref is not None:
            task = self._tasks.get(ref.key)
            if task is not None:
                if op.task_delta:
                    task.tokens = max(0, task.tokens + op.task_delta)
                task.inflight -= 1
                if task.inflight <= 0:
                    task.inflight = 0
                    if c.task_active:
                        members = self._active.get(ref.active_key)
                        if members is not None and ref.member in members:
                            self._set_active(ref.active_key, ref.member, now + op.idle_s)
        qw = c.quota
        if qw is not None and op.quota_delta:
            w = self._windows.get(qw.name)
            if w is not None:
                if w.idx == qw.idx:
                    w.cur = max(0.0, w.cur + op.quota_delta)
                elif w.idx == qw.idx + 1:
                    w.prev = max(0.0, w.prev + op.quota_delta)

    def stats(self) -> dict[str, Any]:
        return {"backend": self.backend, "degraded": self.degraded, "share": self.share,
                "inflight_markers": len(self._inflight), "done_markers": len(self._done),
                "windows": len(self._windows), "tasks": len(self._tasks)}
