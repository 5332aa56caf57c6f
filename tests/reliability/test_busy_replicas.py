"""Busy replicas are not dead (issue #16, finding 1), end to end at the shipped defaults: both simulated replicas
answer GET /metrics only after 2 s (the simulator's `metrics-latency` fault: every scrape outlives the 1 s scrape
timeout, as a saturated real vLLM's did) while they serve a steady load through Envoy + the sidecar. The health
machine must see them answering requests (Envoy's access log) and leave them HEALTHY: no
`sluice_replica_health_transitions_total` sample moves."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from .conftest import MODEL, chat, fault, metric_sum, running_stack

pytestmark = [pytest.mark.reliability, pytest.mark.integration, pytest.mark.timeout(90)]
TWO_REPLICAS = {"pools": [{"model": MODEL, "replicas": ["127.0.0.1:1", "127.0.0.1:2"]}]}
METRICS_LATENCY_S = 2.0   # twice the default scrape timeout
LOAD_S = 8.0              # longer than the default unresponsive_after_s (5 s)
CLIENTS = 24


async def steady_load(base_url: str, seconds: float) -> tuple[int, int]:
    """CLIENTS streams back to back for `seconds`: (completed, failed)."""
    ok = failed = 0
    deadline = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient, i: int) -> None:
        nonlocal ok, failed
        n = 0
        while time.monotonic() < deadline:
            n += 1
            body = chat(f"busy {i} {n} " + "word " * 200, max_tokens=24)
            resp = await http.post("/v1/chat/completions", json=body)
            if resp.status_code == 200:
                ok += 1
            else:
                failed += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        await asyncio.gather(*(client(http, i) for i in range(CLIENTS)))
    return ok, failed


def test_replicas_that_report_late_but_serve_stay_healthy(tmp_path) -> None:
    with running_stack(tmp_path, TWO_REPLICAS) as stack:
        replicas = stack.policy.default_pool.replicas
        for addr in replicas:
            fault(stack, addr, "metrics-latency", METRICS_LATENCY_S)
        ok, failed = asyncio.run(steady_load(stack.base_url, LOAD_S))
        url = stack.metrics_url
        transitions = metric_sum(url, "sluice_replica_health_transitions_total")
        timeouts = {a: metric_sum(url, "sluice_scrape_timeouts_total", replica=a) for a in replicas}
        print(f"\nbusy replicas: {ok} completed, {failed} failed, scrape timeouts {timeouts}, "
              f"health transitions {transitions:.0f}")
        assert ok >= 50 and failed == 0, (ok, failed)
        assert all(n >= 3 for n in timeouts.values()), timeouts   # the fault did cut the scrapes
        assert transitions == 0
        for addr in replicas:
            assert metric_sum(url, "sluice_replica_state", replica=addr, state="healthy") == 1
