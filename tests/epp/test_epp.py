"""The EPP protocol core with real ext_proc protobuf messages, and the gRPC health service over a real grpc.aio
server and the standard health stub."""

from __future__ import annotations

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import epp
from extproc.supervisor import free_ports


def request_with(namespace: str, key: str, value: object) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
    s = struct_pb2.Struct()
    s.update({key: value})
    req.metadata_context.filter_metadata[namespace].CopyFrom(s)
    return req


POOL = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.2:8001", "[fd00::3]:8000"]


def test_no_hint_means_the_whole_pool():
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
    assert epp.subset_hint(req) is None
    assert epp.within(epp.subset_hint(req), POOL) == POOL
    other_key = request_with(epp.SUBSET_NAMESPACE, "something-else", ["10.0.0.1:8000"])
    assert epp.subset_hint(other_key) is None


def test_a_list_hint_restricts_the_candidates_in_pool_order():
    req = request_with(epp.SUBSET_NAMESPACE, epp.SUBSET_KEY, ["10.0.0.2:8001", "10.0.0.1:8000", "10.9.9.9:1"])
    assert epp.within(epp.subset_hint(req), POOL) == ["10.0.0.1:8000", "10.0.0.2:8001"]


def test_a_comma_string_hint_and_bare_hosts_allow_every_port_of_the_host():
    # what a gateway's header_to_metadata rule produces: one flat string
    req = request_with(epp.SUBSET_NAMESPACE, epp.SUBSET_KEY, " 10.0.0.2 , fd00::3,10.0.0.1:9999")
    assert epp.within(epp.subset_hint(req), POOL) == ["10.0.0.2:8000", "10.0.0.2:8001", "[fd00::3]:8000"]
    bracketed = request_with(epp.SUBSET_NAMESPACE, epp.SUBSET_KEY, ["[fd00::3]:8000"])
    assert epp.within(epp.subset_hint(bracketed), POOL) == ["[fd00::3]:8000"]


def test_an_empty_hint_is_present_and_allows_nothing():
    for value in ([], "", [""], 42):
        hint = epp.subset_hint(request_with(epp.SUBSET_NAMESPACE, epp.SUBSET_KEY, value))
        assert hint is not None and not hint
        assert epp.within(hint, POOL) == []


def test_the_answer_carries_the_same_ordered_list_in_header_and_metadata():
    resp = epp.pick_answer(["10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.3:8000"], max_endpoints=2,
                           extra_headers=[("x-sluice-pool", "pool-m")], remove_headers=["x-envoy-max-retries"])
    common = resp.request_body.response
    assert common.clear_route_cache
    headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert headers[epp.DESTINATION_KEY] == "10.0.0.2:8000,10.0.0.1:8000"
    assert headers["x-sluice-pool"] == "pool-m"
    assert list(common.header_mutation.remove_headers) == ["x-envoy-max-retries"]
    lb = resp.dynamic_metadata.fields[epp.LB_NAMESPACE].struct_value.fields
    assert lb[epp.DESTINATION_KEY].string_value == headers[epp.DESTINATION_KEY]
    # round-trips through the wire format unchanged
    again = pb.ProcessingResponse.FromString(resp.SerializeToString())
    assert again.dynamic_metadata == resp.dynamic_metadata


def test_a_single_endpoint_answer_to_the_headers_phase():
    resp = epp.pick_answer(["10.0.0.2:8000", "10.0.0.1:8000"], max_endpoints=1, phase="request_headers")
    assert resp.WhichOneof("response") == "request_headers"
    (h,) = resp.request_headers.response.header_mutation.set_headers
    assert h.header.raw_value == b"10.0.0.2:8000"
    with pytest.raises(ValueError):
        epp.pick_answer([], max_endpoints=1)
    with pytest.raises(ValueError):
        epp.pick_answer(["10.0.0.1:1"], phase="response_headers")


def test_no_endpoint_is_an_openai_shaped_503():
    resp = epp.no_endpoint_answer("m", subset_given=True)
    ir = resp.immediate_response
    assert ir.status.code == 503
    body = orjson.loads(ir.body)
    assert body["error"]["code"] == "pool_unavailable" and "subset" in body["error"]["message"]


def test_the_served_endpoint_is_read_from_metadata_then_from_the_upstream_attribute():
    req = request_with(epp.LB_NAMESPACE, epp.SERVED_KEY, "10.0.0.2:8000")
    assert epp.served_endpoint(req) == "10.0.0.2:8000"
    attr = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    attr.attributes[epp.EXT_PROC_FILTER].update({"upstream.address": "10.0.0.1:8000"})
    assert epp.served_endpoint(attr) == "10.0.0.1:8000"
    assert epp.served_endpoint(pb.ProcessingRequest(response_headers=pb.HttpHeaders())) is None


def test_is_ip_endpoint():
    assert epp.is_ip_endpoint("10.0.0.1:80") and epp.is_ip_endpoint("[fd00::1]:80")
    assert not epp.is_ip_endpoint("vllm:80") and not epp.is_ip_endpoint("fd00::1")


async def test_the_health_service_answers_the_protocols_names():
    server = grpc.aio.server()
    health = epp.EppHealth()
    health.add_to(server)
    port = free_ports(1)[0]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health.start(ready=False)
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> int:
                return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

            assert await status("liveness") == SERVING
            assert [await status(s) for s in epp.READY_SERVICES] == [NOT_SERVING] * len(epp.READY_SERVICES)
            await health.set_ready(True)
            assert [await status(s) for s in epp.READY_SERVICES] == [SERVING] * len(epp.READY_SERVICES)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await status("no-such-service")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            await health.shutdown()
            assert await status("readiness") == NOT_SERVING and await status("liveness") == NOT_SERVING
    finally:
        await server.stop(0)
