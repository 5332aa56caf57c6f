"""Windowed values from counter and histogram deltas: p95 TTFT, tokens/s, restarts, staleness."""

from __future__ import annotations

import math

import pytest

from extproc.routing.metric_names import SGLANG, VLLM
from extproc.routing.pool import Replica
from extproc.routing.scrape import History, MetricsParser, build_state, histogram_quantile, is_fresh

from .pages import sglang_page, vllm_page

INF = math.inf
VP = MetricsParser(VLLM)


def state_after(pages: list[tuple[float, bytes]], window_s: float = 10.0, parser: MetricsParser = VP):
    hist = History(window_s, maxlen=1000)
    st = None
    for t, page in pages:
        st = build_state(t, parser.parse(page), hist)
    return st


# ---- histogram_quantile ---------------------------------------------------------------------------------------

def test_quantile_interpolates_inside_the_bucket():
    # 100 samples: 50 in (0, 1], 40 in (1, 2], 10 in (2, 4]; rank 95 is 5/10 into (2, 4] -> 3.0
    assert histogram_quantile(0.95, (1.0, 2.0, 4.0, INF), [50, 90, 100, 100]) == pytest.approx(3.0)
    # median: rank 50 is the whole first bucket -> its upper bound
    assert histogram_quantile(0.5, (1.0, 2.0, 4.0, INF), [50, 90, 100, 100]) == pytest.approx(1.0)
    # the first bucket starts at 0: rank 19 of 20 in (0, 0.1] -> 0.095
    assert histogram_quantile(0.95, (0.1, INF), [20, 20]) == pytest.approx(0.095)


def test_quantile_in_the_inf_bucket_returns_the_highest_finite_bound():
    assert histogram_quantile(0.95, (1.0, 10.0, INF), [10, 10, 100]) == 10.0


def test_quantile_of_empty_histogram_is_zero():
    assert histogram_quantile(0.95, (1.0, INF), [0, 0]) == 0.0
    assert histogram_quantile(0.95, (), []) == 0.0


def test_quantile_skips_empty_buckets_before_the_rank():
    # all 10 samples in (5, 10]: p95 = 5 + 5 * 9.5/10
    assert histogram_quantile(0.95, (1.0, 5.0, 10.0, INF), [0, 0, 10, 10]) == pytest.approx(9.75)


# ---- windows --------------------------------------------------------------------------------------------------

def test_first_scrape_has_no_window_yet():
    st = state_after([(100.0, vllm_page(running=2, gen=5000, ttft=[30.0] * 50))])
    assert st.window_span_s == 0.0
    assert st.generation_tps == 0.0 and st.ttft_count_window == 0.0 and st.ttft_p95_s == 0.0
    assert st.running == 2 and st.scraped_at == 100.0 and not st.restarted


def test_rates_and_p95_come_from_deltas_not_totals():
    old = [30.0] * 50                 # slow first tokens before the window: must not count
    new = [0.2] * 19 + [3.0]          # 20 in the window: p95 rank 19 -> in (0.1, 0.5]
    st = state_after([
        (100.0, vllm_page(running=4, gen=1000, prompt=10_000, ttft=old)),
        (102.0, vllm_page(running=4, gen=1800, prompt=14_000, ttft=old + new)),
    ])
    assert st.window_span_s == 2.0
    assert st.generation_tps == pytest.approx(400.0)
    assert st.prompt_tps == pytest.approx(2000.0)
    assert st.ttft_count_window == 20
    assert st.ttft_p95_s == pytest.approx(0.5)   # 19/20 lands at the top of (0.1, 0.5]
    assert st.running_avg == 4.0


def test_window_drops_observations_older_than_window_s():
    slow = [30.0] * 20
    fast = [0.07] * 20
    pages = [(0.0, vllm_page(ttft=[])), (1.0, vllm_page(ttft=slow))]
    t = 1.0
    while t < 14.0:
        t += 1.0
        pages.append((t, vllm_page(ttft=slow + fast)))
    st = state_after(pages, window_s=10.0)
    # the window [4, 14] no longer holds the slow first tokens observed at t=1
    assert st.ttft_count_window == 0
    pages.append((15.0, vllm_page(ttft=slow + fast + fast)))
    st = state_after(pages, window_s=10.0)
    assert st.ttft_count_window == 20 and st.ttft_p95_s < 0.1
    assert st.window_span_s == pytest.approx(10.0)


def test_running_average_over_the_window():
    st = state_after([(0.0, vllm_page(running=0)), (1.0, vllm_page(running=0)), (2.0, vllm_page(running=9))])
    assert st.running == 9 and st.running_avg == pytest.approx(3.0)


def test_counter_going_down_marks_a_restart_and_restarts_the_window():
    st = state_after([
        (0.0, vllm_page(gen=50_000, ttft=[1.0] * 30)),
        (1.0, vllm_page(gen=50_400, ttft=[1.0] * 31)),
        (2.0, vllm_page(gen=10, ttft=[])),
    ])
    assert st.restarted
    assert st.window_span_s == 0.0 and st.generation_tps == 0.0
    st2 = state_after([(0.0, vllm_page(gen=5)), (1.0, vllm_page(gen=15))])
    assert not st2.restarted and st2.generation_tps == pytest.approx(10.0)


def test_bucket_layout_change_restarts_the_window_without_a_restart():
    st = state_after([
        (0.0, vllm_page(gen=100, ttft=[0.2] * 5)),
        (1.0, vllm_page(gen=200, ttft=[0.2] * 6, bounds=(0.5, 1.0))),
    ])
    assert not st.restarted and st.window_span_s == 0.0


def test_kv_capacity_preemptions_and_errors():
    st = state_after([(0.0, vllm_page(kv=0.5, preemptions=3, blocks=1000, errors=2)),
                      (5.0, vllm_page(kv=0.75, preemptions=7, blocks=1000, errors=4))])
    assert st.kv_capacity_tokens == 16_000
    assert st.kv_usage == 0.75
    assert st.preemptions_total == 7 and st.preemptions_window == 4
    assert st.errors_total == 4


def test_sglang_state_uses_counter_and_falls_back_to_the_throughput_gauge():
    sp = MetricsParser(SGLANG)
    st = state_after([(0.0, sglang_page(running=3, usage=0.4, gen=1000, hit_rate=0.3)),
                      (2.0, sglang_page(running=3, usage=0.5, gen=1600, gen_throughput=999.0, hit_rate=0.3))],
                     parser=sp)
    assert st.generation_tps == pytest.approx(300.0)   # counter delta wins over the gauge
    assert st.kv_usage == 0.5 and st.prefix_hit_rate == 0.3 and st.running == 3
    st = state_after([(0.0, sglang_page(gen=None, gen_throughput=50.0)),
                      (2.0, sglang_page(gen=None, gen_throughput=70.0))], parser=sp)
    assert st.generation_tps == 70.0


def test_history_is_bounded():
    hist = History(window_s=1e9, maxlen=8)
    for i in range(100):
        build_state(float(i), VP.parse(vllm_page(gen=i)), hist)
    assert len(hist.snaps) == 8


# ---- freshness ------------------------------------------------------------------------------------------------

def test_is_fresh():
    r = Replica(address="127.0.0.1:1", pool="m")
    assert not is_fresh(r, 10.0, 1.0)        # never scraped
    r.engine.scraped_at = 9.5
    assert is_fresh(r, 10.0, 1.0)
    assert is_fresh(r, 10.5, 1.0)
    assert not is_fresh(r, 10.51, 1.0)


def test_a_gap_longer_than_max_gap_restarts_the_window():
    hist = History(10.0, maxlen=100, max_gap_s=1.0)
    build_state(0.0, VP.parse(vllm_page(gen=0, ttft=[])), hist)
    build_state(0.5, VP.parse(vllm_page(gen=50, ttft=[9.0] * 10)), hist)
    st = build_state(3.0, VP.parse(vllm_page(gen=60, ttft=[9.0] * 10)), hist)  # 2.5 s outage
    assert not st.restarted
    assert st.window_span_s == 0.0 and st.ttft_count_window == 0   # the slow first tokens are forgotten
    st = build_state(3.5, VP.parse(vllm_page(gen=80, ttft=[9.0] * 10 + [0.2])), hist)
    assert st.ttft_count_window == 1 and st.generation_tps == pytest.approx(40.0)


def test_a_gap_of_slow_answers_keeps_the_window():
    """Issue 16: a busy vLLM answers /metrics seconds late now and then. Such a gap is not an outage: the window
    keeps covering the lumps in which vLLM refreshes its counters (a restart there left 3 s windows holding no
    lump: 0 tokens/s, tps_collapse). A gap longer than the whole window restarts it anyway."""
    hist = History(10.0, maxlen=100, max_gap_s=1.0)
    build_state(0.0, VP.parse(vllm_page(gen=0, ttft=[])), hist)
    build_state(0.5, VP.parse(vllm_page(gen=50, ttft=[0.2] * 10)), hist)
    st = build_state(3.0, VP.parse(vllm_page(gen=250, ttft=[0.2] * 12)), hist, outage=False)
    assert st.window_span_s == 3.0 and st.ttft_count_window == 12
    assert st.generation_tps == pytest.approx(250 / 3.0)
    st = build_state(14.0, VP.parse(vllm_page(gen=300, ttft=[0.2] * 12)), hist, outage=False)
    assert st.window_span_s == 0.0


def test_recent_ttft_covers_the_last_recent_s_only():
    """Slow start judges each step by that step's first tokens (health.py)."""
    hist = History(10.0, maxlen=100, recent_s=1.0)
    build_state(0.0, VP.parse(vllm_page(ttft=[])), hist)
    build_state(1.0, VP.parse(vllm_page(ttft=[9.0] * 10)), hist)
    st = build_state(2.0, VP.parse(vllm_page(ttft=[9.0] * 10 + [0.2] * 4)), hist)
    assert st.ttft_count_window == 14 and st.ttft_p95_s > 5.0
    assert st.ttft_count_recent == 4 and st.ttft_p95_recent_s < 0.5        # within the 0.2 s bucket
    st = build_state(2.5, VP.parse(vllm_page(ttft=[9.0] * 10 + [0.2] * 5)), hist)
    assert st.ttft_count_recent == 5                        # base: the newest snapshot at or before 1.5 s


def test_prompt_and_first_token_counters_reach_the_state():
    """Token calibration compares the engine's mean prompt per prefill with the sidecar's estimate."""
    st = state_after([(1.0, vllm_page(prompt=12_000, ttft=[0.1] * 6))])
    assert st.prompt_tokens_total == 12_000 and st.first_tokens_total == 6
    st = state_after([(1.0, sglang_page(ttft=[0.1] * 3))], parser=MetricsParser(SGLANG))
    assert st.first_tokens_total == 3


def test_mean_inter_token_latency_over_the_window():
    # 100 intervals of 20 ms by t=100, then 400 more of 10 ms by t=101: the window's mean is 10 ms
    st = state_after([(100.0, vllm_page(itl=(2.0, 100))), (101.0, vllm_page(itl=(6.0, 500)))])
    assert st.itl_s == pytest.approx(0.01) and st.itl_count_recent == 400
    # no token in the window: no mean (0), not a stale one
    st = state_after([(100.0, vllm_page(itl=(2.0, 100))), (101.0, vllm_page(itl=(2.0, 100)))])
    assert st.itl_s == 0.0


def test_mean_inter_token_latency_covers_the_last_recent_s_only():
    # a slowdown: 200 intervals of 50 ms by t=104; then the engine runs nothing (the counters stand still). The
    # 10 s window still holds the slow intervals; the short window does not, so no mean is read (0), and decode
    # time goes stale instead of refusing deadlines at the slow speed (decode_time.py)
    hist = History(10.0, maxlen=100, recent_s=1.0)
    pages = [(100.0, vllm_page(itl=(0.0, 0))), (104.0, vllm_page(itl=(10.0, 200)))]
    pages += [(104.0 + 0.2 * i, vllm_page(itl=(10.0, 200))) for i in range(1, 11)]
    for t, page in pages:
        st = build_state(t, VP.parse(page), hist)
    assert st.itl_s == 0.0 and st.itl_count_recent == 0.0
    # fast tokens again: 100 intervals of 10 ms in the last second; the mean is theirs, not mixed with the slow ones
    st = build_state(106.2, VP.parse(vllm_page(itl=(11.0, 300))), hist)
    assert st.itl_s == pytest.approx(0.01) and st.itl_count_recent == 100


def test_prefix_cache_counters_are_passed_as_read():
    st = state_after([(100.0, vllm_page(prefix=(5000.0, 1280.0)))])
    assert (st.prefix_queries_total, st.prefix_hits_total) == (5000.0, 1280.0)
    assert state_after([(100.0, vllm_page())]).prefix_hits_total == -1.0
