"""InferencePool endpoint discovery through the official kubernetes client, against recorded API responses
(fixtures/k8s/, in the shape the API server returns) replayed by a loopback HTTP server. Not a live cluster."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

import pytest
from kubernetes import client

from extproc.discovery import EndpointDiff
from extproc.discovery.kubernetes import InvalidInferencePool, KubernetesDiscovery, PoolSpec, pod_endpoints, \
    pool_endpoints
from tests.waiting import wait_for_async

FIXTURES = Path(__file__).parent / "fixtures" / "k8s"
POOL_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/qwen3-pool"
PODS_PATH = "/api/v1/namespaces/llm/pods"


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


class FakeApiServer:
    """Serves the recorded responses: the InferencePool, pod lists (one per list call, the last repeats) and watch
    streams (one per watch call; past the last, the watch stays open without events until it times out).
    `fail` makes every call answer 500. Records each call's path and query."""

    def __init__(self) -> None:
        self.pool: Any = fixture("inferencepool.json")
        self.lists: list[Any] = [fixture("pods.json")]
        self.watches: list[str] = []
        self.fail = False
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.released = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                outer.calls.append((url.path, query))
                if outer.fail:
                    return self._json(500, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                            "message": "etcdserver: request timed out", "code": 500})
                if url.path == POOL_PATH:
                    return self._json(200, outer.pool)
                if url.path == PODS_PATH and query.get("watch") == "true":
                    return self._watch(int(query.get("timeoutSeconds", "5")))
                if url.path == PODS_PATH:
                    n = sum(1 for p, q in outer.calls if p == PODS_PATH and q.get("watch") != "true")
                    return self._json(200, outer.lists[min(n, len(outer.lists)) - 1])
                return self._json(404, {"kind": "Status", "code": 404, "message": "not found"})

            def _json(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _watch(self, timeout_s: int) -> None:
                # as the API server streams a watch: chunked, one event per line, ended at timeoutSeconds
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                if outer.watches:
                    for line in outer.watches.pop(0).splitlines(keepends=True):
                        data = line.encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                outer.released.wait(timeout_s)
                self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def list_calls(self) -> list[dict[str, str]]:
        return [q for p, q in self.calls if p == PODS_PATH and q.get("watch") != "true"]

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


def discovery(api: FakeApiServer, **kw: Any) -> KubernetesDiscovery:
    cfg = client.Configuration()
    cfg.host = api.url
    kw.setdefault("watch_timeout_s", 2)
    kw.setdefault("min_backoff_s", 0.05)
    kw.setdefault("max_backoff_s", 0.2)
    return KubernetesDiscovery("qwen3", "llm", "qwen3-pool", client.ApiClient(cfg), **kw)


def test_the_pool_spec_and_which_pods_are_endpoints():
    spec = PoolSpec.from_object(fixture("inferencepool.json"))
    assert spec.label_selector == "app=vllm-qwen3" and spec.target_ports == (8000, 8001)
    by_name = {p["metadata"]["name"]: p for p in fixture("pods.json")["items"]}
    assert pod_endpoints(by_name["vllm-qwen3-6d9f7c5b8-a1"], spec) == {"10.244.1.11:8000", "10.244.1.11:8001"}
    for not_serving in ("c3", "d4", "e5"):  # not ready, being deleted, pending without an IP
        assert pod_endpoints(by_name[f"vllm-qwen3-6d9f7c5b8-{not_serving}"], spec) == set()
    stray = json.loads(json.dumps(by_name["vllm-qwen3-6d9f7c5b8-a1"]))
    stray["metadata"]["labels"] = {"app": "other"}
    assert pod_endpoints(stray, spec) == set()
    assert len(pool_endpoints(by_name.values(), spec)) == 4
    with pytest.raises(InvalidInferencePool):
        PoolSpec.from_object({"metadata": {"name": "x"}, "spec": {"selector": {"matchLabels": {}}}})


async def test_list_then_watch_events_follow_the_pods(api):
    api.watches = [(FIXTURES / "watch-events.jsonl").read_text()]
    d = discovery(api)
    seen: list[EndpointDiff] = []
    d.listeners.append(seen.append)
    first = await d.start()
    try:
        assert first == EndpointDiff("qwen3", ("10.244.1.11:8000", "10.244.1.11:8001", "10.244.2.12:8000",
                                               "10.244.2.12:8001"), (), True)
        assert api.list_calls()[0]["labelSelector"] == "app=vllm-qwen3"
        assert await wait_for_async(lambda: len(seen) >= 5)
        # ADDED f6 (ready), c3 turns ready, a1 turns not ready, a bookmark (ignored), DELETED b2
        assert [(d.added, d.removed) for d in seen[1:5]] == [
            (("10.244.2.16:8000", "10.244.2.16:8001"), ()),
            (("10.244.3.13:8000", "10.244.3.13:8001"), ()),
            ((), ("10.244.1.11:8000", "10.244.1.11:8001")),
            ((), ("10.244.2.12:8000", "10.244.2.12:8001")),
        ]
        assert d.snapshot() == {"10.244.2.16:8000", "10.244.2.16:8001", "10.244.3.13:8000", "10.244.3.13:8001"}
        watch = [q for p, q in api.calls if q.get("watch") == "true"][0]
        assert watch["resourceVersion"] == "1100" and watch["labelSelector"] == "app=vllm-qwen3"
    finally:
        await d.stop()


async def test_an_expired_watch_lists_again_and_the_new_list_is_authoritative(api):
    api.watches = [(FIXTURES / "watch-expired.jsonl").read_text()]
    api.lists = [fixture("pods.json"), fixture("pods-after-expiry.json")]
    d = discovery(api)
    seen: list[EndpointDiff] = []
    d.listeners.append(seen.append)
    await d.start()
    try:
        assert await wait_for_async(lambda: len(seen) >= 2)
        assert len(api.list_calls()) >= 2
        assert set(seen[1].added) == {"10.244.2.16:8000", "10.244.2.16:8001", "10.244.3.17:8000",
                                      "10.244.3.17:8001"}
        assert set(seen[1].removed) == {"10.244.1.11:8000", "10.244.1.11:8001", "10.244.2.12:8000",
                                        "10.244.2.12:8001"}
    finally:
        await d.stop()


async def test_api_errors_keep_the_last_endpoints_and_it_recovers(api):
    api.fail = True
    d = discovery(api)
    try:
        assert await d.start(first_timeout_s=0.5) is None  # no answer yet: nothing reported, nothing invented
        assert d.snapshot() == frozenset()
        api.fail = False
        assert await wait_for_async(lambda: len(d.snapshot()) == 4)
        api.fail = True
        api.released.set()  # end the open watch: the next list fails
        assert await wait_for_async(lambda: d.held)
        assert len(d.snapshot()) == 4  # kept while the API server errs
        api.released.clear()
        api.fail = False
        assert await wait_for_async(lambda: not d.held)
        assert len(d.snapshot()) == 4
    finally:
        await d.stop()
