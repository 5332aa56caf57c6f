"""The harness's clients retry exactly like the installed openai SDK: the same decisions, the same delays.

Each case builds the response the SDK would see and asks the SDK's own `_should_retry` and
`_calculate_retry_timeout` (openai/_base_client.py), so a change in the SDK fails here."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import _base_client, _constants
from openai._models import FinalRequestOptions

from bench.openloop import (SDK_INITIAL_RETRY_DELAY_S, SDK_MAX_RETRIES, SDK_MAX_RETRY_AFTER_S,
                            SDK_MAX_RETRY_DELAY_S, SDK_READ_TIMEOUT_S, STREAM_ERROR, ClientSpec, Record,
                            _parse_retry_after, business_should_retry, scan_events, sdk_retry_delay,
                            sdk_should_retry, should_retry_response)


@pytest.fixture(scope="module")
def client() -> openai.OpenAI:
    return openai.OpenAI(api_key="sk-test", base_url="http://127.0.0.1:9/v1")


def _response(status: int, headers: dict[str, str]) -> httpx.Response:
    return httpx.Response(status, headers=headers, request=httpx.Request("POST", "http://127.0.0.1:9/v1/x"))


def test_constants_are_the_sdks():
    assert SDK_MAX_RETRIES == _constants.DEFAULT_MAX_RETRIES
    assert SDK_INITIAL_RETRY_DELAY_S == _constants.INITIAL_RETRY_DELAY
    assert SDK_MAX_RETRY_DELAY_S == _constants.MAX_RETRY_DELAY == 16 * _constants.INITIAL_RETRY_DELAY
    assert SDK_MAX_RETRY_AFTER_S == _constants.MAX_RETRY_AFTER_DELAY
    assert SDK_READ_TIMEOUT_S == _constants.DEFAULT_TIMEOUT.read
    spec = ClientSpec()
    assert spec.sdk_max_retries == SDK_MAX_RETRIES and spec.read_timeout_s == SDK_READ_TIMEOUT_S
    assert spec.send_read_timeout and spec.stated_timeout_s == SDK_READ_TIMEOUT_S


HEADER_CASES = [{}, {"x-should-retry": "true"}, {"x-should-retry": "false"}, {"retry-after": "3"},
                {"retry-after-ms": "250"}, {"retry-after": "121"}, {"retry-after": "120"},
                {"retry-after-ms": "500000"}, {"retry-after": "0.5", "x-should-retry": "false"},
                {"retry-after": "soon"}]


@pytest.mark.parametrize("status", [400, 401, 404, 408, 409, 413, 422, 429, 500, 502, 503, 504])
@pytest.mark.parametrize("headers", HEADER_CASES)
def test_retry_decision_matches_the_sdk(client: openai.OpenAI, status: int, headers: dict[str, str]):
    resp = _response(status, headers)
    ours = should_retry_response(status, headers.get("x-should-retry", ""), _parse_retry_after(resp.headers))
    assert ours == client._should_retry(resp)
    rec = Record(user=0, attempt=0, sdk_attempt=0, kind="k", status=status,
                 should_retry=headers.get("x-should-retry", ""),
                 retry_after_s=_parse_retry_after(resp.headers))
    assert sdk_should_retry(rec) == client._should_retry(resp)


def test_streams_connection_errors_and_cancels():
    """A started stream is returned to the caller (never retried); a connection error or a timeout before the
    response is retried (the SDK's except branches); a client that leaves on purpose does not retry."""
    assert not sdk_should_retry(Record(user=0, attempt=0, sdk_attempt=0, kind="k", status=200))
    assert sdk_should_retry(Record(user=0, attempt=0, sdk_attempt=0, kind="k", status=0, timed_out=True))
    assert sdk_should_retry(Record(user=0, attempt=0, sdk_attempt=0, kind="k", status=0, error="ClientOSError"))
    assert not sdk_should_retry(Record(user=0, attempt=0, sdk_attempt=0, kind="k", status=0, cancelled=True))


def _chunk(content: str) -> bytes:
    return (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
            b'"delta":{"content":"' + content.encode() + b'"},"finish_reason":null}]}\n\n')


# What smg sent when its upstream died mid-stream (captured by hand: `smg launch` in front of `sluice sim`, the
# replica killed with SIGKILL 1.5 s into a 200-token stream): an error event, then [DONE], on a clean 200.
SMG_UPSTREAM_LOST = (b'data: {"error":{"message":"Stream error: error decoding response body: unexpected EOF during '
                     b'chunk size line","type":"stream_error"}}\n\ndata: [DONE]\n\n')


@pytest.mark.parametrize("events, sdk_chunks, sdk_raises", [
    (_chunk("the") + _chunk(" error") + b"data: [DONE]\n\n", 2, False),   # the word, not an error event
    (_chunk("the") + _chunk(" of") + SMG_UPSTREAM_LOST, 2, True),
    (SMG_UPSTREAM_LOST, 0, True),
])
def test_a_stream_fails_where_the_sdk_raises(client: openai.OpenAI, events: bytes, sdk_chunks: int,
                                             sdk_raises: bool):
    """An error event inside a 200 stream: the SDK yields the chunks before it and raises APIError there, whatever
    follows; the harness's record counts those chunks, is not done, and the business layer retries it."""
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events,
                              request=httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions"))
    stream = openai.Stream(cast_to=object, response=response, client=client)
    got = 0
    raised = False
    try:
        for _ in stream:
            got += 1
    except openai.APIError:
        raised = True
    assert (got, raised) == (sdk_chunks, sdk_raises)

    rec = Record(user=0, attempt=0, sdk_attempt=0, kind="k", status=200)
    assert scan_events(events, rec, 0.5) == b""
    assert rec.tokens == sdk_chunks and rec.ok is (not sdk_raises)
    assert (rec.error == STREAM_ERROR) is sdk_raises and business_should_retry(rec) is sdk_raises
    assert (rec.first_token is None) is (sdk_chunks == 0)


@pytest.mark.parametrize("u", [0.0, 0.3, 0.999])
@pytest.mark.parametrize("headers", HEADER_CASES)
@pytest.mark.parametrize("retries_taken", [0, 1, 2, 5])
def test_retry_delay_matches_the_sdk(client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch, u: float,
                                     headers: dict[str, str], retries_taken: int):
    monkeypatch.setattr(_base_client, "random", lambda: u)
    max_retries = 6
    options = FinalRequestOptions(method="post", url="/x", max_retries=max_retries)
    resp = _response(429, headers)
    expected = client._calculate_retry_timeout(max_retries - retries_taken, options, resp.headers)
    ours = sdk_retry_delay(retries_taken, _parse_retry_after(resp.headers), ClientSpec(), u)
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_headers_the_sdk_sends(client: openai.OpenAI):
    """x-stainless-retry-count is the retries taken and x-stainless-read-timeout the read timeout, as strings."""
    options = FinalRequestOptions(method="post", url="/chat/completions", json_data={})
    headers = client._build_headers(options, retries_taken=2)
    assert headers["x-stainless-retry-count"] == "2"
    assert float(headers["x-stainless-read-timeout"]) == ClientSpec().stated_timeout_s
