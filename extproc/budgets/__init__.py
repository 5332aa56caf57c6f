"""Budgets: the facade the server calls on the hot path (retry budget P5, task budgets P11, tenant tokens per minute,
prompt cost shift P10).

    budgets = Budgets(policy.budgets, capacity_rps=fn, sidecar_count_hint=n)
    await budgets.start()
    try:
        charge = await budgets.admit(req)          # raises BudgetExceeded: answer with e.status / e.headers()
    except BudgetExceeded as e: ...
    try: ... forward the request ...
    finally:
        await budgets.settle(charge, completed=saw_end_of_stream, prompt_tokens=pt, completion_tokens=ct)

Synchronous callers (memory store only, `budgets.is_sync`): `admit_sync(req)` / `settle_sync(charge, ...)`, same
semantics; with Redis `settle_sync` schedules the async settle on the running loop.

A request whose identity (request id, idempotency key) belongs to a request still counted in flight waits up to
`retry.duplicate_wait_s` for that request's end to arrive before it is refused as a duplicate (409): an original
whose client has seen its end is released when Envoy's access log reports it, up to 100 ms later.

Cost: with the memory store `admit` and `settle` never yield to the event loop (no I/O); with Redis each is ONE
round trip (a Lua script doing every check, then every charge, atomically). A request refused by `admit` leaves
nothing charged. The order of checks: loop depth (local), duplicate in flight (409), retry share, task budget,
tenant tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any, Callable

from extproc.budgets.errors import BudgetExceeded, OriginalInFlight
from extproc.budgets.keys import ident
from extproc.budgets.policy import (
    BudgetPolicy,
    PromptShiftPolicy,
    RedisPolicy,
    RetryPolicy,
    StorePolicy,
    TaskPolicy,
    TenantPolicy,
)
from extproc.budgets.memory_store import MemoryStore
from extproc.budgets.ops import (
    BACKEND_MEMORY,
    DUPLICATE,
    OK,
    RETRY_BUDGET,
    TASK_LIMIT,
    AdmitOp,
    AdmitResult,
    Charged,
    SettleOp,
)
from extproc.budgets.prompt_shift import PromptShiftTracker
from extproc.budgets.redis_store import RedisStore
from extproc.budgets.retry import RetryBudget
from extproc.budgets.store import Store, make_store
from extproc.budgets.tasks import TaskBudget
from extproc.budgets.tenants import TenantBudget
from extproc.request import LLMRequest

__all__ = ["Budgets", "BudgetExceeded", "OriginalInFlight", "Charge", "BudgetPolicy", "StorePolicy", "RedisPolicy", "RetryPolicy",
           "TaskPolicy", "TenantPolicy", "PromptShiftPolicy", "MemoryStore", "RedisStore", "PromptShiftTracker"]

log = logging.getLogger("sluice.budgets")

DUPLICATE_POLL_S = 0.02  # how often a request waiting for its duplicate's original tries again


class Charge:
    """What `admit` charged for one request; hand it back to `settle` exactly once (extra calls are no-ops).
    `charged` is the store's record of it (ops.Charged); the rest is what settling reports on."""

    __slots__ = ("charged", "backend", "admitted_at", "tenant", "app", "model", "prefix_key", "is_retry",
                 "est_prompt", "prompt_units", "est_total", "settled")

    def __init__(self, charged: Charged, backend: str, now: float, req: LLMRequest, is_retry: bool) -> None:
        self.charged = charged
        self.backend = backend
        self.admitted_at = now
        self.tenant = req.tenant
        self.app = req.app
        self.model = req.model
        self.prefix_key = req.prefix_key
        self.is_retry = is_retry
        self.est_prompt = req.prompt_tokens
        self.prompt_units = req.prompt_units  # the calibration epoch est_prompt is in (token_calibration.py)
        self.est_total = req.total_tokens
        self.settled = False

    @property
    def token(self) -> str:
        return self.charged.token

    def __repr__(self) -> str:
        return (f"Charge(token={self.charged.token!r}, backend={self.backend}, tenant={self.tenant!r}, "
                f"is_retry={self.is_retry}, est_total={self.est_total}, settled={self.settled})")


class Budgets:
    """Every budget behind two calls: `admit` (check and charge) and `settle` (release and correct)."""

    def __init__(self, policy: BudgetPolicy | None = None,
                 capacity_rps: Callable[[str, float], float] | None = None,
                 sidecar_count_hint: int = 1, label_tenant: Callable[[str], str] | None = None) -> None:
        self.policy = policy = policy or BudgetPolicy()
        if sidecar_count_hint < 1:
            raise ValueError(f"sidecar_count_hint must be >= 1, got {sidecar_count_hint!r}")
        share = policy.store.fallback_share
        if share is None:
            share = 1.0 / sidecar_count_hint
        self.share = share
        self.store: Store = make_store(policy.store, share)
        self._memory = self.store if isinstance(self.store, MemoryStore) else None
        self.retry = RetryBudget(policy.retry)
        self.tasks = TaskBudget(policy.tasks)
        self.tenants = TenantBudget(policy.tenants, label=label_tenant)
        self.prompt_shift = PromptShiftTracker(policy.prompt_shift, capacity_rps)
        self._tokens = itertools.count(1)
        self._token_prefix = os.urandom(6).hex() + "-"
        self._settle_errors = 0

    async def start(self) -> None:
        await self.store.start()

    async def close(self) -> None:
        await self.store.close()

    @property
    def degraded(self) -> bool:
        return self.store.degraded

    @property
    def is_sync(self) -> bool:
        """True with the memory store: `admit_sync` / `settle_sync` may be called from synchronous code."""
        return self._memory is not None

    @property
    def credits_refusals(self) -> bool:
        """Refusals that tell the client to retry earn a free retry (`retry.credit_refused`): only then does the
        gateway look at what a refusal told its client."""
        return self.retry.credits is not None

    def refused(self, req: LLMRequest, retry_after_s: float | None, now: float | None = None) -> None:
        """The gateway refused `req` before any replica saw it and told its client to retry after
        `retry_after_s`: that retry will not be charged to the retry share (budgets/credits.py)."""
        self.retry.refused(ident(req.tenant), time.monotonic() if now is None else now, retry_after_s)

    def retry_refused(self, req: LLMRequest, now: float | None = None, mono: float | None = None) -> bool:
        """Would a retry of `req` be refused by the retry share now (no credits, `retry.py`), after the retries this
        sidecar has already asked its tenant's clients for? A client should not be told to retry what its retry
        budget will refuse. With Redis, the counts its last reply reported (a refusal does not wait on a round
        trip). `now`: wall clock, `mono`: monotonic (the promises' clock)."""
        if not self.retry.enabled or self.retry.credits is not None:
            return False
        tenant = ident(req.tenant)
        pending = self.retry.pending(tenant, time.monotonic() if mono is None else mono)
        check = self.retry.check(req, tenant)
        return self.store.retry_refused(check, time.time() if now is None else now, pending)

    def promise_retry(self, req: LLMRequest, retry_after_s: float | None, now: float | None = None,
                      mono: float | None = None) -> bool:
        """The gateway refuses `req` with a 429 that tells its client to retry after `retry_after_s` (None: it says
        not to): may it, without the retry budget refusing that retry (`retry_refused`)? If so, the retry is
        promised (counted in later reads until it arrives, `retry.py`) and True; False: say not to retry."""
        if retry_after_s is None:
            return True
        mono = time.monotonic() if mono is None else mono
        if self.retry_refused(req, now, mono):
            return False
        self.retry.promise(ident(req.tenant), mono, retry_after_s)
        return True

    # ------------------------------------------------------------------------------------------------ admit
    async def admit(self, req: LLMRequest, now: float | None = None) -> Charge:
        """Check every budget and charge them all, or raise BudgetExceeded having charged nothing."""
        if now is None:
            now = time.time()
        op = self._admit_op(req, now)
        if op is None:
            return self._charge(Charged(self._token_prefix), BACKEND_MEMORY, now, req, req.retry_count > 0)
        mem = self._memory
        res = mem.admit_sync(op) if mem is not None else await self.store.admit(op)
        if res.code == DUPLICATE and self.policy.retry.duplicate_wait_s > 0:
            res = await self._until_original_ends(op, res)
        return self._admitted(req, op, res)

    async def admit_when_ended(self, req: LLMRequest, pending: OriginalInFlight) -> Charge:
        """After `admit_sync` raised OriginalInFlight: admit once the original request has ended, or refuse it
        as a duplicate (409) when it is still in flight `retry.duplicate_wait_s` later."""
        return self._admitted(req, pending.op, await self._until_original_ends(pending.op, pending.result))

    async def _until_original_ends(self, op: AdmitOp, res: AdmitResult) -> AdmitResult:
        """Try the same admission again every DUPLICATE_POLL_S while it is a duplicate, for at most
        `retry.duplicate_wait_s`: an original that ended is settled by then and this request is its retry; one
        still running keeps it a duplicate."""
        start, first_now = time.monotonic(), op.now
        mem = self._memory
        while res.code == DUPLICATE and time.monotonic() - start < self.policy.retry.duplicate_wait_s:
            await asyncio.sleep(DUPLICATE_POLL_S)
            op.now = first_now + (time.monotonic() - start)  # the caller's clock, moved on by the time waited
            res = mem.admit_sync(op) if mem is not None else await self.store.admit(op)
        return res

    def admit_sync(self, req: LLMRequest, now: float | None = None) -> Charge:
        """`admit` for synchronous callers; memory store only (raises RuntimeError with Redis). Where `admit` would
        wait for a duplicate's original to end, raises OriginalInFlight: await `admit_when_ended` then."""
        mem = self._memory
        if mem is None:
            raise RuntimeError("Budgets.admit_sync needs the memory store; with Redis await admit()")
        if now is None:
            now = time.time()
        op = self._admit_op(req, now)
        if op is None:
            return self._charge(Charged(self._token_prefix), BACKEND_MEMORY, now, req, req.retry_count > 0)
        res = mem.admit_sync(op)
        if res.code == DUPLICATE and self.policy.retry.duplicate_wait_s > 0:
            raise OriginalInFlight(op, res)
        return self._admitted(req, op, res)

    def _admit_op(self, req: LLMRequest, now: float) -> AdmitOp | None:
        """Local checks (raise), then the store operation; None when no budget applies to this request."""
        self.tasks.check_local(req)
        tenant = ident(req.tenant)
        op = AdmitOp(now, self._token_prefix + str(next(self._tokens)))
        self.retry.prepare(op, req, tenant, time.monotonic())
        self.tasks.prepare(op, req, tenant)
        self.tenants.prepare(op, req, tenant)
        return op if op.checks_anything else None

    def _admitted(self, req: LLMRequest, op: AdmitOp, res: AdmitResult) -> Charge:
        code = res.code
        if code != OK:
            if code == DUPLICATE or code == RETRY_BUDGET:
                raise self.retry.rejection(req, res)
            if res.is_retry:
                self.retry.seen_rejected(req)
            if code == TASK_LIMIT:
                raise self.tasks.rejection(req, res)
            raise self.tenants.rejection(req, res)
        if res.is_retry:
            self.retry.admitted(req, True)
        return self._charge(op.charged(), res.backend, op.now, req, res.is_retry)

    def _charge(self, charged: Charged, backend: str, now: float, req: LLMRequest, is_retry: bool) -> Charge:
        """The admitted request's Charge; its estimated prompt sizes the app's capacity gauge (prompt_shift.py)."""
        self.prompt_shift.admitted(req.app, req.model, req.prompt_tokens)
        return Charge(charged, backend, now, req, is_retry)

    # ------------------------------------------------------------------------------------------------ settle
    async def settle(self, charge: Charge | None, *, completed: bool, prompt_tokens: int | None = None,
                     completion_tokens: int | None = None, now: float | None = None) -> None:
        """Release in-flight markers, correct token charges to actual usage (estimate kept where unknown), feed
        the prompt-shift tracker for completed requests. Never raises; a second call for one charge is a no-op.

        A request that never reached a replica (shed after admission) should pass prompt_tokens=0,
        completion_tokens=0: its tokens are refunded (the task call stays counted)."""
        if charge is None or charge.settled:
            return
        charge.settled = True
        try:
            op, actual, pt = self._settle_op(charge, prompt_tokens, completion_tokens, now)
            if op is not None:
                mem = self._memory
                if mem is not None:
                    mem.settle_sync(op)
                else:
                    await self.store.settle(op, charge.backend)
            self._settled(charge, completed, actual, pt, prompt_tokens is None, completion_tokens,
                          op.now if op else now)
        except Exception:  # settle runs in `finally`: never mask the request's own outcome
            self._settle_failed()

    def settle_sync(self, charge: Charge | None, *, completed: bool, prompt_tokens: int | None = None,
                    completion_tokens: int | None = None, now: float | None = None) -> None:
        """`settle` for synchronous callers; with the Redis store the release is scheduled on the running loop."""
        if charge is None or charge.settled:
            return
        if self._memory is None:
            asyncio.get_running_loop().create_task(
                self.settle(charge, completed=completed, prompt_tokens=prompt_tokens,
                            completion_tokens=completion_tokens, now=now))
            return
        charge.settled = True
        try:
            op, actual, pt = self._settle_op(charge, prompt_tokens, completion_tokens, now)
            if op is not None:
                self._memory.settle_sync(op)
            self._settled(charge, completed, actual, pt, prompt_tokens is None, completion_tokens,
                          op.now if op else now)
        except Exception:
            self._settle_failed()

    def _settle_op(self, charge: Charge, prompt_tokens: int | None, completion_tokens: int | None,
                   now: float | None) -> tuple[SettleOp | None, int, int]:
        pt = charge.est_prompt if prompt_tokens is None else prompt_tokens
        ct = (charge.est_total - charge.est_prompt) if completion_tokens is None else completion_tokens
        actual = pt + ct
        if not charge.charged.anything:
            return None, actual, pt
        delta = actual - charge.est_total
        op = SettleOp(time.time() if now is None else now, charge.charged, self.policy.retry.dedupe_window_s,
                      task_delta=delta, quota_delta=delta, idle_s=self.policy.tasks.idle_s)
        return op, actual, pt

    def _settled(self, charge: Charge, completed: bool, actual: int, pt: int, estimated: bool,
                 completion_tokens: int | None, now: float | None) -> None:
        """`estimated`: `pt` is the admission estimate (no usage reported), in the calibration epoch
        `charge.prompt_units`; otherwise the engine's own count."""
        self.tenants.charged(charge.tenant, actual)
        if completed:
            self.prompt_shift.observe(charge.app, charge.model, charge.prefix_key, pt, completion_tokens, now,
                                      units=charge.prompt_units if estimated else None)

    def _settle_failed(self) -> None:
        self._settle_errors += 1
        if self._settle_errors <= 10 or self._settle_errors % 1000 == 0:
            log.exception("budgets: settle failed (%d so far)", self._settle_errors)

    # ------------------------------------------------------------------------------------------------ admin
    def snapshot(self) -> dict[str, Any]:
        """State for the admin API: store health and the prompt-shift view per app."""
        return {"store": self.store.stats(), "prompt_shift": self.prompt_shift.snapshot()}
