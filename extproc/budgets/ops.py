"""The operations a budget store performs: one combined check-and-charge per request (`AdmitOp`), and its release
and correction (`SettleOp`), typed.

Why one combined operation: every budget (duplicates, retry share, task, tenant tokens) must pass before ANY of
them is charged, or a request refused by the last check would leave charges from the first ones. So the store
takes an `AdmitOp` describing every check of one request and either charges all of them or none, and tells which
check failed (`AdmitResult`). What an admit charged is a `Charged` record, built once from the op; the settle
carries the same record back (`SettleOp.charged`), so nothing is copied field by field in between.

Limits are GLOBAL limits; a store that enforces only its share scales them (`scaled`). Sliding windows are
approximated from two fixed windows (Cloudflare's method): used = current + previous x (1 - elapsed fraction of
current); `window_index` says which fixed window `now` falls in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# AdmitResult.code
OK = 0
DUPLICATE = 1       # a marker of this request belongs to a request still in flight -> 409
RETRY_BUDGET = 2    # retry share exceeded (detail: "pool" | "tenant")
TASK_LIMIT = 3      # task budget exceeded (detail: max_calls | max_tokens | max_wall_s | max_active_tasks)
TENANT_LIMIT = 4    # tenant tokens per window exceeded

BACKEND_MEMORY = "memory"
BACKEND_REDIS = "redis"
BACKEND_LOCAL = "local"   # the Redis store's local fallback


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


@dataclass(slots=True)
class RetryCheck:
    """The retry share, per tenant and per pool: each window name has an `:a` (admitted) and `:r` (retries)
    counter; a scope fits while retries + 1 <= max(floor, share x (admitted + 1)). A retry needs its tenant to fit,
    and the pool too once the tenant is past its floor (retry.py)."""

    pool: str
    tenant: str
    share: float
    floor: int
    window_s: float


@dataclass(slots=True)
class TaskRef:
    """Where one agent task's state lives: its counters, its tenant's set of active tasks, its name in that set."""

    key: str
    active_key: str
    member: str


@dataclass(slots=True)
class TaskCheck:
    """A task's budgets (0 = unlimited): calls, tokens (`cost` is this call's estimate), wall time since its first
    call, and the tenant's concurrently active tasks."""

    ref: TaskRef
    cost: int
    max_calls: int
    max_tokens: int
    max_wall_s: float
    max_active: int
    ttl_s: float


@dataclass(slots=True)
class QuotaCheck:
    """A tenant's tokens per window: used + cost <= limit."""

    name: str
    cost: int
    limit: int
    window_s: float


@dataclass(slots=True)
class QuotaWindow:
    """The fixed window a quota charge went into (a correction goes to the same one)."""

    name: str
    window_s: float
    idx: int


@dataclass(slots=True)
class Charged:
    """What one admit charged: everything its settle needs to find it again."""

    token: str                          # the charge's own token: markers hold it while the request is in flight
    markers: tuple[str, ...] = ()
    task: TaskRef | None = None
    task_active: bool = False           # the task is counted in its tenant's active set
    quota: QuotaWindow | None = None

    @property
    def anything(self) -> bool:
        return bool(self.markers) or self.task is not None or self.quota is not None


@dataclass(slots=True)
class AdmitOp:
    """Every check of one request. A check left None is off."""

    now: float
    token: str
    markers: tuple[str, ...] = ()       # identities of the request (idempotency key, request id, fingerprint)
    inflight_ttl_s: float = 600.0       # safety expiry of its in-flight markers
    retry_hint: bool = False            # the client says it retries (x-stainless-retry-count > 0)
    retry: RetryCheck | None = None
    task: TaskCheck | None = None
    quota: QuotaCheck | None = None

    @property
    def checks_anything(self) -> bool:
        return bool(self.markers) or self.retry is not None or self.task is not None or self.quota is not None

    def charged(self) -> Charged:
        """The record of what this op charges when it passes."""
        task, quota = self.task, self.quota
        return Charged(self.token, self.markers, task.ref if task else None, bool(task and task.max_active > 0),
                       QuotaWindow(quota.name, quota.window_s, window_index(self.now, quota.window_s)[0])
                       if quota else None)


@dataclass(slots=True)
class SettleOp:
    """Release / correction of one admitted request: its markers become "done" (remembered for `dedupe_ttl_s`),
    its task leaves flight (and starts idling for `idle_s`), and token charges move by the deltas."""

    now: float
    charged: Charged
    dedupe_ttl_s: float = 30.0
    task_delta: int = 0
    quota_delta: int = 0
    idle_s: float = 0.0


@dataclass(slots=True)
class AdmitResult:
    """Outcome of an AdmitOp. On OK everything was charged; otherwise nothing was.

    detail / used / limit describe the failed check; for TENANT_LIMIT, `cur`/`prev`/`frac` describe the window
    (to compute Retry-After) and `limit` is the limit actually enforced (scaled in local mode).
    """

    code: int
    is_retry: bool
    backend: str
    detail: str = ""
    used: float = 0.0
    limit: float = 0.0
    cur: float = 0.0
    prev: float = 0.0
    frac: float = 0.0
