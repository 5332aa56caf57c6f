"""Bad input through the real stack (issue #10, part 1): every malformed request gets a 4xx OpenAI-style JSON
error, promptly, never a 5xx or a hang, and the sidecar stays healthy afterwards."""

from __future__ import annotations

import json
import time
from typing import Iterator

import httpx
import pytest

from extproc.supervisor import Stack

from .conftest import (MODEL, assert_openai_error, assert_settled, chat, metric_sum, raw_http, running_stack,
                       sim_metric,
                       scrape)

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

LIMIT = 1048576  # limits.max_body_bytes of the integration BASE_POLICY
CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("badinput")) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=10) as c:
        yield c


def _b(obj: object) -> bytes:
    return json.dumps(obj).encode()


def _chunks(total: int, size: int = 65536) -> Iterator[bytes]:
    head = b'{"model":"sim-model","messages":[{"role":"user","content":"'
    yield head
    sent = len(head)
    while sent < total:
        yield b"x" * size
        sent += size
    yield b'"}]}'


MSG = [{"role": "user", "content": "x"}]
# name -> (path, body bytes or a callable making the request, extra headers, allowed statuses, expected code)
CASES: dict[str, tuple] = {
    "oversized": (CHAT, _b({"model": MODEL, "messages": [{"role": "user", "content": "x" * (LIMIT + 10_000)}]}),
                  {}, 413, "request_too_large"),
    "oversized_chunked": (CHAT, "chunked", {}, 413, "request_too_large"),
    "deep_nesting": (CHAT, b"[" * 200_000 + b"]" * 200_000, {}, 400, "invalid_json"),
    "deep_nesting_in_messages": (CHAT, b'{"model":"sim-model","messages":' + b"[" * 900 + b"]" * 900 + b"}", {}, 400,
                                 "invalid_message"),
    "deep_object_nesting": (CHAT, b'{"model":"sim-model","messages":[{"role":"user","content":"x","a":'
                            + b'{"a":' * 2000 + b"1" + b"}" * 2000 + b"}]}", {}, 400, "invalid_json"),
    "non_utf8_body": (CHAT, b'{"model":"sim-model","messages":[{"role":"user","content":"\xff\xfe\xc3("}]}', {}, 400,
                      "invalid_json"),
    "binary_garbage": (CHAT, bytes(range(256)) * 4, {}, 400, "invalid_json"),
    "form_content_type": (CHAT, b"model=sim-model&messages=hi",
                          {"content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
    "empty_body": (CHAT, b"", {}, 400, "missing_body"),
    "whitespace_body": (CHAT, b" \r\n\t ", {}, 400, "invalid_json"),
    "json_null": (CHAT, b"null", {}, 400, "invalid_json"),
    "json_array": (CHAT, b"[1,2]", {}, 400, "invalid_json"),
    "trailing_garbage": (CHAT, _b(chat()) + b" }}", {}, 400, "invalid_json"),
    "nan_literal": (CHAT, b'{"model":"sim-model","max_tokens":NaN,"messages":[]}', {}, 400, "invalid_json"),
    "lone_surrogate": (CHAT, b'{"model":"sim-model","messages":[{"role":"user","content":"\\udc00"}]}', {}, 400,
                       "invalid_json"),
    "huge_float": (CHAT, b'{"model":"sim-model","max_tokens":1e400,"messages":[]}', {}, 400, "invalid_json"),
    "huge_integer": (CHAT, b'{"model":"sim-model","max_tokens":' + b"9" * 400 + b',"messages":[{"content":"x"}]}',
                     {}, 400, None),
    "max_tokens_int64": (CHAT, _b(chat(max_tokens=2 ** 63 - 1)), {}, 400, "context_length_exceeded"),
    "n_huge": (CHAT, _b(chat(n=10 ** 6)), {}, 400, "context_length_exceeded"),
    "n_zero": (CHAT, _b(chat(n=0)), {}, 400, "invalid_value"),
    "model_not_string": (CHAT, _b({"model": 5, "messages": MSG}), {}, 400, "missing_model"),
    "model_missing": (CHAT, _b({"messages": MSG}), {}, 400, "missing_model"),
    "messages_string": (CHAT, _b({"model": MODEL, "messages": "hi"}), {}, 400, "missing_messages"),
    "messages_empty": (CHAT, _b({"model": MODEL, "messages": []}), {}, 400, "missing_messages"),
    "message_not_object": (CHAT, _b({"model": MODEL, "messages": ["hi"]}), {}, 400, "invalid_message"),
    "content_number": (CHAT, _b({"model": MODEL, "messages": [{"role": "user", "content": 5}]}), {}, 400,
                       "invalid_message"),
    "stream_string": (CHAT, _b(chat(stream="yes")), {}, 400, "invalid_value"),
    "max_tokens_string": (CHAT, _b(chat(max_tokens="5")), {}, 400, "invalid_value"),
    "max_tokens_float": (CHAT, _b(chat(max_tokens=5.5)), {}, 400, "invalid_value"),
    "max_tokens_negative": (CHAT, _b(chat(max_tokens=-1)), {}, 400, "invalid_value"),
    "max_tokens_bool": (CHAT, _b(chat(max_tokens=True)), {}, 400, "invalid_value"),
    "prompt_number": ("/v1/completions", _b({"model": MODEL, "prompt": 5}), {}, 400, "missing_prompt"),
    "prompt_list_of_numbers": ("/v1/completions", _b({"model": MODEL, "prompt": [1, 2]}), {}, 400, "invalid_prompt"),
    "unknown_model": (CHAT, _b({"model": "gpt-nope", "messages": MSG}), {}, 404, "model_not_found"),
    "unknown_endpoint": ("/v1/embeddings", _b({"model": MODEL, "input": "x"}), {}, 404, "unknown_endpoint"),
    "get_without_body": (CHAT, "GET", {}, 400, "missing_body"),
    # the replica's own validation (the gateway forwards what it cannot judge): still 4xx JSON
    "n_two_replica_rejects": (CHAT, _b(chat(n=2)), {}, 400, None),
    "deadline_unmeetable": (CHAT, _b(chat(max_tokens=2000)), {"x-sluice-deadline-ms": "5"}, 429,
                            "deadline_unmeetable"),
}


def _send(http: httpx.Client, path: str, body, headers: dict) -> httpx.Response:
    if body == "GET":
        return http.get(path)
    if body == "chunked":
        return http.post(path, content=_chunks(LIMIT + 200_000), headers={**JSON_CT, **headers})
    return http.post(path, content=body, headers={**JSON_CT, **headers})


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_4xx_json(http: httpx.Client, name: str) -> None:
    path, body, headers, status, code = CASES[name]
    t0 = time.monotonic()
    resp = _send(http, path, body, headers)
    elapsed = time.monotonic() - t0
    assert_openai_error(resp, status, code)
    assert elapsed < 5.0, f"{name} took {elapsed:.1f}s"


# ---- bad input that got (or gets) the wrong answer: bugs, see docs/reliability.md -------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_wrong_content_type_is_rejected(stack: Stack, http: httpx.Client, content_type: str) -> None:
    """Regression (bug 11 in docs/reliability.md): a JSON body sent as text/plain used to be forwarded."""
    before = sum(sim_metric(a, "vllm:request_success_total") for a in stack.policy.default_pool.replicas)
    resp = http.post(CHAT, content=_b(chat()), headers={"content-type": content_type})
    assert_openai_error(resp, 415, "unsupported_media_type")
    assert sum(sim_metric(a, "vllm:request_success_total") for a in stack.policy.default_pool.replicas) == before


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8", None])
def test_json_or_missing_content_type_is_served(http: httpx.Client, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    resp = http.post(CHAT, content=_b(chat()), headers=headers)
    if content_type is None:  # httpx adds none for raw content: vLLM accepts a missing content-type too
        assert "content-type" not in resp.request.headers
    assert resp.status_code == 200, (content_type, resp.status_code, resp.text[:200])


@pytest.mark.parametrize("header", [b"x-sluice-tenant", b"x-sluice-app", b"x-sluice-task-id", b"authorization",
                                    b"x-sluice-deadline-ms", b"x-unrelated"])
def test_non_utf8_header_byte_is_harmless(stack: Stack, header: bytes) -> None:
    """Regression (bug 2 in docs/reliability.md): a header byte that is not UTF-8 in a header the sidecar read as a
    CEL attribute made the whole ext_proc message undecodable (bare 503, or a bypass with failure_mode_allow). Now
    the request is governed like any other: answered, counted, never a 5xx."""
    before = metric_sum(stack.metrics_url, "sluice_admitted_total")
    resp = raw_http(stack.base_url, CHAT, _b(chat()), [(b"content-type", b"application/json"),
                                                       (header, b"\xff\xfe\xc3(")])
    assert resp.status_code == 200, (resp.status_code, resp.text[:200])
    assert metric_sum(stack.metrics_url, "sluice_admitted_total") == before + 1


def test_infinite_deadline_header_is_not_a_5xx(http: httpx.Client) -> None:
    """Regression (bug 1): x-sluice-deadline-ms: inf used to crash the sidecar's handling of the request."""
    for value in ("inf", "1e309", "-inf"):
        resp = http.post(CHAT, json=chat(), headers={"x-sluice-deadline-ms": value})
        assert resp.status_code == 200, (value, resp.status_code, resp.text[:200])
    resp = http.post(CHAT, json=chat(), headers={"x-stainless-read-timeout": "1e307"})
    assert resp.status_code == 200, resp.text[:200]


def test_oversized_headers_get_json(http: httpx.Client) -> None:
    """Regression (bug 3 in docs/reliability.md): Envoy's own flagless replies (here the codec's 431) were plain
    text; now every error a client sees is OpenAI JSON."""
    resp = http.post(CHAT, json=chat(), headers={"x-junk": "a" * 70_000})
    assert_openai_error(resp, 431)


def test_headers_with_odd_but_valid_values_are_harmless(stack: Stack, http: httpx.Client) -> None:
    """Header values the sidecar parses (numbers, bearer keys, labels): odd values never cause a 5xx."""
    odd = [{"x-sluice-deadline-ms": v} for v in ("nan", "-5", "0", "1e300", "abc", "9e9")]
    odd += [{"x-stainless-read-timeout": v} for v in ("nan", "-1", "1e-300", "")]
    odd += [{"x-stainless-retry-count": "9" * 60}, {"x-sluice-task-depth": "-9" * 30},
            {"x-sluice-priority": "ultra"}, {"x-sluice-tenant": "t" * 8000}, {"authorization": "Bearer"},
            {"authorization": "x" * 8000}, {"idempotency-key": "k" * 8000}, {"x-sluice-task-id": "a\tb"}]
    for headers in odd:
        resp = http.post(CHAT, json=chat(), headers=headers)
        assert resp.status_code < 500, (headers, resp.status_code, resp.text[:200])
        if resp.status_code >= 400:
            assert_openai_error(resp, range(400, 500))


def test_sidecar_healthy_after_the_batch(stack: Stack, http: httpx.Client) -> None:
    """Runs after every case above (file order): the same sidecar process still serves, nothing is counted."""
    assert stack.child("sidecar[0]").alive()
    out = http.post(CHAT, json=chat(max_tokens=3))
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    assert_settled(stack)
    # every case with a code, except the ones Envoy answers itself (413, unknown path), was the sidecar's answer
    envoy_own = {"request_too_large", "unknown_endpoint"}
    by_sidecar = [c for c in CASES.values() if c[4] and c[4] not in envoy_own]
    assert metric_sum(stack.metrics_url, "sluice_rejections_total") >= len(by_sidecar)
    samples = scrape(stack.metrics_url)
    assert samples[("sluice_ready", ())] == 1
