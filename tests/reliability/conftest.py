"""Helpers for the reliability suite (issue #10): real stacks, fault switches, and the accounting checks every
fault test ends with ("nothing admitted is lost or left counted").

Stacks come from the integration suite's `make_stack` (real Envoy binary + sidecar process + simulated replicas
on free loopback ports); every process here is started by the test and stopped by its PID.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from extproc.supervisor import Child, Stack, http_ok
from tests.integration.conftest import make_stack, metric_sum, scrape, sim_metric, wait_for

__all__ = ["make_stack", "metric_sum", "scrape", "sim_metric", "wait_for", "running_stack", "fault",
           "restart_child", "accounting", "assert_settled", "assert_openai_error", "chat", "raw_http", "EchoReplica",
           "echo_stack", "BackgroundStream", "streams", "join_all", "MODEL"]

MODEL = "sim-model"


def chat(content: str = "x", max_tokens: int = 2, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": content}], **extra}


@contextlib.contextmanager
def running_stack(tmp: Path, overrides: dict | None = None) -> Iterator[Stack]:
    stack = make_stack(tmp, overrides)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def fault(stack: Stack, addr: str, name: str, value: Any = None) -> dict[str, Any]:
    """Switch a fault on one simulated replica (POST /sim/fault on its admin port)."""
    body = json.dumps({"fault": name, "value": value}).encode()
    req = urllib.request.Request(stack.sim_admin_url(addr) + "/sim/fault", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def restart_child(child: Child, timeout: float = 30.0) -> float:
    """Start `child` again with its original argv (same ports, same log); returns seconds until it is ready.
    The Child keeps the new process, so `Stack.stop()` stops it by PID like the original."""
    assert not child.alive(), f"{child.name} is still running"
    t0 = time.monotonic()
    child.start(dict(os.environ, PYTHONUNBUFFERED="1"))

    def ready() -> bool:
        assert child.alive(), f"{child.name} exited on restart:\n{child.log_tail()}"
        return http_ok(child.ready_url)

    assert wait_for(ready, timeout), f"{child.name} not ready after restart:\n{child.log_tail()}"
    return time.monotonic() - t0


def accounting(stack: Stack, replicas: list[str] | None = None) -> dict[str, float]:
    """What is still counted: the sidecar's in-flight requests / tokens, queue depth, open ext_proc streams,
    tenant open streams, and the replicas' own running + waiting requests."""
    samples = scrape(stack.metrics_url)

    def total(name: str) -> float:
        return sum(v for (sample, _labels), v in samples.items() if sample == name)

    out = {"inflight_requests": total("sluice_inflight_requests"),
           "inflight_tokens": total("sluice_inflight_tokens"),
           "queue_depth": total("sluice_queue_depth"),
           "open_streams": total("sluice_open_streams"),
           "tenant_open_streams": total("sluice_tenant_open_streams"),
           "lane_inflight": total("sluice_lane_inflight_requests")}
    for addr in replicas if replicas is not None else stack.policy.default_pool.replicas:
        out[f"running@{addr}"] = sim_metric(addr, "vllm:num_requests_running")
        out[f"waiting@{addr}"] = sim_metric(addr, "vllm:num_requests_waiting")
    return out


def assert_settled(stack: Stack, timeout: float = 5.0, replicas: list[str] | None = None) -> None:
    """Everything admitted has been released, in the sidecar and on the replicas."""
    last: dict[str, float] = {}

    def settled() -> bool:
        nonlocal last
        try:
            last = accounting(stack, replicas)
        except (OSError, urllib.error.URLError):
            return False
        return not any(last.values())

    assert wait_for(settled, timeout, 0.1), f"accounting not back to zero: {last}"
    assert_admitted_settled(stack, timeout)


def admitted_and_settled(stack: Stack) -> tuple[float, float]:
    """(requests dispatched to a replica, requests with an outcome from the access log), over every sidecar worker:
    `sluice_admitted_total` and the sum of `sluice_requests_total` over its outcomes."""
    sc = stack.policy.sidecar
    admitted = settled = 0.0
    for w in range(sc.workers):
        url = f"http://{sc.metrics_host}:{sc.metrics_port + w}/metrics"
        admitted += metric_sum(url, "sluice_admitted_total")
        settled += metric_sum(url, "sluice_requests_total")
    return admitted, settled


def assert_admitted_settled(stack: Stack, timeout: float = 10.0) -> None:
    """Every request the sidecar dispatched got exactly one outcome (issue #19: a request refused after its
    dispatch used to stay admitted for ever)."""
    last = (0.0, 0.0)

    def agree() -> bool:
        nonlocal last
        try:
            last = admitted_and_settled(stack)
        except (OSError, urllib.error.URLError):
            return False
        return last[0] == last[1]

    assert wait_for(agree, timeout, 0.1), f"admitted {last[0]:g} != settled {last[1]:g}"


@pytest.fixture(autouse=True)
def _admitted_equals_settled_after_each_probe(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test, each gateway it used that is still running has settled everything it admitted."""
    yield
    for value in request.node.funcargs.values():
        if isinstance(value, Stack) and value.mode == "sluice" and value.children and all(
                c.alive() for c in value.children):
            assert_admitted_settled(value)


class BackgroundStream:
    """One streaming chat request in a thread. `result` = (status or "error", data events, error name or None,
    seconds); `replica` = the x-sim-replica header. An error is also recorded when the stream ends without
    `data: [DONE]` (a cut that closed the connection cleanly)."""

    def __init__(self, base_url: str, max_tokens: int, headers: dict | None = None, timeout: float = 30) -> None:
        self.replica = ""
        self.result: tuple | None = None
        self.ended_at = 0.0
        self.started = threading.Event()  # set once the response headers arrived (or the request failed)
        self._thread = threading.Thread(target=self._run, args=(base_url, max_tokens, headers or {}, timeout),
                                        daemon=True)
        self._thread.start()

    def _run(self, base_url: str, max_tokens: int, headers: dict, timeout: float) -> None:
        t0, events, done = time.monotonic(), 0, False
        try:
            with httpx.stream("POST", base_url + "/v1/chat/completions", headers=headers, timeout=timeout,
                              json=chat(max_tokens=max_tokens, stream=True)) as resp:
                self.replica = resp.headers.get("x-sim-replica", "")
                self.started.set()
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data:"):
                        events += 1
            error = None if done or resp.status_code != 200 else "no [DONE]"
            self.result = (resp.status_code, events, error, time.monotonic() - t0)
        except httpx.HTTPError as exc:
            self.result = ("error", events, type(exc).__name__, time.monotonic() - t0)
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def join(self, timeout: float = 30) -> tuple:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a client hung"
        assert self.result is not None
        return self.result


def streams(base_url: str, n: int, max_tokens: int, headers: dict | None = None) -> list[BackgroundStream]:
    return [BackgroundStream(base_url, max_tokens, headers) for _ in range(n)]


def join_all(running: list[BackgroundStream]) -> list[tuple]:
    return [s.join() for s in running]


class EchoReplica:
    """A stand-in OpenAI replica on a free loopback port that records the request headers it receives (the
    simulator does not echo them). It answers chat completions after `delay_s`; /health says 200; it has no
    /metrics, so pools using it set `metrics_style: none`."""

    def __init__(self, delay_s: float = 0.3) -> None:
        self.delay_s = delay_s
        self.seen: list[dict[str, str]] = []
        echo = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._reply(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                echo.seen.append({k.lower(): v for k, v in self.headers.items()})
                time.sleep(echo.delay_s)  # the replica's latency, set by the test
                self._reply(200, {"id": "echo", "object": "chat.completion", "model": MODEL,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "EchoReplica":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def echo_stack(tmp: Path, echo: EchoReplica, overrides: dict | None = None) -> Stack:
    """A stack whose only replica is `echo` (no simulator)."""
    from extproc.config import policy_from_dict
    from extproc.supervisor import with_free_ports

    data = {"pools": [{"model": MODEL, "replicas": ["127.0.0.1:1"], "metrics_style": "none"}],
            "simulator": {"enabled": False}, **(overrides or {})}
    policy = with_free_ports(policy_from_dict(data))
    policy.pools[0].replicas = [echo.address]
    return Stack(policy, run_dir=tmp)


def raw_http(base_url: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]] = (),
             method: bytes = b"POST", timeout: float = 10.0) -> httpx.Response:
    """One HTTP/1.1 request written byte by byte, for what httpx refuses to send (header bytes that are not
    ASCII, duplicate or malformed headers). Returns an httpx.Response for the same assertions."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    head = [method + b" " + path.encode() + b" HTTP/1.1", b"host: " + host.encode(), b"connection: close",
            b"content-length: " + str(len(body)).encode()]
    head += [k + b": " + v for k, v in headers]
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    raw_headers, _, payload = rest.partition(b"\r\n\r\n")
    parsed = [tuple(part.strip() for part in line.decode("latin-1").split(":", 1))
              for line in raw_headers.split(b"\r\n") if b":" in line]
    return httpx.Response(int(status_line.split()[1]), headers=parsed, content=payload)


def assert_openai_error(resp: httpx.Response, status: int | tuple[int, ...] | range, code: str | None = None) -> dict:
    """An OpenAI-style JSON error: {"error": {"message": str, "type": str, "code": ...}}."""
    allowed = (status,) if isinstance(status, int) else status
    assert resp.status_code in allowed, f"status {resp.status_code} not in {allowed}: {resp.text[:300]!r}"
    assert resp.headers.get("content-type", "").startswith("application/json"), \
        f"{resp.status_code} is not JSON: {dict(resp.headers)} {resp.text[:200]!r}"
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err.get("code") not in (None, ""), err
    if code is not None:
        assert err["code"] == code, err
    return err
