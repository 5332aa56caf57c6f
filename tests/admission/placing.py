"""A placer on a pool of fresh replicas, for the placement tests."""

from __future__ import annotations

from extproc.admission.placement import Placer
from extproc.config import PoolConfig, parse_section
from extproc.request import LLMRequest
from extproc.routing.pool import Pool, Replica

RATE = 10_000.0  # prompt tokens/s: a 10,000-token prompt prefills in 1 s


def placer(n: int = 4, **admission: object) -> Placer:
    """`n` replicas of 100,000 KV tokens each, prefilling RATE tokens/s whatever the prompt's size (prefill time
    linear in the prompt: `prefill_knee_tokens` 0, so each test's arithmetic is in plain tokens; the size model has
    its own tests, test_prefill_work.py); `admission` overrides the policy."""
    pool = Pool.from_config(PoolConfig(model="m", replicas=[f"10.0.0.{i}:8000" for i in range(n)]))
    policy = parse_section("admission", {"kv_capacity_tokens": 100_000, "prefill_tokens_per_s": RATE,
                                         "max_wait_s": 5.0, "prefill_knee_tokens": 0, **admission})
    return Placer(pool, policy)


def place(p: Placer, r: LLMRequest, lane: int, now: float) -> Replica:
    """Choose and commit, as the scheduler does; the request must fit."""
    pins = p.choose(r, lane, now)
    assert pins is not None
    p.commit(pins[0], r, lane, now)
    return pins[0]
