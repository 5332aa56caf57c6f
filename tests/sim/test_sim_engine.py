"""The engine model in simulated time (no I/O): scheduling, KV blocks, preemption, prefix cache."""

from __future__ import annotations

import random

import pytest

from extproc.sim.engine import FINISHED, RUNNING, WAITING, Engine, Request, block_hashes, run_offline
from extproc.sim.presets import TINY_CPU, CostModel

COST = TINY_CPU.cost


def make(blocks: int = 4096, **kw: object) -> Engine:
    return Engine(COST, num_gpu_blocks=blocks, **kw)  # type: ignore[arg-type]


def ttft(r: Request) -> float:
    assert r.first_token_at is not None
    return r.first_token_at - r.arrival


def test_idle_ttft_and_decode_follow_the_cost_model() -> None:
    r = Request("a", 100, 10)
    e = make()
    run_offline(e, [(0.0, r)])
    expected = COST.frontend + COST.frontend_tok * 100 + COST.step_seconds(100, 1, 100 * 50.5, 0)
    assert ttft(r) == pytest.approx(expected, rel=1e-9)
    assert r.finish_reason == "length" and r.num_output == 10
    # nine decode steps after the first token, each reading its context once
    gaps = (r.last_token_at - r.first_token_at) / 9
    assert 0.8 * COST.base < gaps < 2 * COST.base


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    e = make()
    r = Request("long", 5000, 1)
    e.add(r, 0.0)
    e.clock = 1.0
    chunks = []
    while not r.finished:
        step = e.schedule()
        assert step is not None
        chunks.append(sum(n for _, n in step.items))
        e.complete(step)
    assert chunks == [2048, 2048, 904]


def test_attention_makes_ttft_superlinear_in_prompt_length() -> None:
    t = {}
    for n in (4000, 8000):
        r = Request("r", n, 1)
        run_offline(make(), [(0.0, r)])
        t[n] = ttft(r)
    assert t[8000] > 2.5 * t[4000]


def test_short_request_behind_long_prompt_is_blocked_head_of_line() -> None:
    idle = Request("short", 100, 1)
    run_offline(make(), [(0.0, idle)])
    long = Request("long", 4000, 20)
    short = Request("short", 100, 1)
    run_offline(make(), [(0.0, long), (0.001, short)])
    assert ttft(short) > 10 * ttft(idle)
    # ...and it still gets its first token before the long prompt finishes generating.
    assert short.first_token_at is not None and long.last_token_at > short.first_token_at


def test_ttft_grows_with_the_waiting_queue() -> None:
    # max_num_seqs 4: the 20 requests queue; later arrivals wait for earlier ones to finish.
    e = make(max_num_seqs=4)
    reqs = [Request(f"r{i}", 200, 50) for i in range(20)]
    run_offline(e, [(0.0, r) for r in reqs])
    first = sum(ttft(r) for r in reqs[:4]) / 4
    last = sum(ttft(r) for r in reqs[-4:]) / 4
    assert last > 5 * first
    assert all(r.finish_reason == "length" for r in reqs)


def test_kv_usage_is_allocated_blocks_over_total() -> None:
    e = make(blocks=100)
    a, b = Request("a", 160, 100), Request("b", 33, 100)
    e.add(a, 0.0)
    e.add(b, 0.0)
    e.clock = 1.0
    e.complete(e.schedule())  # both prefilled, one token each
    # a: 160 tokens + 1 slot for the token fed back next step -> 10 blocks now (161 later);
    # b: 33 tokens -> 3 blocks
    assert a.num_blocks == 10 and b.num_blocks == 3
    assert e.kv_usage() == pytest.approx(13 / 99)  # one of the 100 blocks is the null block, as in vLLM
    e.complete(e.schedule())  # a needs an 11th block for token 161
    assert a.num_blocks == 11
    assert e.kv_usage() == pytest.approx(14 / 99)
    e.check_invariants()


def test_preemption_when_kv_cache_overflows() -> None:
    # 3 requests of 100 prompt tokens growing to 400: 25 blocks each at the end, 40 blocks total.
    e = make(blocks=40)
    reqs = [Request(f"r{i}", 100, 300) for i in range(3)]
    run_offline(e, [(0.0, r) for r in reqs])
    assert e.stats.preemptions > 0
    assert any(r.preemptions > 0 for r in reqs)
    assert all(r.finished and r.num_output == 300 for r in reqs)
    # the newest request is the one preempted first
    assert reqs[2].preemptions >= reqs[0].preemptions
    assert e.pool.used() == 0


def test_waiting_request_starts_only_when_its_blocks_fit() -> None:
    e = make(blocks=10)
    a = Request("a", 140, 5)  # 9 blocks
    b = Request("b", 40, 5)  # 3 blocks: does not fit while a runs
    e.add(a, 0.0)
    e.add(b, 0.0)
    e.clock = 1.0
    step = e.schedule()
    assert step is not None and [r.rid for r, _ in step.items] == ["a"]
    assert b.status == WAITING
    run_offline(e, [])
    assert b.finished and b.first_token_at is not None and a.last_token_at <= b.first_token_at


def test_a_prompt_is_admitted_only_when_all_its_blocks_fit_not_its_first_chunk() -> None:
    # 80 blocks of 128 (79 usable); four 2,500-token prompts of 20 blocks each, sent together. Three fit whole
    # (60 blocks); the fourth's first chunk (2,048 tokens, 16 blocks) fits in the 19 left but its whole prompt does
    # not. vLLM 0.32 (scheduler_reserve_full_isl, its default) keeps it waiting until one finishes: no preemption.
    def run(reserve_full_isl: bool) -> tuple[Engine, list[Request]]:
        e = Engine(COST, num_gpu_blocks=80, block_size=128, reserve_full_isl=reserve_full_isl)
        reqs = [Request(f"r{i}", 2500, 8) for i in range(4)]
        run_offline(e, [(0.0, r) for r in reqs])
        return e, reqs

    e, reqs = run(True)
    assert e.stats.preemptions == 0
    assert all(r.finished and r.num_output == 8 for r in reqs)
    assert reqs[3].first_scheduled is not None
    assert reqs[3].first_scheduled >= min(r.last_token_at for r in reqs[:3])
    # Admitting on the first chunk alone takes the fourth in, and the blocks run out under it a step later.
    e_chunk, reqs_chunk = run(False)
    assert e_chunk.stats.preemptions > 0
    assert all(r.finished for r in reqs_chunk)


def test_abort_frees_blocks_before_the_next_step() -> None:
    e = make(blocks=100)
    r = Request("a", 500, 1000)
    e.add(r, 0.0)
    e.clock = 1.0
    step = e.schedule()
    assert step is not None
    assert e.pool.used() > 0
    assert e.abort("a")
    assert e.pool.used() == 0 and r.finish_reason == "abort"
    touched = e.complete(step)  # the in-flight step ignores the aborted request
    assert touched == [] and r.num_output == 0
    assert e.schedule() is None
    assert e.stats.finished["abort"] == 1


def test_max_num_seqs_caps_the_running_batch() -> None:
    e = make(max_num_seqs=3)
    for i in range(5):
        e.add(Request(f"r{i}", 10, 100), 0.0)
    e.clock = 1.0
    e.complete(e.schedule())
    assert len(e.running) == 3 and len(e.waiting) == 2


def test_kv_shrink_preempts_and_oversized_requests_fail() -> None:
    e = make(blocks=100)
    reqs = [Request(f"r{i}", 300, 200) for i in range(3)]  # 19 blocks each at first
    for r in reqs:
        e.add(r, 0.0)
    e.clock = 1.0
    e.complete(e.schedule())
    assert len(e.running) == 3
    e.set_kv_lost_fraction(0.5)  # 50 usable blocks: only two fit
    e.complete(e.schedule())
    assert e.stats.preemptions >= 1 and len(e.running) == 2
    assert e.pool.used() <= e.pool.capacity
    e.check_invariants()
    big = Request("big", 1000, 10)  # 63 blocks > 50: can never run
    e.add(big, e.clock)
    run_offline(e, [])
    assert big.finish_reason == "abort"
    assert all(r.finish_reason == "length" for r in reqs)


def test_prefix_cache_shares_prompt_blocks_and_counts_tokens() -> None:
    e = make(blocks=200, prefix_cache=True)
    ids = list(range(1000))
    h = block_hashes(ids, 16)
    a = Request("a", 1000, 5, hashes=h)
    run_offline(e, [(0.0, a)])
    b = Request("b", 1000, 5, hashes=h)
    run_offline(e, [(e.clock + 1.0, b)])
    assert e.stats.prefix_queries == 2000
    assert e.stats.prefix_hits == 62 * 16  # all 62 full blocks of b's prompt were cached
    assert ttft(b) < 0.3 * ttft(a)
    e.check_invariants()
    # a different prompt sharing only the first 320 tokens hits 20 blocks
    c_ids = ids[:320] + [x + 10_000 for x in ids[320:]]
    c = Request("c", 1000, 5, hashes=block_hashes(c_ids, 16))
    run_offline(e, [(e.clock + 1.0, c)])
    assert e.stats.prefix_hits == 62 * 16 + 20 * 16


def test_cached_blocks_are_evicted_when_space_is_needed() -> None:
    e = make(blocks=70, prefix_cache=True)
    a = Request("a", 1000, 2, hashes=block_hashes(list(range(1000)), 16))
    run_offline(e, [(0.0, a)])
    assert e.kv_usage() == 0.0 and len(e.pool.evictable) == 62  # cached but free
    b = Request("b", 1000, 2, hashes=block_hashes(list(range(5000, 6000)), 16))
    run_offline(e, [(e.clock, b)])
    assert b.finish_reason == "length"
    e.check_invariants()


def test_kv_usage_counts_blocks_requests_hold_not_idle_cached_ones() -> None:
    """vLLM 0.32: `kv_cache_usage_perc` = 1 - free blocks / (blocks - the null block) (vllm/v1/core/block_pool.py
    `BlockPool.get_usage`), and a finished request's cached blocks go back to the free queue (evictable, still
    hashed). So idle cached blocks are free; a request reusing them takes them out of the free queue again (its
    whole prompt counts), and one sharing the blocks of a running request adds none of them."""
    e = make(blocks=100, prefix_cache=True)
    ids = list(range(800))  # 50 full blocks
    a = Request("a", 800, 2, hashes=block_hashes(ids, 16))
    run_offline(e, [(0.0, a)])
    assert e.kv_usage() == 0.0 and len(e.pool.evictable) == 50
    b, c = (Request(n, 800, 50, hashes=block_hashes(ids, 16)) for n in "bc")
    for r in (b, c):
        e.add(r, e.clock)
        e.clock = max(e.clock, r.ready_at)
        e.complete(e.schedule())
    assert b.num_blocks == 51 and c.num_blocks == 50 and len(c.shared) == 50  # b's 51st: its first decode token
    assert e.kv_usage() == pytest.approx(51 / 99)  # b's 50 prompt blocks, shared by c, and b's decode block
    assert e.stats.prefix_hits == 2 * 49 * 16
    e.check_invariants()


def test_same_arrivals_give_the_same_decisions() -> None:
    def trace(seed: int) -> list[tuple[float, int, int]]:
        rng = random.Random(seed)
        e = make(blocks=300, max_num_seqs=16)
        arrivals = [(rng.uniform(0, 2), Request(f"r{i}", rng.randint(10, 3000), rng.randint(1, 300)))
                    for i in range(60)]
        run_offline(e, arrivals)
        return [(r.first_token_at or -1.0, r.num_output, r.preemptions) for _, r in arrivals]

    assert trace(7) == trace(7)
    assert trace(7) != trace(8)


def test_invariants_hold_under_random_load() -> None:
    rng = random.Random(3)
    e = make(blocks=150, max_num_seqs=24, prefix_cache=True)
    prefixes = [list(range(k * 10_000, k * 10_000 + 800)) for k in range(3)]
    t = 0.0
    live: list[Request] = []
    for i in range(400):
        t += rng.expovariate(40)
        while e.clock < t and e.has_work():
            step = e.schedule()
            if step is None:
                e.clock = t
                break
            e.complete(step)
            e.check_invariants()
        e.clock = max(e.clock, t)
        ids = rng.choice(prefixes)[: rng.randint(20, 800)] + [rng.randint(0, 99) for _ in range(rng.randint(0, 200))]
        r = Request(f"r{i}", len(ids), rng.randint(1, 120), hashes=block_hashes(ids, 16))
        e.add(r, t)
        live.append(r)
        if rng.random() < 0.1:
            e.abort(rng.choice(live))
            e.check_invariants()
    run_offline(e, [])
    e.check_invariants()
    assert all(r.status == FINISHED for r in live)
    assert e.pool.used() == 0 and not e.running and not e.waiting
    assert e.stats.prefix_hits > 0


def test_slow_factor_stretches_steps() -> None:
    e = make()
    e.slow_factor = 5.0
    r = Request("a", 100, 1)
    run_offline(e, [(0.0, r)])
    assert ttft(r) == pytest.approx(COST.frontend + COST.frontend_tok * 100 + 5 * COST.step_seconds(100, 1, 100 * 50.5, 0))


def test_cost_model_formula() -> None:
    c = CostModel(base=1.0, prefill_tok=2.0, decode_seq=3.0, attn_pair=4.0, kv_read_tok=5.0, frontend=0)
    assert c.step_seconds(10, 2, 7, 11) == 1 + 20 + 6 + 28 + 55
    assert RUNNING != WAITING


def test_an_engine_at_half_the_speed_takes_twice_as_long_for_the_same_request() -> None:
    """`sluice sim --speed 0.5`: every engine step and the API server's work before it cost twice the preset's
    (a request alone: TTFT and finish time double); the /metrics and abort costs stay as measured."""
    slow_cost = COST.at_speed(0.5)
    fast, slow = Request("a", 1500, 20), Request("a", 1500, 20)
    run_offline(make(), [(0.0, fast)])
    run_offline(Engine(slow_cost, num_gpu_blocks=4096), [(0.0, slow)])
    assert ttft(slow) == pytest.approx(2 * ttft(fast), rel=1e-9)
    assert slow.last_token_at == pytest.approx(2 * fast.last_token_at, rel=1e-9)
    assert (slow_cost.abort, slow_cost.metrics_base) == (COST.abort, COST.metrics_base)
    assert COST.at_speed(1.0) is COST
    with pytest.raises(ValueError, match="speed"):
        COST.at_speed(0)


def test_a_request_arriving_while_the_engine_is_busy_takes_its_core_for_server_core() -> None:
    """The API server on the engine's core (vLLM-CPU): a request that arrives during a step lengthens the next step
    by server_core; one that arrives at an idle engine costs nothing but its own frontend delay."""
    from dataclasses import replace

    shared = replace(COST, server_core=0.01)
    alone, idle = Request("a", 100, 1), Request("a", 100, 1)
    run_offline(make(), [(0.0, alone)])
    run_offline(Engine(shared, num_gpu_blocks=4096), [(0.0, idle)])
    assert ttft(idle) == pytest.approx(ttft(alone), rel=1e-9)

    def second_step(cost: CostModel) -> tuple[float, Request]:
        long, short = Request("long", 100, 5), Request("short", 16, 1)
        e = Engine(cost, num_gpu_blocks=4096)
        run_offline(e, [(0.0, long), (COST.frontend + 0.001, short)])  # the short arrives during long's prefill
        assert long.first_token_at is not None
        return long.first_token_at, long

    plain_first, plain = second_step(COST)
    shared_first, slowed = second_step(shared)
    assert shared_first == pytest.approx(plain_first, rel=1e-9)  # the step running when it arrived is not touched
    assert slowed.last_token_at == pytest.approx(plain.last_token_at + 0.01, rel=1e-6)  # the next one pays it
