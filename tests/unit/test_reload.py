"""Hot reload of the policy inside the sidecar: validate first, keep live state, migrate the queue."""

import asyncio

import pytest

from extproc.admission.queue import Waiter
from extproc.admission.scheduler import Placement
from extproc.config import PolicyError, policy_from_dict
from extproc.gateway import Gateway
from extproc.reload import apply_policy
from extproc.request import LLMRequest

BASE = {"pools": [{"model": "m", "replicas": ["10.0.0.1:8000", "10.0.0.2:8000"]}],
        "admission": {"kv_capacity_tokens": 10000, "max_concurrency_per_replica": 1}}


def req() -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=10,
                      max_output_tokens=10)


async def test_reload_keeps_replica_state_and_requeues_waiters():
    gw = Gateway(policy_from_dict(BASE))
    sched = gw.schedulers["m"]
    placed = [sched.submit(req(), 0.0) for _ in range(2)]
    assert all(isinstance(p, Placement) for p in placed)
    waiting = sched.submit(req(), 0.0)
    assert isinstance(waiting, Waiter)
    kept = gw.pools["m"].replicas[0]
    changes = apply_policy(gw, policy_from_dict({
        **BASE, "pools": [{"model": "m", "replicas": ["10.0.0.1:8000", "10.0.0.3:8000"]}]}))
    assert any("10.0.0.3:8000" in c for c in changes)
    assert gw.pools["m"].replicas[0] is kept and kept.inflight_requests == 1
    # the new replica is free: the re-queued waiter is dispatched there at once
    assert waiting.future.done()
    assert waiting.future.result().replica.address == "10.0.0.3:8000"
    # a request placed under the old policy releases to the scheduler that placed it
    placed[0].owner.release(placed[0], req())
    assert placed[0].replica.inflight_requests == 0


async def test_invalid_reload_changes_nothing():
    gw = Gateway(policy_from_dict(BASE))
    before = gw.admission
    with pytest.raises(ValueError):
        apply_policy(gw, policy_from_dict({**BASE, "admission": {"kv_margin": 3}}))
    assert gw.admission is before
    with pytest.raises(PolicyError):
        policy_from_dict({"pools": [{"model": "m", "replicas": ["bad"]}]})


async def test_removed_pool_sheds_its_waiters():
    gw = Gateway(policy_from_dict({**BASE, "pools": BASE["pools"] + [{"model": "n", "replicas": ["10.0.1.1:1"]}]}))
    s = gw.schedulers["m"]
    s.submit(req(), 0.0), s.submit(req(), 0.0)
    w = s.submit(req(), 0.0)
    apply_policy(gw, policy_from_dict({**BASE, "pools": [{"model": "n", "replicas": ["10.0.1.1:1"]}]}))
    assert w.future.done() and w.future.exception().status == 503
    await asyncio.sleep(0)  # one loop step: the shed waiters' done-callbacks run before the test's loop closes
