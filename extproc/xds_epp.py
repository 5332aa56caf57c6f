"""The Envoy configuration a Gateway API implementation builds for an InferencePool backend, with an endpoint
picker (sluice in EPP mode, docs/epp.md) as ext_proc: for tests, demos and "bring your own Envoy" setups that want
the Gateway API shape rather than sluice's own (extproc/xds.py).

    listener ── HCM: early header mutation strips client-sent x-gateway-destination-endpoint
                ext_proc (the EPP): request headers + buffered body; response headers (served endpoint)
                router
    routes   ── header x-gateway-destination-endpoint present ─► cluster `<pool>-original-dst`
                otherwise: FailOpen ─► cluster `<pool>-fallback` (the pool's endpoints, least request)
                           FailClose ─► the same ORIGINAL_DST cluster, which answers 503 without the header
    clusters ── ORIGINAL_DST routing by the header (lb_policy CLUSTER_PROVIDED), the EPP (HTTP/2), the fallback

The EPP's answer sets the header (and `envoy.lb` metadata) with clear_route_cache, so the route is chosen again
and the ORIGINAL_DST cluster connects to exactly that `ip:port`. ORIGINAL_DST takes ONE address: a comma list in
the header makes Envoy 1.40 answer 503 "no healthy upstream" (measured, docs/epp.md), so an EPP behind this shape
must answer one endpoint (max_endpoints 1). The served endpoint reaches the EPP as the `upstream.address`
response attribute (this shape has no override_host policy to write `x-gateway-destination-endpoint-served`).

`subset_hint_header` (demos and tests only: a client must not choose its candidates) copies a request header into
the `envoy.lb.subset_hint` metadata namespace the way a gateway's header_to_metadata rule would.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
from envoy_data_plane.envoy.config.cluster.v3 import (
    Cluster,
    ClusterDiscoveryType,
    ClusterLbPolicy,
    ClusterOriginalDstLbConfig,
    LoadBalancingPolicy,
    LoadBalancingPolicyPolicy,
)
from envoy_data_plane.envoy.config.core.v3 import GrpcService, GrpcServiceEnvoyGrpc, Node
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.route.v3 import HeaderMatcher, Route, RouteAction, RouteConfiguration, \
    RouteMatch, VirtualHost
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    MetadataOptions,
    MetadataOptionsMetadataNamespaces,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.http.header_to_metadata.v3 import (
    Config as HeaderToMetadata,
    ConfigKeyValuePair,
    ConfigRule,
    ConfigValueType,
)
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
    HttpConnectionManagerCodecType,
    HttpFilter,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.least_request.v3 import LeastRequest
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
from envoy_data_plane.google.protobuf import Any as PbAny

from extproc.discovery.eds import load_assignment
from extproc.epp import EXT_PROC_FILTER, SUBSET_KEY, SUBSET_NAMESPACE
from extproc.xds import (
    DESTINATION_KEY,
    LB_NAMESPACE,
    PROTOCOL_OPTIONS_KEY,
    _addr,
    _circuit_breakers,
    _http1_options,
    _http2_options,
    _strip_gateway_headers,
    _to_dict,
    _typed,
)
from extproc.config import Policy

FAIL_OPEN, FAIL_CLOSE = "FailOpen", "FailClose"  # InferencePool endpointPickerRef.failureMode


@dataclass(frozen=True)
class GatewayApiShape:
    """What the rendered Envoy needs: where it listens, where the EPP is, the pool's endpoints (fail-open
    fallback), and the InferencePool's failure mode."""

    pool: str                                 # InferencePool name (cluster names derive from it)
    listen_port: int
    admin_port: int
    epp_address: str                          # ip:port of the EPP's ext_proc gRPC service
    endpoints: list[str] = field(default_factory=list)  # the pool's ip:port (fail-open fallback cluster)
    failure_mode: str = FAIL_CLOSE
    listen_host: str = "127.0.0.1"
    admin_host: str = "127.0.0.1"
    message_timeout_ms: int = 1000            # one message; the EPP asks for more while a request is queued
    max_queue_wait_ms: int = 30_000
    max_body_bytes: int = 4 << 20
    subset_hint_header: str | None = None     # demos/tests: a header copied into the subset hint

    def __post_init__(self) -> None:
        if self.failure_mode not in (FAIL_OPEN, FAIL_CLOSE):
            raise ValueError(f"failure_mode must be {FAIL_OPEN} or {FAIL_CLOSE}, got {self.failure_mode!r}")
        if self.failure_mode == FAIL_OPEN and not self.endpoints:
            raise ValueError("FailOpen needs the pool's endpoints (the fallback cluster)")

    @property
    def original_dst_cluster(self) -> str:
        return f"{self.pool}-original-dst"

    @property
    def fallback_cluster(self) -> str:
        return f"{self.pool}-fallback"

    @property
    def epp_cluster(self) -> str:
        return f"{self.pool}-epp"


def _ext_proc(shape: GatewayApiShape) -> HttpFilter:
    send, skip = ProcessingModeHeaderSendMode.SEND, ProcessingModeHeaderSendMode.SKIP
    namespaces = MetadataOptionsMetadataNamespaces
    processor = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=shape.epp_cluster),
                                 timeout=dt.timedelta(seconds=5)),
        failure_mode_allow=shape.failure_mode == FAIL_OPEN,
        processing_mode=ProcessingMode(
            request_header_mode=send, request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            request_trailer_mode=skip, response_header_mode=send,
            # Trailers SEND keeps the stream open until the response ends (at no per-chunk cost): the EPP learns
            # each request's end from it, since the gateway sends it no access log.
            response_body_mode=ProcessingModeBodySendMode.NONE, response_trailer_mode=send),
        message_timeout=dt.timedelta(milliseconds=shape.message_timeout_ms),
        max_message_timeout=dt.timedelta(milliseconds=shape.max_queue_wait_ms + 2000),
        response_attributes=["upstream.address"],
        metadata_options=MetadataOptions(
            receiving_namespaces=namespaces(untyped=[LB_NAMESPACE]),
            forwarding_namespaces=namespaces(untyped=[LB_NAMESPACE, SUBSET_NAMESPACE])),
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
        stat_prefix="epp",
    )
    return HttpFilter(name=EXT_PROC_FILTER, typed_config=PbAny.pack(processor))


def _subset_from_header(header: str) -> HttpFilter:
    rule = ConfigRule(header=header, remove=True, on_header_present=ConfigKeyValuePair(
        metadata_namespace=SUBSET_NAMESPACE, key=SUBSET_KEY, type=ConfigValueType.STRING))
    return HttpFilter(name="envoy.filters.http.header_to_metadata",
                      typed_config=PbAny.pack(HeaderToMetadata(request_rules=[rule])))


def render_routes(shape: GatewayApiShape) -> RouteConfiguration:
    picked = Route(name="picked", match=RouteMatch(prefix="/", headers=[
        HeaderMatcher(name=DESTINATION_KEY, present_match=True)]),
        route=RouteAction(cluster=shape.original_dst_cluster, timeout=dt.timedelta(0)))
    unpicked_cluster = shape.fallback_cluster if shape.failure_mode == FAIL_OPEN else shape.original_dst_cluster
    unpicked = Route(name="unpicked", match=RouteMatch(prefix="/"),
                     route=RouteAction(cluster=unpicked_cluster, timeout=dt.timedelta(0)))
    vhost = VirtualHost(name="inference", domains=["*"], routes=[picked, unpicked],
                        request_body_buffer_limit=shape.max_body_bytes)
    return RouteConfiguration(name="inference", virtual_hosts=[vhost])


def render_clusters(shape: GatewayApiShape, policy: Policy) -> list[Cluster]:
    original_dst = Cluster(
        name=shape.original_dst_cluster, type=ClusterDiscoveryType.ORIGINAL_DST,
        lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED, connect_timeout=dt.timedelta(seconds=1),
        original_dst_lb_config=ClusterOriginalDstLbConfig(use_http_header=True, http_header_name=DESTINATION_KEY),
        typed_extension_protocol_options={PROTOCOL_OPTIONS_KEY: _http1_options()},
        circuit_breakers=_circuit_breakers(policy, with_retry_budget=False))
    epp = Cluster(
        name=shape.epp_cluster, type=ClusterDiscoveryType.STATIC, connect_timeout=dt.timedelta(seconds=1),
        load_assignment=load_assignment(shape.epp_cluster, [shape.epp_address]),
        typed_extension_protocol_options={PROTOCOL_OPTIONS_KEY: _http2_options(65536)},
        circuit_breakers=_circuit_breakers(policy, with_retry_budget=False))
    clusters = [original_dst, epp]
    if shape.failure_mode == FAIL_OPEN:
        least = _typed("envoy.load_balancing_policies.least_request", LeastRequest(choice_count=2))
        clusters.append(Cluster(
            name=shape.fallback_cluster, type=ClusterDiscoveryType.STATIC, connect_timeout=dt.timedelta(seconds=1),
            load_assignment=load_assignment(shape.fallback_cluster, shape.endpoints),
            load_balancing_policy=LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(
                typed_extension_config=least)]),
            typed_extension_protocol_options={PROTOCOL_OPTIONS_KEY: _http1_options()},
            circuit_breakers=_circuit_breakers(policy, with_retry_budget=False)))
    return clusters


def render_listener(shape: GatewayApiShape) -> Listener:
    filters = [_subset_from_header(shape.subset_hint_header)] if shape.subset_hint_header else []
    filters += [_ext_proc(shape), HttpFilter(name="envoy.filters.http.router", typed_config=PbAny.pack(Router()))]
    hcm = HttpConnectionManager(
        stat_prefix="inference", codec_type=HttpConnectionManagerCodecType.AUTO,
        route_config=render_routes(shape), http_filters=filters,
        early_header_mutation_extensions=[_strip_gateway_headers()])
    return Listener(name="inference", address=_addr(shape.listen_host, shape.listen_port),
                    filter_chains=[FilterChain(filters=[Filter(
                        name="envoy.filters.network.http_connection_manager", typed_config=PbAny.pack(hcm))])])


def render_gateway_api_bootstrap(shape: GatewayApiShape, policy: Policy | None = None) -> dict[str, Any]:
    """A complete, static Envoy bootstrap (a dict ready for YAML) in the Gateway API implementations' shape.
    `policy` supplies the circuit-breaker ceilings (defaults when omitted)."""
    policy = policy or Policy()
    bootstrap = Bootstrap(
        node=Node(id="sluice-epp-gateway", cluster="sluice-epp-gateway"),
        admin=Admin(address=_addr(shape.admin_host, shape.admin_port)),
        static_resources=BootstrapStaticResources(listeners=[render_listener(shape)],
                                                  clusters=render_clusters(shape, policy)))
    return _to_dict(bootstrap)
