"""Budget state: one combined check-and-charge per request, in memory or in Redis.

Why one combined operation: every budget (duplicates, retry share, task, tenant tokens) must pass before ANY of
them is charged, or a request refused by the last check would leave charges from the first ones. So the store
takes a flat `AdmitOp` describing every check of one request and either charges all of them or none, and tells
which check failed. With Redis that is one Lua script, i.e. ONE round trip per request, atomic across sidecars
(limits hold exactly however many sidecars share the Redis). `SettleOp` is the matching release / correction,
also one round trip.

State kept (the Redis keys; the memory store keeps the same things in dicts):
  markers     `m:<tenant>:<kind>:<id>` -> charge token while the request is in flight (TTL inflight_ttl_s),
              "0" once it finished (TTL dedupe_window_s). Token present => duplicate in flight (409); "0" => retry.
  windows     `<name>:<window index>` -> count, TTL 2 windows + 1 s. Sliding windows are approximated from two
              fixed windows (Cloudflare's method): used = current + previous * (1 - elapsed fraction of current).
              O(1) per check; exact at window boundaries, smooth in between.
  tasks       hash `t:<tenant>:<task>` {calls, tokens, first, inflight}, TTL ttl_s refreshed per admitted call.
  active set  zset `ta:<tenant>` task -> expiry (now + inflight_ttl while a call runs, now + idle_s after).

Time is the caller's wall clock (`now`, seconds), so sidecars must keep NTP-synced clocks (windows are seconds
long; skew of a few ms is irrelevant).

Fallback (RedisStore): any Redis error (refused, timeout, loading, OOM...) flips the store to `degraded`: it logs
once, sets `sluice_budget_store_fallback_active`, and serves every request from an embedded MemoryStore that
enforces `limit * fallback_share` (this sidecar's share of each global limit). While degraded no request touches
Redis (no per-request connect attempts, so no added latency); a background probe pings Redis with exponential
backoff and flips back when it answers. Settles of Redis charges that arrive while degraded are queued (bounded)
and replayed after recovery.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict, deque
from typing import Any

from extproc.budgets import metrics
from extproc.budgets.policy import RedisPolicy

log = logging.getLogger("sluice.budgets.store")

# AdmitResult.code
OK = 0
DUPLICATE = 1       # a marker of this request belongs to a request still in flight -> 409
RETRY_BUDGET = 2    # retry share exceeded (detail: "pool" | "tenant")
TASK_LIMIT = 3      # task budget exceeded (detail: max_calls | max_tokens | max_wall_s | max_active_tasks)
TENANT_LIMIT = 4    # tenant tokens per window exceeded

BACKEND_MEMORY = "memory"
BACKEND_REDIS = "redis"
BACKEND_LOCAL = "local"   # the Redis store's local fallback


class AdmitOp:
    """Every check of one request, flat (no nested objects on the hot path). Disabled groups leave `*_on` False.

    Limits are GLOBAL limits; a local store scales them by its share.
    """

    __slots__ = ("now", "token", "markers", "inflight_ttl_s", "retry_hint",
                 "r_on", "r_pool", "r_tenant", "r_share", "r_floor", "r_window_s",
                 "t_on", "t_key", "t_active_key", "t_member", "t_cost", "t_max_calls", "t_max_tokens", "t_max_wall_s",
                 "t_max_active", "t_ttl_s",
                 "q_on", "q_name", "q_cost", "q_limit", "q_window_s")

    def __init__(self, now: float, token: str) -> None:
        self.now = now
        self.token = token
        self.markers: tuple[str, ...] = ()
        self.inflight_ttl_s = 600.0
        self.retry_hint = False
        self.r_on = False
        self.t_on = False
        self.q_on = False

    def set_retry(self, pool: str, tenant: str, share: float, floor: int, window_s: float) -> None:
        """Retry share check on window names `pool` and `tenant` (each has an `:a` admitted and `:r` retry counter)."""
        self.r_on = True
        self.r_pool = pool
        self.r_tenant = tenant
        self.r_share = share
        self.r_floor = floor
        self.r_window_s = window_s

    def set_task(self, key: str, active_key: str, member: str, cost: int, max_calls: int, max_tokens: int,
                 max_wall_s: float, max_active: int, ttl_s: float) -> None:
        self.t_on = True
        self.t_key = key
        self.t_active_key = active_key
        self.t_member = member
        self.t_cost = cost
        self.t_max_calls = max_calls
        self.t_max_tokens = max_tokens
        self.t_max_wall_s = max_wall_s
        self.t_max_active = max_active
        self.t_ttl_s = ttl_s

    def set_quota(self, name: str, cost: int, limit: int, window_s: float) -> None:
        self.q_on = True
        self.q_name = name
        self.q_cost = cost
        self.q_limit = limit
        self.q_window_s = window_s


class AdmitResult:
    """Outcome of an AdmitOp. On OK everything was charged; otherwise nothing was.

    detail / used / limit describe the failed check; for TENANT_LIMIT, `cur`/`prev`/`frac` describe the window
    (to compute Retry-After) and `limit` is the limit actually enforced (scaled in local mode).
    """

    __slots__ = ("code", "is_retry", "detail", "used", "limit", "cur", "prev", "frac", "backend")

    def __init__(self, code: int, is_retry: bool, backend: str, detail: str = "", used: float = 0.0,
                 limit: float = 0.0, cur: float = 0.0, prev: float = 0.0, frac: float = 0.0) -> None:
        self.code = code
        self.is_retry = is_retry
        self.backend = backend
        self.detail = detail
        self.used = used
        self.limit = limit
        self.cur = cur
        self.prev = prev
        self.frac = frac

    def __repr__(self) -> str:
        return (f"AdmitResult(code={self.code}, is_retry={self.is_retry}, backend={self.backend}, "
                f"detail={self.detail!r}, used={self.used}, limit={self.limit})")


class SettleOp:
    """Release / correction of one admitted request: the same names as its AdmitOp plus token deltas."""

    __slots__ = ("now", "token", "markers", "dedupe_ttl_s",
                 "t_on", "t_key", "t_active_key", "t_member", "t_delta", "t_active_on", "t_idle_s",
                 "q_on", "q_name", "q_window_s", "q_idx", "q_delta")

    def __init__(self, now: float, token: str) -> None:
        self.now = now
        self.token = token
        self.markers: tuple[str, ...] = ()
        self.dedupe_ttl_s = 30.0
        self.t_on = False
        self.q_on = False


def window_index(now: float, window_s: float) -> tuple[int, float]:
    """(index of the fixed window containing now, elapsed fraction of it)."""
    pos = now / window_s
    idx = math.floor(pos)
    return idx, pos - idx


def scaled(limit: float, share: float) -> float:
    """This sidecar's share of a global limit (0 = unlimited stays 0); at least 1 so a limit never becomes 0."""
    if limit <= 0 or share >= 1.0:
        return limit
    return max(1, math.floor(limit * share))


# ================================================================================================== memory store


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
        # 2. retry share, per pool and per tenant
        if op.r_on:
            idx, frac = window_index(now, op.r_window_s)
            wins = [self._window(n + s, idx, op.r_window_s)
                    for n in (op.r_pool, op.r_tenant) for s in (":a", ":r")]
            if is_retry:
                floor = scaled(op.r_floor, share)
                keep = 1.0 - frac
                for j, scope in ((0, "pool"), (2, "tenant")):
                    adm = wins[j].cur + wins[j].prev * keep
                    ret = wins[j + 1].cur + wins[j + 1].prev * keep
                    allowed = max(floor, op.r_share * (adm + 1))
                    if ret + 1 > allowed:
                        return AdmitResult(RETRY_BUDGET, True, backend, detail=scope, used=ret, limit=allowed)
        # 3. task budget
        task = None
        if op.t_on:
            task = self._tasks.get(op.t_key)
            if task is not None and task.expires <= now:
                del self._tasks[op.t_key]
                task = None
            calls = task.calls if task else 0
            tokens = task.tokens if task else 0
            first = task.first if task else now
            lim = scaled(op.t_max_calls, share)
            if lim and calls + 1 > lim:
                return AdmitResult(TASK_LIMIT, is_retry, backend, "max_calls", calls, lim)
            lim = scaled(op.t_max_tokens, share)
            if lim and tokens + op.t_cost > lim:
                return AdmitResult(TASK_LIMIT, is_retry, backend, "max_tokens", tokens, lim)
            if op.t_max_wall_s and now - first > op.t_max_wall_s:
                return AdmitResult(TASK_LIMIT, is_retry, backend, "max_wall_s", now - first, op.t_max_wall_s)
            if op.t_max_active:
                members = self._active.get(op.t_active_key)
                exp = members.get(op.t_member) if members else None
                if exp is None or exp <= now:
                    lim = scaled(op.t_max_active, share)
                    count = self._active_count(op.t_active_key, now)
                    if count >= lim:
                        return AdmitResult(TASK_LIMIT, is_retry, backend, "max_active_tasks", count, lim)
        # 4. tenant tokens per window
        qwin = None
        if op.q_on:
            idx, frac = window_index(now, op.q_window_s)
            qwin = self._window(op.q_name, idx, op.q_window_s)
            lim = scaled(op.q_limit, share)
            used = qwin.cur + qwin.prev * (1.0 - frac)
            if used + op.q_cost > lim:
                return AdmitResult(TENANT_LIMIT, is_retry, backend, "", used, lim, qwin.cur, qwin.prev, frac)
        # ---- every check passed: charge everything
        if op.markers:
            exp = now + op.inflight_ttl_s
            for key in op.markers:
                done.pop(key, None)
                inflight[key] = (op.token, exp)
                inflight.move_to_end(key)  # insertion order = expiry order
        if op.r_on:
            wins[0].cur += 1
            wins[2].cur += 1
            if is_retry:
                wins[1].cur += 1
                wins[3].cur += 1
        if op.t_on:
            if task is None:
                task = self._tasks[op.t_key] = _Task(now)
            else:
                self._tasks.move_to_end(op.t_key)
            task.calls += 1
            task.tokens += op.t_cost
            task.inflight += 1
            task.expires = now + op.t_ttl_s
            if op.t_max_active:
                self._set_active(op.t_active_key, op.t_member, now + op.inflight_ttl_s)
        if qwin is not None:
            qwin.cur += op.q_cost
        return AdmitResult(OK, is_retry, backend)

    def settle_sync(self, op: SettleOp) -> None:
        now = op.now
        inflight = self._inflight
        for key in op.markers:
            entry = inflight.get(key)
            if entry is not None and entry[0] == op.token:
                del inflight[key]
                self._done.pop(key, None)
                self._done[key] = now + op.dedupe_ttl_s
        if op.t_on:
            task = self._tasks.get(op.t_key)
            if task is not None:
                if op.t_delta:
                    task.tokens = max(0, task.tokens + op.t_delta)
                task.inflight -= 1
                if task.inflight <= 0:
                    task.inflight = 0
                    if op.t_active_on:
                        members = self._active.get(op.t_active_key)
                        if members is not None and op.t_member in members:
                            self._set_active(op.t_active_key, op.t_member, now + op.t_idle_s)
        if op.q_on and op.q_delta:
            w = self._windows.get(op.q_name)
            if w is not None:
                if w.idx == op.q_idx:
                    w.cur = max(0.0, w.cur + op.q_delta)
                elif w.idx == op.q_idx + 1:
                    w.prev = max(0.0, w.prev + op.q_delta)

    def stats(self) -> dict[str, Any]:
        return {"backend": self.backend, "degraded": self.degraded, "share": self.share,
                "inflight_markers": len(self._inflight), "done_markers": len(self._done),
                "windows": len(self._windows), "tasks": len(self._tasks)}


# ================================================================================================== redis store

_ADMIT_LUA = r"""
-- KEYS: markers[1..nm]; retry (8): pool a cur/prev, pool r cur/prev, tenant a cur/prev, tenant r cur/prev;
--       task (2): hash, active zset; quota (2): cur, prev
-- ARGV[1]: space-separated numbers (one string: packing 25 separate arguments costs the client more than the
--   server spends splitting): 1 now, 2 nm, 3 inflight_ttl_ms, 4 retry_hint, 5 r_on, 6 share, 7 floor, 8 r_frac,
--   9 r_ttl_ms, 10 t_on, 11 cost, 12 max_calls, 13 max_tokens, 14 max_wall_s, 15 max_active, 16 ttl_ms,
--   17 active_score (now + inflight_ttl), 18 q_on, 19 q_cost, 20 q_limit, 21 q_frac, 22 q_ttl_ms
-- ARGV[2]: charge token; ARGV[3]: task member
local a = {}
for v in string.gmatch(ARGV[1], '%S+') do a[#a + 1] = v end
local now = tonumber(a[1])
local nm = tonumber(a[2])
local is_retry = tonumber(a[4])
local r_on = a[5] == '1'
local t_on = a[10] == '1'
local q_on = a[18] == '1'
for i = 1, nm do
  local v = redis.call('GET', KEYS[i])
  if v then
    if v ~= '0' then return {1, 1, KEYS[i]} end
    is_retry = 1
  end
end
local k = nm
local rk = k
if r_on then
  k = k + 8
  if is_retry == 1 then
    local share = tonumber(a[6])
    local floor_ = tonumber(a[7])
    local keep = 1 - tonumber(a[8])
    local scopes = {'pool', 'tenant'}
    for j = 0, 1 do
      local b = rk + j * 4
      local adm = tonumber(redis.call('GET', KEYS[b + 1]) or '0')
                  + tonumber(redis.call('GET', KEYS[b + 2]) or '0') * keep
      local ret = tonumber(redis.call('GET', KEYS[b + 3]) or '0')
                  + tonumber(redis.call('GET', KEYS[b + 4]) or '0') * keep
      local allowed = math.max(floor_, share * (adm + 1))
      if ret + 1 > allowed then return {2, 1, scopes[j + 1], tostring(ret), tostring(allowed)} end
    end
  end
end
local tk = k
local new_task = false
if t_on then
  k = k + 2
  local h = redis.call('HMGET', KEYS[tk + 1], 'calls', 'tokens', 'first')
  local calls = tonumber(h[1] or '0')
  local tokens = tonumber(h[2] or '0')
  local first = tonumber(h[3] or a[1])
  new_task = h[1] == false
  local lim = tonumber(a[12])
  if lim > 0 and calls + 1 > lim then return {3, is_retry, 'max_calls', tostring(calls), tostring(lim)} end
  lim = tonumber(a[13])
  if lim > 0 and tokens + tonumber(a[11]) > lim then
    return {3, is_retry, 'max_tokens', tostring(tokens), tostring(lim)}
  end
  lim = tonumber(a[14])
  if lim > 0 and now - first > lim then return {3, is_retry, 'max_wall_s', tostring(now - first), tostring(lim)} end
  lim = tonumber(a[15])
  if lim > 0 then
    local sc = redis.call('ZSCORE', KEYS[tk + 2], ARGV[3])
    if (not sc) or tonumber(sc) <= now then
      redis.call('ZREMRANGEBYSCORE', KEYS[tk + 2], '-inf', a[1])  -- expired members only: charges nothing
      local count = redis.call('ZCARD', KEYS[tk + 2])
      if count >= lim then return {3, is_retry, 'max_active_tasks', tostring(count), tostring(lim)} end
    end
  end
end
local qk = k
if q_on then
  local cur = tonumber(redis.call('GET', KEYS[qk + 1]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[qk + 2]) or '0')
  local used = cur + prev * (1 - tonumber(a[21]))
  if used + tonumber(a[19]) > tonumber(a[20]) then
    return {4, is_retry, '', tostring(used), a[20], tostring(cur), tostring(prev)}
  end
end
-- every check passed: charge everything
for i = 1, nm do redis.call('SET', KEYS[i], ARGV[2], 'PX', a[3]) end
if r_on then
  local ttl = a[9]
  redis.call('INCR', KEYS[rk + 1]); redis.call('PEXPIRE', KEYS[rk + 1], ttl)
  redis.call('INCR', KEYS[rk + 5]); redis.call('PEXPIRE', KEYS[rk + 5], ttl)
  if is_retry == 1 then
    redis.call('INCR', KEYS[rk + 3]); redis.call('PEXPIRE', KEYS[rk + 3], ttl)
    redis.call('INCR', KEYS[rk + 7]); redis.call('PEXPIRE', KEYS[rk + 7], ttl)
  end
end
if t_on then
  local h = KEYS[tk + 1]
  redis.call('HINCRBY', h, 'calls', 1)
  redis.call('HINCRBY', h, 'tokens', a[11])
  redis.call('HINCRBY', h, 'inflight', 1)
  if new_task then redis.call('HSET', h, 'first', a[1]) end
  redis.call('PEXPIRE', h, a[16])
  if tonumber(a[15]) > 0 then
    redis.call('ZADD', KEYS[tk + 2], a[17], ARGV[3])
    redis.call('PEXPIRE', KEYS[tk + 2], a[16])
  end
end
if q_on then
  redis.call('INCRBY', KEYS[qk + 1], a[19])
  redis.call('PEXPIRE', KEYS[qk + 1], a[22])
end
return {0, is_retry}
"""

_SETTLE_LUA = r"""
-- KEYS: markers[1..nm]; task (2): hash, active zset; quota (1): the window key charged
-- ARGV[1]: numbers "nm dedupe_ms t_on t_delta active_on idle_score q_on q_delta"; ARGV[2]: token; ARGV[3]: member
local a = {}
for v in string.gmatch(ARGV[1], '%S+') do a[#a + 1] = v end
local nm = tonumber(a[1])
for i = 1, nm do
  if redis.call('GET', KEYS[i]) == ARGV[2] then redis.call('SET', KEYS[i], '0', 'PX', a[2]) end
end
local k = nm
if a[3] == '1' then
  local h = KEYS[k + 1]
  if redis.call('EXISTS', h) == 1 then
    local d = tonumber(a[4])
    if d ~= 0 then
      local v = redis.call('HINCRBY', h, 'tokens', d)
      if v < 0 then redis.call('HSET', h, 'tokens', 0) end
    end
    local inf = redis.call('HINCRBY', h, 'inflight', -1)
    if inf <= 0 then
      redis.call('HSET', h, 'inflight', 0)
      if a[5] == '1' then redis.call('ZADD', KEYS[k + 2], 'XX', a[6], ARGV[3]) end
    end
  end
  k = k + 2
end
if a[7] == '1' then
  local d = tonumber(a[8])
  if d ~= 0 and redis.call('EXISTS', KEYS[k + 1]) == 1 then
    local v = redis.call('INCRBY', KEYS[k + 1], d)
    if v < 0 then redis.call('INCRBY', KEYS[k + 1], -v) end
  end
end
return 0
"""


def _num(x: Any) -> float:
    return float(x.decode() if isinstance(x, bytes) else x)


def _str(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisStore:
    """State in Redis, shared by every sidecar using the same Redis and key prefix; local fallback when it is down.

    `fallback_share` scales global limits while degraded (see module docstring). `degraded` is True while local
    limits apply. Call `start()` once on the event loop (optional: the first operation connects lazily) and
    `close()` at shutdown.

    Batching: redis-py's asyncio client spends about 130-170 us of CPU per command here, more than the sidecar's
    whole per-request budget at load. Calls are therefore queued and sent once per event-loop iteration as one
    pipeline of EVALSHAs (at most `_MAX_BATCHES` pipelines in flight, `_MAX_BATCH` scripts each): still one round
    trip per request, but the fixed cost is shared (measured: 26 us of CPU per script in batches of 50). Each
    script stays atomic on its own; a lone call goes out directly without a pipeline.
    """

    backend = BACKEND_REDIS
    _MAX_BATCH = 256
    _MAX_BATCHES = 4

    def __init__(self, policy: RedisPolicy | None = None, fallback_share: float = 1.0, client: Any = None) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import NoScriptError, RedisError

        self.policy = policy or RedisPolicy()
        self.prefix = self.policy.key_prefix
        self.fallback_share = fallback_share
        self.local = MemoryStore(share=fallback_share, backend=BACKEND_LOCAL)
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
        self._noscript = NoScriptError
        if client is None:
            p = self.policy
            # No client-side retries: a failed command falls back at once instead of stacking connect attempts.
            pool = aioredis.BlockingConnectionPool.from_url(
                p.url, max_connections=p.max_connections, timeout=p.pool_timeout_s,
                socket_timeout=p.socket_timeout_s, socket_connect_timeout=p.connect_timeout_s,
                retry=Retry(NoBackoff(), 0), retry_on_error=[], health_check_interval=0)
            client = aioredis.Redis(connection_pool=pool)
        self.client = client
        self._scripts = (_ADMIT_LUA, _SETTLE_LUA)
        self._shas = tuple(hashlib.sha1(s.encode()).hexdigest() for s in self._scripts)
        self._batch: list[list[Any]] = []       # [script index, keys, args, future, op]
        self.compensated = 0                    # admits charged in Redis after their caller was cancelled
        self._running = 0
        self._kick_scheduled = False
        self.degraded = False
        self.last_error: str | None = None
        self.fallback_count = 0
        self._probe_task: asyncio.Task[None] | None = None
        self._next_probe_at = 0.0
        self._probe_delay = self.policy.probe_interval_s
        self._pending: deque[SettleOp] = deque(maxlen=self.policy.pending_settles_max or None)
        self._closed = False

    # ------------------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect and load the scripts; if Redis is down, start degraded (the probe brings it back)."""
        try:
            await self.client.ping()
            await self._load_scripts()
        except self._errors as exc:
            self._enter_degraded(exc)

    async def _load_scripts(self) -> None:
        for script in self._scripts:
            await self.client.script_load(script)

    async def close(self) -> None:
        self._closed = True
        task = self._probe_task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            await self.client.aclose(close_connection_pool=True)
        except Exception:  # closing a broken connection must not fail shutdown
            pass

    # ------------------------------------------------------------------------------------------------ batching
    def _submit(self, which: int, keys: list[str], args: list[str], op: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._batch.append([which, keys, args, fut, op])
        if not self._kick_scheduled:
            self._kick_scheduled = True
            loop.call_soon(self._kick)   # next loop iteration: collects every call made in this one
        return fut

    def _kick(self) -> None:
        self._kick_scheduled = False
        loop = asyncio.get_running_loop()
        while self._batch and self._running < self._MAX_BATCHES:
            items = self._batch[:self._MAX_BATCH]
            del self._batch[:self._MAX_BATCH]
            self._running += 1
            loop.create_task(self._run(items))

    async def _run(self, items: list[list[Any]]) -> None:
        try:
            # admits whose caller is already gone (client disconnected while queued) are never sent
            items = [it for it in items if it[0] != 0 or not it[3].cancelled()]
            results = await self._execute(items) if items else []
            retry = [i for i, r in enumerate(results) if isinstance(r, self._noscript)]
            if retry:  # Redis restarted or flushed its script cache: reload once, rerun those (they did not run)
                await self._load_scripts()
                again = await self._execute([items[i] for i in retry])
                for i, r in zip(retry, again, strict=True):
                    results[i] = r
        except asyncio.CancelledError:  # loop shutting down
            for item in items:
                item[3].cancel()
            raise
        except Exception as exc:  # delivered to every waiter, which falls back
            results = [exc] * len(items)
        finally:
            self._running -= 1
            if self._batch and not self._kick_scheduled:
                self._kick_scheduled = True
                asyncio.get_running_loop().call_soon(self._kick)
        for item, res in zip(items, results, strict=True):
            fut = item[3]
            if fut.cancelled():
                self._compensate(item, res)
            elif isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)

    async def _execute(self, items: list[list[Any]]) -> list[Any]:
        shas = self._shas
        if len(items) == 1:
            which, keys, args = items[0][:3]
            try:
                return [await self.client.execute_command("EVALSHA", shas[which], len(keys), *keys, *args)]
            except self._noscript as exc:
                return [exc]
        pipe = self.client.pipeline(transaction=False)
        for which, keys, args, _fut, _op in items:
            pipe.execute_command("EVALSHA", shas[which], len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)

    def _compensate(self, item: list[Any], res: Any) -> None:
        """The caller of an admit was cancelled (client gone) after the script was sent: if it charged, release
        what can be released (markers, in-flight, tokens) so a cancelled request does not pin a 409 marker."""
        op = item[4]
        if item[0] == 1:  # a settle whose caller went away: it ran, or it waits for Redis to come back
            if isinstance(res, self._errors):
                self._enter_degraded(res)
                self._pending.append(op)
            return
        if isinstance(res, BaseException) or int(res[0]) != OK:
            return
        self.compensated += 1
        s = SettleOp(op.now, op.token)
        s.markers = op.markers
        s.dedupe_ttl_s = 0.001
        if op.t_on:
            s.t_on = True
            s.t_key, s.t_active_key, s.t_member = op.t_key, op.t_active_key, op.t_member
            s.t_delta = -op.t_cost
            s.t_active_on = op.t_max_active > 0
            s.t_idle_s = 0.0
        if op.q_on:
            s.q_on = True
            s.q_name, s.q_window_s = op.q_name, op.q_window_s
            s.q_idx = window_index(op.now, op.q_window_s)[0]
            s.q_delta = -op.q_cost
        keys, args = self._settle_call(s)
        self._submit(1, keys, args, s)

    # ------------------------------------------------------------------------------------------------ fallback
    def _enter_degraded(self, exc: BaseException) -> None:
        metrics.STORE_ERRORS.inc()
        if self.degraded:
            return
        self.degraded = True
        self.fallback_count += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._probe_delay = self.policy.probe_interval_s
        self._next_probe_at = time.monotonic() + self._probe_delay
        metrics.STORE_FALLBACK_ACTIVE.set(1)
        metrics.STORE_FALLBACK_TRANSITIONS.labels("enter").inc()
        log.warning("budget store: Redis unreachable (%s); enforcing local share %.3g of global limits",
                    self.last_error, self.fallback_share,
                    extra={"event": "budget_store_fallback", "state": "enter", "error": self.last_error,
                           "fallback_share": self.fallback_share})
        self._ensure_probe()

    def _ensure_probe(self) -> None:
        if self._closed or (self._probe_task is not None and not self._probe_task.done()):
            return
        try:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())
        except RuntimeError:  # no running loop (sync caller): the next async call starts it
            self._probe_task = None

    async def _probe_loop(self) -> None:
        """Ping Redis with exponential backoff until it answers, replay queued settles, leave fallback."""
        while self.degraded and not self._closed:
            await asyncio.sleep(max(0.0, self._next_probe_at - time.monotonic()))
            try:
                # Drop connections that died with the old server, then probe on a fresh one.
                await self.client.connection_pool.disconnect(inuse_connections=False)
                await self.client.ping()
                await self._load_scripts()
            except self._errors:
                self._probe_delay = min(self._probe_delay * 2, self.policy.probe_max_interval_s)
                self._next_probe_at = time.monotonic() + self._probe_delay
                continue
            if not await self._replay_pending():
                self._next_probe_at = time.monotonic() + self._probe_delay
                continue
            self.degraded = False
            metrics.STORE_FALLBACK_ACTIVE.set(0)
            metrics.STORE_FALLBACK_TRANSITIONS.labels("exit").inc()
            log.warning("budget store: Redis reachable again; shared limits restored",
                        extra={"event": "budget_store_fallback", "state": "exit"})

    async def _replay_pending(self) -> bool:
        """Replay settles queued while degraded; False if Redis failed again (the rest stays queued)."""
        while self._pending:
            op = self._pending[0]
            keys, args = self._settle_call(op)
            try:
                await self._submit(1, keys, args, op)
            except self._errors:
                return False
            self._pending.popleft()
        return True

    # ------------------------------------------------------------------------------------------------ encoding
    def _admit_call(self, op: AdmitOp) -> tuple[list[str], list[str]]:
        p = self.prefix
        keys = [p + m for m in op.markers]
        now = op.now
        nums = f"{now!r} {len(op.markers)} {_ms(op.inflight_ttl_s)} {1 if op.retry_hint else 0}"
        if op.r_on:
            idx, frac = window_index(now, op.r_window_s)
            c, pv = f":{idx}", f":{idx - 1}"
            for n in (op.r_pool, op.r_tenant):
                keys += (f"{p}{n}:a{c}", f"{p}{n}:a{pv}", f"{p}{n}:r{c}", f"{p}{n}:r{pv}")
            nums += f" 1 {op.r_share!r} {op.r_floor} {frac!r} {_ms(op.r_window_s * 2 + 1)}"
        else:
            nums += " 0 0 0 0 0"
        member = ""
        if op.t_on:
            keys += (p + op.t_key, p + op.t_active_key)
            member = op.t_member
            nums += (f" 1 {op.t_cost} {op.t_max_calls} {op.t_max_tokens} {float(op.t_max_wall_s)!r} {op.t_max_active}"
                     f" {_ms(op.t_ttl_s)} {now + op.inflight_ttl_s!r}")
        else:
            nums += " 0 0 0 0 0 0 0 0"
        if op.q_on:
            idx, frac = window_index(now, op.q_window_s)
            keys += (f"{p}{op.q_name}:{idx}", f"{p}{op.q_name}:{idx - 1}")
            nums += f" 1 {op.q_cost} {op.q_limit} {frac!r} {_ms(op.q_window_s * 2 + 1)}"
        else:
            nums += " 0 0 0 0 0"
        return keys, [nums, op.token, member]

    def _settle_call(self, op: SettleOp) -> tuple[list[str], list[str]]:
        p = self.prefix
        keys = [p + m for m in op.markers]
        nums = f"{len(op.markers)} {_ms(op.dedupe_ttl_s)}"
        member = ""
        if op.t_on:
            keys += (p + op.t_key, p + op.t_active_key)
            member = op.t_member
            nums += f" 1 {int(op.t_delta)} {1 if op.t_active_on else 0} {op.now + op.t_idle_s!r}"
        else:
            nums += " 0 0 0 0"
        if op.q_on:
            keys.append(f"{p}{op.q_name}:{op.q_idx}")
            nums += f" 1 {int(op.q_delta)}"
        else:
            nums += " 0 0"
        return keys, [nums, op.token, member]

    # ------------------------------------------------------------------------------------------------ operations
    async def admit(self, op: AdmitOp) -> AdmitResult:
        if self.degraded:
            if self._probe_task is None or self._probe_task.done():
                self._ensure_probe()
            return self.local.admit_sync(op)
        keys, args = self._admit_call(op)
        try:
            res = await self._submit(0, keys, args, op)
        except self._errors as exc:
            self._enter_degraded(exc)
            return self.local.admit_sync(op)
        code = int(res[0])
        is_retry = int(res[1]) == 1
        if code == OK:
            return AdmitResult(OK, is_retry, BACKEND_REDIS)
        if code == DUPLICATE:
            return AdmitResult(DUPLICATE, True, BACKEND_REDIS, detail=_str(res[2])[len(self.prefix):])
        if code == TENANT_LIMIT:
            _, frac = window_index(op.now, op.q_window_s)
            return AdmitResult(TENANT_LIMIT, is_retry, BACKEND_REDIS, "", _num(res[3]), _num(res[4]),
                               _num(res[5]), _num(res[6]), frac)
        return AdmitResult(code, is_retry, BACKEND_REDIS, _str(res[2]), _num(res[3]), _num(res[4]))

    async def settle(self, op: SettleOp, backend: str = BACKEND_REDIS) -> None:
        """Settle a charge on the backend that made it (`local` charges stay local). Runs to completion even if
        the caller is cancelled meanwhile (the script is already queued)."""
        if backend == BACKEND_LOCAL:
            self.local.settle_sync(op)
            return
        if self.degraded:
            self._pending.append(op)
            return
        keys, args = self._settle_call(op)
        try:
            await self._submit(1, keys, args, op)
        except self._errors as exc:
            self._enter_degraded(exc)
            self._pending.append(op)

    def stats(self) -> dict[str, Any]:
        return {"backend": self.backend, "degraded": self.degraded, "fallback_share": self.fallback_share,
                "fallback_count": self.fallback_count, "last_error": self.last_error,
                "pending_settles": len(self._pending), "compensated": self.compensated,
                "local": self.local.stats()}


Store = MemoryStore | RedisStore
