"""A queued request whose wait budget ends is served late through the gateway's hold, not refused after a futile
wait (P1's slow refusals)."""

import asyncio

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.config import policy_from_dict
from extproc.gateway import Gateway
from extproc.stream import Stream

PATH = [base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")]
BODY = orjson.dumps({"model": "late-m", "max_tokens": 5, "stream": True,
                     "messages": [{"role": "user", "content": "x"}]})


def gateway(late_wait_of_target: float) -> Gateway:
    return Gateway(policy_from_dict({
        "pools": [{"model": "late-m", "replicas": ["10.9.0.1:8000"]}],
        "admission": {"kv_capacity_tokens": 60000, "max_concurrency_per_replica": 1, "ttft_target_s": 0.3,
                      "late_wait_of_target": late_wait_of_target}}))


async def _held_answer(late_wait_of_target: float, free_after_s: float) -> pb.ProcessingResponse:
    """One request takes the only slot, a second is held; the slot frees after `free_after_s`: the second's
    answer."""
    gw = gateway(late_wait_of_target)
    first, second = Stream(), Stream()
    for st in (first, second):
        gw.on_request_headers(st, pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=PATH)))
    assert (await gw.on_request_body(first, pb.HttpBody(body=BODY, end_of_stream=True))).HasField("request_body")
    hold = await gw.on_request_body(second, pb.HttpBody(body=BODY, end_of_stream=True))
    assert second.held and hold.HasField("override_message_timeout")
    # Envoy is asked to hold it past the late limit: its 0.3 s target's wait, then 2 x 0.3 s more, + 1 s
    assert hold.override_message_timeout.ToTimedelta().total_seconds() > 1.0 + 0.3 * late_wait_of_target
    held = asyncio.ensure_future(gw.wait(second))
    await asyncio.sleep(free_after_s)
    gw.finish(first)
    answer = await held
    gw.finish(second)
    return answer


async def test_a_request_past_its_wait_budget_is_served_late():
    answer = await _held_answer(2.0, free_after_s=0.5)  # its wait budget is at most 0.3 - 0.1 s: it is late
    assert answer.HasField("request_body")  # forwarded to the replica


async def test_off_it_is_refused_at_the_end_of_its_wait_budget():
    answer = await _held_answer(0.0, free_after_s=0.5)
    assert answer.immediate_response.status.code == 429
    assert orjson.loads(answer.immediate_response.body)["error"]["code"] == "queue_timeout"


def test_the_wait_and_the_late_wait_end_within_the_longest_hold():
    """Envoy holds a request for the sidecar at most sidecar.max_queue_wait_ms: the late wait ends within it."""
    policy = policy_from_dict({"pools": [{"model": "late-m", "replicas": ["10.9.0.1:8000"]}],
                               "sidecar": {"max_queue_wait_ms": 30_000}, "admission": {"ttft_target_s": 20.0}})
    assert policy.admission.late_wait_of_target == 0.5  # 20 s of wait, 10 s late
