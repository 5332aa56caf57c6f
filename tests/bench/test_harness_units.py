"""Fast tests of the scenario harness pieces: aggregation, SSE parsing, retry rules, report, JSON layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report
from bench.openloop import ClientSpec, Record, business_should_retry, scan_events, sdk_backoff, sdk_should_retry
from bench.runner import parse_prom, parse_prom_labels, policy_dict, run_scenarios
from bench.scenarios import SCENARIOS, get_scenarios
from bench.scenarios.base import (Metric, RunData, Scenario, Workload, chat, in_windows, pct, ratio, rnd,
                                  scale_arrivals, ttfts_censored)


def rec(**kw) -> Record:
    base = dict(user=0, attempt=0, sdk_attempt=0, kind="k")
    base.update(kw)
    return Record(**base)


def test_pct_and_helpers():
    assert pct([], 95) is None
    assert pct([1.0], 99) == 1.0
    vals = [float(i) for i in range(1, 101)]
    assert pct(vals, 50) == 50.0
    assert pct(vals, 95) == 95.0
    assert pct(vals, 99) == 99.0
    assert ratio(4.0, 2.0) == 2.0
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    assert rnd(float("nan")) is None and rnd(1.23456, 2) == 1.23
    assert in_windows(1.5, [(0, 1), (1.4, 2)]) and not in_windows(3, [(0, 1)])


def test_rundata_time_scale_and_censoring():
    run = RunData(scenario="PX", system="envoy-rr", time_scale=10.0, replicas=["a", "b"])
    run.records = [rec(start=1.0, first_token=1.5, end=2.0, status=200, done=True),
                   rec(start=1.0, end=3.0, status=200),                      # never got a token
                   rec(start=1.0, end=1.2, cancelled=True)]                  # the client left after 0.2 s
    # nothing is dropped: attempts without a first token count with the time they waited (a lower bound)
    assert run.ttfts(run.records) == pytest.approx([5.0, 20.0, 2.0])        # 0.5 wall s x 10, ...
    assert run.censored(run.records) == 2
    assert sorted(ttfts_censored(run, run.records)) == pytest.approx([2.0, 5.0, 20.0])
    run.extra["deadline"] = 4.0
    assert run.ttfts([rec(start=1.0)]) == [30.0]                             # still open at the run's deadline
    run.samples = {"a": [{"t": 0.0, "round": 0, "kv": 0.9}, {"t": 0.25, "round": 1, "kv": 0.8}],
                   "b": [{"t": 0.0, "round": 0, "kv": 0.1}]}
    grid = run.time_grid(0.0, 1.0)
    assert len(grid) == 1 and set(grid[0]) == {"a", "b"}                    # round 1 lacks b
    assert run.max_over_replicas("kv") == 0.9
    run.sim_final = {"a": {"running": 1, "waiting": 2, "counters": {"finished": {"stop": 3, "abort": 1},
                                                                    "preemptions": 4}},
                     "b": {"running": 0, "waiting": 0, "counters": {"finished": {"length": 5}, "preemptions": 1}}}
    assert run.replica_requests_total() == 12
    assert run.counter_total("preemptions") == 5


def test_a_real_engines_requests_are_its_api_servers_answers_not_vllms_finished_count():
    """vLLM counts no client abort in vllm:request_success_total; its API server's http_requests_total counts
    every request it answered, the abandoned ones included (bench/backends.py)."""
    from bench.backends import minus, parse_metrics

    def page(ok: float, chat: float, completions: float) -> str:
        return "\n".join([
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} {ok}',
            'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 0.0',
            f'http_requests_total{{handler="/v1/chat/completions",method="POST",status="2xx"}} {chat}',
            'http_requests_total{handler="/v1/chat/completions",method="POST",status="4xx"} 1.0',
            f'http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} {completions}',
            'http_requests_total{handler="/metrics",method="GET",status="2xx"} 99.0',
            'http_requests_total{handler="/reset_prefix_cache",method="POST",status="2xx"} 1.0',
            "vllm:num_requests_running 2.0", "vllm:num_requests_waiting 1.0"])

    start, end = parse_metrics(page(10, 20, 1)), parse_metrics(page(14, 35, 1))
    assert start["counters"]["http_requests"] == 22                  # chat 2xx + 4xx + completions, not /metrics
    st = minus(end, start)
    assert st["counters"]["http_requests"] == 15 and st["counters"]["finished"]["length"] == 4
    run = RunData(scenario="P5", system="envoy-rr", time_scale=1.0, replicas=["a"], duration=10.0)
    run.sim_final = {"a": st}
    assert run.replica_requests_total() == 15 + 2 + 1                   # 11 abandoned attempts counted, not 4 + 3


def test_p8_without_replica_names_counts_what_each_engine_received_after_detection():
    """Real engines name no replica in their responses: P8's sick share comes from the engines' own counts."""
    [sc] = get_scenarios(["P8"])
    run = RunData(scenario="P8", system="envoy-rr", time_scale=1.0, replicas=["sick", "ok"], duration=10.0)
    run.records = [Record(user=i, attempt=0, sdk_attempt=0, kind="user", start=float(i), end=float(i) + 0.5,
                          status=200, first_token=float(i) + 0.1) for i in range(10)]
    run.samples = {"sick": [{"t": 1.0, "round": 0, "received": 5.0}, {"t": 4.0, "round": 1, "received": 9.0},
                            {"t": 9.0, "round": 2, "received": 13.0}],
                   "ok": [{"t": 1.0, "round": 0, "received": 5.0}, {"t": 4.0, "round": 1, "received": 10.0},
                          {"t": 9.0, "round": 2, "received": 22.0}]}
    assert run.received_after("sick", 4.5) == 4.0 and run.received_after("ok", 0.0) == 22.0
    assert sc.sick_share(run, "sick", 4.5) == pytest.approx(4 / 16)
    run.records[5].replica = "ok"                                             # a named replica wins (simulators)
    assert sc.sick_share(run, "sick", 4.5) == 0.0


def test_scan_events_counts_content_and_first_token():
    r = rec(start=0.0)
    role_and_first = (b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                      b'"logprobs":null,"finish_reason":null}]}\n\n'
                      b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"the"}}]}\n\n')
    tail = scan_events(role_and_first + b'data: {"id":"x","choices":[{"index":0,"del', r, 0.5)
    assert r.tokens == 1 and r.first_token == 0.5
    tail = scan_events(tail + b'ta":{"content":" of"}}]}\n\n', r, 0.7)
    assert tail == b"" and r.tokens == 2 and r.first_token == 0.5
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    scan_events(usage, r, 0.8)
    assert r.done and r.prompt_tokens == 12 and r.completion_tokens == 2 and r.tokens == 2


def test_scan_events_after_the_clients_timeout_counts_late_tokens_only():
    r = rec(start=0.0, timed_out=True, tokens=3)
    events = (b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
              b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"b"}}]}\n\n'
              b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5}}\n\n'
              b'data: [DONE]\n\n')
    assert scan_events(events, r, 4.0) == b""
    assert r.late_tokens == 2 and r.tokens == 3      # nobody was waiting for these two
    assert not r.done and not r.ok                    # a stream that completes after the deadline is no success


def test_variants_sort_after_their_problem_and_names_are_case_insensitive():
    ids = [s.id for s in get_scenarios(["all"])]
    assert ids.index("P4n") == ids.index("P4") + 1 and ids[-3:] == ["P13", "PG", "PX"]
    assert [s.id for s in get_scenarios(["p4N", "P10", "p4"])] == ["P4", "P4n", "P10"]
    p4, p4n = get_scenarios(["P4", "P4n"])
    assert "no-abort" not in p4.sim_args and p4n.sim_args == ["--fault", "no-abort"]
    assert [a.kind for a in p4.workload(True).arrivals] == [a.kind for a in p4n.workload(True).arrivals]


def test_p4_ghost_tokens_count_the_replicas_ghost_and_late_tokens():
    [sc] = get_scenarios(["P4"])
    kinds = {a.kind: a.client for a in sc.workload(True).arrivals}
    assert kinds["lingers"].linger_s and kinds["lingers"].mark_deadline and kinds["lingers"].send_read_timeout
    assert kinds["waits"].linger_s is None and kinds["leaves"].cancel_after_tokens == 5
    run = RunData(scenario="P4", system="envoy-rr", time_scale=1.0, replicas=["a", "b"], duration=10.0)
    run.sim_final = {"a": {"counters": {"ghost_tokens": 4, "late_tokens": 100}},
                     "b": {"counters": {"ghost_tokens": 0, "late_tokens": 96}}}
    run.records = [rec(user=0, timed_out=True, tokens=10, late_tokens=90), rec(user=1, cancelled=True, tokens=5),
                   rec(user=2, status=200, done=True, tokens=120),
                   rec(user=3, timed_out=True, tokens=20, late_tokens=100)]
    m = sc.metrics(run)
    assert m["ghost_tokens"] == 200 and m["cancels"] == 3 and m["ghost_tokens_per_cancel"] == 66.67
    assert m["wasted_tokens"] == 235 and m["late_tokens_received"] == 190 and m["goodput_rps"] == 0.1
    assert sc.reproduced(m)[0] and not sc.reproduced({**m, "ghost_tokens_per_cancel": 0.5})[0]


def test_p4_ghost_tokens_on_real_engines_are_generated_minus_read_in_time():
    [sc] = get_scenarios(["P4"])
    run = RunData(scenario="P4", system="envoy-rr", time_scale=1.0, replicas=["a", "b"], duration=10.0)
    run.extra["backend"] = "vllm-cpu"
    run.sim_final = {"a": {"counters": {"generation_tokens": 300}}, "b": {"counters": {"generation_tokens": 200}}}
    run.records = [rec(user=0, timed_out=True, tokens=10, late_tokens=90), rec(user=1, cancelled=True, tokens=5),
                   rec(user=2, status=200, done=True, tokens=100, completion_tokens=120)]
    m = sc.metrics(run)
    assert m["ghost_tokens"] == 500 - 10 - 5 - 120 and m["ghost_tokens_per_cancel"] == 182.5


def test_sdk_retry_rules_follow_the_openai_sdk():
    assert sdk_should_retry(rec(status=503))
    assert sdk_should_retry(rec(status=429))
    assert not sdk_should_retry(rec(status=400))
    assert not sdk_should_retry(rec(status=429, should_retry="false"))
    assert sdk_should_retry(rec(status=400, should_retry="true"))
    assert sdk_should_retry(rec(status=0, timed_out=True))
    assert not sdk_should_retry(rec(status=0, cancelled=True))
    import random
    spec = ClientSpec(sdk_backoff_s=0.5)
    assert sdk_backoff(rec(status=429, retry_after_s=2.0), 0, spec, random.Random(0)) == 2.0
    b = sdk_backoff(rec(status=503), 1, spec, random.Random(0))
    assert 0.75 <= b <= 1.0                                                   # 0.5 x 2^1, jitter x0.75..1
    assert sdk_backoff(rec(status=503, retry_after_s=600.0), 0, spec, random.Random(0)) <= 0.5
    assert business_should_retry(rec(status=502)) and business_should_retry(rec(status=0))
    assert not business_should_retry(rec(status=429)) and not business_should_retry(rec(status=200, done=True))


def test_scale_arrivals_converts_scenario_to_wall_seconds():
    from bench.openloop import Arrival
    arr = [Arrival(at=10.0, body={}, client=ClientSpec(timeout_s=4.0, sdk_backoff_s=0.5, read_interval_s=1.0))]
    out = scale_arrivals(arr, 4.0)
    assert out[0].at == 2.5 and out[0].client.timeout_s == 1.0 and out[0].client.sdk_backoff_s == 0.125
    assert out[0].client.read_interval_s == 0.25 and arr[0].at == 10.0      # input untouched


def test_chat_body_prompt_size_matches_the_simulator_tokenizer():
    from extproc.sim import tokenizer
    for n in (100, 1000, 6000):
        b = chat(n, 8, salt=7)
        got = tokenizer.chat_prompt(b["messages"], False)[0]
        assert abs(got - n) <= 8, (n, got)
    assert chat(100, 8, salt=1) != chat(100, 8, salt=2)                        # bodies stay distinct


def test_parse_prometheus_text():
    text = ('# HELP x\n# TYPE x counter\nsluice_prompt_shift_events_total{app="a"} 2.0\n'
            'sluice_prompt_shift_events_total{app="b"} 1.0\nsluice_prompt_shift_events_total_created 5\n'
            'sluice_replica_state{pool="m",replica="1.2.3.4:5",state="degraded"} 1.0\nup 1\n')
    assert parse_prom(text)["sluice_prompt_shift_events_total"] == 3.0
    assert parse_prom(text, ("up",)) == {"up": 1.0}
    samples = parse_prom_labels(text, "sluice_replica_state")
    assert samples == [({"pool": "m", "replica": "1.2.3.4:5", "state": "degraded"}, 1.0)]
    assert len(parse_prom_labels(text, "sluice_prompt_shift_events_total")) == 2


REQUIRED_KEYS = {
    "P1": {"ttft_p95_s", "shed_fraction", "shed_latency_p99_s", "replica_waiting_max"},
    "P1f": {"other_tenant_ttft_p95_ratio", "other_tenant_refused"},
    "P2": {"ttft_p95_s", "heavy_slowdown"},
    "P3": {"short_ttft_p95_s", "short_ttft_p95_idle_s", "hol_slowdown"},
    "P4": {"ghost_tokens", "ghost_tokens_per_cancel"},
    "P4n": {"ghost_tokens", "ghost_tokens_per_cancel", "wasted_tokens"},
    "P5": {"amplification", "goodput_rps"},
    "P6": {"recollapses", "time_to_full_s", "replica_inflight_max_after"},
    "P7": {"kv_usage_spread", "ttft_p95_s"},
    "P8": {"detect_s", "sick_share_after_detect", "ttft_p95_s"},
    "P9": {"preemptions", "ttft_p99_s"},
    "P10": {"detect_s", "capacity_estimate_error", "true_capacity_rps", "rejected_after"},
    "P11": {"max_calls_per_task", "max_tokens_per_task", "other_tenant_ttft_p95_s"},
    "P12": {"open_streams_max", "rejected_clean", "gateway_rss_mb"},
    "P13": {"gateway_rss_mb_per_slow_stream", "slow_streams_cut"},
    "PX": {"prefix_hit_rate", "best_achievable_hit_rate", "ttft_p95_s", "kv_usage_max"},
    "PG": {"ttft_p95_s", "preemptions", "kv_usage_spread"},
}


@pytest.mark.parametrize("sid", list(SCENARIOS))
def test_every_scenario_is_bounded_documented_and_robust(sid: str):
    [sc] = get_scenarios([sid])
    assert sc.id == sid
    doc = sc.describe()
    assert "Workload" in doc and "Headline metrics" in doc and f"Reproduced on {sc.reproduced_on}" in doc
    keys = {m.key for m in sc.metrics_doc}
    assert REQUIRED_KEYS[sid] <= keys
    for quick, budget in ((True, 26.0), (False, 90.0)):
        wl = sc.workload(quick)
        assert 0 < len(wl.arrivals) <= 20000
        assert (wl.duration + wl.drain) / sc.time_scale <= budget, "a system-run must fit its wall budget"
        assert all(0 <= a.at <= wl.duration for a in wl.arrivals)
    # metrics of an empty run: every key present, values are numbers or None (the report shows "none")
    run = RunData(scenario=sid, system="envoy-rr", time_scale=sc.time_scale, replicas=["127.0.0.1:1"],
                  duration=10.0)
    run.extra["quick"] = True
    m = sc.metrics(run)
    assert set(m) == keys
    assert all(v is None or isinstance(v, (int, float)) for v in m.values())
    ok, why = sc.reproduced(m)
    assert ok is False and why
    slo = sc.slo(run)
    assert slo["slo_goodput_rps"] == 0 and slo["class_slo_goodput"] == {}
    assert "SLO:" in doc and "Sluice is told" in doc and f"ttft_target_s: {sc.slo_ttft_s:g}" in doc
    for cls in sc.refused_classes:
        assert cls in doc, "a class sluice refuses by design is named in the scenario module"


@pytest.mark.parametrize("sid", list(SCENARIOS))
def test_sluice_is_told_deployment_facts_only(sid: str):
    """One policy: the shipped defaults plus the SLO (one admission.ttft_target_s), tenants where the scenario is
    about tenants, a task budget (and the sidecars that share it) where it is about agents. Nothing else."""
    from bench.bars import policy_violations
    from bench.runner import sluice_additions

    [sc] = get_scenarios([sid])
    sc.workload(True)
    additions = sluice_additions(sc)
    assert policy_violations(sid, additions) == []
    assert additions["admission"] == {"ttft_target_s": float(sc.slo_ttft_s)}
    assert set(sc.gateway) <= {"envoy_concurrency", "max_downstream_connections", "socket_send_buffer_bytes"}, \
        "gateway settings are environment every Envoy-based system gets"
    assert not sc.limits


def test_policy_check_catches_tuning():
    from bench.bars import policy_violations

    assert policy_violations("P1", {"admission": {"ttft_target_s": 2.0}}) == []
    assert policy_violations("P1", {"admission": {"ttft_target_s": 2.0, "max_wait_s": 1.5}}) == ["admission.max_wait_s"]
    assert policy_violations("P13", {"streaming": {"slow_consumer": {"min_bytes_per_s": 4000}}}) == \
        ["streaming.slow_consumer.min_bytes_per_s"]
    assert policy_violations("P2", {"budgets": {"tasks": {"max_calls": 8}}}) == ["budgets.tasks.max_calls"]
    assert policy_violations("P11", {"budgets": {"tasks": {"max_calls": 8}}, "sidecar": {"workers": 2}}) == []
    assert policy_violations("P1f", {"admission": {"tenant_prefill_share": 0.5}}) == ["admission.tenant_prefill_share"]


def test_slo_goodput_counts_user_requests_with_their_whole_latency():
    """A request shed, retried and then served meets the SLO only if its first token came within the SLO of its
    first send; a request never served counts as offered, censored at the time its user waited."""
    from bench.scenarios.base import slo_metrics, worst_class_ratio

    def r(user, attempt, start, first=None, end=None, status=200, kind="a"):
        return Record(user=user, attempt=attempt, sdk_attempt=attempt, kind=kind, start=start, first_send=0.0 + user,
                      first_token=first, end=end, status=status, done=status == 200 and end is not None)
    run = RunData(scenario="P0", system="x", time_scale=1.0, replicas=[], duration=10.0)
    run.extra["deadline"] = 12.0
    run.records = [r(0, 0, 0.0, status=429, end=0.01), r(0, 1, 0.6, first=0.9, end=1.2),      # 0.9 s from first send
                   r(1, 0, 1.0, status=429, end=1.01), r(1, 1, 2.5, first=3.2, end=3.5),      # 2.2 s: over the SLO
                   r(2, 0, 2.0, kind="b"),                                                   # never answered
                   r(3, 0, 3.0, first=3.1, end=3.3, kind="b")]
    m = slo_metrics(run, 1.0, lambda c: c.kind)
    assert m["slo_goodput_rps"] == 0.2                       # users 0 and 3, over 10 s offered
    assert m["class_slo_goodput"] == {"a": 0.1, "b": 0.1}
    assert m["class_calls"] == {"a": 2.0, "b": 2.0} and m["class_failed"] == {"a": 0.0, "b": 1.0}
    assert m["class_ttft_p95_s"]["b"] == 10.0                # censored at the run's deadline (12 - 2)
    by = {"sluice": {"class_slo_goodput": {"a": 0.1, "b": 0.4, "c": 0.0}},
          "envoy-rr": {"class_slo_goodput": {"a": 0.2, "b": 0.1, "c": 0.0}},
          "smg": {"class_slo_goodput": {"a": 0.05, "b": 0.5}}}
    assert worst_class_ratio(by) == (0.5, "a")
    assert worst_class_ratio(by, refused=("a",)) == (0.8, "b")


def test_sluice_policy_sections_parse_with_the_sidecars_own_parser():
    from extproc.config import policy_from_dict

    for sc in get_scenarios(["all"]):
        sc.workload(True)
        p = sc.sluice_policy
        assert set(p) <= {"admission", "routing", "budgets", "tenants", "streaming"}
        policy_from_dict(policy_dict(sc, "sluice", 0))  # raises PolicyError naming any field it rejects


class _Fake(Scenario):
    """A scenario for report tests (no processes). Workload: none. Headline metrics: hol_slowdown."""

    id = "P3"
    title = "fake"
    metrics_doc = [Metric("hol_slowdown", "ratio", "x"), Metric("detect_s", "none when absent", "s")]

    def workload(self, quick: bool) -> Workload:
        return Workload(arrivals=[], duration=1.0)

    def metrics(self, run: RunData) -> dict:
        return {"hol_slowdown": 2.0 if run.system == "envoy-rr" else 1.1, "detect_s": None}

    def reproduced(self, m: dict) -> tuple[bool, str]:
        return (m["hol_slowdown"] or 0) >= 3, f"hol_slowdown {m['hol_slowdown']}"


def test_report_table_shows_none_and_not_reproduced():
    sc = _Fake()
    by = {"sluice": {"hol_slowdown": 1.1, "detect_s": None}, "envoy-rr": {"hol_slowdown": 25.0, "detect_s": None}}
    text = report.render_table(sc, by, reproduced=False, why="hol_slowdown 2")
    lines = text.splitlines()
    assert lines[0] == "| metric | envoy-rr | sluice | better |"                # systems as columns, rr first
    assert "| `hol_slowdown` (x) | 25 | 1.1 | lower |" in lines
    assert "| `detect_s` (s) | none | none | lower |" in lines
    assert "problem not reproduced" in text
    assert "yes" in report.render_table(sc, by, reproduced=True)
    assert report.fmt(0.000123) == "0.00012" and report.fmt(1234.5) == "1234" and report.fmt(3.0) == "3"


def test_json_layout_and_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """run_scenarios with the stack replaced by canned runs: layout {P: {system: {metric: value}}, _meta}."""
    import bench.runner as runner

    def fake_run_one(sc, system, quick, seed, workdir, backend=None):
        run = RunData(scenario=sc.id, system=system, time_scale=1.0, replicas=["127.0.0.1:1"], duration=1.0)
        run.records = [rec(start=0.0, first_token=0.1, end=0.2, status=200, done=True, kind="short")]
        return run, {"system": system, "notes": [], "wall_s": 0.1}

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    out = run_scenarios([_Fake()], ["sluice", "envoy-rr"], quick=True, results_dir=tmp_path, plots=True,
                        command="sluice bench run P3 --quick")
    assert set(out) == {"P3", "_meta"}
    assert set(out["P3"]) == {"sluice", "envoy-rr"}
    rr = out["P3"]["envoy-rr"]
    assert rr["hol_slowdown"] == 2.0 and rr["detect_s"] is None
    assert rr["slo_goodput_rps"] == 1.0 and rr["class_slo_goodput"] == {"short": 1.0}   # 1 call in 1 s, 0.1 s TTFT
    assert rr["offered_rps"] == 1.0
    assert out["P3"]["sluice"]["worst_class_ratio"] == 1.0 and out["P3"]["sluice"]["worst_class"] == "short"
    assert out["_meta"]["sluice_policy"]["P3"] == {"admission": {"ttft_target_s": 2.0}}
    assert out["_meta"]["reproduced"] == {"P3": False}
    json.dumps(out)                                                           # serialisable as is
    assert (tmp_path / "P3.md").read_text().count("problem not reproduced") == 1
    assert "sluice bench run P3 --quick" in (tmp_path / "P3.md").read_text()
    assert 1000 < (tmp_path / "P3.png").stat().st_size < 80_000                # one small figure per scenario
    summary = report.write_summary(out, tmp_path / "summary.md", tmp_path, scenarios=[_Fake()])
    text = summary.read_text()
    assert "| P3 fake | **problem not reproduced** |" in text and "Commit:" in text


def test_a_non_streaming_answer_is_its_own_first_token():
    from bench.openloop import _read_answer

    r = rec(start=1.0, status=200)
    _read_answer(r, b'{"choices":[],"usage":{"prompt_tokens":1000,"completion_tokens":48}}', 1.7)
    assert r.ok and r.tokens == 48 and r.prompt_tokens == 1000 and r.ttft == pytest.approx(0.7)
    bad = rec(start=1.0, status=200)
    _read_answer(bad, b"not json", 1.2)
    assert not bad.ok and bad.error == "bad_json"


def test_hop_cost_drives_every_request_through_the_gateway_and_releases_it() -> None:
    from bench.hop_cost import run

    result = run(requests=40, rounds=2)
    assert result["forwarded"] == 80 and result["open_requests_left"] == 0
    assert len(result["us_per_request_rounds"]) == 2 and result["us_per_request_min"] > 0


def test_each_replicas_share_and_prefix_hits_are_in_the_diagnostics():
    """Real engines name no replica in their answers: how a router split the prompts between them, and how much of
    them each engine found cached, comes from each engine's counters at the end of the run."""
    from bench.runner import diagnostics

    run = RunData(scenario="PX", system="smg", time_scale=1.0, replicas=["a", "b"], duration=10.0)
    run.sim_final = {
        "a": {"running": 1, "waiting": 2, "counters": {"http_requests": 30, "prefix_cache_queries": 40_000.0,
                                                        "prefix_cache_hits": 36_000.0}},
        "b": {"running": 0, "waiting": 0, "counters": {"finished": {"stop": 7, "abort": 1}}},
    }
    assert diagnostics(run)["replicas"] == {
        "a": {"received": 33.0, "prefix_queries": 40_000.0, "prefix_hit_rate": 0.9},
        "b": {"received": 8.0},
    }
