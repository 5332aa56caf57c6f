"""Redis killed mid-load -> local share limits, no exception escapes, `degraded`; Redis back -> shared again."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest
from prometheus_client import REGISTRY

from extproc.budgets import BudgetExceeded, Budgets
from tests.waiting import wait_for_async as _wait_for

from .conftest import RedisProc, policy, req


def _sample(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def _budgets(r: RedisProc, **extra) -> Budgets:
    return Budgets(policy("redis", r.url, "fb:", tasks={"max_calls": 20},
                          store={"fallback_share": 0.5,
                                 "redis": {"probe_interval_s": 0.05, "probe_max_interval_s": 0.2}}, **extra))


@pytest.mark.asyncio
async def test_kill_and_restart_under_load(redis_proc: RedisProc, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.budgets.store")
    b = _budgets(redis_proc)
    await b.start()
    assert not b.degraded
    enter0 = _sample("sluice_budget_store_fallback_transitions_total", {"direction": "enter"})
    exit0 = _sample("sluice_budget_store_fallback_transitions_total", {"direction": "exit"})
    unexpected: list[BaseException] = []
    backends: list[str] = []
    stop = asyncio.Event()

    async def worker(w: int) -> None:
        i = 0
        while not stop.is_set() and i < 5000:   # bounded
            i += 1
            try:
                c = await b.admit(req(tenant=f"load-{w}"))
                backends.append(c.backend)
                await asyncio.sleep(0.001)  # the request's run time between its admit and its settle
                await b.settle(c, completed=True, prompt_tokens=10, completion_tokens=5)
            except BudgetExceeded:
                pass
            except BaseException as exc:  # noqa: BLE001 - the point of the test
                unexpected.append(exc)
                return

    workers = [asyncio.create_task(worker(w)) for w in range(16)]
    await _wait_for(lambda: len(backends) >= 16, 2.0)  # the load runs
    assert backends and set(backends) == {"redis"}

    redis_proc.kill()                                   # mid-load
    assert await _wait_for(lambda: b.degraded, 2.0)
    assert _sample("sluice_budget_store_fallback_active") == 1.0
    # while down: this sidecar enforces its share (0.5) of max_calls=20 -> 10, with no per-request reconnects
    t = time.perf_counter()
    ok = 0
    for _ in range(200):
        try:
            c = await b.admit(req(task_id="t-down"))
            assert c.backend == "local"
            ok += 1
        except BudgetExceeded as e:
            assert e.code == "task_budget_exceeded" and "local share 10" in e.message
    elapsed = time.perf_counter() - t
    assert ok == 10
    assert elapsed < 0.5, f"200 admits while degraded took {elapsed:.3f} s"
    await asyncio.sleep(0.3)                            # several probe periods with Redis still down
    assert b.degraded
    assert _sample("sluice_budget_store_fallback_transitions_total", {"direction": "enter"}) - enter0 == 1
    assert len([r for r in caplog.records if getattr(r, "state", None) == "enter"]) == 1   # logged once

    redis_proc.start()                                  # same port, empty (no persistence)
    assert await _wait_for(lambda: not b.degraded, 5.0), b.store.stats()
    assert _sample("sluice_budget_store_fallback_active") == 0.0
    assert _sample("sluice_budget_store_fallback_transitions_total", {"direction": "exit"}) - exit0 == 1
    n = len(backends)
    await _wait_for(lambda: "redis" in backends[n:], 2.0)  # the load runs on Redis again
    stop.set()
    await asyncio.gather(*workers)
    assert not unexpected, unexpected[:3]
    assert backends[-1] == "redis" and "redis" in backends[n:]
    # shared limits again: the full 20 calls for a new task (the Redis side never saw the local ones)
    got = 0
    for _ in range(25):
        try:
            await b.admit(req(task_id="t-up"))
            got += 1
        except BudgetExceeded:
            pass
    assert got == 20
    await b.close()


@pytest.mark.asyncio
async def test_start_while_down_then_up(redis_proc: RedisProc) -> None:
    redis_proc.kill()
    b = _budgets(redis_proc)
    await b.start()                                     # no exception: starts degraded
    assert b.degraded
    c = await b.admit(req(task_id="x"))
    assert c.backend == "local"
    await b.settle(c, completed=True, prompt_tokens=1, completion_tokens=1)
    redis_proc.start()
    assert await _wait_for(lambda: not b.degraded, 5.0)
    assert (await b.admit(req(task_id="x"))).backend == "redis"
    await b.close()


@pytest.mark.asyncio
async def test_hung_redis_times_out_into_fallback(redis_proc: RedisProc) -> None:
    b = _budgets(redis_proc)
    await b.start()
    redis_proc.signal(signal.SIGSTOP)                   # accepts nothing, answers nothing
    try:
        t = time.perf_counter()
        c = await b.admit(req())
        first = time.perf_counter() - t
        assert c.backend == "local" and b.degraded
        assert first < 1.0                              # bounded by the socket timeout, not by TCP
        t = time.perf_counter()
        for _ in range(100):
            await b.admit(req())
        assert time.perf_counter() - t < 0.3            # later requests do not wait for Redis at all
    finally:
        redis_proc.signal(signal.SIGCONT)
    assert await _wait_for(lambda: not b.degraded, 5.0)
    await b.close()


@pytest.mark.asyncio
async def test_settles_queued_while_down_are_replayed(redis_proc: RedisProc) -> None:
    b = _budgets(redis_proc)
    await b.start()
    c = await b.admit(req(idempotency_key="idem"))      # a Redis charge with an in-flight marker
    redis_proc.signal(signal.SIGSTOP)
    try:
        await b.admit(req())                            # notices the hang, degrades
        assert b.degraded
        await b.settle(c, completed=True, prompt_tokens=1, completion_tokens=1)
        assert b.store.stats()["pending_settles"] == 1
    finally:
        redis_proc.signal(signal.SIGCONT)
    assert await _wait_for(lambda: not b.degraded, 5.0)
    assert b.store.stats()["pending_settles"] == 0
    # the replayed settle released the in-flight marker: the same key is now a retry, not a 409
    again = await b.admit(req(idempotency_key="idem"))
    assert again.is_retry and again.backend == "redis"
    await b.close()
