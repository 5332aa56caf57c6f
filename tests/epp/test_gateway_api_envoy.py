"""The Gateway API shape (extproc/xds_epp.py) with the real Envoy 1.40 and a minimal picker built from extproc.epp:
`envoy --mode validate` accepts both failure modes; requests follow the picked endpoint, honour the subset hint,
report the served endpoint, fail open to the pool or closed with 503 when the picker is down; ORIGINAL_DST takes
one endpoint, not a list."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import epp
from extproc import responses as R
from extproc.xds_epp import FAIL_CLOSE, FAIL_OPEN, GatewayApiShape, render_gateway_api_bootstrap

from tests.discovery.envoy_harness import Backend, Envoy, ports, request

pytestmark = pytest.mark.integration

SUBSET_HEADER = "x-test-subset"
SERVED_HEADER = "x-test-served"


class MiniPicker(pb_grpc.ExternalProcessorServicer):
    """Picks the first allowed endpoint (or all of them, `list_all`), answers on the body, echoes the served
    endpoint back as a response header."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.list_all = False
        self.served: list[str | None] = []

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], context):
        hint = None
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                hint = epp.subset_hint(msg)
                yield R.CONTINUE_REQUEST_HEADERS
            elif kind == "request_body":
                allowed = epp.within(hint, self.endpoints)
                if not allowed:
                    yield epp.no_endpoint_answer("pool", hint is not None)
                    return
                yield epp.pick_answer(allowed, max_endpoints=len(allowed) if self.list_all else 1)
            elif kind == "response_headers":
                served = epp.served_endpoint(msg)
                self.served.append(served)
                mutation = pb.HeaderMutation(set_headers=[R._header(SERVED_HEADER, served or "none")])
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse(
                    response=pb.CommonResponse(header_mutation=mutation)))


@pytest.fixture
def backends():
    made = [Backend() for _ in range(3)]
    yield made
    for b in made:
        b.close()


async def _serve(picker: MiniPicker, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def _ask(port: int, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    return await asyncio.to_thread(request, port, "/v1/completions", headers, b'{"model":"m","prompt":"hi"}')


@pytest.mark.parametrize("mode", [FAIL_OPEN, FAIL_CLOSE])
def test_the_rendered_shape_validates(tmp_path, mode):
    shape = GatewayApiShape(pool="p", listen_port=10000, admin_port=10001, epp_address="127.0.0.1:9002",
                            endpoints=["10.0.0.1:8000"], failure_mode=mode, subset_hint_header=SUBSET_HEADER)
    envoy = Envoy(tmp_path, render_gateway_api_bootstrap(shape))
    result = envoy.validate()
    assert result.returncode == 0, result.stdout + result.stderr


async def test_envoy_follows_the_picker_honours_the_subset_and_reports_the_served_endpoint(tmp_path, backends):
    addrs = [b.address for b in backends]
    listen, admin, picker_port = ports(3)
    picker = MiniPicker(addrs)
    server = await _serve(picker, picker_port)
    shape = GatewayApiShape(pool="p", listen_port=listen, admin_port=admin, epp_address=f"127.0.0.1:{picker_port}",
                            endpoints=addrs, failure_mode=FAIL_OPEN, subset_hint_header=SUBSET_HEADER)
    envoy = Envoy(tmp_path, render_gateway_api_bootstrap(shape))
    envoy.start(admin)
    try:
        status, headers, body = await _ask(listen)
        assert (status, body, headers[SERVED_HEADER]) == (200, addrs[0], addrs[0])
        # a client cannot pin itself: its own x-gateway-destination-endpoint is stripped before the picker runs
        status, headers, body = await _ask(listen, {epp.DESTINATION_KEY: addrs[2]})
        assert body == addrs[0]
        # the subset hint (here from a header, as a gateway's header_to_metadata rule would set it)
        status, headers, body = await _ask(listen, {SUBSET_HEADER: f"{addrs[2]},{addrs[1]}"})
        assert (status, body, headers[SERVED_HEADER]) == (200, addrs[1], addrs[1])
        status, _, body = await _ask(listen, {SUBSET_HEADER: "10.9.9.9:1"})
        assert status == 503 and "pool_unavailable" in body
        # ORIGINAL_DST takes one endpoint: a list in the header is a 503 from Envoy itself
        picker.list_all = True
        status, _, body = await _ask(listen)
        assert status == 503 and "no healthy upstream" in body
        picker.list_all = False
        # the picker is gone: FailOpen serves the request from the pool anyway
        await server.stop(0)
        served = {(await _ask(listen))[2] for _ in range(6)}
        assert served and served <= set(addrs)
    finally:
        envoy.stop()
        await server.stop(0)


async def test_fail_close_answers_503_when_the_picker_is_down(tmp_path, backends):
    listen, admin, picker_port = ports(3)
    shape = GatewayApiShape(pool="p", listen_port=listen, admin_port=admin, epp_address=f"127.0.0.1:{picker_port}",
                            failure_mode=FAIL_CLOSE)
    envoy = Envoy(tmp_path, render_gateway_api_bootstrap(shape))
    envoy.start(admin)
    try:
        status, _, _ = await _ask(listen)
        assert status == 503
    finally:
        envoy.stop()


async def test_override_host_reports_the_endpoint_that_served_the_pin_list(tmp_path, backends):
    """sluice's own shape (override_host): with `selected_host_key` Envoy 1.40 writes the host it chose into
    `envoy.lb` / x-gateway-destination-endpoint-served, and ext_proc forwards it (forwarding_namespaces) to the
    picker: here the first pin is unknown, so the second served, and the picker is told so."""
    from extproc.xds import PROTOCOL_OPTIONS_KEY, _http2_options, _pool_lb_policy, _to_dict
    from extproc.discovery.eds import load_assignment
    from tests.discovery.envoy_harness import hcm, listener

    listen, admin, picker_port = ports(3)
    second = backends[1].address
    picker = MiniPicker(["127.0.0.1:1", second])
    picker.list_all = True
    server = await _serve(picker, picker_port)
    lb = _to_dict(_pool_lb_policy("sluice"))
    lb["policies"][0]["typed_extension_config"]["typed_config"]["selected_host_key"] = {
        "key": epp.LB_NAMESPACE, "path": [{"key": epp.SERVED_KEY}]}  # not in the generated stubs yet
    ext_proc = {"name": epp.EXT_PROC_FILTER, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}},
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                            "response_header_mode": "SEND", "response_body_mode": "NONE"},
        "metadata_options": {"receiving_namespaces": {"untyped": [epp.LB_NAMESPACE]},
                             "forwarding_namespaces": {"untyped": [epp.LB_NAMESPACE]}}}}
    bootstrap = {
        "node": {"id": "t", "cluster": "t"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [listener("l", listen, hcm("t", "pool", [ext_proc]))],
            "clusters": [
                {"name": "pool", "type": "STATIC", "connect_timeout": "1s", "load_balancing_policy": lb,
                 "load_assignment": _to_dict(load_assignment("pool", [b.address for b in backends]))},
                {"name": "picker", "type": "STATIC", "connect_timeout": "1s",
                 "typed_extension_protocol_options": {PROTOCOL_OPTIONS_KEY: _to_dict(_http2_options(65536))},
                 "load_assignment": _to_dict(load_assignment("picker", [f"127.0.0.1:{picker_port}"]))}]}}
    envoy = Envoy(tmp_path, bootstrap)
    envoy.start(admin)
    try:
        for _ in range(3):
            status, headers, body = await _ask(listen)
            assert (status, body, headers[SERVED_HEADER]) == (200, second, second)
        assert picker.served == [second] * 3
    finally:
        envoy.stop()
        await server.stop(0)
