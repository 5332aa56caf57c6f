"""The policy file: one YAML document that says where everything listens, which replicas serve which model,
and the limits the sidecar enforces. `sluice render` turns it into Envoy's xDS files; the sidecar reads it at start
and on every reload.

`Policy` holds one typed section per top-level key; the sections owned by a package (admission, routing, budgets,
tenants, streaming) are defined beside the code they drive. All of them are built by one generic builder
(`extproc.schema.build`): unknown fields are errors at every level, named by their full path. Every field is
documented once, by the comment on its line; `docs/configuration.md` is generated from the same words.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from extproc.admission.policy import AdmissionPolicy
from extproc.budgets.policy import BudgetPolicy
from extproc.discovery import STATIC, BadReplicaEntry, ReplicaSource, format_address, parse_replica_entry
from extproc.discovery.policy import DiscoveryPolicy, DnsEntry
from extproc.identity import TenantPolicy
from extproc.routing.policy import RoutingPolicy
from extproc.schema import INTERNAL, PolicyError, build, file_fields, non_negative, require, to_dict
from extproc.streaming import StreamingPolicy

__all__ = ["Policy", "PolicyError", "GatewayConfig", "SidecarConfig", "LimitsConfig", "SimulatorConfig",
           "PoolConfig", "EppConfig", "DnsEntry", "policy_from_dict", "load_policy", "read_policy_file",
           "parse_section", "policy_to_dict", "split_addr", "is_loopback", "default_policy_path", "EMBEDDED_POLICY",
           "POLICY_FILE_NAME", "default_workers"]


def _check_port(value: int, where: str) -> None:
    require(0 < value < 65536, where, f"port {value} is outside 1..65535")


@dataclass
class GatewayConfig:
    """Envoy's side. Rendered without a field (measurements in docs/reliability.md): Envoy's heap (tcmalloc) returns
    free pages above a 16 MiB soft limit (its heap at rest) and at 16 MiB/s in the background, and Envoy runs with
    `GLIBC_TUNABLES=glibc.pthread.rseq=0` (`sluice up` sets it, docker-compose.yml too; set it for an Envoy you run
    yourself) so that tcmalloc has per-CPU caches. P12: with glibc >= 2.35 it otherwise falls back to per-thread caches,
    and after 10,000 silent connections Envoy stayed 35 MB (+52%) above where it started; with per-CPU caches it is
    back within 3-5 MB in about 20 s."""

    host: str = "127.0.0.1"                 # listener address for client traffic
    port: int = 8080                        # listener port (the base URL is http://host:port/v1)
    admin_host: str = "127.0.0.1"           # Envoy admin (stats at /stats/prometheus); keep it on loopback
    admin_port: int = 9901                  # Envoy admin port: /stats/prometheus, /ready, /clusters
    buffer_limit_bytes: int = 65536         # per-connection buffer on the listener and replica clusters (P13)
    http2_stream_window_bytes: int = 65536  # HTTP/2 initial stream window toward clients and the sidecar (P13)
    http2_max_concurrent_streams: int = 256  # per client connection (P12)
    socket_send_buffer_bytes: int = 0       # SO_SNDBUF of client connections; 0 = kernel default (autotuned, MBs)
    max_downstream_connections: int = 10000  # overload manager: excess connections are closed at accept (P12)
    connection_idle_timeout_s: float = 60.0  # a client connection with no request in flight is closed after this
                                            # (0 = never). P12: an idle keep-alive connection holds one of the
                                            # max_downstream_connections slots and an fd; 60 s outlives the
                                            # keep-alive pools of common clients (openai-python/httpx 5 s, Node 5 s,
                                            # aiohttp 15 s), so reuse never races a close, and returns a slot within
                                            # a minute. Never cuts a stream or a held request (they are in flight)
    request_headers_timeout_s: float = 10.0  # a new connection must send its first request line within this, and
                                            # every request its whole header block within this of its first byte;
                                            # else the connection is closed (0 = off). P12: a connection that sends
                                            # nothing (or headers a byte at a time) would otherwise hold a slot for
                                            # connection_idle_timeout_s; headers are a few KB, sent in milliseconds
                                            # on any network
    request_receive_timeout_s: float = 0.0  # the whole request (headers, body, and the sidecar's decision, queue
                                            # hold included) must be passed to a replica within this; Envoy answers
                                            # 408 otherwise. 0 = derived: sidecar.max_queue_wait_ms + 60 s (a 4 MiB
                                            # prompt at 0.6 Mbit/s). P12: a body trickled a byte at a time holds a
                                            # slot; the response, however long it streams, is not part of it
    max_request_headers: int = 100          # headers per request (Envoy's max_headers_count); more get a JSON 431
                                            # from Envoy. The sidecar's own additions (pool header, upstream
                                            # timeout) must fit too: a request with fewer than that many spare is
                                            # refused with the same 431 by the sidecar, before it is admitted
    max_request_headers_kb: int = 8         # total size of a request's headers, in KiB (keys + values, as Envoy
                                            # counts); larger get a JSON 431 from Envoy, before any replica sees
                                            # them. 8 KiB is what common servers take per header (nginx, Apache,
                                            # aiohttp: 8190 bytes), an SDK request carries about 1 KiB. P12: Envoy
                                            # keeps each request's headers while it runs: 10,000 streams x 60 KiB
                                            # (Envoy's default) would be 600 MB
    stream_idle_timeout_s: float = 0.0      # 0 = derived: longest queue wait + longest expected TTFT + margin
    request_timeout_s: float = 0.0          # route timeout for a whole response; 0 = none (streams can be long).
                                            # A client's shorter deadline replaces it per request, a longer one not
    num_retries: int = 1                    # Envoy retries on connect failure / refused stream (one per pin entry)
    retry_budget_percent: float = 20.0      # Envoy's own retry budget on replica clusters (P5)
    envoy_concurrency: int = 2              # Envoy worker threads
    envoy_log_level: str = "warning"        # Envoy's --log-level (trace, debug, info, warning, error)

    def validate(self, path: str) -> None:
        _check_port(self.port, f"{path}.port")
        _check_port(self.admin_port, f"{path}.admin_port")
        require(self.buffer_limit_bytes >= 16384, f"{path}.buffer_limit_bytes", "must be at least 16384")
        non_negative(self, path, "connection_idle_timeout_s", "request_headers_timeout_s",
                     "request_receive_timeout_s")
        require(self.max_request_headers >= 16, f"{path}.max_request_headers", "must be at least 16")
        require(1 <= self.max_request_headers_kb <= 8192, f"{path}.max_request_headers_kb", "must be in 1..8192")


def default_workers(cores: int | None = None) -> int:
    """Sidecar processes for a machine of `cores` cores (default: the cores this process may run on), leaving
    Envoy its share: max(1, cores - ceil(cores / 3)). Per request Envoy spends about half of the sidecar's CPU
    (`sluice bench overhead` reports both: 0.36-0.41 ms against 0.68-0.76 ms here), so about a third of the
    gateway's cores go to Envoy."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - math.ceil(cores / 3))


@dataclass
class SidecarConfig:
    """The ext_proc sidecar's side."""

    host: str = "127.0.0.1"            # gRPC listen address (Envoy connects here)
    advertise_host: str = ""           # how Envoy reaches the sidecar when that is not `host` (a listen address
                                       # of 0.0.0.0, a container): an address, or a name Envoy resolves (its
                                       # cluster is then STRICT_DNS, e.g. the compose service `sluice`).
                                       # "" = `host`
    grpc_port: int = 50051             # ext_proc + access-log gRPC port (worker i listens on grpc_port + i)
    metrics_host: str = "127.0.0.1"    # /metrics (Prometheus) and /ready; loopback by default
    metrics_port: int = 9100           # /metrics and /ready (worker i: metrics_port + i)
    admin_port: int = 50061            # admin gRPC API (proto/sluice/v1/admin.proto), loopback only (worker i: +i)
    failure_mode_allow: bool = False   # false: sidecar down -> 503 (fail closed); true: traffic flows unpinned
    message_timeout_ms: int = 1000     # Envoy waits this long for each sidecar answer (except held requests)
    max_queue_wait_ms: int = 30000     # longest a request may be held in the sidecar's queue
    workers: int = 0                   # sidecar processes behind the ext_proc cluster; 0 = derived from the
                                       # machine: max(1, cores - ceil(cores / 3)), i.e. the cores left after
                                       # Envoy's share (Envoy spends about half of what the sidecar spends per
                                       # request: a third of the gateway's CPU), where cores is what this
                                       # process may run on (os.sched_getaffinity)
    max_open_requests: int = 0         # per process, queued + forwarded; beyond it a clean 429 (P12). 0 = derived:
                                       # 90% of gateway.max_downstream_connections / workers, so the sidecar
                                       # refuses with an HTTP error before Envoy must drop connections at accept
    recycle_rss_mb: int = 512          # `sluice up` replaces a worker whose RSS passed this many MB, with no
                                       # request lost (a replacement shares the gRPC port, then the old worker
                                       # hands over and exits): grpc.aio leaks ~150 bytes per ext_proc stream Envoy
                                       # cancels (grpc/grpc#43360), so abandoned requests grow a worker without
                                       # bound. A worker holds ~100 MB at rest. 0 = never. `sluice serve` alone:
                                       # use the process manager's memory limit (docs/operations.md)
    recycle_check_s: float = 10.0      # seconds between two RSS reads of a worker by `sluice up`
    grpc_server: str = "h2"            # the ext_proc/access-log gRPC server: "h2" (extproc/h2grpc.py, a minimal
                                       # HTTP/2 server for Envoy's two streaming RPCs: about a tenth of grpc.aio's
                                       # CPU per request) or "grpcio" (grpc.aio). EPP mode always uses grpcio

    def __post_init__(self) -> None:
        if self.workers == 0:
            self.workers = default_workers()

    @property
    def envoy_host(self) -> str:
        """Where Envoy's ext_proc cluster connects: `advertise_host`, else `host`."""
        return self.advertise_host or self.host

    def open_request_cap(self, max_downstream_connections: int) -> int:
        if self.max_open_requests > 0:
            return self.max_open_requests
        return max(1, int(0.9 * max_downstream_connections / max(1, self.workers)))

    def validate(self, path: str) -> None:
        require(self.workers >= 1, f"{path}.workers", "must be >= 0 (0 = derived from the machine's cores)")
        for name in ("grpc_port", "metrics_port", "admin_port"):
            _check_port(getattr(self, name), f"{path}.{name}")
        require(self.message_timeout_ms >= 50, f"{path}.message_timeout_ms", "must be at least 50")
        require(self.recycle_rss_mb >= 0, f"{path}.recycle_rss_mb", "must be >= 0 (0 = never recycle)")
        require(self.recycle_check_s >= 0.1, f"{path}.recycle_check_s", "must be at least 0.1")
        require(self.grpc_server in ("h2", "grpcio"), f"{path}.grpc_server", "must be h2 or grpcio")
        require(self.max_queue_wait_ms >= self.message_timeout_ms, f"{path}.max_queue_wait_ms",
                f"must be >= {path}.message_timeout_ms")


@dataclass
class LimitsConfig:
    """Request-level limits checked before anything is queued."""

    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies get 413 (Envoy buffers the body for the sidecar)
    default_output_tokens: int = 256        # expected output when a request sets no max_tokens (until the app's
                                            # p90 is learned from observed responses)
    tokenizer: Literal["heuristic", "hf", "tiktoken"] = "heuristic"  # how prompt tokens are counted
    tokenizer_path: str = ""                # local tokenizer.json / .tiktoken file (never downloaded)
    bytes_per_token: float = 4.0            # heuristic: bytes of ASCII text per token

    def validate(self, path: str) -> None:
        require(self.max_body_bytes >= 1024, f"{path}.max_body_bytes", "must be at least 1024")
        require(self.tokenizer == "heuristic" or bool(self.tokenizer_path), f"{path}.tokenizer_path",
                f"is required for tokenizer {self.tokenizer!r}")


@dataclass
class SimulatorConfig:
    """Simulated replicas that `sluice up` starts for every pool replica on loopback (demos, tests, benches)."""

    enabled: bool = True         # start simulated replicas for loopback replica addresses (`sluice up`)
    preset: str = "tiny-cpu"     # engine cost model (see docs/simulator.md)
    time_scale: float = 1.0      # >1 runs the engine faster than real time
    seed: int = 0                # replica i uses seed + i: reproducible runs
    extra_args: list[str] = field(default_factory=list)  # passed to `sluice sim` as is


@dataclass
class PoolConfig:
    """One model served by a set of OpenAI-compatible replicas."""

    model: str = ""                                      # the `model` value clients send for this pool
    replicas: list[str | DnsEntry] = field(default_factory=list)  # each replica: "ip:port" (a fixed address),
                                                    # "name:port" (one replica: the name's first address), or
                                                    # {dns: "name:port"} (every address the name resolves to);
                                                    # vLLM, SGLang, the simulator
    metrics_style: Literal["vllm", "sglang", "none"] = "vllm"  # the replicas' metric names; none: no /metrics
                                                                # (own accounting only)
    discovery: DiscoveryPolicy = field(default_factory=DiscoveryPolicy)  # how names are re-resolved, or the
                                                                          # InferencePool that gives the replicas

    @property
    def cluster(self) -> str:
        """Envoy cluster name for this pool (model names may contain '/', ':', ...)."""
        return "pool-" + re.sub(r"[^A-Za-z0-9_.-]", "_", self.model)

    @property
    def sources(self) -> list[ReplicaSource]:
        """Each replica entry, parsed (the policy was validated, so every entry parses)."""
        return [parse_replica_entry(_entry(e)) for e in self.replicas]

    @property
    def addresses(self) -> list[str]:
        """The fixed `ip:port` entries (the ones that need no discovery), as Envoy names the hosts."""
        return [format_address(s.host, s.port) for s in self.sources if s.kind == STATIC]

    @property
    def discovered(self) -> bool:
        """Are some replicas found at run time (names to resolve, or an InferencePool)? Envoy then learns them
        through EDS."""
        return self.discovery.kubernetes is not None or any(s.kind != STATIC for s in self.sources)

    def validate(self, path: str) -> None:
        require(bool(self.model), f"{path}.model", "is required")
        require(bool(self.replicas) or self.discovery.kubernetes is not None, f"{path}.replicas:",
                "at least one replica is required (or discovery.kubernetes)")
        seen: set[ReplicaSource] = set()
        for i, entry in enumerate(self.replicas):
            try:
                src = parse_replica_entry(_entry(entry), f"{path}.replicas[{i}]")
            except BadReplicaEntry as exc:
                raise PolicyError(str(exc)) from None
            require(src not in seen, f"{path}.replicas[{i}]", f"duplicate replica {src.entry!r}")
            seen.add(src)


def _entry(entry: str | DnsEntry) -> str | dict[str, str]:
    return {"dns": entry.dns} if isinstance(entry, DnsEntry) else entry


@dataclass
class EppConfig:
    """sluice as the endpoint picker (EPP) of a Gateway API InferencePool (docs/epp.md): the gateway asks it, over
    ext_proc, which endpoint serves each request."""

    enabled: bool = False              # answer the endpoint-picker protocol instead of sluice's own Envoy shape:
                                       # one pool, the subset hint honoured, the pick in the
                                       # x-gateway-destination-endpoint header and envoy.lb metadata, the
                                       # served endpoint read back, gRPC health on the ext_proc port
    max_endpoints: int = 1             # endpoints in the answer (an ordered fallback list). 1 behind gateways that
                                       # route through an ORIGINAL_DST cluster (Envoy Gateway, kgateway: a list
                                       # there is a 503); 2+ behind Envoy's override_host policy
    failure_mode: Literal["FailOpen", "FailClose"] | None = None  # when sluice cannot decide (an internal
                                       # error): FailOpen answers any ready endpoint, FailClose a 503. null: the
                                       # InferencePool's endpointPickerRef.failureMode (Kubernetes discovery),
                                       # else FailClose. (The gateway applies the pool's own failureMode when
                                       # sluice is unreachable)

    def validate(self, path: str) -> None:
        require(self.max_endpoints >= 1, f"{path}.max_endpoints", f"must be >= 1, got {self.max_endpoints!r}")


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Policy:
    """The whole policy file: one typed section per top-level key."""

    gateway: GatewayConfig = field(default_factory=GatewayConfig)  # Envoy: listener, admin, buffers, timeouts
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)  # the ext_proc sidecar: ports, workers, queue wait
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # body size, default output, token estimation
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)  # simulated replicas for `sluice up`
    pools: list[PoolConfig] = field(default_factory=list)  # one per model: its replicas
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)  # lanes, queue, when a replica fits
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)  # scraping and health of the replicas
    budgets: BudgetPolicy = field(default_factory=BudgetPolicy)  # retry, task and tenant-token budgets
    tenants: TenantPolicy = field(default_factory=TenantPolicy)  # API keys -> tenants, open streams per tenant
    streaming: StreamingPolicy = field(default_factory=StreamingPolicy)  # observed responses, slow consumers
    epp: EppConfig = field(default_factory=EppConfig)  # sluice as a Gateway API InferencePool's endpoint picker
    source: str = field(default="", metadata=INTERNAL)  # file the policy came from (for messages)

    def pool_for(self, model: str) -> PoolConfig | None:
        for pool in self.pools:
            if pool.model == model:
                return pool
        return None

    def validate(self, path: str = "") -> None:
        """The rules that span sections (each section checked its own when it was built)."""
        require(bool(self.pools), "pools:", "at least one pool is required")
        seen: set[str] = set()
        for i, pool in enumerate(self.pools):
            require(pool.model not in seen, f"pools[{i}].model", f"{pool.model!r} is listed twice")
            seen.add(pool.model)
        require(not self.epp.enabled or len(self.pools) == 1, "epp.enabled",
                "serves exactly one pool (an endpoint picker belongs to one InferencePool)")
        ports = [("gateway.port", self.gateway.port), ("gateway.admin_port", self.gateway.admin_port)]
        for name in ("grpc_port", "metrics_port", "admin_port"):  # each worker uses base + its index
            base = getattr(self.sidecar, name)
            ports += [(f"sidecar.{name}" + (f"+{i}" if i else ""), base + i) for i in range(self.sidecar.workers)]
        by_port: dict[int, str] = {}
        for name, port in ports:
            require(port not in by_port, name, f"and {by_port.get(port)} both use port {port}")
            by_port[port] = name
        receive = self.gateway.request_receive_timeout_s
        hold_s = self.sidecar.max_queue_wait_ms / 1000.0
        require(receive == 0 or receive > hold_s, "gateway.request_receive_timeout_s",
                f"must exceed sidecar.max_queue_wait_ms ({hold_s:g} s): a held request would be cut")

    def derive(self) -> None:
        """Fill the values one section derives from another: admission.max_wait_s 0 (derived from the SLO by the
        scheduler) never exceeds sidecar.max_queue_wait_ms, the longest Envoy holds a request for the sidecar, nor
        does that wait and the late one after it (admission.late_wait_of_target);
        budgets.retry.duplicate_wait_s at most half of sidecar.message_timeout_ms."""
        cap_s = self.sidecar.max_queue_wait_ms / 1000.0
        adm = self.admission
        if adm.max_wait_s > cap_s or (adm.max_wait_s <= 0 and adm.ttft_target_s > cap_s):
            adm.max_wait_s = cap_s
        late_cap_s = max(0.0, cap_s - (adm.max_wait_s if adm.max_wait_s > 0 else adm.ttft_target_s))
        if adm.late_wait_of_target * adm.ttft_target_s > late_cap_s:  # the wait served late ends within it too
            adm.late_wait_of_target = late_cap_s / adm.ttft_target_s
        retry = self.budgets.retry
        dup_cap_s = self.sidecar.message_timeout_ms / 2000.0  # Envoy waits no longer than the timeout for the answer
        if retry.duplicate_wait_s > dup_cap_s:
            self.budgets = dataclasses.replace(self.budgets,
                                               retry=dataclasses.replace(retry, duplicate_wait_s=dup_cap_s))

    @property
    def default_pool(self) -> PoolConfig:
        return self.pools[0]


def policy_from_dict(data: dict[str, Any], source: str = "<dict>") -> Policy:
    """Build and validate a Policy from a parsed YAML mapping."""
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: the policy must be a mapping")
    policy = build(Policy, data, "")
    policy.derive()
    policy.source = source
    return policy


def parse_section(name: str, data: Any) -> Any:
    """One section of the policy file (`admission`, `routing`, ...) by the same builder, for code and tests that
    need a section alone. Derived values that depend on other sections (admission.max_wait_s = 0) stay unset."""
    cls = typing.get_type_hints(Policy).get(name)
    if name not in file_fields(Policy) or not dataclasses.is_dataclass(cls):
        sections = [n for n in file_fields(Policy) if dataclasses.is_dataclass(typing.get_type_hints(Policy)[n])]
        raise PolicyError(f"{name}: not a section of mappings (those are: {', '.join(sections)})")
    return build(cls, data, name)


def policy_to_dict(policy: Policy) -> dict[str, Any]:
    """The YAML data of a policy (every field, defaults included): what `sluice up` hands its sidecars."""
    return to_dict(policy)


def read_policy_file(path: str | Path) -> dict[str, Any]:
    """The parsed YAML mapping of a policy file, not yet validated; a PolicyError names the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read policy {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{path}: the policy must be a mapping")
    return data


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; every problem becomes a PolicyError with the file name."""
    data = read_policy_file(path)
    try:
        return policy_from_dict(data, source=str(path))
    except PolicyError as exc:
        raise PolicyError(f"{path}: {exc}") from None


POLICY_FILE_NAME = "sluice.yaml"
# The simulated demo, shipped as package data: what runs when there is no policy file.
EMBEDDED_POLICY = Path(__file__).resolve().with_name("default_policy.yaml")


def default_policy_path() -> Path:
    """The policy file a command reads without `--config FILE`: ./sluice.yaml in the current directory when there
    is one (what `sluice init` writes), else the built-in default (EMBEDDED_POLICY). The full order is
    `--config FILE` > ./sluice.yaml > the built-in default."""
    local = Path.cwd() / POLICY_FILE_NAME
    return local if local.is_file() else EMBEDDED_POLICY
