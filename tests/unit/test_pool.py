"""Picking replicas by the sidecar's own in-flight token accounting."""

from extproc.config import PoolConfig
from extproc.routing.pool import Pool


def make_pool(n: int = 3) -> Pool:
    return Pool.from_config(PoolConfig(model="m", replicas=[f"127.0.0.1:{9000 + i}" for i in range(n)]))


def test_pick_returns_least_loaded_then_runner_up():
    pool = make_pool()
    a, b, c = pool.replicas
    a.place(1000)
    b.place(10)
    pins = pool.pick(100)
    assert pins == [c, b]


def test_ties_broken_by_request_count():
    pool = make_pool(2)
    a, b = pool.replicas
    a.place(0)
    assert pool.pick(1)[0] is b


def test_spreads_successive_placements():
    pool = make_pool(3)
    chosen = []
    for _ in range(6):
        r = pool.pick(100)[0]
        r.place(100)
        chosen.append(r.address)
    assert sorted(chosen.count(r.address) for r in pool.replicas) == [2, 2, 2]


def test_release_restores_accounting_and_counts_served():
    pool = make_pool(1)
    (r,) = pool.replicas
    r.place(500)
    r.release(500)
    assert (r.inflight_requests, r.inflight_tokens, r.served_total) == (0, 0, 1)


def test_draining_replicas_are_not_picked_and_single_replica_has_no_fallback():
    pool = make_pool(2)
    pool.replicas[0].draining = True
    assert pool.pick(1) == [pool.replicas[1]]
    pool.replicas[1].draining = True
    assert pool.pick(1) == []
