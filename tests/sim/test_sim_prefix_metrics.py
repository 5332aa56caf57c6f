"""Prefix caching on by default (block-granular, LRU eviction, vLLM's token counters), the measured /metrics
latency and its contended fault, and the running gauge's lag after an abort."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from extproc.sim import cli
from extproc.sim.engine import Engine, Request, block_hashes, run_offline
from extproc.sim.metrics import SimCollector, make_registry, render
from extproc.sim.presets import TINY_CPU

from ..waiting import wait_for_async
from .conftest import chat_body, words


def test_prefix_caching_is_on_by_default_and_has_vllms_off_switch() -> None:
    assert cli.build_parser().parse_args(["--port", "1"]).prefix_cache is True
    assert cli.build_parser().parse_args(["--port", "1", "--no-enable-prefix-caching"]).prefix_cache is False
    assert TINY_CPU.block_size == 128  # vLLM's CPU backend


def test_lru_eviction_reuses_the_least_recently_used_cached_blocks_first() -> None:
    bs = 16
    e = Engine(TINY_CPU.cost, num_gpu_blocks=41, block_size=bs)  # 40 + the null block
    a_ids, b_ids = list(range(320)), list(range(10_000, 10_320))
    for rid, ids in (("a", a_ids), ("b", b_ids)):
        r = Request(rid, len(ids), 1, hashes=block_hashes(ids, bs))
        run_offline(e, [(e.clock, r)])
    assert len(e.pool.evictable) == 40  # a's 20 blocks, then b's 20: all cached, all free
    c_ids = list(range(50_000, 50_000 + 10 * bs))  # needs 10 (+1) blocks: taken from a's, the older
    c = Request("c", len(c_ids), 1, hashes=block_hashes(c_ids, bs))
    run_offline(e, [(e.clock, c)])
    cached = set(e.pool.refs)
    assert set(block_hashes(b_ids, bs)) <= cached
    assert not set(block_hashes(a_ids, bs)[:10]) & cached
    e.check_invariants()


async def test_default_sim_counts_prefix_hits_in_whole_blocks(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20)
    system = {"role": "system", "content": words(700)}
    for question in ("first question here", "another different question"):
        body = chat_body(max_tokens=2)
        body["messages"] = [system, {"role": "user", "content": question}]
        async with http.post(sim.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            prompt = (await r.json())["usage"]["prompt_tokens"]
    st = sim.engine.stats
    assert st.prefix_queries > 2 * 700
    assert st.prefix_hits == (700 // 128) * 128  # the system prompt's full 128-token blocks, nothing more
    async with http.get(sim.url + "/metrics") as r:
        text = await r.text()
    assert f'vllm:prefix_cache_hits_total{{engine="0",model_name="sim-model"}} {float(st.prefix_hits)}' in text
    assert prompt > 700


async def test_no_prefix_caching_flag_turns_hits_off(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20, prefix_cache=False)
    for _ in range(2):
        async with http.post(sim.url + "/v1/chat/completions", json=chat_body(words(600), max_tokens=2)) as r:
            assert r.status == 200
    assert sim.engine.stats.prefix_hits == 0


async def _scrape_seconds(http: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        await r.read()
    return time.perf_counter() - t0


async def test_metrics_latency_fault_fixed_and_contended(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=1, faults=[("metrics-latency", 0.3)])
    assert await _scrape_seconds(http, sim.url) >= 0.3
    t0 = time.perf_counter()
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200
    assert time.perf_counter() - t0 < 0.3  # only /metrics is slow
    await sim.apply_fault("metrics-latency", "contended")
    lo, hi = min(TINY_CPU.metrics_contended), max(TINY_CPU.metrics_contended)
    took = await _scrape_seconds(http, sim.url)
    assert lo * 0.9 <= took <= hi + 1.0
    await sim.apply_fault("clear")
    assert sim.faults.metrics_latency == 0.0


async def test_metrics_take_the_measured_idle_latency(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=1)
    assert TINY_CPU.cost.metrics_base > 0
    assert await _scrape_seconds(http, sim.url) >= TINY_CPU.cost.metrics_base


async def test_abort_stops_generation_at_once_but_the_gauge_lags(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=0.2)  # 5x slower: the gauge's lag is 5x the measured one
    got = 0
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=500, stream=True)) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                got += 1
            if got >= 3:
                break
    assert await wait_for_async(lambda: not sim.engine.running, timeout=5)
    assert sim.collector.lagging_running == 1  # vllm:num_requests_running still counts it
    assert sim.engine.stats.ghost_tokens <= 1
    assert await wait_for_async(lambda: sim.collector.lagging_running == 0, timeout=5 + TINY_CPU.cost.abort / 0.2)
    await asyncio.sleep(0)


def test_the_waiting_gauge_counts_only_requests_that_reached_the_engine() -> None:
    """vLLM's num_requests_waiting is its scheduler's queue: a request the API server is still tokenizing (the
    preset's frontend delay) is not in it yet."""
    e = Engine(TINY_CPU.cost, num_gpu_blocks=200, block_size=128)
    now = [0.0]

    def page() -> str:
        return render(make_registry(SimCollector(lambda: e, "m", now_ref=lambda: now[0]))).decode()

    e.add(Request("a", 6_000, 1), 0.0)
    delay = TINY_CPU.cost.frontend + TINY_CPU.cost.frontend_tok * 6_000
    assert len(e.waiting) == 1 and e.waiting_in_engine(0.0) == 0
    assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0' in page()
    now[0] = delay
    assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0' in page()


def test_finished_requests_prefill_time_and_computed_tokens_as_vllm_records_them() -> None:
    """vLLM observes, per request it finishes, the seconds from its first scheduling to its first token and the
    prompt tokens it computed (its prefix-cache hit excluded); the sidecar reads them as a light-load lower bound
    of the prefill speed (admission/prefill_rate.py), so the simulator must export them the same way."""
    from extproc.routing.metric_names import VLLM
    from extproc.routing.scrape import MetricsParser

    bs = 128
    e = Engine(TINY_CPU.cost, num_gpu_blocks=200, block_size=bs)
    ids = list(range(2_000))
    a = Request("a", len(ids), 4, hashes=block_hashes(ids, bs))
    run_offline(e, [(0.0, a)])
    b = Request("b", len(ids), 4, hashes=block_hashes(ids, bs))  # the same prompt: 15 of its blocks cached
    aborted = Request("c", 3_000, 400)
    run_offline(e, [(e.clock, b), (e.clock, aborted)], until=e.clock + 0.5)
    assert not aborted.finished and e.abort("c")
    run_offline(e, [])
    p = MetricsParser(VLLM).parse(render(make_registry(SimCollector(lambda: e, "m"))))
    assert p.prefill_s_count == 2  # a and b; the abort is not observed (vLLM records only what it finished)
    assert p.prefill_new_sum == 2_000 + (2_000 - 15 * bs)
    want = sum(r.first_token_at - r.first_scheduled for r in (a, b))  # type: ignore[operator]
    assert p.prefill_s_sum is not None and abs(p.prefill_s_sum - want) < 1e-9 and want > 0
