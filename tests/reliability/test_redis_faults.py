"""Redis (the shared budget store) killed mid-load and restarted (issue #10, part 2).

Clients see nothing but budget rejections: while Redis is down the sidecar enforces its local share of each
limit (`sluice_budget_store_fallback_active` = 1), and returns to the shared store once Redis answers again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.budgets.conftest import RedisProc

from .conftest import assert_settled, chat, metric_sum, running_stack, wait_for

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
MAX_CALLS = 4


def test_redis_killed_and_restarted_under_load(tmp_path: Path) -> None:
    redis = RedisProc()
    redis.start()
    try:
        overrides = {"budgets": {"store": {"kind": "redis", "redis": {
            "url": redis.url, "probe_interval_s": 0.2, "probe_max_interval_s": 0.5}},
            "tasks": {"max_calls": MAX_CALLS}}}
        with running_stack(tmp_path, overrides) as stack:
            _run(stack, redis)
    finally:
        redis.kill()


def _run(stack, redis: RedisProc) -> None:
    url = stack.metrics_url
    fallback: list[tuple[float, float]] = []  # (t, gauge) sampled during the run
    statuses: dict[tuple[int, str], int] = {}
    per_task: dict[str, tuple[int, float, float]] = {}  # task -> (calls admitted, first call, last call)
    timeline: dict[str, float] = {}
    t0 = time.monotonic()

    async def task_client(http: httpx.AsyncClient, task: str, calls: int) -> None:
        first, ok = time.monotonic() - t0, 0
        for _ in range(calls):
            resp = await http.post("/v1/chat/completions", json=chat(max_tokens=20),
                                   headers={"x-sluice-task-id": task})
            code = resp.json()["error"]["code"] if resp.status_code != 200 else ""
            statuses[(resp.status_code, code)] = statuses.get((resp.status_code, code), 0) + 1
            ok += resp.status_code == 200
        per_task[task] = (ok, first, time.monotonic() - t0)

    async def load() -> None:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as http:
            n = 0
            while time.monotonic() - t0 < 7.0:
                # a fresh task every round: MAX_CALLS + 2 calls each, so every task also meets its budget
                await asyncio.gather(*(task_client(http, f"task-{n}-{i}", MAX_CALLS + 2) for i in range(4)))
                n += 1

    async def chaos() -> None:  # the fault timeline: Redis down from 1.5 s to 4 s into the load
        await asyncio.sleep(1.5)
        redis.kill()
        timeline["killed"] = time.monotonic() - t0
        await asyncio.sleep(2.5)
        redis.start()
        timeline["restarted"] = time.monotonic() - t0

    async def sample() -> None:
        while time.monotonic() - t0 < 7.5:
            value = await asyncio.to_thread(metric_sum, url, "sluice_budget_store_fallback_active")
            fallback.append((time.monotonic() - t0, value))
            await asyncio.sleep(0.1)  # the sampling period of the fallback timeline

    async def main() -> None:
        await asyncio.gather(load(), chaos(), sample())

    asyncio.run(main())

    # clients saw successes and budget rejections only
    assert set(statuses) <= {(200, ""), (429, "task_budget_exceeded")}, statuses
    ok, rejected = statuses.get((200, ""), 0), statuses.get((429, "task_budget_exceeded"), 0)
    assert ok > 20 and rejected > 5, statuses
    # A task that ran wholly on one store (Redis before the kill, the local fallback, the restarted Redis) got
    # exactly its budget. One that straddled a switch may get up to one budget per store: the local fallback
    # does not know what Redis counted, and a restarted Redis (no persistence) starts empty.
    switches = (timeline["killed"], timeline["restarted"])
    for task, (admitted, first, last) in per_task.items():
        straddles = any(first - 0.6 <= t <= last + 0.6 for t in switches)  # 0.6 s: detection and probe time
        if straddles:
            assert MAX_CALLS <= admitted <= 2 * MAX_CALLS, (task, admitted, first, last, timeline)
        else:
            assert admitted == MAX_CALLS, (task, admitted, first, last, timeline)
    assert sum(not any(f - 0.6 <= t <= l + 0.6 for t in switches) for _a, f, l in per_task.values()) >= 10
    # fallback: entered while Redis was down, left after it came back
    during = [v for t, v in fallback if timeline["killed"] + 0.5 < t < timeline["restarted"]]
    assert during and max(during) == 1, fallback
    assert wait_for(lambda: metric_sum(url, "sluice_budget_store_fallback_active") == 0, 5), fallback
    assert metric_sum(url, "sluice_budget_store_fallback_transitions_total", direction="enter") >= 1
    assert metric_sum(url, "sluice_budget_store_fallback_transitions_total", direction="exit") >= 1
    # and the shared store is used again: a new task's calls are counted in Redis
    with httpx.Client(base_url=stack.base_url, timeout=10) as http:
        codes = [http.post("/v1/chat/completions", json=chat(), headers={"x-sluice-task-id": "after"}).status_code
                 for _ in range(MAX_CALLS + 1)]
    assert codes == [200] * MAX_CALLS + [429], codes
    import redis as redis_client

    keys = redis_client.Redis.from_url(redis.url).keys("*after*")
    assert keys, "the task budget is not kept in Redis after recovery"
    assert_settled(stack)
    print(f"\nredis: statuses {statuses}, kill at {timeline['killed']:.1f}s, restart at {timeline['restarted']:.1f}s, "
          f"fallback samples {[(round(t, 1), v) for t, v in fallback if v]}[:3]..., tasks {len(per_task)}, "
          f"admitted per straddling task {[a for a, f, l in per_task.values() if a != MAX_CALLS]}")
