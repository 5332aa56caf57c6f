"""The Lua scripts and the MemoryStore implement the same semantics: a seeded random walk of admits and settles
(duplicates, retries, task limits, active tasks, tenant windows, corrections) gives identical results on both."""

from __future__ import annotations

import random
import uuid

import pytest

from extproc.budgets.policy import RedisPolicy
from extproc.budgets.store import OK, AdmitOp, MemoryStore, RedisStore, SettleOp, window_index

T0 = 1_000_020.0


def _random_op(rng: random.Random, now: float, n: int) -> AdmitOp:
    op = AdmitOp(now, f"tok-{n}")
    tenant = rng.choice(["a", "b"])
    op.markers = tuple(f"m:{tenant}:{k}:{rng.randrange(6)}" for k in rng.sample(["i", "r", "f"], rng.randrange(0, 3)))
    op.inflight_ttl_s = 3600.0
    op.retry_hint = rng.random() < 0.3
    if rng.random() < 0.9:
        op.set_retry(f"rw:p:{rng.choice(['m1', 'm2'])}", f"rw:t:{tenant}", 0.2, 2, 10.0)
    if rng.random() < 0.8:
        task = rng.randrange(4)
        op.set_task(f"t:{tenant}:{task}", f"ta:{tenant}", str(task), rng.randrange(10, 200), 12, 1500,
                    rng.choice([0.0, 40.0]), rng.choice([0, 2]), 7200.0)
    if rng.random() < 0.8:
        op.set_quota(f"q:{tenant}", rng.randrange(10, 300), 900, 60.0)
    return op


def _settle_for(op: AdmitOp, rng: random.Random, now: float) -> SettleOp:
    s = SettleOp(now, op.token)
    s.markers = op.markers
    s.dedupe_ttl_s = 3600.0
    delta = rng.randrange(-150, 60)
    if op.t_on:
        s.t_on, s.t_key, s.t_active_key, s.t_member = True, op.t_key, op.t_active_key, op.t_member
        s.t_delta, s.t_active_on, s.t_idle_s = delta, op.t_max_active > 0, 5.0
    if op.q_on:
        s.q_on, s.q_name, s.q_window_s, s.q_delta = True, op.q_name, 60.0, delta
        s.q_idx = window_index(op.now, 60.0)[0]
    return s


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_memory_and_redis_agree(redis_server, seed: int) -> None:
    rng = random.Random(seed)
    mem = MemoryStore()
    red = RedisStore(RedisPolicy(url=redis_server.url, key_prefix=f"parity-{uuid.uuid4().hex[:8]}:"))
    await red.start()
    now = T0
    open_ops: list[AdmitOp] = []
    codes = set()
    for n in range(400):
        now += rng.choice([0.0, 0.0, 0.3, 1.7, 4.0])
        if open_ops and rng.random() < 0.45:
            op = open_ops.pop(rng.randrange(len(open_ops)))
            s = _settle_for(op, rng, now)
            mem.settle_sync(s)
            await red.settle(s)
            continue
        op = _random_op(rng, now, n)
        a = mem.admit_sync(op)
        b = await red.admit(op)
        assert (a.code, a.is_retry, a.detail) == (b.code, b.is_retry, b.detail), (n, a, b)
        assert a.used == pytest.approx(b.used) and a.limit == pytest.approx(b.limit), (n, a, b)
        codes.add(a.code)
        if a.code == OK:
            open_ops.append(op)
    assert not red.degraded
    assert codes == {0, 1, 2, 3, 4}  # the walk exercised every outcome
    await red.close()
