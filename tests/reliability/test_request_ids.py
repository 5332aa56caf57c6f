"""A client's own request id (issue #19, finding 6): free again as soon as the client has seen its response end,
still refused (409) while the request it names runs."""

from __future__ import annotations

import uuid
from typing import Iterator

import httpx
import pytest

from extproc.supervisor import Stack

from .conftest import BackgroundStream, assert_openai_error, chat, running_stack, sim_metric, wait_for

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # every resend of an id is a retry: a floor that lets all of them through the retry budget
    with running_stack(tmp_path_factory.mktemp("rid"), {"budgets": {"retry": {"floor": 50}}}) as s:
        yield s


def test_request_id_is_free_once_the_response_ended(stack: Stack) -> None:
    """Re-sending the same x-request-id right after a complete response got 409 duplicate_in_flight in 9 of 10
    tries (the original was released ~0.1 s later, when Envoy's access log reported it). Now 10 of 10 succeed,
    streamed or not."""
    with httpx.Client(base_url=stack.base_url, timeout=10) as http:
        for i in range(10):
            rid = f"rid-{uuid.uuid4().hex}"
            first = http.post(CHAT, json=chat(stream=i % 2 == 1), headers={"x-request-id": rid})
            assert first.status_code == 200, first.text
            again = http.post(CHAT, json=chat(), headers={"x-request-id": rid})
            assert again.status_code == 200, (i, again.status_code, again.text)


def test_request_id_of_a_running_request_is_a_409(stack: Stack) -> None:
    rid = f"rid-{uuid.uuid4().hex}"
    running = BackgroundStream(stack.base_url, 400, headers={"x-request-id": rid})
    assert running.started.wait(10)
    assert wait_for(lambda: sum(sim_metric(a, "vllm:num_requests_running")
                                for a in stack.policy.default_pool.replicas) >= 1, 5)
    resp = httpx.post(stack.base_url + CHAT, json=chat(), headers={"x-request-id": rid}, timeout=10)
    assert_openai_error(resp, 409, "duplicate_in_flight")
    assert resp.headers["x-should-retry"] == "false"
    status, events, error, _ = running.join()
    assert (status, error) == (200, None) and events >= 400
    resp = httpx.post(stack.base_url + CHAT, json=chat(), headers={"x-request-id": rid}, timeout=10)
    assert resp.status_code == 200, resp.text
