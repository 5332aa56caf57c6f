"""The `budgets:` section of the policy file: one frozen dataclass per concern, every field documented here.

`BudgetPolicy.from_dict(d)` takes the parsed YAML mapping under `budgets:` (or `{}` / `None` for all defaults),
rejects unknown fields and wrong types with a `ValueError` naming the dotted field path, and fills defaults.

```yaml
budgets:
  store:
    kind: memory            # memory | redis
    fallback_share: null    # share of each global limit this sidecar enforces alone; null = 1 / sidecar_count_hint
    redis:
      url: redis://127.0.0.1:6379/0
      key_prefix: "sluice:b:"
      socket_timeout_s: 0.05
      connect_timeout_s: 0.05
      max_connections: 64
      pool_timeout_s: 1.0
      probe_interval_s: 0.5
      probe_max_interval_s: 5.0
      pending_settles_max: 10000
  retry:
    enabled: true
    max_share: 0.1
    window_s: 10.0
    floor: 3
    dedupe_window_s: 30.0
    inflight_ttl_s: 600.0
    use_idempotency_key: true
    use_request_id: true
    use_fingerprint: false
  tasks:
    header: x-sluice-task-id
    depth_header: x-sluice-task-depth
    max_calls: 0            # 0 = unlimited, for every max_* below
    max_tokens: 0
    max_depth: 0
    max_wall_s: 0
    max_active_per_tenant: 0
    idle_s: 30.0
    ttl_s: 3600.0
  tenants:
    tokens_per_minute: {}   # tenant -> tokens per minute
    default: 0              # tokens per minute for tenants not in the map; 0 = unlimited
    short_wait_s: 5.0
  prompt_shift:
    enabled: true
    threshold: 0.3
    baseline_requests: 20
    sustain_requests: 5
    max_apps: 64
    max_fingerprints_per_app: 8
```
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

STORE_KINDS = ("memory", "redis")


@dataclass(frozen=True, slots=True)
class RedisPolicy:
    """How the Redis store connects (used when `store.kind: redis`).

    Fields:
      url: redis URL (`redis://host:port/db`, `rediss://` for TLS, `unix:///path.sock`).
      key_prefix: prefix of every key the budgets write; lets several deployments share one Redis.
      socket_timeout_s: read/write timeout of one command. Short: a slow Redis must fall back, not stall requests.
      connect_timeout_s: TCP connect timeout.
      max_connections: size of the (blocking) connection pool; one command holds one connection for one round trip.
      pool_timeout_s: longest wait for a free pooled connection under load before the call counts as a failure.
      probe_interval_s: first delay before probing a Redis that failed; doubles per failed probe.
      probe_max_interval_s: cap of that backoff.
      pending_settles_max: settles of Redis charges made while Redis was down are queued (at most this many,
        oldest dropped) and replayed once it is back, so token corrections and in-flight releases are not lost.
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "sluice:b:"
    socket_timeout_s: float = 0.05
    connect_timeout_s: float = 0.05
    max_connections: int = 64
    pool_timeout_s: float = 1.0
    probe_interval_s: float = 0.5
    probe_max_interval_s: float = 5.0
    pending_settles_max: int = 10000

    def _validate(self, path: str) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{path}.url must start with redis://, rediss:// or unix://, got {self.url!r}")
        _positive(self, path, "socket_timeout_s", "connect_timeout_s", "max_connections", "pool_timeout_s",
                  "probe_interval_s",
                  "probe_max_interval_s")
        if self.probe_max_interval_s < self.probe_interval_s:
            raise ValueError(f"{path}.probe_max_interval_s must be >= probe_interval_s")
        _non_negative(self, path, "pending_settles_max")


@dataclass(frozen=True, slots=True)
class StorePolicy:
    """Where budget state lives.

    Fields:
      kind: `memory` (default: state in this process, right for one sidecar) or `redis` (shared by every sidecar
        pointed at the same Redis; limits then hold across sidecars).
      fallback_share: the share of each global limit (task calls/tokens/active tasks, tenant tokens per minute,
        retry floor) this sidecar enforces on its own: with the memory store always, with the Redis store while
        Redis is unreachable. `null` means `1 / sidecar_count_hint` (the hint the server passes to `Budgets`).
      redis: connection settings, see RedisPolicy.
    """

    kind: str = "memory"
    fallback_share: float | None = None
    redis: RedisPolicy = field(default_factory=RedisPolicy)

    def _validate(self, path: str) -> None:
        if self.kind not in STORE_KINDS:
            raise ValueError(f"{path}.kind must be one of {', '.join(STORE_KINDS)}, got {self.kind!r}")
        if self.fallback_share is not None and not (0.0 < self.fallback_share <= 1.0):
            raise ValueError(f"{path}.fallback_share must be in (0, 1] or null, got {self.fallback_share!r}")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry budget (P5): recognise retries, cap their share of admitted traffic, refuse duplicates in flight.

    A request is a retry when `retry_count > 0` (the SDK's `x-stainless-retry-count`), or when one of its
    identities was seen within `dedupe_window_s`: the idempotency key, the request id, or the body fingerprint
    (same tenant). If an identity belongs to a request still in flight, the request is refused with 409
    `duplicate_in_flight` (the openai SDK does not retry 409).

    Fields:
      enabled: turn the whole retry budget off (no markers written, nothing counted).
      max_share: retries may be at most this share of admitted requests, per pool (model) and per tenant, over
        the sliding window; past it a retry is refused with 429 and `x-should-retry: false`.
      window_s: the sliding window of that share.
      floor: retries allowed per window whatever the share, so a quiet pool can still retry.
      dedupe_window_s: how long a finished request's identities are remembered to recognise its retry.
      inflight_ttl_s: safety expiry of an in-flight marker if its settle never comes (sidecar crash); longer than
        the longest request.
      use_idempotency_key: recognise retries / duplicates by the `Idempotency-Key` header.
      use_request_id: recognise them by a reused request id (`x-request-id`).
      use_fingerprint: recognise them by an identical body from the same tenant. Off by default: clients
        legitimately send identical bodies concurrently (load generators, parallel sampling, cached prompts);
        turn it on where retries come from layers that send neither the SDK's retry count nor a key.
    """

    enabled: bool = True
    max_share: float = 0.1
    window_s: float = 10.0
    floor: int = 3
    dedupe_window_s: float = 30.0
    inflight_ttl_s: float = 600.0
    use_idempotency_key: bool = True
    use_request_id: bool = True
    use_fingerprint: bool = False

    def _validate(self, path: str) -> None:
        if not (0.0 <= self.max_share <= 1.0):
            raise ValueError(f"{path}.max_share must be in [0, 1], got {self.max_share!r}")
        _positive(self, path, "window_s", "dedupe_window_s", "inflight_ttl_s")
        _non_negative(self, path, "floor")


@dataclass(frozen=True, slots=True)
class TaskPolicy:
    """Per agent task budgets (P11), keyed by (tenant, task id). Every `max_*` is 0 = unlimited.

    Fields:
      header: request header carrying the task id (the server parses it into `LLMRequest.task_id`).
      depth_header: request header carrying the agent loop depth / step (`LLMRequest.task_depth`).
      max_calls: LLM calls per task.
      max_tokens: tokens per task, charged at admission with the estimate (prompt + expected output) and
        corrected with actual usage when the call ends. A call whose estimate does not fit is refused.
      max_depth: highest loop depth / step a call may report.
      max_wall_s: seconds since the task's first call after which further calls are refused.
      max_active_per_tenant: concurrent active tasks per tenant. A task is active while it has a call in flight
        and for `idle_s` after its last call ended; a new task over the cap is refused, known tasks continue.
      idle_s: see max_active_per_tenant.
      ttl_s: a task's counters are forgotten after this many seconds without an admitted call (a later call with
        the same id starts a new task). Raised to max_wall_s if smaller.
    """

    header: str = "x-sluice-task-id"
    depth_header: str = "x-sluice-task-depth"
    max_calls: int = 0
    max_tokens: int = 0
    max_depth: int = 0
    max_wall_s: float = 0.0
    max_active_per_tenant: int = 0
    idle_s: float = 30.0
    ttl_s: float = 3600.0

    def _validate(self, path: str) -> None:
        for name in ("header", "depth_header"):
            v = getattr(self, name)
            if not v or v != v.lower() or any(c.isspace() for c in v):
                raise ValueError(f"{path}.{name} must be a non-empty lower-case header name, got {v!r}")
        _non_negative(self, path, "max_calls", "max_tokens", "max_depth", "max_wall_s", "max_active_per_tenant",
                      "idle_s")
        _positive(self, path, "ttl_s")

    @property
    def enabled(self) -> bool:
        return bool(self.max_calls or self.max_tokens or self.max_depth or self.max_wall_s
                    or self.max_active_per_tenant)


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """Tenant tokens-per-minute limits, over a sliding 60 s window in the store.

    Charged at admission with the estimate (prompt + expected output), corrected with actual usage at the end.
    Over the limit: 429 `tenant_token_limit` with Retry-After computed from the window.

    Fields:
      tokens_per_minute: map tenant -> tokens per minute (a positive integer; 0 = unlimited for that tenant).
      default: tokens per minute for tenants not in the map; 0 = unlimited.
      short_wait_s: a rejected client is told it may retry (`x-should-retry: true`) only when the window frees
        room within this many seconds; otherwise `false`.
    """

    tokens_per_minute: dict[str, int] = field(default_factory=dict)
    default: int = 0
    short_wait_s: float = 5.0

    def _validate(self, path: str) -> None:
        for tenant, v in self.tokens_per_minute.items():
            if v < 0:
                raise ValueError(f"{path}.tokens_per_minute.{tenant} must be >= 0, got {v!r}")
        _non_negative(self, path, "default", "short_wait_s")

    def limit_for(self, tenant: str) -> int:
        return self.tokens_per_minute.get(tenant, self.default)

    @property
    def enabled(self) -> bool:
        return bool(self.default or any(self.tokens_per_minute.values()))


@dataclass(frozen=True, slots=True)
class PromptShiftPolicy:
    """Prompt cost shift detection (P10), local to each sidecar.

    Per app: the baseline cost (tokens/request) is the mean of the first `baseline_requests` completed requests,
    then follows slow drift (EWMA with alpha 1/baseline_requests) while no shift is suspected. The recent cost is the
    mean of the last `sustain_requests` requests. When |recent / baseline - 1| > threshold holds for
    `sustain_requests` requests in a row, one event is emitted (log + metric) and the baseline becomes the new cost.

    Fields:
      enabled: turn detection and its metrics off.
      threshold: relative change of cost per request that counts as a shift (0.3 = 30 %).
      baseline_requests: requests needed to establish a baseline; also the drift EWMA span.
      sustain_requests: requests the change must persist (and the window of the recent mean).
      max_apps: apps tracked; further apps collapse into `other` (bounded state and metric labels).
      max_fingerprints_per_app: system-prompt fingerprints tracked per app (least recently seen evicted).
    """

    enabled: bool = True
    threshold: float = 0.3
    baseline_requests: int = 20
    sustain_requests: int = 5
    max_apps: int = 64
    max_fingerprints_per_app: int = 8

    def _validate(self, path: str) -> None:
        _positive(self, path, "threshold", "baseline_requests", "sustain_requests", "max_apps",
                  "max_fingerprints_per_app")


@dataclass(frozen=True, slots=True)
class BudgetPolicy:
    """The whole `budgets:` section. Fields: store, retry, tasks, tenants, prompt_shift (see each class)."""

    store: StorePolicy = field(default_factory=StorePolicy)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    tasks: TaskPolicy = field(default_factory=TaskPolicy)
    tenants: TenantPolicy = field(default_factory=TenantPolicy)
    prompt_shift: PromptShiftPolicy = field(default_factory=PromptShiftPolicy)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> BudgetPolicy:
        """Build and validate from the mapping under `budgets:`; raises ValueError naming the bad field."""
        return _build(cls, {} if d is None else d, "budgets")


# ---------------------------------------------------------------------------------------------- validation helpers


def _positive(obj: Any, path: str, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{path}.{name} must be > 0, got {getattr(obj, name)!r}")


def _non_negative(obj: Any, path: str, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ValueError(f"{path}.{name} must be >= 0, got {getattr(obj, name)!r}")


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{path} must be a mapping, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin is dict:
        key_t, val_t = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ValueError(f"{path} must be a mapping, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                raise ValueError(f"{path} keys must be non-empty strings, got {k!r}")
            out[k] = _convert(val_t, v, f"{path}.{k}")
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{path} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported field type {tp!r} at {path}")  # programming error, not a policy error


def _build(cls: type, d: dict[str, Any], path: str) -> Any:
    if not isinstance(d, dict):
        raise ValueError(f"{path} must be a mapping, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {', '.join(map(str, unknown))} (known: {', '.join(sorted(names))})")
    kwargs = {name: _convert(hints[name], value, f"{path}.{name}") for name, value in d.items()}
    obj = cls(**kwargs)
    validate = getattr(obj, "_validate", None)
    if validate is not None:
        validate(path)
    return obj
