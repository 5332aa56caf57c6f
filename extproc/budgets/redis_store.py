"""Budget state in Redis, shared by every sidecar using the same Redis and key prefix, with a local fallback.

Each operation is ONE Lua script (lua/admit.lua, lua/settle.lua; the same algorithm as memory_store.py, loaded
from the package at start), so it is one round trip, atomic across sidecars: limits hold exactly however many
sidecars share the Redis. Keys:
  markers     `m:<tenant>:<kind>:<id>` -> the charge's token while in flight (TTL inflight_ttl_s), "0" once it
              finished (TTL dedupe_window_s).
  windows     `<name>:<window index>` -> count, TTL 2 windows + 1 s.
  tasks       hash `t:<tenant>:<task>` {calls, tokens, first, inflight}, TTL ttl_s refreshed per admitted call.
  active set  zset `ta:<tenant>` task -> expiry (now + inflight_ttl while a call runs, now + idle_s after).
Time is the caller's wall clock (`now`, seconds), so sidecars must keep NTP-synced clocks (windows are seconds
long; skew of a few ms is irrelevant).

Retry windows seen: admit.lua returns the retry windows' counts with every admit and every retry refusal, and the
store keeps the latest per pool and tenant (`seen`, a MemoryStore that is never charged). `retry_refused` reads
them, so the gateway can tell a refused client whether its retry would pass without a round trip of its own.

Fallback: any Redis error (refused, timeout, loading, OOM...) flips the store to `degraded`: it logs once, sets
`sluice_budget_store_fallback_active`, and serves every request from an embedded MemoryStore that enforces
`limit * fallback_share` (this sidecar's share of each global limit). While degraded no request touches Redis (no
per-request connect attempts, so no added latency); a background probe pings Redis with exponential backoff and
flips back when it answers. Settles of Redis charges that arrive while degraded are queued (bounded) and replayed
after recovery.

Batching: redis-py's asyncio client spends about 130-170 us of CPU per command here, more than the sidecar's whole
per-request budget at load. Calls are therefore queued and sent once per event-loop iteration as one pipeline of
EVALSHAs (at most `_MAX_BATCHES` pipelines in flight, `_MAX_BATCH` scripts each): still one round trip per request,
but the fixed cost is shared (measured: 26 us of CPU per script in batches of 50). Each script stays atomic on its
own; a lone call goes out directly without a pipeline.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from importlib import resources
from typing import Any

from extproc.budgets import metrics
from extproc.budgets.memory_store import MemoryStore
from extproc.budgets.ops import (
    BACKEND_LOCAL,
    BACKEND_REDIS,
    DUPLICATE,
    OK,
    RETRY_BUDGET,
    TENANT_LIMIT,
    AdmitOp,
    AdmitResult,
    RetryCheck,
    SettleOp,
    window_index,
)
from extproc.budgets.policy import RedisPolicy

log = logging.getLogger("sluice.budgets.store")

ADMIT, SETTLE = 0, 1  # script index


def _script(name: str) -> str:
    return resources.files("extproc.budgets").joinpath("lua").joinpath(name).read_text()


SCRIPTS = (_script("admit.lua"), _script("settle.lua"))  # read once, at import: shipped as package data


@dataclass(slots=True)
class _Call:
    """One script call waiting for its batch."""

    script: int                    # ADMIT or SETTLE
    keys: list[str]
    args: list[str]
    future: asyncio.Future[Any]
    op: AdmitOp | SettleOp


def _num(x: Any) -> float:
    return float(x.decode() if isinstance(x, bytes) else x)


def _str(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisStore:
    """State in Redis; local fallback when it is down.

    `fallback_share` scales global limits while degraded (see module docstring). `degraded` is True while local
    limits apply. Call `start()` once on the event loop (optional: the first operation connects lazily) and
    `close()` at shutdown.
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
        # the retry windows as Redis last reported them to this sidecar: read by retry_refused, never charged
        self.seen = MemoryStore(share=1.0, backend=BACKEND_REDIS)
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
        self._shas = tuple(hashlib.sha1(s.encode()).hexdigest() for s in SCRIPTS)
        self._batch: list[_Call] = []
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
        for script in SCRIPTS:
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
    def _submit(self, script: int, keys: list[str], args: list[str], op: AdmitOp | SettleOp) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._batch.append(_Call(script, keys, args, fut, op))
        if not self._kick_scheduled:
            self._kick_scheduled = True
            loop.call_soon(self._kick)   # next loop iteration: collects every call made in this one
        return fut

    def _kick(self) -> None:
        self._kick_scheduled = False
        loop = asyncio.get_running_loop()
        while self._batch and self._running < self._MAX_BATCHES:
            calls = self._batch[:self._MAX_BATCH]
            del self._batch[:self._MAX_BATCH]
            self._running += 1
            loop.create_task(self._run(calls))

    async def _run(self, calls: list[_Call]) -> None:
        try:
            # admits whose caller is already gone (client disconnected while queued) are never sent
            calls = [c for c in calls if c.script != ADMIT or not c.future.cancelled()]
            results = await self._execute(calls) if calls else []
            retry = [i for i, r in enumerate(results) if isinstance(r, self._noscript)]
            if retry:  # Redis restarted or flushed its script cache: reload once, rerun those (they did not run)
                await self._load_scripts()
                again = await self._execute([calls[i] for i in retry])
                for i, r in zip(retry, again, strict=True):
                    results[i] = r
        except asyncio.CancelledError:  # loop shutting down
            for call in calls:
                call.future.cancel()
            raise
        except Exception as exc:  # delivered to every waiter, which falls back
            results = [exc] * len(calls)
        finally:
            self._running -= 1
            if self._batch and not self._kick_scheduled:
                self._kick_scheduled = True
                asyncio.get_running_loop().call_soon(self._kick)
        for call, res in zip(calls, results, strict=True):
            fut = call.future
            if fut.cancelled():
                self._compensate(call, res)
            elif isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)

    async def _execute(self, calls: list[_Call]) -> list[Any]:
        shas = self._shas
        if len(calls) == 1:
            c = calls[0]
            try:
                return [await self.client.execute_command("EVALSHA", shas[c.script], len(c.keys), *c.keys, *c.args)]
            except self._noscript as exc:
                return [exc]
        pipe = self.client.pipeline(transaction=False)
        for c in calls:
            pipe.execute_command("EVALSHA", shas[c.script], len(c.keys), *c.keys, *c.args)
        return await pipe.execute(raise_on_error=False)

    def _compensate(self, call: _Call, res: Any) -> None:
        """The caller of an admit was cancelled (client gone) after the script was sent: if it charged, release
        what can be released (markers, in-flight, tokens) so a cancelled request does not pin a 409 marker."""
        op = call.op
        if isinstance(op, SettleOp):  # a settle whose caller went away: it ran, or it waits for Redis to come back
            if isinstance(res, self._errors):
                self._enter_degraded(res)
                self._pending.append(op)
            return
        if not isinstance(res, (bytes, str)):  # not admitted (lua/admit.lua answers an admit with one string)
            return
        self.compensated += 1
        undo = SettleOp(op.now, op.charged(), dedupe_ttl_s=0.001,
                        task_delta=-op.task.cost if op.task else 0, quota_delta=-op.quota.cost if op.quota else 0)
        keys, args = self._settle_call(undo)
        self._submit(SETTLE, keys, args, undo)

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
                await self._submit(SETTLE, keys, args, op)
            except self._errors:
                return False
            self._pending.popleft()
        return True

    # ------------------------------------------------------------------------------------------------ encoding
    def _admit_call(self, op: AdmitOp) -> tuple[list[str], list[str]]:
        """KEYS and ARGV of lua/admit.lua (its header says the layout)."""
        p = self.prefix
        keys = [p + m for m in op.markers]
        now = op.now
        nums = f"{now!r} {len(op.markers)} {_ms(op.inflight_ttl_s)} {1 if op.retry_hint else 0}"
        r = op.retry
        if r is not None:
            idx, frac = window_index(now, r.window_s)
            c, pv = f":{idx}", f":{idx - 1}"
            for n in (r.pool, r.tenant):
                keys += (f"{p}{n}:a{c}", f"{p}{n}:a{pv}", f"{p}{n}:r{c}", f"{p}{n}:r{pv}")
            nums += f" 1 {r.share!r} {r.floor} {frac!r} {_ms(r.window_s * 2 + 1)}"
        else:
            nums += " 0 0 0 0 0"
        member = ""
        t = op.task
        if t is not None:
            keys += (p + t.ref.key, p + t.ref.active_key)
            member = t.ref.member
            nums += (f" 1 {t.cost} {t.max_calls} {t.max_tokens} {float(t.max_wall_s)!r} {t.max_active}"
                     f" {_ms(t.ttl_s)} {now + op.inflight_ttl_s!r}")
        else:
            nums += " 0 0 0 0 0 0 0 0"
        q = op.quota
        if q is not None:
            idx, frac = window_index(now, q.window_s)
            keys += (f"{p}{q.name}:{idx}", f"{p}{q.name}:{idx - 1}")
            nums += f" 1 {q.cost} {q.limit} {frac!r} {_ms(q.window_s * 2 + 1)}"
        else:
            nums += " 0 0 0 0 0"
        return keys, [nums, op.token, member]

    def _settle_call(self, op: SettleOp) -> tuple[list[str], list[str]]:
        """KEYS and ARGV of lua/settle.lua."""
        p = self.prefix
        c = op.charged
        keys = [p + m for m in c.markers]
        nums = f"{len(c.markers)} {_ms(op.dedupe_ttl_s)}"
        member = ""
        if c.task is not None:
            keys += (p + c.task.key, p + c.task.active_key)
            member = c.task.member
            nums += f" 1 {int(op.task_delta)} {1 if c.task_active else 0} {op.now + op.idle_s!r}"
        else:
            nums += " 0 0 0 0"
        if c.quota is not None:
            keys.append(f"{p}{c.quota.name}:{c.quota.idx}")
            nums += f" 1 {int(op.quota_delta)}"
        else:
            nums += " 0 0"
        return keys, [nums, c.token, member]

    def retry_refused(self, r: RetryCheck, now: float, pending: float = 0.0) -> bool:
        """Would a retry in `r`'s scopes be refused now, after `pending` asked for? While degraded, the local store
        answers. Otherwise the shared counts are a round trip away and a refusal must not wait on one: the answer
        reads the counts the last admit of the same pool and tenant returned (`seen`), which miss only what other
        sidecars charged since (windows never reported read as empty: not refused)."""
        return (self.local if self.degraded else self.seen).retry_refused(r, now, pending)

    # ------------------------------------------------------------------------------------------------ operations
    async def admit(self, op: AdmitOp) -> AdmitResult:
        if self.degraded:
            if self._probe_task is None or self._probe_task.done():
                self._ensure_probe()
            return self.local.admit_sync(op)
        keys, args = self._admit_call(op)
        try:
            res = await self._submit(ADMIT, keys, args, op)
        except self._errors as exc:
            self._enter_degraded(exc)
            return self.local.admit_sync(op)
        if isinstance(res, (bytes, str)):  # admitted: "<is_retry>[ <the 8 retry window counts>]" (lua/admit.lua)
            parts = res.split()
            if op.retry is not None:
                self.seen.mirror_retry_windows(op.retry, op.now, parts[1:])
            return AdmitResult(OK, int(parts[0]) == 1, BACKEND_REDIS)
        code = int(res[0])
        is_retry = int(res[1]) == 1
        if code == DUPLICATE:
            return AdmitResult(DUPLICATE, True, BACKEND_REDIS, detail=_str(res[2])[len(self.prefix):])
        if code == TENANT_LIMIT:
            _, frac = window_index(op.now, op.quota.window_s)  # type: ignore[union-attr]
            return AdmitResult(TENANT_LIMIT, is_retry, BACKEND_REDIS, "", _num(res[3]), _num(res[4]),
                               _num(res[5]), _num(res[6]), frac)
        if code == RETRY_BUDGET and op.retry is not None:
            self.seen.mirror_retry_windows(op.retry, op.now, res[5].split())
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
            await self._submit(SETTLE, keys, args, op)
        except self._errors as exc:
            self._enter_degraded(exc)
            self._pending.append(op)

    def stats(self) -> dict[str, Any]:
        return {"backend": self.backend, "degraded": self.degraded, "fallback_share": self.fallback_share,
                "fallback_count": self.fallback_count, "last_error": self.last_error,
                "pending_settles": len(self._pending), "compensated": self.compensated,
                "local": self.local.stats()}
