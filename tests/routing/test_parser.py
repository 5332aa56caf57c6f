"""The /metrics line scanner on real exposition pages (rendered by prometheus-client like vLLM and SGLang do)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from extproc.routing.metric_names import SGLANG, VLLM, names_for
from extproc.routing.pool import Replica
from extproc.routing.scrape import History, MetricsParser, build_state

DATA = Path(__file__).parent / "data"
VLLM_PAGE = (DATA / "vllm_metrics.txt").read_bytes()
SGLANG_PAGE = (DATA / "sglang_metrics.txt").read_bytes()

VLLM_TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, math.inf)


def test_fixture_is_a_realistic_vllm_page():
    text = VLLM_PAGE.decode()
    assert text.count("\n") > 400  # process/python collectors, HTTP series, ~12 histograms, _created series
    assert "vllm:time_to_first_token_seconds_created" in text and "python_gc_objects_collected_total" in text


def test_vllm_page_exact_values():
    p = MetricsParser(VLLM).parse(VLLM_PAGE)
    assert p.running == 7.0
    assert p.waiting == 3.0
    assert p.kv_usage == 0.4375
    assert p.preemptions == 12.0
    assert p.generation_tokens == 456789.0
    assert p.prompt_tokens == 1234567.0
    assert p.prefix_queries == 250000.0 and p.prefix_hits == 125000.0
    assert p.finished == {"stop": 1400.0, "length": 100.0, "abort": 17.0, "error": 3.0}
    assert p.errors == 20.0  # abort + error
    assert p.cache_info_tokens == 16 * 27648
    assert p.cache_block_tokens == 16  # prefixes are shared in whole blocks (admission/prefix_affinity.py)
    assert p.ttft_bounds == VLLM_TTFT_BOUNDS
    # 50 first tokens at 0.03 s, 40 at 0.07 s, 9 at 0.3 s, 1 at 12 s
    assert p.ttft_cum == (0, 0, 0, 0, 50, 50, 90, 90, 90, 99, 99, 99, 99, 99, 99, 99, 100, 100, 100, 100, 100, 100, 100)
    assert p.ttft_count == 100.0
    assert p.cache_hit_rate is None and p.generation_tps_gauge is None
    # the inter-token latency histogram is read for its mean only (decode time per token, admission)
    assert (p.itl_sum, p.itl_count) == (19.47, 60.0)
    # the finished requests' prefill seconds and computed prompt tokens (admission/prefill_rate.py)
    assert (p.prefill_s_sum, p.prefill_s_count) == (19.47, 60.0)
    assert p.prefill_new_sum == sum(37 * i + 5 for i in range(40))


def test_sglang_page_exact_values():
    p = MetricsParser(SGLANG).parse(SGLANG_PAGE)
    assert p.running == 12.0
    assert p.waiting == 4.0
    assert p.kv_usage == 0.62
    assert p.generation_tokens == 987654.0
    assert p.prompt_tokens == 3456789.0
    assert p.generation_tps_gauge == 812.5
    assert p.cache_hit_rate == 0.35
    assert p.kv_capacity_tokens == 77760.0
    assert p.ttft_bounds == (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
                             200.0, 400.0, math.inf)
    assert p.ttft_cum[:8] == (0, 20, 20, 38, 38, 38, 38, 40) and p.ttft_cum[-1] == 40
    assert p.preemptions is None and p.errors is None and p.cache_info_tokens is None
    assert p.cache_block_tokens is None  # SGLang's radix cache shares to the token
    assert (p.itl_sum, p.itl_count) == (30.450000000000003, 30.0)


def test_vllm_names_do_not_read_an_sglang_page():
    p = MetricsParser(VLLM).parse(SGLANG_PAGE)
    assert p.running is None and p.waiting is None and p.kv_usage is None and p.ttft_cum == ()


@pytest.mark.parametrize("page", [VLLM_PAGE, SGLANG_PAGE], ids=["vllm", "sglang"])
def test_page_without_type_lines_parses_the_same(page):
    names = VLLM if page is VLLM_PAGE else SGLANG
    bare = b"\n".join(line for line in page.split(b"\n") if not line.startswith(b"#"))
    a, b = MetricsParser(names).parse(page), MetricsParser(names).parse(bare)
    for field in a.__slots__:
        assert getattr(a, field) == getattr(b, field), field


def test_type_lines_missing_for_the_engine_gauges_fall_back_to_the_line_scan():
    page = (b"# TYPE other gauge\nother 1\n"
            b"vllm:num_requests_running{engine=\"0\"} 5\nvllm:num_requests_waiting 2\n")
    p = MetricsParser(VLLM).parse(page)
    assert (p.running, p.waiting) == (5.0, 2.0)


def test_engines_are_summed_and_fractions_averaged():
    page = b"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="m"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 7.0
"""
    p = MetricsParser(VLLM).parse(page)
    assert p.running == 7.0
    assert p.kv_usage == pytest.approx(0.4)
    assert p.ttft_bounds == (0.1, math.inf) and p.ttft_cum == (6.0, 9.0)


def test_preferred_name_wins_and_old_name_is_a_fallback():
    both = b"vllm:gpu_cache_usage_perc{engine=\"0\"} 0.9\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.3\n"
    assert MetricsParser(VLLM).parse(both).kv_usage == 0.3
    old = b"vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc{engine=\"0\"} 0.9\n"
    assert MetricsParser(VLLM).parse(old).kv_usage == 0.9


def test_odd_lines_timestamps_nan_and_unprofiled_cache_info():
    page = b"""vllm:num_requests_running{engine="0"} 4 1700000000000
vllm:num_requests_waiting{engine="0"} NaN
vllm:num_requests_waiting{engine="1"} 2
vllm:num_requests_running_created{engine="0"} 1.7e9
vllm:generation_tokens_total{engine="0"} not-a-number
vllm:prompt_tokens_total
vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",model_le="x",le="0.5"} 3
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 4
"""
    p = MetricsParser(VLLM).parse(page)
    assert p.running == 4.0          # the timestamp is ignored
    assert p.waiting == 2.0          # NaN skipped
    assert p.generation_tokens is None and p.prompt_tokens is None
    assert p.cache_info_tokens is None  # num_gpu_blocks not known yet
    assert p.ttft_bounds == (0.5, math.inf) and p.ttft_cum == (3.0, 4.0)  # le found after model_le


def test_data_parallel_cache_info_sums_engines():
    page = (b'vllm:num_requests_running 0\n'
            b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
            b'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="50"} 1.0\n')
    p = MetricsParser(VLLM).parse(page)
    assert p.cache_info_tokens == 2400 and p.cache_block_tokens == 16
    r = Replica(address="a:1", pool="m")
    r.on_scrape(build_state(1.0, p, History(10.0, maxlen=8)))
    assert (r.kv_capacity_tokens, r.kv_block_tokens) == (2400, 16)


def test_names_for_rejects_unknown_styles():
    assert names_for("sglang") is SGLANG
    with pytest.raises(ValueError, match="tgi"):
        names_for("tgi")
