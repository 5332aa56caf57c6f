"""Policy reload under load (issue #10, part 2).

In-process: `apply_policy` (what every reload path calls) swapped back and forth while many requests are
submitted, queued, dispatched, cancelled and released: nothing is lost or left counted.
End to end: rewrite the stack's policy.yaml and SIGHUP the sidecar while streams are running.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from pathlib import Path

import orjson
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.config import policy_from_dict
from extproc.gateway import Gateway
from extproc.reload import apply_policy
from extproc.routing.pool import Replica
from extproc.config import policy_to_dict

from ..transitions import only_legal_transitions
from .conftest import BackgroundStream, assert_settled, metric_sum, running_stack, sim_metric, wait_for

pytestmark = pytest.mark.reliability

POOL = "reload-m"
BASE = {"pools": [{"model": POOL, "replicas": ["10.9.0.1:8000", "10.9.0.2:8000", "10.9.0.3:8000"]}],
        "admission": {"kv_capacity_tokens": 20000, "max_concurrency_per_replica": 3},
        "sidecar": {"max_queue_wait_ms": 1500, "message_timeout_ms": 100},
        "tenants": {"max_streams_per_tenant": 12}}
VARIANTS = [
    BASE,
    # a replica removed, another added: requests in flight on the removed one release to it
    {**BASE, "pools": [{"model": POOL, "replicas": ["10.9.0.1:8000", "10.9.0.4:8000"]}]},
    # tighter admission: fewer slots, different lane queue sizes (same number of lanes)
    {**BASE, "admission": {"kv_capacity_tokens": 20000, "max_concurrency_per_replica": 1, "lanes": [
        {"name": "short", "max_prefill_of_target": 0.1, "max_queue": 5},
        {"name": "normal", "max_prefill_of_target": 0.5},
        {"name": "long", "max_prefill_of_target": 1e6, "max_queue": 10}]}},
    # budgets and tenant limits replaced mid-flight
    {**BASE, "budgets": {"tasks": {"max_calls": 2}}, "tenants": {"max_streams_per_tenant": 2}},
    # a second pool appears, then (next variant) disappears again
    {**BASE, "pools": BASE["pools"] + [{"model": "reload-n", "replicas": ["10.9.1.1:8000"]}]},
]


async def _client(gw: Gateway, i: int, rng: random.Random, outcomes: dict[str, int]) -> None:
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
        base_pb2.HeaderValue(key="x-sluice-tenant", raw_value=f"t{i % 8}".encode()),
        base_pb2.HeaderValue(key="x-sluice-task-id", raw_value=f"task{i % 5}".encode())]))
    body = orjson.dumps({"model": POOL, "max_tokens": rng.choice([5, 50, 500]), "stream": True,
                         "messages": [{"role": "user", "content": "w " * rng.choice([10, 2000])}]})
    st = gw.open_stream()

    async def flow() -> str:
        gw.on_request_headers(st, headers)
        answer = await gw.on_request_body(st, pb.HttpBody(body=body, end_of_stream=True))
        if st.held:
            answer = await gw.wait(st)
        if answer.WhichOneof("response") == "immediate_response":
            return answer.immediate_response.details
        await asyncio.sleep(rng.uniform(0, 0.08))  # the replica generating
        gw.on_response_headers(st, pb.HttpHeaders(end_of_stream=True))
        return "completed"

    task = asyncio.ensure_future(flow())
    try:
        leave = rng.random() < 0.2
        done, _ = await asyncio.wait((task,), timeout=rng.uniform(0, 0.1) if leave else None)
        if not done:
            task.cancel()  # the client left: Envoy cancels the ext_proc stream
        try:
            outcome = await task
        except asyncio.CancelledError:
            outcome = "client_left"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        gw.finish(st)
        assert st.holds == 0


async def test_apply_policy_under_concurrent_load() -> None:
    rng = random.Random(10)
    gw = Gateway(policy_from_dict(BASE))
    seen: dict[int, Replica] = {}
    outcomes: dict[str, int] = {}
    reloads = 0

    def note_replicas() -> None:
        for pool in gw.pools.values():
            for r in pool.replicas:
                seen[id(r)] = r

    async def reloader() -> None:
        nonlocal reloads
        for k in range(40):
            await asyncio.sleep(rng.uniform(0.005, 0.03))  # reloads paced among the clients' requests
            note_replicas()
            apply_policy(gw, policy_from_dict(VARIANTS[(k + 1) % len(VARIANTS)]))
            note_replicas()
            reloads += 1

    async def clients() -> None:
        pending = set()
        for i in range(600):
            pending.add(asyncio.ensure_future(_client(gw, i, rng, outcomes)))
            if i % 20 == 0:
                await asyncio.sleep(0.01)  # the arrival pacing: 20 requests per 10 ms
        await asyncio.gather(*pending)

    note_replicas()
    with only_legal_transitions():
        await asyncio.wait_for(asyncio.gather(reloader(), clients()), 30)
    assert reloads == 40
    assert sum(outcomes.values()) == 600
    assert outcomes.get("completed", 0) > 100 and len(outcomes) >= 3, outcomes
    # nothing left counted, on any replica that ever existed (removed ones included), in any scheduler
    for r in seen.values():
        assert (r.inflight_requests, r.inflight_tokens, r.inflight_prompt_tokens) == (0, 0, 0), r
        assert not any(r.lane_inflight) and not any(r.lane_prefill_until), (r.address, r.lane_inflight)
        assert metric_value("sluice_inflight_requests", r.pool, r.address) == 0, r.address
        assert metric_value("sluice_inflight_tokens", r.pool, r.address) == 0, r.address
    for sched in gw.schedulers.values():
        assert sched.queued_total() == 0 and sum(sched.lane_requests) == 0 and sum(sched.lane_tokens) == 0
    assert gw.identity.open_streams == {}
    assert getattr(gw, "open_requests", 0) == 0


def metric_value(name: str, pool: str, replica: str) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples
               if s.name == name and s.labels.get("pool") == pool and s.labels.get("replica") == replica)


async def test_reload_keeps_lane_counters_of_inflight_requests() -> None:
    """Regression (bug 7 in docs/reliability.md): Placer.__init__ reset every replica's lane_inflight and lane_busy,
    so requests in flight across a reload released into fresh counters and left them negative for good."""
    from extproc.request import LLMRequest

    gw = Gateway(policy_from_dict(BASE))
    req = LLMRequest(request_id="", endpoint="chat", model=POOL, stream=True, prompt_tokens=10, max_output_tokens=10)
    placement = gw.schedulers[POOL].submit(req, 0.0)
    replica = placement.replica
    assert replica.lane_inflight[placement.lane] == 1
    apply_policy(gw, policy_from_dict(BASE))  # same policy: a no-op reload
    assert replica.lane_inflight[placement.lane] == 1, "the reload forgot a request in flight"
    placement.owner.release(placement, req)
    assert replica.lane_inflight == [0] * len(replica.lane_inflight)
    assert replica.lane_prefill_until == [0.0] * len(replica.lane_inflight)


# ---- end to end: SIGHUP ------------------------------------------------------------------------------------
@pytest.mark.integration
def test_sighup_reload_under_load(tmp_path: Path) -> None:
    """Rewrite the stack's policy.yaml (one replica removed, a tenant limit set) and SIGHUP the sidecar while four
    clients stream back to back: no request fails, the reload is applied, the removed replica gets no new work."""
    with running_stack(tmp_path) as stack:
        sidecar = stack.child("sidecar[0]")
        keep, drop = stack.policy.default_pool.replicas[:2], stack.policy.default_pool.replicas[2]
        results: list[tuple] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                results.append(BackgroundStream(stack.base_url, 60).join())

        threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # a second of load first: the reload lands while streams are in flight
        new = policy_to_dict(stack.policy)
        new["pools"][0]["replicas"] = keep
        new["tenants"] = {"max_streams_per_tenant": 50}
        (stack.run_dir / "policy.yaml").write_text(yaml.safe_dump(new, sort_keys=False))
        os.kill(sidecar.proc.pid, signal.SIGHUP)
        assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_policy_reloads_total", result="ok") >= 1, 5)
        served_drop = sim_metric(drop, "vllm:request_success_total")
        time.sleep(1.5)  # load on the new policy: the window in which the removed replica must get nothing new
        stop.set()
        for t in threads:
            t.join(15)
        assert sidecar.alive(), "SIGHUP killed the sidecar"
        failed = [r for r in results if not (r[0] == 200 and r[1] >= 60 and r[2] is None)]
        assert len(results) >= 8 and not failed, (len(results), failed)
        # the removed replica gets nothing new after the reload (at most what was already in flight)
        assert wait_for(lambda: sim_metric(drop, "vllm:num_requests_running") == 0, 5)
        assert sim_metric(drop, "vllm:request_success_total") - served_drop <= 4
        assert_settled(stack)
