"""The policy file: one YAML document that says where everything listens, which replicas serve which model,
and the limits the sidecar enforces. `sluice render` turns it into Envoy's xDS files; the sidecar reads it at start.

Every field is documented once, here, where it is defined; `docs/configuration.md` is generated from the same
words. Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class PolicyError(ValueError):
    """The policy file is invalid; the message names the field."""


def _build(cls: type[T], data: Any, where: str) -> T:
    """Build a (flat) dataclass from a mapping, rejecting unknown keys and wrong scalar types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise PolicyError(f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        default = names[key].default
        if default is not dataclasses.MISSING and default is not None and value is not None:
            if isinstance(default, bool) and not isinstance(value, bool):
                raise PolicyError(f"{where}.{key}: expected true/false, got {value!r}")
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise PolicyError(f"{where}.{key}: expected a number, got {value!r}")
                if isinstance(default, int) and not isinstance(value, int):
                    raise PolicyError(f"{where}.{key}: expected an integer, got {value!r}")
            if isinstance(default, str) and not isinstance(value, str):
                raise PolicyError(f"{where}.{key}: expected a string, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def _check_port(value: int, where: str) -> None:
    if not 0 < value < 65536:
        raise PolicyError(f"{where}: port {value} is outside 1..65535")


@dataclass
class GatewayConfig:
    """Envoy's side."""

    host: str = "127.0.0.1"                 # listener address for client traffic
    port: int = 8080                        # listener port (the base URL is http://host:port/v1)
    admin_host: str = "127.0.0.1"           # Envoy admin (stats at /stats/prometheus); keep it on loopback
    admin_port: int = 9901                  # Envoy admin port: /stats/prometheus, /ready, /clusters
    buffer_limit_bytes: int = 65536         # per-connection buffer on the listener and replica clusters (P13)
    http2_stream_window_bytes: int = 65536  # HTTP/2 initial stream window toward clients and the sidecar (P13)
    http2_max_concurrent_streams: int = 256  # per client connection (P12)
    socket_send_buffer_bytes: int = 0       # SO_SNDBUF of client connections; 0 = kernel default (autotuned, MBs)
    max_downstream_connections: int = 10000  # overload manager: excess connections are closed at accept (P12)
    stream_idle_timeout_s: float = 0.0      # 0 = derived: longest queue wait + longest expected TTFT + margin
    request_timeout_s: float = 0.0          # route timeout for a whole response; 0 = none (streams can be long)
    num_retries: int = 1                    # Envoy retries on connect failure / refused stream (one per pin entry)
    retry_budget_percent: float = 20.0      # Envoy's own retry budget on replica clusters (P5)
    envoy_concurrency: int = 2              # Envoy worker threads
    envoy_log_level: str = "warning"        # Envoy's --log-level (trace, debug, info, warning, error)

    def validate(self) -> None:
        _check_port(self.port, "gateway.port")
        _check_port(self.admin_port, "gateway.admin_port")
        if self.buffer_limit_bytes < 16384:
            raise PolicyError("gateway.buffer_limit_bytes must be at least 16384")


@dataclass
class SidecarConfig:
    """The ext_proc sidecar's side."""

    host: str = "127.0.0.1"            # gRPC listen address (Envoy connects here)
    grpc_port: int = 50051             # ext_proc + access-log gRPC port (worker i listens on grpc_port + i)
    metrics_host: str = "127.0.0.1"    # /metrics (Prometheus) and /ready; loopback by default
    metrics_port: int = 9100           # /metrics and /ready (worker i: metrics_port + i)
    admin_port: int = 50061            # admin gRPC API (proto/sluice/v1/admin.proto), loopback only (worker i: +i)
    failure_mode_allow: bool = False   # false: sidecar down -> 503 (fail closed); true: traffic flows unpinned
    message_timeout_ms: int = 1000     # Envoy waits this long for each sidecar answer (except held requests)
    max_queue_wait_ms: int = 30000     # longest a request may be held in the sidecar's queue
    workers: int = 1                   # sidecar processes behind the ext_proc cluster (more cores)
    max_open_requests: int = 0         # per process, queued + forwarded; beyond it a clean 429 (P12). 0 = derived:
                                       # 90% of gateway.max_downstream_connections / workers, so the sidecar
                                       # refuses with an HTTP error before Envoy must drop connections at accept

    def open_request_cap(self, max_downstream_connections: int) -> int:
        if self.max_open_requests > 0:
            return self.max_open_requests
        return max(1, int(0.9 * max_downstream_connections / max(1, self.workers)))

    def validate(self) -> None:
        if self.workers < 1:
            raise PolicyError("sidecar.workers must be >= 1")
        for name in ("grpc_port", "metrics_port", "admin_port"):
            _check_port(getattr(self, name), f"sidecar.{name}")
        if self.message_timeout_ms < 50:
            raise PolicyError("sidecar.message_timeout_ms must be at least 50")
        if self.max_queue_wait_ms < self.message_timeout_ms:
            raise PolicyError("sidecar.max_queue_wait_ms must be >= sidecar.message_timeout_ms")


@dataclass
class LimitsConfig:
    """Request-level limits checked before anything is queued."""

    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies get 413 (Envoy buffers the body for the sidecar)
    default_output_tokens: int = 256        # expected output when a request sets no max_tokens (until the app's
                                            # p90 is learned from observed responses)
    tokenizer: str = "heuristic"            # heuristic | hf | tiktoken
    tokenizer_path: str = ""                # local tokenizer.json / .tiktoken file (never downloaded)
    bytes_per_token: float = 4.0            # heuristic: bytes of ASCII text per token

    def validate(self) -> None:
        if self.max_body_bytes < 1024:
            raise PolicyError("limits.max_body_bytes must be at least 1024")
        if self.tokenizer not in ("heuristic", "hf", "tiktoken"):
            raise PolicyError(f"limits.tokenizer: unknown kind {self.tokenizer!r}")
        if self.tokenizer != "heuristic" and not self.tokenizer_path:
            raise PolicyError(f"limits.tokenizer_path is required for tokenizer {self.tokenizer!r}")


@dataclass
class SimulatorConfig:
    """Simulated replicas that `sluice up` starts for every pool replica on loopback (demos, tests, benches)."""

    enabled: bool = True         # start simulated replicas for loopback replica addresses (`sluice up`)
    preset: str = "tiny-cpu"     # engine cost model (see docs/simulator.md)
    time_scale: float = 1.0      # >1 runs the engine faster than real time
    seed: int = 0                # replica i uses seed + i: reproducible runs
    extra_args: list[str] = field(default_factory=list)  # passed to `sluice sim` as is


_ADDR = re.compile(r"^(?P<host>[^:\s]+):(?P<port>\d{1,5})$")


@dataclass
class PoolConfig:
    """One model served by a set of OpenAI-compatible replicas."""

    model: str = ""                                      # the `model` value clients send for this pool
    replicas: list[str] = field(default_factory=list)  # "ip:port" of each replica (vLLM, SGLang, simulator)
    metrics_style: str = "vllm"  # vllm | sglang: the replicas' metric names; none: no /metrics (own accounting only)

    @property
    def cluster(self) -> str:
        """Envoy cluster name for this pool (model names may contain '/', ':', ...)."""
        return "pool-" + re.sub(r"[^A-Za-z0-9_.-]", "_", self.model)

    def validate(self, where: str) -> None:
        if not self.model:
            raise PolicyError(f"{where}.model is required")
        if not self.replicas:
            raise PolicyError(f"{where}.replicas: at least one replica is required")
        for addr in self.replicas:
            m = _ADDR.match(str(addr))
            if not m:
                raise PolicyError(f"{where}.replicas: {addr!r} is not host:port")
            _check_port(int(m["port"]), f"{where}.replicas[{addr}]")
        if len(set(self.replicas)) != len(self.replicas):
            raise PolicyError(f"{where}.replicas: duplicate address")
        if self.metrics_style not in ("vllm", "sglang", "none"):
            raise PolicyError(f"{where}.metrics_style must be vllm, sglang or none")


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
    """The whole policy file. Sections owned by other packages (admission, routing, budgets) stay raw
    mappings here and are parsed by their own modules, so each policy lives beside the code it drives."""

    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    pools: list[PoolConfig] = field(default_factory=list)
    admission: dict[str, Any] = field(default_factory=dict)
    routing: dict[str, Any] = field(default_factory=dict)
    budgets: dict[str, Any] = field(default_factory=dict)
    tenants: dict[str, Any] = field(default_factory=dict)
    streaming: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # file the policy came from (for messages)

    def pool_for(self, model: str) -> PoolConfig | None:
        for pool in self.pools:
            if pool.model == model:
                return pool
        return None

    def validate(self) -> None:
        self.gateway.validate()
        self.sidecar.validate()
        self.limits.validate()
        if not self.pools:
            raise PolicyError("pools: at least one pool is required")
        seen: set[str] = set()
        for i, pool in enumerate(self.pools):
            pool.validate(f"pools[{i}]")
            if pool.model in seen:
                raise PolicyError(f"pools[{i}].model {pool.model!r} is listed twice")
            seen.add(pool.model)
        ports = [("gateway.port", self.gateway.port), ("gateway.admin_port", self.gateway.admin_port)]
        for name in ("grpc_port", "metrics_port", "admin_port"):  # each worker uses base + its index
            base = getattr(self.sidecar, name)
            ports += [(f"sidecar.{name}" + (f"+{i}" if i else ""), base + i) for i in range(self.sidecar.workers)]
        by_port: dict[int, str] = {}
        for name, port in ports:
            if port in by_port:
                raise PolicyError(f"{name} and {by_port[port]} both use port {port}")
            by_port[port] = name

    @property
    def default_pool(self) -> PoolConfig:
        return self.pools[0]


_SECTIONS = {"gateway": GatewayConfig, "sidecar": SidecarConfig, "limits": LimitsConfig,
             "simulator": SimulatorConfig}
_RAW_SECTIONS = ("admission", "routing", "budgets", "tenants", "streaming")


def policy_from_dict(data: dict[str, Any], source: str = "<dict>") -> Policy:
    """Build and validate a Policy from a parsed YAML mapping."""
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: the policy must be a mapping")
    known = set(_SECTIONS) | set(_RAW_SECTIONS) | {"pools"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PolicyError(f"unknown section(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {name: _build(cls, data.get(name), name) for name, cls in _SECTIONS.items()}
    pools = data.get("pools") or []
    if not isinstance(pools, list):
        raise PolicyError("pools: expected a list")
    kwargs["pools"] = [_build(PoolConfig, p, f"pools[{i}]") for i, p in enumerate(pools)]
    for name in _RAW_SECTIONS:
        raw = data.get(name) or {}
        if not isinstance(raw, dict):
            raise PolicyError(f"{name}: expected a mapping")
        kwargs[name] = raw
    policy = Policy(**kwargs, source=source)
    policy.validate()
    return policy


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; every problem becomes a PolicyError with the file name."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read policy {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: invalid YAML: {exc}") from None
    try:
        return policy_from_dict(data, source=str(path))
    except PolicyError as exc:
        raise PolicyError(f"{path}: {exc}") from None


def default_policy_path() -> Path:
    return Path(__file__).resolve().parent.parent / "sluice.yaml"
