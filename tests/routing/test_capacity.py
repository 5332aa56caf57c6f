"""A pool's prompt-token throughput (routing/capacity.py): the busy rate is recorded by the scrape; reading the
capacity writes nothing."""

from __future__ import annotations

from extproc.config import PoolConfig
from extproc.routing.capacity import tokens_per_s
from extproc.routing.pool import EJECTED, EngineState, Pool


def test_capacity_is_each_routable_replicas_last_busy_prompt_rate_else_the_default():
    pool = Pool.from_config(PoolConfig(model="m", replicas=["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]))
    a, b, c = pool.replicas
    a.on_scrape(EngineState(running=2, prompt_tps=3000.0))  # busy: its rate is recorded
    a.on_scrape(EngineState(running=0, prompt_tps=10.0))    # idle since: the last busy rate stands
    b.on_scrape(EngineState(waiting=1, prompt_tps=0.0))      # busy but no rate seen: the default stands
    c.state = EJECTED
    before = [(r.busy_prompt_tps, r.engine) for r in pool.replicas]
    assert tokens_per_s(pool, 1000.0) == 3000.0 + 1000.0
    assert [(r.busy_prompt_tps, r.engine) for r in pool.replicas] == before  # reading changed nothing
