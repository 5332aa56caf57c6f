"""The Gateway API Inference Extension's endpoint-picker (EPP) protocol, the parts that are protocol and not policy
(docs/epp.md has the protocol message by message; the decision itself stays in admission and placement):

  request   the data plane MAY restrict the candidates: filter metadata namespace `envoy.lb.subset_hint`, key
            `x-gateway-destination-endpoint-subset`, a list of `ip:port` (or bare `ip`: any port of that host);
            a gateway's header_to_metadata rule delivers the same as one comma-separated string. Present: pick only
            from it (empty, or nothing eligible: 503). Absent: pick from the whole pool.
  answer    the ordered pin list, the SAME value twice: request header `x-gateway-destination-endpoint` and dynamic
            metadata `{"envoy.lb": {"x-gateway-destination-endpoint": "ip:port,ip:port"}}`; or an immediate 503
            (no endpoint) / 429 (shed).
  response  the data plane reports the endpoint that served the request: metadata_context namespace `envoy.lb`,
            key `x-gateway-destination-endpoint-served` (`served_endpoint`).
  health    the standard gRPC health service (`EppHealth`): liveness, readiness and the ext_proc service name.

How many endpoints to list depends on the data plane: Envoy's override_host policy tries the list in order (one
entry per attempt); an ORIGINAL_DST cluster routing by the header takes exactly one `ip:port` and answers 503 to a
list (measured with Envoy 1.40: tests/epp/test_gateway_api_envoy.py). Hence `max_endpoints`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, TypeVar

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc import responses as R
from extproc.xds import DESTINATION_KEY, LB_NAMESPACE

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# gRPC health service names the EPP answers: the protocol's three, plus the name the reference picker's
# Kubernetes probes ask for.
LIVENESS, READINESS = "liveness", "readiness"
READY_SERVICES = ("", READINESS, EXT_PROC_SERVICE, "inference-extension")
# Envoy's ext_proc filter name: the key of ProcessingRequest.attributes (response_attributes such as
# upstream.address arrive under it).
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"

T = TypeVar("T")


def _host_of(endpoint: str) -> str:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or (":" in host and not host.startswith("[")):
        return ""  # not ip:port (a bare IPv6 address has colons but no brackets)
    return host.removeprefix("[").removesuffix("]")


@dataclass(frozen=True, slots=True)
class Subset:
    """The data plane's subset hint: `ip:port` endpoints, and bare hosts that allow any port."""

    endpoints: frozenset[str]
    hosts: frozenset[str]

    def allows(self, address: str) -> bool:
        return address in self.endpoints or (bool(self.hosts) and _host_of(address) in self.hosts)

    def __bool__(self) -> bool:
        return bool(self.endpoints or self.hosts)


def _normalise(entry: str) -> tuple[str, bool]:
    """(the entry as sluice writes addresses, True if it is `ip:port`; False: a bare host)."""
    entry = entry.strip()
    host = _host_of(entry)
    if host:
        return (f"[{host}]:{entry.rpartition(':')[2]}" if ":" in host else entry), True
    return entry.removeprefix("[").removesuffix("]"), False


def parse_subset(value: struct_pb2.Value) -> Subset:
    """A subset value: a list of strings, or one string; either may hold comma-separated entries."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        raw = [value.string_value]
    elif kind == "list_value":
        raw = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    else:
        raw = []
    endpoints, hosts = set(), set()
    for item in raw:
        for part in item.split(","):
            if not part.strip():
                continue
            norm, has_port = _normalise(part)
            (endpoints if has_port else hosts).add(norm)
    return Subset(frozenset(endpoints), frozenset(hosts))


def subset_hint(req: pb.ProcessingRequest) -> Subset | None:
    """The request's subset hint, or None when the data plane set none (pick from the whole pool). An empty
    Subset means the hint is present and empty: the protocol's answer is 503."""
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    return parse_subset(ns.fields[SUBSET_KEY])


def within(subset: Subset | None, items: Iterable[T], address: Callable[[T], str] = str) -> list[T]:
    """The candidates the hint allows (all of them without a hint), in their order."""
    if subset is None:
        return list(items)
    return [item for item in items if subset.allows(address(item))]


def destination(pins: Sequence[str], max_endpoints: int) -> str:
    """The header / metadata value: the first `max_endpoints` pins, comma-separated, in order."""
    return ",".join(pins[:max_endpoints])


def pick_answer(pins: Sequence[str], *, max_endpoints: int = 1, phase: str = "request_body",
                extra_headers: Sequence[tuple[str, str]] = (),
                remove_headers: Sequence[str] = ()) -> pb.ProcessingResponse:
    """The answer that routes the request: the same ordered list in the `x-gateway-destination-endpoint` header
    and in `envoy.lb` dynamic metadata, route cache cleared (the header may select the route). `phase` is the
    message being answered: `request_body` (body BUFFERED, sluice's mode) or `request_headers`."""
    if not pins or max_endpoints < 1:
        raise ValueError("an EPP answer needs at least one endpoint")
    value = destination(pins, max_endpoints)
    mutation = pb.HeaderMutation(set_headers=[R._header(DESTINATION_KEY, value)])
    for key, text in extra_headers:
        mutation.set_headers.append(R._header(key, text))
    mutation.remove_headers.extend(remove_headers)
    common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    if phase == "request_headers":
        resp = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
    elif phase == "request_body":
        resp = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    else:
        raise ValueError(f"an EPP answer is given to request_headers or request_body, not {phase!r}")
    resp.dynamic_metadata.CopyFrom(R.pin_metadata(value))
    return resp


def no_endpoint_answer(pool: str, subset_given: bool) -> pb.ProcessingResponse:
    """503: no ready endpoint (in the subset, when the data plane gave one)."""
    where = "in the gateway's endpoint subset" if subset_given else "in the pool"
    return R.immediate(503, f"no endpoint of {pool} is available {where}", "pool_unavailable",
                       retry_after_s=1.0, should_retry=True)


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The endpoint that served the request, as the data plane reports it: `envoy.lb` /
    `x-gateway-destination-endpoint-served` in metadata_context (the protocol; Envoy's override_host policy
    writes it with `selected_host_key`), else the `upstream.address` response attribute (what stock Envoy can
    send with an ORIGINAL_DST cluster: ext_proc `response_attributes: [upstream.address]`). None: not reported."""
    ns = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if ns is not None:
        value = ns.fields.get(SERVED_KEY)
        if value is not None and value.string_value:
            return value.string_value
    attrs = req.attributes.get(EXT_PROC_FILTER)
    if attrs is not None:
        value = attrs.fields.get("upstream.address")
        if value is not None and value.string_value:
            return value.string_value
    return None


class EppHealth:
    """The standard gRPC health service (grpc.health.v1, grpcio-health-checking) as the protocol names it:
    `liveness` is SERVING while the process answers; `readiness`, the ext_proc service name, "" and the name the
    reference picker's probes use follow `set_ready` (pool endpoints known, not shutting down)."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.ready = False

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start(self, ready: bool = False) -> None:
        await self.servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(ready)

    async def set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self.ready = ready
        for service in READY_SERVICES:
            await self.servicer.set(service, status)

    async def shutdown(self) -> None:
        """Everything NOT_SERVING for good (graceful shutdown: gateways stop sending new requests)."""
        self.ready = False
        await self.servicer.enter_graceful_shutdown()


def is_ip_endpoint(address: str) -> bool:
    """Is `address` `ip:port` (what the protocol carries; names are never sent to the data plane)?"""
    host = _host_of(address)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
