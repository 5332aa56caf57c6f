"""Request headers at and over the gateway's limits (issue #19, findings 5 and 7b): too many or too large headers get
a JSON 431 before anything is admitted and before any replica sees them; the sidecar's own headers never turn a
client's request into a 5xx."""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest

from extproc.supervisor import Stack

from .conftest import MODEL, assert_openai_error, chat, metric_sum, raw_http, running_stack, sim_metric

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
CHAT = "/v1/chat/completions"
BODY = json.dumps(chat()).encode()
JSON_CT = (b"content-type", b"application/json")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("headers")) as s:
        yield s


def served(stack: Stack) -> float:
    """Requests the replicas have seen (the simulator counts every request it parsed)."""
    return sum(sim_metric(a, "vllm:request_success_total") for a in stack.policy.default_pool.replicas)


def test_every_header_count_gets_200_or_json_431(stack: Stack) -> None:
    """From well under to over `gateway.max_request_headers` (100): at the edge the sidecar's pool header used to
    push the request over Envoy's limit (503 header_mutation_result_exceeds_limit, counted admitted without an
    outcome). Now: 200 while the headers leave room for the sidecar's, then a JSON 431, from the sidecar or
    Envoy's codec; never a 5xx."""
    statuses = {}
    before = served(stack)
    for n in range(86, 104):
        extra = [(f"x-h{i}".encode(), b"v") for i in range(n)]
        resp = raw_http(stack.base_url, CHAT, BODY, [JSON_CT, *extra])
        statuses[n] = resp.status_code
        if resp.status_code != 200:
            assert_openai_error(resp, 431, "request_headers_too_large")
    codes = list(statuses.values())
    assert set(codes) == {200, 431}, statuses
    first_431 = codes.index(431)
    assert all(c == 431 for c in codes[first_431:]), statuses  # one edge, no holes
    assert served(stack) == before + first_431, statuses  # the refused ones never reached a replica
    print(f"\nheader count -> status: {statuses}")


def test_header_sizes_near_and_over_the_limit(stack: Stack) -> None:
    """One header of 6 KiB passes; from there to 8 KiB (gateway.max_request_headers_kb) every size is a 200 or a
    JSON 431 (the last bytes are the sidecar's room); 8-60 KiB values (finding 7b: they reached the replica, which
    answered text/plain echoing the value) get a JSON 431 from Envoy and never reach a replica."""
    assert raw_http(stack.base_url, CHAT, BODY, [JSON_CT, (b"x-big", b"a" * 6144)]).status_code == 200
    before = served(stack)
    passed = 0
    for size in range(7800, 8200, 16):
        resp = raw_http(stack.base_url, CHAT, BODY, [JSON_CT, (b"x-big", b"a" * size)])
        if resp.status_code == 200:
            passed += 1
        else:
            err = assert_openai_error(resp, 431, "request_headers_too_large")
            assert "a" * 64 not in err["message"]
    for size in (8 * 1024, 20 * 1024, 60 * 1024):
        resp = raw_http(stack.base_url, CHAT, BODY, [JSON_CT, (b"x-big", b"b" * size)])
        err = assert_openai_error(resp, 431, "request_headers_too_large")
        assert "bbbb" not in resp.text and "8 KiB" in err["message"]
    assert served(stack) == before + passed


def test_http2_headers_at_and_over_the_limit(stack: Stack) -> None:
    """HTTP/2: Envoy's codec resets a stream whose header block is over its limits (HTTP/2 has no status for it:
    RST_STREAM, measured); within the limit but without room for the sidecar's headers, the sidecar's JSON 431.
    Never a 5xx, never a replica."""
    outcomes = {}
    with httpx.Client(base_url=stack.base_url, http2=True, http1=False, timeout=10) as h2:
        ok = h2.post(CHAT, json=chat())
        assert ok.status_code == 200 and ok.http_version == "HTTP/2"
        for n in [*range(82, 96), 120]:
            before = served(stack)
            try:
                resp = h2.post(CHAT, json=chat(), headers={f"x-h{i}": "v" for i in range(n)})
            except httpx.RemoteProtocolError as exc:
                assert "StreamReset" in repr(exc), exc
                outcomes[n] = "reset"
                assert served(stack) == before
                continue
            outcomes[n] = resp.status_code
            if resp.status_code != 200:
                assert_openai_error(resp, 431, "request_headers_too_large")
                assert served(stack) == before
    print(f"\nHTTP/2 header count -> {outcomes}")
    assert set(outcomes.values()) == {200, 431, "reset"}, outcomes
    assert outcomes[120] == "reset"


def test_sidecar_counts_nothing_for_refused_headers(stack: Stack) -> None:
    """A 431 is answered before admission: nothing admitted, nothing left to settle."""
    before = metric_sum(stack.metrics_url, "sluice_admitted_total")
    for n in (99, 100, 101, 130):
        raw_http(stack.base_url, CHAT, BODY, [JSON_CT, *[(f"x-h{i}".encode(), b"v") for i in range(n)]])
    assert metric_sum(stack.metrics_url, "sluice_admitted_total") == before
    assert httpx.post(stack.base_url + CHAT, json={"model": MODEL, "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "x"}]}).status_code == 200
