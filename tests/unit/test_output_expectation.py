"""A request without max_tokens reserves its app's learned p90 output, once observed responses taught it (P2, P9)."""

from __future__ import annotations

import asyncio

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.admission.output_length import MIN_SAMPLES
from extproc.config import policy_from_dict
from extproc.gateway import Gateway
from extproc.stream import Stream

REPLICA = "10.9.0.2:8000"


def _gateway() -> Gateway:
    return Gateway(policy_from_dict({"pools": [{"model": "out-m", "replicas": [REPLICA]}],
                                     "admission": {"kv_capacity_tokens": 600_000},
                                     "limits": {"default_output_tokens": 256},
                                     "streaming": {"sample_rate": 1.0}}))


def _headers(*pairs: tuple[str, str]) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))


async def _request(gw: Gateway, app: str, n: int, max_tokens: int | None) -> Stream:
    st = Stream()
    gw.on_request_headers(st, _headers((":path", "/v1/chat/completions"), ("x-request-id", f"{app}-{n}"),
                                       ("x-sluice-app", app)))
    body: dict = {"model": "out-m", "messages": [{"role": "user", "content": f"question {n}"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    answer = await gw.on_request_body(st, pb.HttpBody(body=orjson.dumps(body), end_of_stream=True))
    assert answer.HasField("request_body"), answer
    return st


def _respond(gw: Gateway, st: Stream, completion_tokens: int) -> None:
    gw.on_response_headers(st, _headers((":status", "200"), ("content-type", "application/json")))
    body = orjson.dumps({"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": completion_tokens}})
    gw.on_response_body(st, pb.HttpBody(body=body, end_of_stream=True))
    gw.finish(st)


def test_unlimited_requests_learn_and_use_the_apps_p90() -> None:
    async def run() -> None:
        gw = _gateway()
        first = await _request(gw, "essays", 0, None)
        assert first.req is not None and first.req.max_output_tokens == 256  # nothing known: the default
        _respond(gw, first, 1_500)
        for n in range(1, MIN_SAMPLES + 10):
            st = await _request(gw, "essays", n, None)
            _respond(gw, st, 1_000 + 20 * n)
        learned = await _request(gw, "essays", 99, None)
        assert learned.req is not None and 1_400 <= learned.req.max_output_tokens <= 1_600
        # A limited request keeps the client's limit and teaches nothing (its completion may be cut by it).
        for n in range(MIN_SAMPLES + 5):
            st = await _request(gw, "short", n, 8)
            assert st.req is not None and st.req.max_output_tokens == 8
            _respond(gw, st, 8)
        other = await _request(gw, "short", 99, None)
        assert other.req is not None and other.req.max_output_tokens == 256

    asyncio.run(run())
