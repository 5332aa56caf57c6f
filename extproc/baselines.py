"""The gateways sluice is compared with in the benchmarks, rendered or started from the same policy file.

- `envoy-tuned`: what an experienced Envoy operator writes for an LLM pool, without any ext_proc. It starts
  from the `envoy-rr` rendering (same listener, buffers, socket options, connection limit, local replies, so
  the environment is identical) and adds the operator's choices, each explained where it is made below.
- `smg`: the Shepherd Model Gateway (`pip install smg`), `smg launch --policy cache_aware` in front of the
  same replicas, its retries, circuit breaker and health checks as shipped.

`extproc.xds.render` hands these modes to `render` here; `extproc.supervisor.Stack` starts `smg` with
`smg_child` instead of Envoy. `BaselineOptions` carries the deployment facts an operator sizes Envoy with.
"""

from __future__ import annotations

import datetime as dt
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    CircuitBreakersThresholdsRetryBudget,
    LoadBalancingPolicy,
    LoadBalancingPolicyPolicy,
    OutlierDetection,
)
from envoy_data_plane.envoy.config.core.v3 import (
    HealthCheck,
    HealthCheckHttpHealthCheck,
    RoutingPriority,
    RuntimeDouble,
    RuntimeFractionalPercent,
    RuntimePercent,
    TypedExtensionConfig,
)
from envoy_data_plane.envoy.config.route.v3 import (
    RateLimit,
    RateLimitAction,
    RateLimitActionRequestHeaders,
    RetryPolicy,
    RetryPolicyRetryHostPredicate,
)
from envoy_data_plane.envoy.extensions.common.ratelimit.v3 import LocalRateLimitDescriptor, RateLimitDescriptorEntry
from envoy_data_plane.envoy.extensions.filters.http.admission_control.v3 import (
    AdmissionControl,
    AdmissionControlSuccessCriteria,
    AdmissionControlSuccessCriteriaHttpCriteria,
)
from envoy_data_plane.envoy.extensions.filters.http.local_ratelimit.v3 import LocalRateLimit
from envoy_data_plane.envoy.extensions.load_balancing_policies.common.v3 import SlowStartConfig
from envoy_data_plane.envoy.extensions.load_balancing_policies.least_request.v3 import LeastRequest
from envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 import PreviousHostsPredicate
from envoy_data_plane.envoy.type.v3 import FractionalPercent, FractionalPercentDenominatorType, Int32Range, Percent
from envoy_data_plane.envoy.type.v3 import TokenBucket
from envoy_data_plane.google.protobuf import Any as PbAny

from extproc.config import Policy
from extproc.xds_files import to_dict, write_atomic

MODES = ("envoy-tuned", "smg")
VLLM_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs, when the operator does not know the engine's


@dataclass(frozen=True)
class BaselineOptions:
    """Deployment facts an operator sizes the baseline with (the benchmark derives them from the scenario)."""

    max_num_seqs: int = VLLM_MAX_NUM_SEQS          # requests one engine runs at once
    tenant_header: str = "x-sluice-tenant"         # the header naming the tenant
    tenant_rps: dict[str, float] = field(default_factory=dict)  # per-tenant request rate limit; empty: none


def _secs(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=seconds)


def _typed(name: str, msg: Any) -> TypedExtensionConfig:
    return TypedExtensionConfig(name=name, typed_config=PbAny.pack(msg))


def _dict(msg: Any) -> dict[str, Any]:
    return to_dict(msg)


def _packed(msg: Any) -> dict[str, Any]:
    return _dict(PbAny.pack(msg))


# ---- envoy-tuned: the cluster ----------------------------------------------------------------------------------
def tuned_lb_policy() -> LoadBalancingPolicy:
    """least_request (power of two choices): an LLM request's cost varies 100x, so the count of requests in
    flight per replica is a better signal than turns. Slow start ramps a replica that (re)enters the pool over
    10 s instead of handing it its full share at once (P6's herd); Envoy applies it to hosts that pass active
    health checks again, which is why the cluster has them."""
    lr = LeastRequest(choice_count=2, slow_start_config=SlowStartConfig(
        slow_start_window=_secs(10), aggression=RuntimeDouble(default_value=1.0, runtime_key="tuned.slow_start.aggr")))
    return LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(
        typed_extension_config=_typed("envoy.load_balancing_policies.least_request", lr))])


def tuned_circuit_breakers(replicas: int, opts: BaselineOptions) -> CircuitBreakers:
    """Sized to the pool: replicas x max_num_seqs requests is what the engines can run at once, so more than that
    in flight only queues inside the engines. HTTP/1.1 upstream: one connection per request, so connections get
    the same bound, and as many again may wait for a connection (a second batch) before Envoy answers 503
    overflow, which clients retry. Retries are limited by a budget, 20 % of the requests in flight (at least
    3), not by a fixed count: a retry storm cannot double the load (P5)."""
    size = max(1, replicas * opts.max_num_seqs)
    th = CircuitBreakersThresholds(
        priority=RoutingPriority.DEFAULT, max_connections=size, max_pending_requests=size, max_requests=size,
        retry_budget=CircuitBreakersThresholdsRetryBudget(budget_percent=Percent(value=20.0), min_retry_concurrency=3))
    return CircuitBreakers(thresholds=[th])


def tuned_health_check() -> HealthCheck:
    """Active HTTP health checks on the engine's /health every second (timeout 1 s): a crashed replica leaves the
    pool after 2 failed checks and returns after 2 good ones (then through slow start). vLLM's /health answers
    200 while the engine runs, so this catches crashes, not a slow replica (P8). The same 1 s interval while the
    pool has no traffic (Envoy's default for an idle cluster is 60 s): hosts start unchecked, and a pool must be
    known healthy before its first request, not a minute after."""
    return HealthCheck(timeout=_secs(1), interval=_secs(1), no_traffic_interval=_secs(1), unhealthy_threshold=2,
                       healthy_threshold=2, http_health_check=HealthCheckHttpHealthCheck(path="/health"))


def tuned_outlier_detection() -> OutlierDetection:
    """Passive ejection: 5 consecutive 5xx or 3 consecutive gateway errors (502/503/504: resets, refused
    connections, timeouts) eject a replica for 10 s (growing with each ejection), checked every second, at most
    half the pool at once so a pool-wide outage does not leave nothing to route to."""
    return OutlierDetection(consecutive_5xx=5, consecutive_gateway_failure=3, interval=_secs(1),
                            base_ejection_time=_secs(10), max_ejection_percent=50)


# ---- envoy-tuned: the route and the filters --------------------------------------------------------------------
def tuned_retry_policy() -> RetryPolicy:
    """Retry what never reached an engine or was refused outright: a reset, a connect failure, a 503 (overflow,
    an ejected or crashed replica). Never on a timeout or a 5xx after the stream began: an LLM request that was
    computing is expensive to repeat. Up to 2 retries, each on a host not tried yet (`previous_hosts`), within
    the cluster's retry budget. The per-try limit is an idle timeout (no byte for 30 s): a whole-response
    per-try timeout would cut long streams that are fine.

    Host selection is re-drawn up to 5 times to find a host not tried yet, the value of Envoy's FAQ on
    transient failures and Istio's default. While a replica is in slow start, least_request picks by weighted
    EDF, which can hand back the failed host on 3 draws in a row; a connect-refused request then spent all its
    tries on the crashed replica (URX,UF): 6 of 300 requests over 25 crash-and-recover cycles with 3 draws, 0 of
    480 over 40 cycles with 5."""
    return RetryPolicy(
        retry_on="reset,connect-failure,retriable-status-codes", retriable_status_codes=[503], num_retries=2,
        per_try_idle_timeout=_secs(30),
        retry_host_predicate=[RetryPolicyRetryHostPredicate(
            name="envoy.retry_host_predicates.previous_hosts", typed_config=PbAny.pack(PreviousHostsPredicate()))],
        host_selection_retry_max_attempts=5)


def tuned_admission_control() -> AdmissionControl:
    """Client-side throttling from the observed success rate (Envoy's admission_control): when less than 95 % of
    the requests in the last 10 s succeeded (5xx, resets and timeouts fail), new requests are refused early with
    503, with a probability growing as the success rate falls (at most 80 %), so an overloaded or recovering
    pool is not pushed over the edge (P1, P5, P6). Only above 5 requests/s, so a handful of errors on a quiet
    pool does not throttle it."""
    return AdmissionControl(
        enabled=None,
        success_criteria=AdmissionControlSuccessCriteria(http_criteria=AdmissionControlSuccessCriteriaHttpCriteria(
            http_success_status=[Int32Range(start=100, end=500)])),
        sampling_window=_secs(10),
        aggression=RuntimeDouble(default_value=1.0, runtime_key="tuned.admission_control.aggression"),
        sr_threshold=RuntimePercent(default_value=Percent(value=95.0), runtime_key="tuned.admission_control.sr"),
        max_rejection_probability=RuntimePercent(default_value=Percent(value=80.0),
                                                 runtime_key="tuned.admission_control.max_p"))


def _bucket(rps: float) -> TokenBucket:
    per_s = max(1, math.ceil(rps))
    return TokenBucket(max_tokens=per_s, tokens_per_fill=per_s, fill_interval=_secs(1))


def tuned_local_ratelimit(opts: BaselineOptions) -> LocalRateLimit:
    """A request-rate limit per tenant (the tenant header's value), each tenant at the rate the operator grants
    it (BaselineOptions.tenant_rps; the benchmark grants each tenant half the pool's capacity for its requests),
    one second of burst; over it Envoy answers 429 with `retry-after: 1`. Unknown tenants are not limited (the
    filter's own bucket is effectively unlimited)."""
    always = RuntimeFractionalPercent(default_value=FractionalPercent(
        numerator=100, denominator=FractionalPercentDenominatorType.HUNDRED))
    from envoy_data_plane.envoy.config.core.v3 import HeaderValue, HeaderValueOption

    return LocalRateLimit(
        stat_prefix="tenant_rate_limit", token_bucket=TokenBucket(max_tokens=1_000_000, tokens_per_fill=1_000_000,
                                                                  fill_interval=_secs(1)),
        filter_enabled=always, filter_enforced=always,
        response_headers_to_add=[HeaderValueOption(header=HeaderValue(key="retry-after", value="1"))],
        descriptors=[LocalRateLimitDescriptor(entries=[RateLimitDescriptorEntry(key="tenant", value=t)],
                                              token_bucket=_bucket(r)) for t, r in sorted(opts.tenant_rps.items())])


def tuned_rate_limits(opts: BaselineOptions) -> list[RateLimit]:
    return [RateLimit(actions=[RateLimitAction(request_headers=RateLimitActionRequestHeaders(
        header_name=opts.tenant_header, descriptor_key="tenant", skip_if_absent=True))])]


def render_envoy_tuned(policy: Policy, out_dir: Path, opts: BaselineOptions,
                       xds_dir: str | Path | None) -> dict[str, Path]:
    """envoy-rr's rendering (same environment) with the operator's cluster, route and filter choices added."""
    from extproc import xds

    out_dir.mkdir(parents=True, exist_ok=True)
    clusters = [_packed(c) for c in xds.render_clusters(policy, "envoy-rr")]
    for cluster, pool in zip(clusters, policy.pools):
        cluster["load_balancing_policy"] = _dict(tuned_lb_policy())
        cluster["circuit_breakers"] = _dict(tuned_circuit_breakers(len(pool.replicas), opts))
        cluster["health_checks"] = [_dict(tuned_health_check())]
        cluster["outlier_detection"] = _dict(tuned_outlier_detection())
    listener = _packed(xds.render_listener(policy, "envoy-rr"))
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = [{"name": "envoy.filters.http.admission_control", "typed_config": _packed(tuned_admission_control())}]
    if opts.tenant_rps:
        filters.insert(0, {"name": "envoy.filters.http.local_ratelimit",
                           "typed_config": _packed(tuned_local_ratelimit(opts))})
    hcm["http_filters"] = filters + hcm["http_filters"]
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            if "route" not in route:
                continue
            route["route"]["retry_policy"] = _dict(tuned_retry_policy())
            if opts.tenant_rps:
                route["route"]["rate_limits"] = [_dict(r) for r in tuned_rate_limits(opts)]
    paths = {"bootstrap": out_dir / "bootstrap.yaml", "lds": out_dir / "lds.yaml", "cds": out_dir / "cds.yaml"}
    write_atomic(paths["cds"], {"resources": clusters})
    write_atomic(paths["lds"], {"resources": [listener]})
    where = Path(xds_dir) if xds_dir is not None else out_dir.resolve()
    write_atomic(paths["bootstrap"], _dict(xds.render_bootstrap(policy, where)))
    return paths


def render(policy: Policy, out_dir: str | Path, mode: str, xds_dir: str | Path | None = None,
           options: BaselineOptions | None = None) -> dict[str, Path]:
    """The hook `extproc.xds.render` calls for a baseline mode; smg has no Envoy files."""
    if mode not in MODES:
        raise ValueError(f"unknown baseline mode {mode!r} (expected one of {', '.join(MODES)})")
    if mode == "smg":
        return {}
    return render_envoy_tuned(policy, Path(out_dir), options or BaselineOptions(), xds_dir)


# ---- smg -------------------------------------------------------------------------------------------------------
def smg_binary() -> str:
    """The `smg` console script installed beside this interpreter (the `bench` extra installs it)."""
    path = Path(sys.executable).with_name("smg")
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: install the bench extra (pip install -e '.[bench]')")
    return str(path)


def smg_argv(policy: Policy) -> list[str]:
    """`smg launch` in front of the default pool's replicas on the gateway's listen address, its Prometheus
    metrics on the gateway's admin port, cache_aware routing; retries, circuit breaker, health checks, worker
    overload protection and admission limits as shipped. Logging at warn, as Envoy's is kept at error here:
    smg logs two lines per request at info."""
    gw = policy.gateway
    return [smg_binary(), "launch", "--host", gw.host, "--port", str(gw.port),
            "--worker-urls", *[f"http://{a}" for a in policy.default_pool.addresses],
            "--policy", "cache_aware", "--prometheus-host", gw.admin_host, "--prometheus-port", str(gw.admin_port),
            "--log-level", "warn",
            # start-up and teardown only, nothing about routing: smg is started beside the replicas, so it polls
            # for them every second instead of every 30 s before it serves, and a stopped benchmark run does not
            # wait out the 180 s grace for requests the harness has already cancelled
            "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1"]


def smg_ready_url(policy: Policy) -> str:
    """200 once smg has registered its workers and at least one is healthy."""
    return f"http://{policy.gateway.host}:{policy.gateway.port}/readiness"


__all__ = ["MODES", "BaselineOptions", "render", "render_envoy_tuned", "smg_argv", "smg_ready_url", "smg_binary"]
