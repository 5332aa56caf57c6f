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
    p4 = {"P4": {"sluice": {"ghost_tokens_per_cancel": 0.2}, "envoy-rr": {"ghost_tokens_per_cancel": 57.0}},
          "P4n": {"sluice": {"wasted_tokens": 30000.0}, "envoy-rr": {"wasted_tokens": 25000.0}}}
    p4_verdicts = {bar.scenario: ok for bar, ok, _shown in evaluate(p4) if bar.scenario.startswith("P4")}
    assert p4_verdicts == {"P4": True, "P4n": False}  # the no-abort variant has its own, informational row
    text = table({**results, "_meta": {"command": "c", "commit": "x"}})
    assert "**not met**" in text and "| P3 |" in text


def test_loadgen_percentile_is_nearest_rank():
    from bench.loadgen import percentile

    data = list(range(1, 101))
    assert percentile(data, 95) == 95 and percentile(data, 50) == 50 and percentile(data, 100) == 100
    assert percentile([7.0], 99) == 7.0
