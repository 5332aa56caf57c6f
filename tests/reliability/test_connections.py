"""Silent connections (issue #19, finding 2): a connection that sends nothing is closed within the request headers
timeout, so a flood of them cannot hold `max_downstream_connections` and a normal client is still served. This is
the quick form (250 connections, a 1 s timeout); the 10,000-connection form with Envoy's RSS is a bench."""

from __future__ import annotations

import socket
import time
from typing import Iterator

import httpx
import pytest

from extproc.supervisor import Stack

from .conftest import chat, running_stack

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
HEADERS_TIMEOUT_S = 1.0
SILENT = 250


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("conn"),
                       {"gateway": {"request_headers_timeout_s": HEADERS_TIMEOUT_S}}) as s:
        yield s


def _closed_by_peer(sock: socket.socket, deadline: float) -> bool:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_silent_connections_are_closed_and_a_client_is_served(stack: Stack) -> None:
    gw = stack.policy.gateway
    silent = [socket.create_connection((gw.host, gw.port), timeout=5) for _ in range(SILENT)]
    try:
        t0 = time.monotonic()
        resp = httpx.post(stack.base_url + "/v1/chat/completions", json=chat(), timeout=10)
        served_s = time.monotonic() - t0
        assert resp.status_code == 200, resp.text
        assert served_s < HEADERS_TIMEOUT_S, served_s
        deadline = t0 + HEADERS_TIMEOUT_S + 2.5
        still_open = sum(not _closed_by_peer(s, deadline) for s in silent)
        assert still_open == 0, f"{still_open} of {SILENT} silent connections still open"
        print(f"\n{SILENT} silent connections closed within {time.monotonic() - t0:.2f} s; a client served in "
              f"{served_s * 1000:.0f} ms")
    finally:
        for s in silent:
            s.close()
