from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("pools", "draining", "policy_source", "uptime_s", "last_reload", "pid")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    POLICY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LAST_RELOAD_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    draining: bool
    policy_source: str
    uptime_s: float
    last_reload: ReloadResponse
    pid: int
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., draining: _Optional[bool] = ..., policy_source: _Optional[str] = ..., uptime_s: _Optional[float] = ..., last_reload: _Optional[_Union[ReloadResponse, _Mapping]] = ..., pid: _Optional[int] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("model", "cluster", "replicas", "lanes", "all_degraded", "inflight_requests", "inflight_tokens", "queued", "shed_total", "admitted_total")
    class ShedTotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    ALL_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    SHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    model: str
    cluster: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    lanes: _containers.RepeatedCompositeFieldContainer[LaneStatus]
    all_degraded: bool
    inflight_requests: int
    inflight_tokens: int
    queued: int
    shed_total: _containers.ScalarMap[str, float]
    admitted_total: float
    def __init__(self, model: _Optional[str] = ..., cluster: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., lanes: _Optional[_Iterable[_Union[LaneStatus, _Mapping]]] = ..., all_degraded: _Optional[bool] = ..., inflight_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., queued: _Optional[int] = ..., shed_total: _Optional[_Mapping[str, float]] = ..., admitted_total: _Optional[float] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "state", "weight", "draining", "routable", "state_reason", "state_age_s", "retired", "kv_usage", "waiting", "running", "ttft_p95_s", "generation_tps", "scrape_age_s", "scrape_failures", "kv_capacity_tokens", "inflight_requests", "inflight_tokens", "lane_inflight", "served_total", "errors_total", "shared_inflight_requests", "shared_inflight_tokens")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    STATE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    TTFT_P95_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TPS_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LANE_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SHARED_INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: str
    weight: float
    draining: bool
    routable: bool
    state_reason: str
    state_age_s: float
    retired: bool
    kv_usage: float
    waiting: int
    running: int
    ttft_p95_s: float
    generation_tps: float
    scrape_age_s: float
    scrape_failures: int
    kv_capacity_tokens: int
    inflight_requests: int
    inflight_tokens: int
    lane_inflight: _containers.RepeatedScalarFieldContainer[int]
    served_total: int
    errors_total: int
    shared_inflight_requests: int
    shared_inflight_tokens: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[str] = ..., weight: _Optional[float] = ..., draining: _Optional[bool] = ..., routable: _Optional[bool] = ..., state_reason: _Optional[str] = ..., state_age_s: _Optional[float] = ..., retired: _Optional[bool] = ..., kv_usage: _Optional[float] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., ttft_p95_s: _Optional[float] = ..., generation_tps: _Optional[float] = ..., scrape_age_s: _Optional[float] = ..., scrape_failures: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., inflight_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., lane_inflight: _Optional[_Iterable[int]] = ..., served_total: _Optional[int] = ..., errors_total: _Optional[int] = ..., shared_inflight_requests: _Optional[int] = ..., shared_inflight_tokens: _Optional[int] = ...) -> None: ...

class LaneStatus(_message.Message):
    __slots__ = ("name", "queued", "inflight_requests", "inflight_tokens", "max_queue", "max_concurrency", "queued_by_priority")
    class QueuedByPriorityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BY_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    queued: int
    inflight_requests: int
    inflight_tokens: int
    max_queue: int
    max_concurrency: int
    queued_by_priority: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., queued: _Optional[int] = ..., inflight_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_concurrency: _Optional[int] = ..., queued_by_priority: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("replica", "pool")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    replica: str
    pool: str
    def __init__(self, replica: _Optional[str] = ..., pool: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("replica", "pool", "changed", "message")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaStatus
    pool: str
    changed: bool
    message: str
    def __init__(self, replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ..., pool: _Optional[str] = ..., changed: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("ok", "changes", "error", "source", "at_unix_s", "trigger")
    OK_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    changes: _containers.RepeatedScalarFieldContainer[str]
    error: str
    source: str
    at_unix_s: float
    trigger: str
    def __init__(self, ok: _Optional[bool] = ..., changes: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ..., source: _Optional[str] = ..., at_unix_s: _Optional[float] = ..., trigger: _Optional[str] = ...) -> None: ...
