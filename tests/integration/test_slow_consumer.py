"""P13: a client that stops reading is cut by the sidecar and the replica's generation stops."""

from __future__ import annotations

import json
import socket
import time

import pytest

from extproc.supervisor import Stack

from .conftest import make_stack, metric_sum, sim_metric, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory: pytest.TempPathFactory):
    s = make_stack(tmp_path_factory.mktemp("slow"), {
        "gateway": {"socket_send_buffer_bytes": 16384},
        "streaming": {"sample_rate": 0.0,
                      "slow_consumer": {"min_bytes_per_s": 2000, "grace_s": 1.5, "report_interval_s": 0.5}},
    })
    s.start()
    try:
        yield s
    finally:
        s.stop()


def open_stalled_stream(stack: Stack, max_tokens: int) -> socket.socket:
    """A raw HTTP/1.1 client with a tiny receive buffer that reads the response headers and then stops."""
    host, port = stack.policy.gateway.host, stack.policy.gateway.port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    body = json.dumps({"model": "sim-model", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "tell me everything"}]}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = sock.recv(512)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def test_stalled_client_is_cut_and_generation_stops(slow_stack: Stack):
    sock = open_stalled_stream(slow_stack, max_tokens=30000)
    try:
        assert wait_for(lambda: metric_sum(slow_stack.metrics_url, "sluice_slow_streams_cut_total") >= 1, 25)
        assert wait_for(lambda: metric_sum(slow_stack.metrics_url, "sluice_inflight_requests") == 0, 5)
        replicas = slow_stack.policy.default_pool.replicas
        assert wait_for(lambda: all(sim_metric(a, "vllm:num_requests_running") == 0 for a in replicas), 5)
        generated = sum(sim_metric(a, "vllm:generation_tokens_total") for a in replicas)
        time.sleep(0.5)  # the window in which a replica that kept generating would add tokens
        assert sum(sim_metric(a, "vllm:generation_tokens_total") for a in replicas) == generated
        assert generated < 30000
    finally:
        sock.close()


def test_normal_reader_is_not_cut(slow_stack: Stack):
    import httpx

    before = metric_sum(slow_stack.metrics_url, "sluice_slow_streams_cut_total")
    with httpx.Client(base_url=slow_stack.base_url, timeout=30) as http:
        body = {"model": "sim-model", "stream": True, "max_tokens": 600,
                "messages": [{"role": "user", "content": "x"}]}
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            events = sum(1 for line in resp.iter_lines() if line.startswith("data:"))
    assert events >= 600
    assert metric_sum(slow_stack.metrics_url, "sluice_slow_streams_cut_total") == before
