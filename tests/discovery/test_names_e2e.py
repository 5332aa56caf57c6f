"""Replicas by name, end to end, under load: the real Envoy, the sidecar and simulated vLLM replicas; the pool is
`{dns: pool.sluice.test:PORT}`, a name resolved by the sidecar's real getaddrinfo inside a private mount namespace
(hosts_ns.py), where it stands for several loopback addresses. While clients stream requests through the gateway
without a pause, a third address joins the name and a first one leaves it:

  - the new replica joins in slow start: its sluice_replica_weight climbs 0.1 -> 0.3 -> 0.5 -> 1.0 and its health
    transition recovering -> healthy (slow_start_done) is counted; it serves requests; Envoy knows it (EDS);
  - the removed one takes no new request, drains, and leaves the pool (its series gone, Envoy's EDS without it);
    only then is its process stopped, the way an operator or Kubernetes would (endpoint gone, then the pod);
  - no request fails: every one is a 200 with a complete stream.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from extproc.config import policy_from_dict
from extproc.supervisor import Child, Stack, free_ports, http_ok, with_free_ports
from tests.integration.conftest import scrape

from .hosts_ns import HostsNamespace

pytestmark = pytest.mark.integration

NAME = "pool.sluice.test"
IPS = ["127.0.0.11", "127.0.0.12", "127.0.0.13"]
WORKERS = 10            # clients streaming at once
MAX_REQUESTS = 2000     # bounds of the load loop ...
MAX_LOAD_S = 90.0       # ... in count and time


def _sim(ip: str, port: int, admin: int, logs: Path) -> Child:
    argv = [sys.executable, "-m", "extproc.sim", "--host", ip, "--port", str(port), "--model", "sim-model",
            "--name", f"{ip}:{port}", "--admin-port", str(admin), "--preset", "tiny-cpu", "--seed", ip[-1]]
    return Child(f"sim {ip}", argv, logs / f"sim-{ip}.log", f"http://{ip}:{port}/health")


def _sim_finished(ip: str, admin: int) -> int:
    with urllib.request.urlopen(f"http://{ip}:{admin}/sim/state", timeout=2) as resp:
        state = json.loads(resp.read())
    return sum(state["counters"]["finished"].values())


def _sidecar_series(stack: Stack, name: str) -> dict[str, float]:
    """replica -> value of one per-replica sidecar series."""
    return {dict(labels)["replica"]: value for (sample, labels), value in scrape(stack.metrics_url).items()
            if sample == name and dict(labels).get("pool") == "sim-model"}


def _envoy_hosts(stack: Stack) -> set[str]:
    with urllib.request.urlopen(f"{stack.admin_url}/clusters", timeout=2) as resp:
        lines = resp.read().decode().splitlines()
    return {line.split("::")[1] for line in lines if line.startswith("pool-sim-model::") and "::cx_active::" in line}


class Load:
    """WORKERS clients streaming chat completions through the gateway (openai SDK, no retries), until stopped."""

    def __init__(self, base_url: str) -> None:
        self.client = AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        self.ok = 0
        self.failures: list[str] = []
        self.served_by: dict[str, int] = {}
        self.stop = asyncio.Event()
        self.started = time.monotonic()

    async def one(self, n: int) -> None:
        try:
            raw = await self.client.chat.completions.with_raw_response.create(
                model="sim-model", max_tokens=24, stream=True,
                messages=[{"role": "user", "content": f"request {n} " + "words " * 40}])
            replica = raw.headers.get("x-sim-replica", "?")
            text, finished = "", False
            async for chunk in raw.parse():
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finished = finished or chunk.choices[0].finish_reason is not None
            if not (finished and text):
                raise AssertionError(f"incomplete stream from {replica}")
            self.ok += 1
            self.served_by[replica] = self.served_by.get(replica, 0) + 1
        except Exception as exc:  # every failure is recorded; the test asserts there is none
            self.failures.append(f"{type(exc).__name__}: {exc}")

    async def run(self) -> None:
        counter = iter(range(MAX_REQUESTS))

        async def worker() -> None:
            while not self.stop.is_set() and time.monotonic() - self.started < MAX_LOAD_S:
                n = next(counter, None)
                if n is None:
                    return
                await self.one(n)

        await asyncio.gather(*(worker() for _ in range(WORKERS)))
        await self.client.close()


async def _until(pred, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(pred):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(interval)


@pytest.mark.timeout(240)
async def test_a_replica_added_and_one_removed_by_name_under_load(tmp_path: Path):
    ns = HostsNamespace(tmp_path)
    ns.set_hosts({NAME: IPS[:2]})
    port, *admins = free_ports(4)
    addr = {ip: f"{ip}:{port}" for ip in IPS}
    policy = with_free_ports(policy_from_dict({
        "pools": [{"model": "sim-model", "replicas": [{"dns": f"{NAME}:{port}"}],
                   "discovery": {"interval_s": 0.3, "remove_after": 2}}],
        "simulator": {"enabled": False},
        "admission": {"max_concurrency_per_replica": 4},
        "routing": {"health": {"slow_start_step_s": 1.5}},
    }))
    sims = {ip: _sim(ip, port, admin, tmp_path / "logs") for ip, admin in zip(IPS, admins)}
    for sim in sims.values():
        sim.start()
    stack = Stack(policy, run_dir=tmp_path / "run", sidecar_wrapper=ns.command)
    try:
        await _until(lambda: all(http_ok(s.ready_url) for s in sims.values()), 30, "the simulators")
        await asyncio.to_thread(stack.start)
        assert _sidecar_series(stack, "sluice_replica_weight") == {addr[IPS[0]]: 1.0, addr[IPS[1]]: 1.0}
        assert _envoy_hosts(stack) == {addr[IPS[0]], addr[IPS[1]]}  # learnt from the EDS file the sidecar wrote

        load = Load(stack.base_url)
        traffic = asyncio.create_task(load.run())
        await asyncio.sleep(2.0)
        assert load.ok > 0 and not load.failures

        # A third address behind the name: it joins in slow start and ramps up under load.
        ns.set_hosts({NAME: IPS})
        new = addr[IPS[2]]
        weights: list[float] = []

        def ramped() -> bool:
            w = _sidecar_series(stack, "sluice_replica_weight").get(new)
            if w is not None and (not weights or weights[-1] != w):
                weights.append(w)
            return w == 1.0

        await _until(ramped, 30, "the new replica to finish slow start", interval=0.05)
        assert weights[0] == 0.1 and weights == sorted(weights) and len(weights) >= 3, weights
        done = scrape(stack.metrics_url).get(("sluice_replica_health_transitions_total", tuple(sorted({
            "pool": "sim-model", "replica": new, "from": "recovering", "to": "healthy",
            "reason": "slow_start_done"}.items()))))
        assert done == 1
        assert new in _envoy_hosts(stack)
        await _until(lambda: load.served_by.get(new, 0) >= 5, 20, "the new replica to serve requests")

        # The first address leaves the name: no new request goes there, it drains and leaves the pool.
        gone = addr[IPS[0]]
        ns.set_hosts({NAME: IPS[1:]})
        await _until(lambda: gone not in _sidecar_series(stack, "sluice_replica_weight"), 20,
                     "the removed replica to drain and leave the pool")
        assert gone not in _envoy_hosts(stack)
        finished_at_removal = await asyncio.to_thread(_sim_finished, IPS[0], admins[0])
        sims[IPS[0]].stop()  # now the process may go: nothing of the gateway's is in flight on it
        served_before = load.served_by.get(gone, 0)
        await asyncio.sleep(3.0)  # load goes on without it
        assert load.served_by.get(gone, 0) == served_before
        changes = {dict(labels)["change"]: v for (name, labels), v in scrape(stack.metrics_url).items()
                   if name == "sluice_discovery_changes_total" and dict(labels)["pool"] == "sim-model"}
        assert changes == {"added": 3.0, "removed": 1.0}  # the starting two, the one that joined; the one gone
        load.stop.set()
        await traffic
    finally:
        stack.stop()
        for sim in sims.values():
            sim.stop()

    assert not load.failures, load.failures[:5]
    assert load.ok >= 100, load.ok
    assert served_before <= finished_at_removal  # every request it got had finished there
    counts = {ip: load.served_by.get(addr[ip], 0) for ip in IPS}
    assert all(counts.values()), counts
