"""The `budgets:` section of the policy file: one frozen dataclass per concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from extproc.schema import non_negative, positive, require


@dataclass(frozen=True, slots=True)
class RedisPolicy:
    """How the Redis store connects (used when `store.kind: redis`)."""

    url: str = "redis://127.0.0.1:6379/0"  # redis URL (`redis://host:port/db`, `rediss://` for TLS,
                                           # `unix:///path.sock`)
    key_prefix: str = "sluice:b:"     # prefix of every key the budgets write; lets several deployments share one
                                      # Redis
    socket_timeout_s: float = 0.05    # read/write timeout of one command. Short: a slow Redis must fall back, not
                                      # stall requests
    connect_timeout_s: float = 0.05   # TCP connect timeout
    max_connections: int = 64         # size of the (blocking) connection pool; one command holds one connection for
                                      # one round trip
    pool_timeout_s: float = 1.0       # longest wait for a free pooled connection under load before the call counts
                                      # as a failure
    probe_interval_s: float = 0.5     # first delay before probing a Redis that failed; doubles per failed probe
    probe_max_interval_s: float = 5.0  # cap of that backoff
    pending_settles_max: int = 10000  # settles of Redis charges made while Redis was down are queued (at most this
                                      # many, oldest dropped) and replayed once it is back, so token corrections
                                      # and in-flight releases are not lost

    def validate(self, path: str) -> None:
        require(self.url.startswith(("redis://", "rediss://", "unix://")), f"{path}.url",
                f"must start with redis://, rediss:// or unix://, got {self.url!r}")
        positive(self, path, "socket_timeout_s", "connect_timeout_s", "max_connections", "pool_timeout_s",
                 "probe_interval_s", "probe_max_interval_s")
        require(self.probe_max_interval_s >= self.probe_interval_s, f"{path}.probe_max_interval_s",
                "must be >= probe_interval_s")
        non_negative(self, path, "pending_settles_max")


@dataclass(frozen=True, slots=True)
class StorePolicy:
    """Where budget state lives."""

    kind: Literal["memory", "redis"] = "memory"  # `memory` (default: state in this process, right for one sidecar)
                                      # or `redis` (shared by every sidecar pointed at the same Redis; limits then
                                      # hold across sidecars)
    fallback_share: float | None = None  # the share of each global limit (task calls/tokens/active tasks, tenant
                                      # tokens per minute, retry floor) this sidecar enforces on its own: with the
                                      # memory store always, with the Redis store while Redis is unreachable.
                                      # `null` means `1 / sidecar_count_hint` (the hint the server passes to
                                      # `Budgets`)
    redis: RedisPolicy = field(default_factory=RedisPolicy)  # connection settings

    def validate(self, path: str) -> None:
        require(self.fallback_share is None or 0.0 < self.fallback_share <= 1.0, f"{path}.fallback_share",
                f"must be in (0, 1] or null, got {self.fallback_share!r}")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry budget (P5): recognise retries, cap their share of admitted traffic, refuse duplicates in flight.

    A request is a retry when `retry_count > 0` (the SDK's `x-stainless-retry-count`), or when one of its
    identities was seen within `dedupe_window_s`: the idempotency key, the request id, or the body fingerprint
    (same tenant). If an identity belongs to a request still in flight, the request is refused with 409
    `duplicate_in_flight` (the openai SDK does not retry 409).
    """

    enabled: bool = True              # turn the whole retry budget off (no markers written, nothing counted)
    max_share: float = 0.1            # retries may be at most this share of admitted requests, per tenant and
                                      # per pool (model), over the sliding window; past it a retry is refused with
                                      # 429 and `x-should-retry: false`
    window_s: float = 10.0            # the sliding window of that share
    floor: int = 3                    # retries each tenant may make per window whatever the shares, so a quiet
                                      # tenant can still retry and no other tenant can spend them; past its floor a
                                      # tenant's retry must fit the pool's share as well
    dedupe_window_s: float = 30.0     # how long a finished request's identities are remembered to recognise its
                                      # retry
    inflight_ttl_s: float = 600.0     # safety expiry of an in-flight marker if its settle never comes (sidecar
                                      # crash); longer than the longest request
    duplicate_wait_s: float = 0.3     # a request whose identity is still counted in flight waits up to this long
                                      # for that request to end before it is refused as a duplicate (409): the end
                                      # of a finished request reaches the sidecar up to Envoy's access-log flush
                                      # interval (10 ms) after its client saw it, and a client may resend the id
                                      # at once. 0 = refuse at once; at most half of sidecar.message_timeout_ms
    credit_refused: bool = False      # a retry of a request this sidecar refused before any replica saw it, with
                                      # `x-should-retry: true`, is not charged to the retry share (one free retry
                                      # per refusal, until its retry-after + window_s; budgets/credits.py). Off by
                                      # default: such retries are then served late and displace fresh requests
                                      # (SLO goodput P1 10.7 against 12.1 req/s, real PX 3.0 against 3.75), for
                                      # more requests completed at all (P5 6.62 against 5.54 req/s). Off, such a
                                      # refusal, if a 429, says `x-should-retry: false` while the retry would be
                                      # refused
    use_idempotency_key: bool = True  # recognise retries / duplicates by the `Idempotency-Key` header
    use_request_id: bool = True       # recognise them by a reused request id (`x-request-id`)
    use_fingerprint: bool = False     # recognise them by an identical body from the same tenant. Off by default:
                                      # clients legitimately send identical bodies concurrently (load generators,
                                      # parallel sampling, cached prompts); turn it on where retries come from
                                      # layers that send neither the SDK's retry count nor a key

    def validate(self, path: str) -> None:
        require(0.0 <= self.max_share <= 1.0, f"{path}.max_share", f"must be in [0, 1], got {self.max_share!r}")
        positive(self, path, "window_s", "dedupe_window_s", "inflight_ttl_s")
        non_negative(self, path, "floor", "duplicate_wait_s")


@dataclass(frozen=True, slots=True)
class TaskPolicy:
    """Per agent task budgets (P11), keyed by (tenant, task id): the id from the `x-sluice-task-id` request header,
    the loop depth from `x-sluice-task-depth`. Every `max_*` is 0 = unlimited."""

    max_calls: int = 0                # LLM calls per task
    max_tokens: int = 0               # tokens per task, charged at admission with the estimate (prompt + expected
                                      # output) and corrected with actual usage when the call ends. A call whose
                                      # estimate does not fit is refused
    max_depth: int = 0                # highest loop depth / step a call may report
    max_wall_s: float = 0.0           # seconds since the task's first call after which further calls are refused
    max_active_per_tenant: int = 0    # concurrent active tasks per tenant. A task is active while it has a call in
                                      # flight and for `idle_s` after its last call ended; a new task over the cap
                                      # is refused, known tasks continue
    idle_s: float = 30.0              # see max_active_per_tenant
    ttl_s: float = 3600.0             # a task's counters are forgotten after this many seconds without an admitted
                                      # call (a later call with the same id starts a new task). Raised to
                                      # max_wall_s if smaller

    def validate(self, path: str) -> None:
        non_negative(self, path, "max_calls", "max_tokens", "max_depth", "max_wall_s", "max_active_per_tenant",
                     "idle_s")
        positive(self, path, "ttl_s")

    @property
    def enabled(self) -> bool:
        return bool(self.max_calls or self.max_tokens or self.max_depth or self.max_wall_s
                    or self.max_active_per_tenant)


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """Tenant tokens-per-minute limits, over a sliding 60 s window in the store.

    Charged at admission with the estimate (prompt + expected output), corrected with actual usage at the end.
    Over the limit: 429 `tenant_token_limit` with Retry-After computed from the window.
    """

    tokens_per_minute: dict[str, int] = field(default_factory=dict)  # map tenant -> tokens per minute (a positive
                                      # integer; 0 = unlimited for that tenant)
    default: int = 0                  # tokens per minute for tenants not in the map; 0 = unlimited
    short_wait_s: float = 5.0         # a rejected client is told it may retry (`x-should-retry: true`) only when
                                      # the window frees room within this many seconds; otherwise `false`

    def validate(self, path: str) -> None:
        for tenant, v in self.tokens_per_minute.items():
            require(v >= 0, f"{path}.tokens_per_minute.{tenant}", f"must be >= 0, got {v!r}")
        non_negative(self, path, "default", "short_wait_s")

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
    """

    enabled: bool = True              # turn detection and its metrics off
    threshold: float = 0.3            # relative change of cost per request that counts as a shift (0.3 = 30 %)
    baseline_requests: int = 20       # requests needed to establish a baseline; also the drift EWMA span
    sustain_requests: int = 5         # requests the change must persist (and the window of the recent mean)
    max_apps: int = 64                # apps tracked; further apps collapse into `other` (bounded state and metric
                                      # labels)
    max_fingerprints_per_app: int = 8  # system-prompt fingerprints tracked per app (least recently seen evicted)

    def validate(self, path: str) -> None:
        positive(self, path, "threshold", "baseline_requests", "sustain_requests", "max_apps",
                 "max_fingerprints_per_app")


@dataclass(frozen=True, slots=True)
class BudgetPolicy:
    """Retry, agent-task and tenant-token budgets, and prompt cost shift detection."""

    store: StorePolicy = field(default_factory=StorePolicy)  # where budget state lives (memory or Redis)
    retry: RetryPolicy = field(default_factory=RetryPolicy)  # retry budget (P5)
    tasks: TaskPolicy = field(default_factory=TaskPolicy)  # per agent task budgets (P11)
    tenants: TenantPolicy = field(default_factory=TenantPolicy)  # tenant tokens per minute
    prompt_shift: PromptShiftPolicy = field(default_factory=PromptShiftPolicy)  # prompt cost shift (P10)
