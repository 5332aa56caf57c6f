"""sluice in EPP mode, message by message with real ext_proc protobufs (the servicer's hooks and the gateway, no
Envoy): the answer's shape, the subset hint, one pool whatever the model, the protocol's 503 and 429, the served
endpoint taking over the request's accounting, health fed from the stream's status, and the failure mode when the
decision itself breaks."""

from __future__ import annotations

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc import epp
from extproc.config import policy_from_dict
from extproc.epp_gateway import EppGateway, EppServicer
from extproc.stream import State, Stream
from tests.transitions import only_legal_transitions

A, B, C = "10.8.0.1:8000", "10.8.0.2:8000", "10.8.0.3:8000"


def _gateway(sidecar: dict | None = None, **epp_cfg: object) -> tuple[EppGateway, EppServicer]:
    gw = EppGateway(policy_from_dict({"pools": [{"model": "Qwen/Qwen3-8B", "replicas": [A, B, C]}],
                                      "admission": {"kv_capacity_tokens": 60000}, "sidecar": sidecar or {},
                                      "epp": {"enabled": True, **epp_cfg}}))
    return gw, EppServicer(gw)


def _headers_msg(subset: object = None, **headers: str) -> pb.ProcessingRequest:
    hs = [base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")]
    hs += [base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode()) for k, v in headers.items()]
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)))
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({epp.SUBSET_KEY: subset})
        msg.metadata_context.filter_metadata[epp.SUBSET_NAMESPACE].CopyFrom(s)
    return msg


def _body(model: str = "some-adapter") -> pb.HttpBody:
    return pb.HttpBody(body=orjson.dumps({"model": model, "max_tokens": 8, "stream": True,
                                          "messages": [{"role": "user", "content": "hi"}]}), end_of_stream=True)


async def _ask(gw: EppGateway, servicer: EppServicer, subset: object = None,
               **headers: str) -> tuple[Stream, pb.ProcessingResponse]:
    st = gw.open_stream()
    servicer.request_headers(st, _headers_msg(subset, **headers))
    answer = await gw.on_request_body(st, _body())
    if st.held:
        answer = await gw.wait(st)
    return st, answer


def _picked(answer: pb.ProcessingResponse) -> str:
    common = answer.request_body.response
    header = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    meta = answer.dynamic_metadata.fields[epp.LB_NAMESPACE].struct_value.fields[epp.DESTINATION_KEY].string_value
    assert header[epp.DESTINATION_KEY] == meta and common.clear_route_cache  # the same value twice
    assert "x-sluice-pool" not in header  # the gateway's route chose the pool
    return meta


def _status(answer: pb.ProcessingResponse) -> tuple[int, str]:
    ir = answer.immediate_response
    return ir.status.code, orjson.loads(ir.body)["error"]["code"]


def _served(st: Stream, servicer: EppServicer, address: str | None, status: int = 200) -> None:
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())])))
    if address is not None:
        s = struct_pb2.Struct()
        s.update({epp.SERVED_KEY: address})
        msg.metadata_context.filter_metadata[epp.LB_NAMESPACE].CopyFrom(s)
    servicer.response_headers(st, msg)


async def test_one_endpoint_in_header_and_metadata_whatever_model_the_body_names():
    gw, servicer = _gateway()
    with only_legal_transitions():
        st, answer = await _ask(gw, servicer, x_sluice_deadline_ms="60000")
        assert _picked(answer) in (A, B, C) and "," not in _picked(answer)
        mutation = answer.request_body.response.header_mutation
        assert any(h.header.key == "x-envoy-upstream-rq-timeout-ms" for h in mutation.set_headers)
        assert epp.DESTINATION_KEY not in mutation.remove_headers  # set by the answer, not removed after it
        assert "x-envoy-max-retries" in mutation.remove_headers
        assert st.state is State.FORWARDED  # no access log: the stream stays open until the request ends
        gw.close(st)
    assert gw.open_requests == 0 and gw.pools["Qwen/Qwen3-8B"].inflight_requests == 0


async def test_max_endpoints_gives_an_ordered_fallback_list():
    gw, servicer = _gateway(max_endpoints=2)
    st, answer = await _ask(gw, servicer)
    pins = _picked(answer).split(",")
    assert len(pins) == 2 and len(set(pins)) == 2 and pins[0] == st.placement.replica.address
    gw.close(st)


@pytest.mark.parametrize("subset, allowed", [([B], {B}), (f"{C},{B}", {B, C}), ("10.8.0.3", {C})])
async def test_the_subset_hint_restricts_the_pick(subset, allowed):
    gw, servicer = _gateway()
    streams = []
    for _ in range(6):
        st, answer = await _ask(gw, servicer, subset)
        assert _picked(answer) in allowed
        streams.append(st)
    assert {r.address for r in gw.pools["Qwen/Qwen3-8B"].replicas if r.inflight_requests} <= allowed
    for st in streams:
        gw.close(st)


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:1"], [""]])
async def test_a_subset_with_no_eligible_endpoint_is_a_503(subset):
    gw, servicer = _gateway()
    with only_legal_transitions():
        st, answer = await _ask(gw, servicer, subset)
    assert _status(answer) == (503, "pool_unavailable") and st.state is State.REJECTED
    gw.close(st)
    assert gw.open_requests == 0


async def test_no_ready_endpoint_is_a_503_and_a_shed_request_a_429():
    gw, servicer = _gateway(sidecar={"max_open_requests": 1})
    first, answer = await _ask(gw, servicer)
    assert _picked(answer)
    st, answer = await _ask(gw, servicer)  # over the sidecar's open-request limit: shed
    assert _status(answer) == (429, "gateway_at_capacity")
    gw.close(st)
    gw.close(first)
    for r in gw.pools["Qwen/Qwen3-8B"].replicas:
        r.draining = True
    st, answer = await _ask(gw, servicer)
    assert _status(answer) == (503, "pool_unavailable")


def _inflight_gauge(replica) -> float:
    """sluice_inflight_requests of a replica as Prometheus reads it (0 before its first placement)."""
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value("sluice_inflight_requests", {"pool": replica.pool, "replica": replica.address})
    return value or 0.0


async def test_the_served_endpoint_takes_over_the_requests_accounting():
    gw, servicer = _gateway(max_endpoints=2)
    pool = gw.pools["Qwen/Qwen3-8B"]
    st, answer = await _ask(gw, servicer)
    first, second = _picked(answer).split(",")
    placed, fallback = pool.by_address(first), pool.by_address(second)
    tokens = st.req.total_tokens
    assert (placed.inflight_requests, fallback.inflight_requests) == (1, 0)
    gauge_placed, gauge_fallback = _inflight_gauge(placed), _inflight_gauge(fallback)
    _served(st, servicer, second)  # the gateway fell back down the list
    assert (placed.inflight_requests, placed.inflight_tokens) == (0, 0)
    assert (fallback.inflight_requests, fallback.inflight_tokens) == (1, tokens)
    assert sum(fallback.lane_inflight) == 1 and sum(placed.lane_inflight) == 0
    assert _inflight_gauge(fallback) == gauge_fallback + 1
    assert _inflight_gauge(placed) == gauge_placed - 1
    _served(st, servicer, "10.99.0.1:1")  # not a replica sluice knows: nothing to move
    assert st.placement.replica is fallback
    gw.close(st)
    assert fallback.inflight_requests == 0 and _inflight_gauge(fallback) == gauge_fallback
    assert gw.schedulers["Qwen/Qwen3-8B"].lane_requests == [0] * len(gw.policy.admission.lanes)


async def test_the_response_status_feeds_the_replicas_error_rate():
    gw, servicer = _gateway()
    health = gw.fleet.health["Qwen/Qwen3-8B"]
    for status in (200, 503, 503):
        st, answer = await _ask(gw, servicer)
        address = _picked(answer)
        _served(st, servicer, address, status)
        if status == 200:
            gw.on_response_trailers(st)  # the response's end was seen
        gw.close(st)
    totals = [health.error_counts(r) for r in gw.pools["Qwen/Qwen3-8B"].replicas]
    assert sum(t[0] for t in totals) == 3 and sum(t[1] for t in totals) == 2


@pytest.mark.parametrize("mode", ["FailOpen", "FailClose"])
async def test_a_broken_decision_fails_open_or_closed_as_configured(mode, monkeypatch):
    gw, servicer = _gateway(failure_mode=mode)
    sched = gw.schedulers["Qwen/Qwen3-8B"]

    def broken(*args: object) -> None:
        raise RuntimeError("a bug in placement")

    monkeypatch.setattr(sched, "submit", broken)
    with only_legal_transitions():
        st, answer = await _ask(gw, servicer, [B, C])
    if mode == "FailOpen":
        assert _picked(answer) in (B, C) and st.state is State.FORWARDED
    else:
        assert _status(answer) == (503, "picker_error") and st.state is State.REJECTED
    gw.close(st)
    assert gw.open_requests == 0 and st.holds == 0  # whatever was taken before the failure is released


def test_epp_mode_serves_exactly_one_pool():
    from extproc.config import PolicyError

    with pytest.raises(PolicyError, match="exactly one pool"):
        policy_from_dict({"pools": [{"model": "a", "replicas": [A]}, {"model": "b", "replicas": [B]}],
                          "epp": {"enabled": True}})
