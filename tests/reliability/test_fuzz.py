"""Fuzzing the request path in-process (issue #10, part 1): the body parser, the token estimator, the
request-header reader (`read_head` on the headers Envoy sends, raw bytes), and the whole per-request state
machine on top of them.

The contract under test: no input crashes or hangs the sidecar; every rejection is `BadRequest` (or an
immediate response) with a 4xx status, a code and a message; nothing stays counted after `finish`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from extproc.config import policy_from_dict
from extproc.gateway import Gateway
from extproc.head import HEADER_READERS, Head, read_head
from extproc.request import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, ENDPOINTS, BadRequest, LLMRequest, parse_body
from extproc.stream import State, Stream
from extproc.tokens import HeuristicEstimator
from extproc.xds import POOL_HEADER

from ..transitions import only_legal_transitions

pytestmark = pytest.mark.reliability

FUZZ = settings(max_examples=300, deadline=1000, suppress_health_check=[HealthCheck.too_slow],
                derandomize=False, print_blob=True)
EST = HeuristicEstimator()

# ---- strategies ---------------------------------------------------------------------------------------------
# Text that includes what real clients and attackers send: control characters, NUL, emoji, CJK, RTL marks,
# and (for the estimator, which must also take what `surrogatepass` lets through) lone surrogates.
any_text = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=200)
utf8_text = st.text(st.characters(codec="utf-8"), max_size=200)
text_with_surrogates = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, categories=None,
                                             exclude_categories=()), max_size=200)
numbers = st.one_of(st.integers(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False))
scalars = st.one_of(st.none(), st.booleans(), numbers, any_text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(any_text, inner, max_size=4)), max_leaves=20)


def _message() -> st.SearchStrategy:
    content = st.one_of(any_text, json_values,
                        st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": any_text}),
                                           json_values), max_size=3))
    return st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                            "content": content}),
                     json_values)


def dumps(value: object, ascii_only: bool = True) -> bytes:
    """JSON like clients send it (stdlib: big integers allowed; raw UTF-8 or \\u escapes, lone surrogates kept)."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


KNOWN_KEYS = ("model", "messages", "prompt", "stream", "max_tokens", "max_completion_tokens", "n", "stream_options")
field_values = {
    "model": st.one_of(st.just("m"), json_values),
    "messages": st.one_of(st.lists(_message(), max_size=4), json_values),
    "prompt": st.one_of(any_text, st.lists(any_text, max_size=3), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "max_tokens": st.one_of(st.integers(min_value=-5, max_value=2 ** 64), json_values),
    "max_completion_tokens": st.one_of(st.integers(min_value=-5, max_value=2 ** 40), json_values),
    "n": st.one_of(st.integers(min_value=-2, max_value=2 ** 40), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_values}), json_values),
}
# Mostly-plausible bodies: a subset of the known fields, each valid or any JSON value, plus unknown keys.
plausible_bodies = st.builds(
    lambda known, extra, ascii_only: dumps({**extra, **known}, ascii_only),
    st.fixed_dictionaries({}, optional={k: field_values[k] for k in KNOWN_KEYS}),
    st.dictionaries(any_text, json_values, max_size=2), st.booleans())
raw_bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(dumps),
    plausible_bodies,
    # valid JSON, then damaged: truncated, a byte flipped, non-UTF-8 spliced in
    st.tuples(plausible_bodies, st.integers(min_value=0, max_value=400), st.binary(min_size=1, max_size=4)).map(
        lambda t: t[0][:t[1]] + t[2] + t[0][t[1]:]),
)
endpoints = st.sampled_from([ENDPOINT_CHAT, ENDPOINT_COMPLETIONS])


def _check_rejection(exc: BadRequest) -> None:
    assert 400 <= exc.status < 500, exc.status
    assert isinstance(exc.code, str) and exc.code, exc.code
    assert isinstance(exc.message, str) and exc.message
    assert isinstance(exc.err_type, str) and exc.err_type


def _check_request(req: LLMRequest) -> None:
    assert isinstance(req.model, str) and req.model
    assert isinstance(req.stream, bool)
    assert isinstance(req.prompt_tokens, int) and req.prompt_tokens >= 0
    assert isinstance(req.max_output_tokens, int) and req.max_output_tokens >= 1
    assert isinstance(req.n, int) and req.n >= 1
    assert isinstance(req.total_tokens, int) and req.total_tokens > req.prompt_tokens
    assert len(req.body_fingerprint) == 16


# ---- parse_body ---------------------------------------------------------------------------------------------
DEEP = b"[" * 200_000 + b"]" * 200_000


@FUZZ
@given(endpoint=endpoints, raw=raw_bodies)
@example(endpoint=ENDPOINT_CHAT, raw=b"")
@example(endpoint=ENDPOINT_CHAT, raw=DEEP)
@example(endpoint=ENDPOINT_CHAT, raw=b'{"model":"m","messages":' + b"[" * 5000 + b"]" * 5000 + b"}")
@example(endpoint=ENDPOINT_CHAT, raw=b'{"model":"m","max_tokens":1e400,"messages":[{"role":"user","content":"x"}]}')
@example(endpoint=ENDPOINT_CHAT, raw=b'{"model":"m","max_tokens":' + b"9" * 400 + b',"messages":[{"content":"x"}]}')
@example(endpoint=ENDPOINT_CHAT, raw=b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}')
@example(endpoint=ENDPOINT_CHAT, raw=b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}')
@example(endpoint=ENDPOINT_COMPLETIONS, raw=b'{"model":"m","prompt":[]}')
@example(endpoint=ENDPOINT_CHAT, raw=b'{"model":"m","messages":[{"role":"system","content":5}]}')
def test_parse_body_never_crashes(endpoint: str, raw: bytes) -> None:
    try:
        req = parse_body(endpoint, raw, EST, 256)
    except BadRequest as exc:
        _check_rejection(exc)
    else:
        _check_request(req)


def test_parse_body_worst_cases_are_fast() -> None:
    """Inputs built to be expensive (deep nesting, huge arrays, multi-MB text) stay cheap: the parser is on
    the request path of every other client."""
    cases = [
        DEEP,
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 200_000}),
        orjson.dumps({"model": "m",
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 200_000}]}),
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "\u4e2d" * 1_000_000}]}),
        orjson.dumps({"model": "m", "prompt": ["a"] * 300_000}),
        b'{"model":"m","messages":[{"role":"user","content":"' + b"\\u00e9" * 500_000 + b'"}]}',
    ]
    for raw in cases:
        t0 = time.perf_counter()
        for endpoint in (ENDPOINT_CHAT, ENDPOINT_COMPLETIONS):
            try:
                _check_request(parse_body(endpoint, raw, EST, 256))
            except BadRequest as exc:
                _check_rejection(exc)
        assert time.perf_counter() - t0 < 2.0, f"{len(raw)} bytes took {time.perf_counter() - t0:.2f}s"


# ---- token estimator ----------------------------------------------------------------------------------------
@FUZZ
@given(text=text_with_surrogates, bytes_per_token=st.floats(min_value=0.5, max_value=16))
@example(text="\ud800", bytes_per_token=4.0)
@example(text="\x00" * 50, bytes_per_token=4.0)
def test_estimator_is_total_and_sane(text: str, bytes_per_token: float) -> None:
    est = HeuristicEstimator(bytes_per_token)
    n = est.count(text)
    assert isinstance(n, int)
    assert (n == 0) == (text == "")
    # never more tokens than UTF-8 bytes scaled by the heuristic's own factors (1.33 for non-ASCII), plus rounding
    assert n <= len(text.encode("utf-8", "surrogatepass")) * 1.33 / bytes_per_token + 1
    assert est.count(text * 3) >= n  # longer text never estimates fewer tokens


# ---- request headers (what Envoy sends in the request-headers message: raw bytes) ---------------------------
_LIMITS = {"tenant": 64, "app": 64, "task_id": 128, "priority": 16, "idempotency_key": 128}
_colliding = st.sampled_from([b"t1", b"t2", b"batch", b"sheddable", b"k1", b"1", b"2"])  # limits and budgets engage
header_values = st.one_of(
    st.binary(max_size=200),                      # any bytes: not UTF-8, NUL, CR/LF as Envoy would never pass
    utf8_text.map(lambda t: t.encode()),
    _colliding, _colliding, _colliding,
    st.sampled_from([b"0", b"-1", b"1e3", b"nan", b"NaN", b"inf", b"-inf", b"Infinity", b"1e309", b"1e307",
                     b"1e-300", b"0x10", b" 5 ", b"5.5", b"9" * 400, b"Bearer ", b"bearer sk-1", b"BEARER", b"",
                     b"\x00", b"Bearer \xff\xfe"]),
    st.integers(min_value=-(10 ** 30), max_value=10 ** 30).map(lambda i: str(i).encode()),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).encode()),
)
paths = st.one_of(st.sampled_from([b"/v1/chat/completions", b"/v1/completions", b"/v1/chat/completions?a=b",
                                   b"/v1/embeddings", b"/", b"", b"?", b"/v1/chat/completions?"]),
                  st.binary(max_size=50))
header_names = st.one_of(st.sampled_from([*HEADER_READERS, "x-request-id", ":method", ":authority",
                                          "content-type", "x-other"]),
                         st.text("abcdefghijklmnopqrstuvwxyz-:", min_size=1, max_size=20))


@st.composite
def request_headers(draw: st.DrawFn) -> list[base_pb2.HeaderValue]:
    """A header list as Envoy sends it: pseudo-headers, repeated names possible, values as raw bytes."""
    out = [base_pb2.HeaderValue(key=":path", raw_value=draw(paths))] if draw(st.integers(0, 9)) else []
    for name, value in draw(st.lists(st.tuples(header_names, header_values), max_size=12)):
        out.append(base_pb2.HeaderValue(key=name, raw_value=value))
    return out


def headers_msg(headers: list[base_pb2.HeaderValue], end_of_stream: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers), end_of_stream=end_of_stream)


@FUZZ
@given(headers=request_headers())
@example(headers=[base_pb2.HeaderValue(key="x-sluice-deadline-ms", raw_value=b"1e-321")])  # underflows to 0 s
def test_read_head_never_crashes_and_bounds_every_field(headers: list) -> None:
    head = read_head(headers)
    assert isinstance(head, Head)
    for name, limit in _LIMITS.items():
        value = getattr(head, name)
        assert value is None or (isinstance(value, str) and len(value) <= limit), (name, value)
    assert "?" not in head.path
    assert isinstance(head.retry_count, int) and isinstance(head.task_depth, int)
    t = head.client_timeout_s
    assert t is None or (t > 0 and math.isfinite(t) and math.isfinite(t * 1000)), t


def test_read_head_reads_every_header_it_knows() -> None:
    values = {"x-stainless-retry-count": b"2", "x-stainless-read-timeout": b"30", "x-sluice-deadline-ms": b"1500",
              "x-sluice-tenant": b"acme", "x-sluice-app": b"bot", "x-sluice-task-id": b"t-1",
              "x-sluice-task-depth": b"3", "x-sluice-priority": b"batch", "idempotency-key": b"k-1",
              "authorization": b"Bearer sk-1"}
    assert set(values) == set(HEADER_READERS)  # a new reader needs a line here
    headers = [base_pb2.HeaderValue(key=k, raw_value=v) for k, v in values.items()]
    headers += [base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions?x=1"),
                base_pb2.HeaderValue(key="x-request-id", raw_value=b"rid")]
    head = read_head(headers)
    assert (head.path, head.request_id, head.retry_count, head.task_depth) == ("/v1/chat/completions", "rid", 2, 3)
    assert (head.tenant, head.app, head.task_id, head.priority) == ("acme", "bot", "t-1", "batch")
    assert (head.idempotency_key, head.api_key, head.client_timeout_s) == ("k-1", "sk-1", 1.5)


@pytest.mark.parametrize("order", [("x-stainless-read-timeout", "x-sluice-deadline-ms"),
                                   ("x-sluice-deadline-ms", "x-stainless-read-timeout")])
def test_the_clients_own_deadline_wins_over_the_sdks_read_timeout_in_either_order(order: tuple[str, str]) -> None:
    # the openai SDK always sends its read timeout (600 s by default); a client that needs a longer stream, or a
    # shorter deadline, says so with x-sluice-deadline-ms, wherever its header lands among the SDK's
    values = {"x-stainless-read-timeout": b"600", "x-sluice-deadline-ms": b"3600000"}
    head = read_head([base_pb2.HeaderValue(key=k, raw_value=values[k]) for k in order])
    assert head.client_timeout_s == 3600.0


# ---- the whole state machine: headers -> body -> (queue) -> finish -----------------------------------------
POLICY = {"pools": [{"model": "m", "replicas": ["10.0.0.1:8000", "10.0.0.2:8000"]}],
          "admission": {"kv_capacity_tokens": 60000, "max_concurrency_per_replica": 2},
          "sidecar": {"max_queue_wait_ms": 200, "message_timeout_ms": 100},
          "limits": {"max_body_bytes": 4096},
          "budgets": {"tasks": {"max_calls": 3}},
          "tenants": {"max_streams_per_tenant": 8, "label_tenants": 5}}
valid_bodies = st.builds(lambda c, mt, s: dumps({"model": "m", "max_tokens": mt, "stream": s, "prompt": c,
                                                  "messages": [{"role": "user", "content": c}]}),
                         any_text, st.one_of(st.integers(1, 300), st.integers(1, 300), st.integers(1, 70000)),
                         st.booleans())
bodies_for_gateway = st.one_of(raw_bodies, valid_bodies, valid_bodies, valid_bodies)


def _event(text: str) -> None:
    """hypothesis.event, also callable from plain tests (then a no-op)."""
    from hypothesis.control import currently_in_test_context

    if currently_in_test_context():
        event(text)


def _assert_answer(resp: pb.ProcessingResponse) -> None:
    kind = resp.WhichOneof("response")
    if kind == "immediate_response":
        ir = resp.immediate_response
        _event(f"answer: {ir.status.code} {ir.details}")
        assert 400 <= ir.status.code < 600, ir
        assert ir.status.code in (429, 503) or ir.status.code < 500, ir
        err = orjson.loads(ir.body)["error"]
        assert err["code"] and err["message"] and err["type"], err
        assert ir.details.startswith("sluice_")
    else:
        assert kind == "request_body", resp
        _event("answer: forwarded")
        headers = {h.header.key for h in resp.request_body.response.header_mutation.set_headers}
        assert POOL_HEADER in headers


async def _one_request(gw: Gateway, headers: list, body: bytes, held: list[Stream], streams: list[Stream]) -> None:
    st_ = gw.open_stream()
    streams.append(st_)
    try:
        first = gw.on_request_headers(st_, headers_msg(headers, end_of_stream=not body))
        if first.WhichOneof("response") == "immediate_response":
            _assert_answer(first)
            return
        if st_.ended:  # passed to Envoy's own route (no body, not an inference path): the servicer returns too
            assert first.WhichOneof("response") == "request_headers", first
            return
        answer = await gw.on_request_body(st_, pb.HttpBody(body=body, end_of_stream=True))
        if st_.held:
            answer = await gw.wait(st_)
        _assert_answer(answer)
        if answer.WhichOneof("response") == "request_body":
            held.append(st_)  # stays "in flight" until the end of the example
            return
    finally:
        if st_ not in held:
            gw.finish(st_)


def _assert_released(gw: Gateway, streams: list[Stream] = ()) -> None:
    assert all(s.holds == 0 for s in streams), [s.holds for s in streams]
    for pool in gw.pools.values():
        for r in pool.replicas:
            assert (r.inflight_requests, r.inflight_tokens, r.inflight_prompt_tokens) == (0, 0, 0), r
        sched = gw.schedulers[pool.model]
        assert sched.queued_total() == 0
        assert sum(sched.lane_requests) == 0 and sum(sched.lane_tokens) == 0
    assert gw.identity.open_streams == {}
    assert gw.open_requests == 0 and not gw.inflight.live and not gw.inflight.detached


@FUZZ
@given(requests=st.lists(st.tuples(request_headers(), bodies_for_gateway), min_size=1, max_size=10))
def test_gateway_state_machine_survives_any_request(requests: list) -> None:
    """Several fuzzed requests in flight together (so limits, queueing and budgets engage), then all end:
    every answer is a forward or a 4xx/429/503 JSON error, and nothing stays counted."""

    async def run() -> None:
        gw = Gateway(policy_from_dict(POLICY))
        held: list[Stream] = []
        streams: list[Stream] = []
        # Fuzzed paths are mostly junk: send most requests to a real endpoint so bodies get parsed.
        for i, (headers, body) in enumerate(requests):
            if i % 4 != 3:
                headers.append(base_pb2.HeaderValue(key=":path", raw_value=list(ENDPOINTS)[i % 2].encode()))
        await asyncio.wait_for(asyncio.gather(*(_one_request(gw, h, b, held, streams) for h, b in requests)), 5)
        for st_ in held:
            gw.on_response_headers(st_, pb.HttpHeaders())
            gw.finish(st_)
        _assert_released(gw, streams)

    with only_legal_transitions():
        asyncio.run(run())


async def _held_request(gw: Gateway, headers: list, body: bytes, hold_s: float, leave_after_s: float | None,
                        answers: list[str], streams: list[Stream]) -> None:
    """One client: forwarded requests run `hold_s`; a client with `leave_after_s` disconnects then (Envoy then
    cancels the ext_proc stream, which is what `task.cancel()` does here)."""
    st_ = gw.open_stream()
    streams.append(st_)

    async def flow() -> None:
        gw.on_request_headers(st_, headers_msg(headers))
        answer = await gw.on_request_body(st_, pb.HttpBody(body=body, end_of_stream=True))
        if st_.held:
            answers.append("queued")
            answer = await gw.wait(st_)
        _assert_answer(answer)
        if answer.WhichOneof("response") == "request_body":
            await asyncio.sleep(hold_s)  # the request runs on its replica for hold_s, holding its slot
            gw.on_response_headers(st_, pb.HttpHeaders(end_of_stream=True))
            answers.append("completed")
        else:
            answers.append(answer.immediate_response.details)

    task = asyncio.ensure_future(flow())
    try:
        if leave_after_s is None:
            await task
        else:
            done, _ = await asyncio.wait((task,), timeout=leave_after_s)
            if not done:
                task.cancel()
                answers.append("client_left")
            await asyncio.gather(task, return_exceptions=True)
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        gw.finish(st_)


@settings(FUZZ, max_examples=60)
@given(requests=st.lists(st.tuples(request_headers(), valid_bodies, st.floats(0, 0.05),
                                   st.one_of(st.none(), st.floats(0, 0.1))), min_size=8, max_size=24))
def test_gateway_accounting_under_contention(requests: list) -> None:
    """Many fuzzed requests at once against 2 replicas x 2 slots: they queue, are dispatched as others finish,
    time out in the queue, hit tenant and task limits, or their clients leave at any moment. Afterwards every
    slot, queue entry, tenant stream and lane counter is released."""

    async def run() -> None:
        gw = Gateway(policy_from_dict(POLICY))
        answers: list[str] = []
        streams: list[Stream] = []
        for i, (headers, *_rest) in enumerate(requests):
            headers.append(base_pb2.HeaderValue(key=":path", raw_value=list(ENDPOINTS)[i % 2].encode()))
        await asyncio.wait_for(asyncio.gather(*(_held_request(gw, a, b, hold, leave, answers, streams)
                                                for a, b, hold, leave in requests)), 10)
        for outcome in set(answers):
            event(f"outcome: {outcome}")
        _assert_released(gw, streams)

    with only_legal_transitions() as seen:
        asyncio.run(run())
    for (a, b) in seen:
        event(f"transition: {a.label} -> {b.label}")


@pytest.mark.parametrize("header, value", [("x-sluice-deadline-ms", b"inf"), ("x-sluice-deadline-ms", b"1e309"),
                                           ("x-stainless-read-timeout", b"Infinity"),
                                           ("x-stainless-read-timeout", b"1e307")])
def test_infinite_client_deadline_is_not_a_crash(header: str, value: bytes) -> None:
    """Regression (bug 1 in docs/reliability.md): an infinite or huge deadline used to raise OverflowError in
    Gateway._forward (int(remaining * 1000)); the client got a bare 503."""
    async def run() -> None:
        gw = Gateway(policy_from_dict(POLICY))
        st_ = Stream()
        gw.on_request_headers(st_, headers_msg([base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                                                base_pb2.HeaderValue(key=header, raw_value=value)]))
        body = orjson.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        try:
            answer = await gw.on_request_body(st_, pb.HttpBody(body=body, end_of_stream=True))
            _assert_answer(answer)
            assert answer.HasField("request_body"), answer  # forwarded: the deadline is simply no limit
        finally:
            gw.finish(st_)
        _assert_released(gw)

    asyncio.run(run())


def _gauge(name: str, pool: str, replica: str) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples
               if s.name == name and s.labels.get("pool") == pool and s.labels.get("replica") == replica)


def test_client_leaving_as_it_is_dispatched_keeps_gauges_exact() -> None:
    """Regression (bug 8): a queued request dispatched just as its client left was released by finish() and
    decremented the sluice_inflight_* gauges that only _forward increments: the gauges drifted below zero."""
    async def run() -> None:
        gw = Gateway(policy_from_dict({"pools": [{"model": "race-m", "replicas": ["10.8.0.1:8000"]}],
                                       "admission": {"kv_capacity_tokens": 60000, "max_concurrency_per_replica": 1}}))
        path = [base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")]
        body = orjson.dumps({"model": "race-m", "max_tokens": 5, "stream": True,
                             "messages": [{"role": "user", "content": "x"}]})
        first, second = Stream(), Stream()
        for st_ in (first, second):
            gw.on_request_headers(st_, headers_msg(path))
        assert (await gw.on_request_body(first, pb.HttpBody(body=body, end_of_stream=True))).HasField("request_body")
        hold = await gw.on_request_body(second, pb.HttpBody(body=body, end_of_stream=True))
        assert second.held and hold.HasField("override_message_timeout")
        waiter = second.waiter
        held = asyncio.ensure_future(gw.wait(second))
        await asyncio.sleep(0)  # one loop step: the held request now awaits its dispatch
        gw.finish(first)               # frees the slot: the queued request is dispatched (its future resolves) ...
        assert waiter.future.done()
        held.cancel()                  # ... and in the same instant its client leaves
        await asyncio.gather(held, return_exceptions=True)
        gw.finish(second)
        _assert_released(gw, [first, second])
        assert _gauge("sluice_inflight_requests", "race-m", "10.8.0.1:8000") == 0
        assert _gauge("sluice_inflight_tokens", "race-m", "10.8.0.1:8000") == 0

    with only_legal_transitions() as seen:
        asyncio.run(run())
    assert (State.HEADERS, State.QUEUED) in seen
