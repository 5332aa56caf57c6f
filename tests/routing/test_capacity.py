"""What a pool sustains (routing/capacity.py): the prefill throughput measured while the engine had a queue, between
prefill ends (engines count a prompt in one lump when its prefill ends); the rate a lightly loaded engine shows is
the offered load, only a fallback; reading the capacity writes nothing."""

from __future__ import annotations

import pytest

from extproc.config import PoolConfig
from extproc.routing.capacity import requests_per_s
from extproc.routing.pool import EJECTED, EngineState, Pool, Replica
from extproc.routing.scrape import ScrapedState


def _scrape(r: Replica, at: float, waiting: int, firsts: float, prompts: float, running: int = 4,
            offered_tps: float = 0.0, restarted: bool = False) -> None:
    r.on_scrape(ScrapedState(scraped_at=at, running=running, waiting=waiting, first_tokens_total=firsts,
                             prompt_tokens_total=prompts, prompt_tps=offered_tps, restarted=restarted))


def _in_flight(r: Replica, n: int, prompt: int) -> None:
    for _ in range(n):
        r.place(prompt + 48, prompt)


def test_a_lightly_loaded_engine_shows_the_offered_load_not_its_capacity():
    """P10 before its change: one prompt at a time, the engine never queues; its 10-s window rate (1,050 tokens/s)
    is what was sent. Then a queue forms and prefills end every 1.5 s: 5,000 tokens each as the engine counts them,
    3,333 /s, whatever this sidecar estimated for them (6,000: the rate is in the engine's units, those of the
    calibrated estimate it is divided by)."""
    pool = Pool.from_config(PoolConfig(model="m", replicas=["10.0.0.1:1"]))
    r = pool.replicas[0]
    _in_flight(r, 1, 1_000)
    for i in range(10):
        _scrape(r, 1.0 + 0.2 * i, 0, 10 + i // 5, 1_000 * (10 + i // 5), running=1, offered_tps=1_050.0)
    assert requests_per_s(pool, 1_000, 10_000.0) == pytest.approx(1.05)  # fallback: a lower bound
    r.release(1_048, 1_000)
    _in_flight(r, 4, 6_000)
    firsts, at = 12, 5.0
    _scrape(r, at, 2, firsts, 12_000)
    for k in range(1, 16):  # a prefill ends at every 1.5 s, scraped every 0.25 s (the end seen up to 0.25 s late)
        at = 5.0 + 0.25 * k
        firsts = 12 + (k + 1) // 6
        _scrape(r, at, 2, firsts, 12_000 + 5_000 * (firsts - 12), offered_tps=1_050.0)
    assert r.saturated.rate == pytest.approx(5_000 / 1.5)
    assert requests_per_s(pool, 5_000, 10_000.0) == pytest.approx(1 / 1.5)


def test_the_first_prefill_end_of_a_saturated_run_is_not_counted():
    """The prompt that ends first was mostly prefilled before the run was seen: counting it over the run's time
    doubled the rate of a two-prefill run."""
    pool = Pool.from_config(PoolConfig(model="m", replicas=["10.0.0.1:1"]))
    r = pool.replicas[0]
    _in_flight(r, 3, 5_000)
    _scrape(r, 1.0, 1, 0, 0)
    _scrape(r, 1.2, 1, 1, 5_000)          # an end 0.2 s into the run: the anchor, not a measurement
    assert r.saturated.rate == 0.0
    _scrape(r, 2.7, 1, 2, 10_000)         # the next, 1.5 s later
    assert r.saturated.rate == pytest.approx(5_000 / 1.5)
    _scrape(r, 2.9, 0, 2, 10_000)         # the queue drained: the run ends, the rate stands
    _scrape(r, 3.1, 1, 3, 15_000)
    _scrape(r, 3.3, 1, 4, 20_000)         # a new run: its first end is an anchor again
    assert r.saturated.rate == pytest.approx(5_000 / 1.5)
    _scrape(r, 3.5, 1, 0, 0, restarted=True)  # the engine restarted: no end counted across it
    _scrape(r, 3.7, 1, 1, 5_000)
    assert r.saturated.rate == pytest.approx(5_000 / 1.5)


def test_capacity_sums_the_routable_replicas_and_reading_it_changes_nothing():
    pool = Pool.from_config(PoolConfig(model="m", replicas=["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]))
    a, b, c = pool.replicas
    a.on_scrape(EngineState(running=2, prompt_tps=3000.0))  # busy: its rate is recorded
    a.on_scrape(EngineState(running=0, prompt_tps=10.0))    # idle since: the last busy rate stands
    b.on_scrape(EngineState(waiting=1, prompt_tps=0.0))      # busy but no rate seen: the default stands
    c.state = EJECTED
    before = [(r.busy_prompt_tps, r.saturated, r.engine) for r in pool.replicas]
    assert requests_per_s(pool, 1000.0, 1000.0) == pytest.approx(3.0 + 1.0)
    assert [(r.busy_prompt_tps, r.saturated, r.engine) for r in pool.replicas] == before
