"""The acceptance-bar checker judges real numbers and says when it cannot."""

from bench.bars import evaluate, table


def test_bars_judge_met_not_met_and_missing():
    results = {
        "P3": {"sluice": {"hol_slowdown": 1.4}, "envoy-rr": {"hol_slowdown": 20.0}},
        "P7": {"sluice": {"kv_usage_spread": 0.35}, "envoy-rr": {"kv_usage_spread": 0.9}},
        "P8": {"sluice": {"detect_s": None, "sick_share_after_detect": 0.0}, "envoy-rr": {"detect_s": None}},
    }
    verdicts = {(bar.scenario, bar.text): ok for bar, ok, _shown in evaluate(results)}
    assert verdicts[("P3", "sluice hol_slowdown <= 2.0 (envoy-rr >= 3)")] is True
    assert verdicts[("P7", "sluice kv_usage_spread <= 0.15")] is False
    assert verdicts[("P7", "sluice kv_usage_spread <= half of envoy-rr's")] is True
    assert verdicts[("P8", "sluice detect_s <= 10 and envoy-rr never detects")] is False
    assert verdicts[("P1", "sluice shed_latency_p99_s <= 0.05")] is None  # not run
    text = table({**results, "_meta": {"command": "c", "commit": "x"}})
    assert "**not met**" in text and "| P3 |" in text


def test_loadgen_percentile_is_nearest_rank():
    from bench.loadgen import percentile

    data = list(range(1, 101))
    assert percentile(data, 95) == 95 and percentile(data, 50) == 50 and percentile(data, 100) == 100
    assert percentile([7.0], 99) == 7.0
