"""`sluice bench run --seeds N`: each system runs N times on other workloads of the same shape; metrics are the
medians with their [min, max]."""

from __future__ import annotations

import json
import os
import random
import time
import types
from pathlib import Path

import pytest

import bench.runner as runner
from bench import report
from bench.openloop import Record
from bench.runner import combine_reps, main, run_scenarios
from bench.scenarios import get_scenarios
from bench.scenarios.base import RunData, set_workload_rep, workload_rep, workload_rng

from .test_harness_units import _Fake


def test_combine_reps_takes_medians_and_spreads_of_numbers_only():
    reps = [{"slo_goodput_rps": 3.0, "x": None, "cls": {"a": 1}, "flag": "a"},
            {"slo_goodput_rps": 5.5, "x": 2.0, "cls": {"a": 2}, "flag": "b"},
            {"slo_goodput_rps": 3.4, "x": 4.0, "cls": {"a": 3}, "flag": "c"}]
    out = combine_reps(reps)
    assert out["slo_goodput_rps"] == 3.4 and out["spread"]["slo_goodput_rps"] == [3.0, 5.5]
    assert out["x"] == 3.0 and out["spread"]["x"] == [2.0, 4.0]           # the repetitions that produced it
    assert out["cls"] == {"a": 3} and out["flag"] == "c"                    # the last repetition's
    assert out["reps"] == 3 and [m["slo_goodput_rps"] for m in out["per_rep"]] == [3.0, 5.5, 3.4]
    assert combine_reps(reps[:1]) is reps[0]                                # one run: unchanged


def test_repetition_zero_is_the_published_workload_and_others_differ():
    assert workload_rep() == 0 and workload_rng(16).random() == random.Random(16).random()
    sc = get_scenarios(["P9"])[0]
    base = [a.at for a in sc.workload(True).arrivals]
    try:
        set_workload_rep(1)
        other = [a.at for a in sc.workload(True).arrivals]
    finally:
        set_workload_rep(0)
    assert other != base and 0.7 < len(other) / len(base) < 1.3           # same shape and rate, other draws
    assert [a.at for a in sc.workload(True).arrivals] == base


def test_px_best_hit_rate_follows_the_repetitions_workload():
    from bench.scenarios import px_prefix as px

    r0 = px.best_hit_rate(True)
    try:
        set_workload_rep(1)
        r1 = px.best_hit_rate(True)
    finally:
        set_workload_rep(0)
    assert r0 != r1 and abs(r0 - r1) < 0.1 and px.best_hit_rate(True) == r0


def test_seeds_run_each_system_n_times_with_its_own_seed_and_workload(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    import bench.runner as runner

    seen: list[tuple[str, int, int]] = []

    def fake_run_one(sc, system, quick, seed, workdir, backend=None):
        seen.append((system, seed, workload_rep()))
        run = RunData(scenario=sc.id, system=system, time_scale=1.0, replicas=["127.0.0.1:1"], duration=1.0)
        ok = 1 + workload_rep()  # repetition k: k + 1 calls within the SLO
        run.records = [Record(user=i, attempt=0, sdk_attempt=0, kind="short", start=0.0, first_token=0.1, end=0.2,
                              status=200, done=True) for i in range(ok)]
        return run, {"system": system, "notes": [], "wall_s": 0.1}

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    out = run_scenarios([_Fake()], ["sluice"], quick=True, seed=5, results_dir=tmp_path, plots=False, seeds=3)
    assert seen == [("sluice", 5, 0), ("sluice", 6, 1), ("sluice", 7, 2)] and workload_rep() == 0
    m = out["P3"]["sluice"]
    assert m["slo_goodput_rps"] == 2.0 and m["spread"]["slo_goodput_rps"] == [1.0, 3.0] and m["reps"] == 3
    assert out["_meta"]["seeds"] == 3 and out["_meta"]["runs"]["P3"]["sluice"]["reps_ok"] == 3
    assert "| `slo_goodput_rps` (req/s) | 2 [1-3] |" in (tmp_path / "P3.md").read_text()
    assert "seeds=3" in report.header(out["_meta"])


def test_each_repetition_runs_every_system_once_in_an_order_that_rotates(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """Seeds interleave: repetition k runs every system before repetition k + 1 starts, and the first system moves
    one place per repetition and per scenario, so no system always runs first on a machine whose speed drifts."""
    import bench.runner as runner

    seen: list[tuple[str, str, int]] = []

    def fake_run_one(sc, system, quick, seed, workdir, backend=None):
        seen.append((sc.id, system, seed))
        run = RunData(scenario=sc.id, system=system, time_scale=1.0, replicas=["127.0.0.1:1"], duration=1.0)
        run.records = [Record(user=0, attempt=0, sdk_attempt=0, kind="short", start=0.0, first_token=0.1, end=0.2,
                              status=200, done=True)]
        return run, {"system": system, "notes": [], "wall_s": 0.1}

    second = _Fake()
    second.id = "P3b"
    monkeypatch.setattr(runner, "run_one", fake_run_one)
    out = run_scenarios([_Fake(), second], ["sluice", "envoy-rr", "smg"], quick=True, seed=5, results_dir=tmp_path,
                        plots=False, seeds=2)
    assert seen == [("P3", "sluice", 5), ("P3", "envoy-rr", 5), ("P3", "smg", 5),
                    ("P3", "envoy-rr", 6), ("P3", "smg", 6), ("P3", "sluice", 6),
                    ("P3b", "envoy-rr", 5), ("P3b", "smg", 5), ("P3b", "sluice", 5),
                    ("P3b", "smg", 6), ("P3b", "sluice", 6), ("P3b", "envoy-rr", 6)]
    assert list(out["P3b"]) == ["sluice", "envoy-rr", "smg"]  # the tables keep the systems' order
    assert all(out[sid][s]["reps"] == 2 for sid in ("P3", "P3b") for s in ("sluice", "envoy-rr", "smg"))
    assert runner.system_order(["a", "b", "c"], 4) == ["b", "c", "a"] and runner.system_order([], 3) == []


def test_the_cli_takes_seeds(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "--seeds" in capsys.readouterr().out


def test_records_writes_every_attempt_of_each_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`sluice bench run --records DIR`: each system-run's client attempts, one JSON object per line, so a reader
    can recompute a metric or look at the requests behind a percentile."""
    import json

    import bench.runner as runner

    def fake_run_one(sc, system, quick, seed, workdir, backend=None):
        run = RunData(scenario=sc.id, system=system, time_scale=1.0, replicas=["127.0.0.1:1"], duration=1.0)
        run.records = [Record(user=0, attempt=1, sdk_attempt=1, kind="short", start=0.7, first_token=0.8, end=0.9,
                              status=200, done=True, tokens=4),
                       Record(user=0, attempt=0, sdk_attempt=0, kind="short", start=0.1, end=0.2, status=429,
                              retry_after_s=0.5, body_excerpt='{"error":{}}')]
        return run, {"system": system, "notes": [], "wall_s": 0.1}

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    run_scenarios([_Fake()], ["sluice", "envoy-rr"], quick=True, seed=5, results_dir=tmp_path, plots=False,
                  seeds=2, records_dir=tmp_path / "rec")
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == [
        "P3-envoy-rr-seed5.jsonl", "P3-envoy-rr-seed6.jsonl", "P3-sluice-seed5.jsonl", "P3-sluice-seed6.jsonl"]
    lines = [json.loads(x) for x in (tmp_path / "rec" / "P3-sluice-seed6.jsonl").read_text().splitlines()]
    assert [(x["attempt"], x["status"], x["retry_after_s"]) for x in lines] == [(0, 429, 0.5), (1, 200, None)]
    assert lines[1]["tokens"] == 4 and lines[1]["first_token"] == 0.8


def test_every_run_reports_its_gateways_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`gateway_cpu_s`: the CPU the gateway's processes used while serving, a cost in every scenario's table, read
    from /proc for the stack's own children (Envoy, the sidecar workers, smg) and nothing else."""
    me = types.SimpleNamespace(pid=os.getpid())
    stack = types.SimpleNamespace(children=[types.SimpleNamespace(name="sidecar[0]", proc=me),
                                            types.SimpleNamespace(name="sim 127.0.0.1:1", proc=me),
                                            types.SimpleNamespace(name="envoy", proc=None)])
    before = runner._cpu_by_process([stack])
    assert set(before) == {("sidecar", os.getpid())}  # the replicas are not the gateway; Envoy never started
    deadline = time.monotonic() + 5.0
    while runner._cpu_by_process([stack]) == before and time.monotonic() < deadline:
        sum(i * i for i in range(100_000))  # spend CPU in "the sidecar" until the kernel's tick counts it
    after = runner._cpu_by_process([stack])
    used = runner._cpu_used(before, after)
    assert set(used) == {"sidecar"} and used["sidecar"] > 0
    assert runner._cpu_used(before, {}) == {}  # a process gone by the end counts nothing, never negative

    def fake_run_one(sc, system, quick, seed, workdir, backend=None):
        run = RunData(scenario=sc.id, system=system, time_scale=1.0, replicas=["127.0.0.1:1"], duration=1.0)
        run.records = [Record(user=0, attempt=0, sdk_attempt=0, kind="short", start=0.0, first_token=0.1, end=0.2,
                              status=200, done=True)]
        run.extra["gateway_cpu_s"] = {"envoy": 0.5, "sidecar": 0.25} if system == "sluice" else {"envoy": 0.4}
        return run, {"system": system, "notes": [], "wall_s": 0.1}

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    out = run_scenarios([_Fake()], ["sluice", "envoy-rr"], quick=True, seed=1, results_dir=tmp_path, plots=False)
    assert out["P3"]["sluice"]["gateway_cpu_s"] == 0.75 and out["P3"]["envoy-rr"]["gateway_cpu_s"] == 0.4
    assert out["P3"]["sluice"]["diagnostics"]["gateway_cpu_s"] == {"envoy": 0.5, "sidecar": 0.25}
    assert "| `gateway_cpu_s` (s) | 0.4 | 0.75 | lower |" in (tmp_path / "P3.md").read_text()


def test_each_repetition_keeps_its_engine_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`engine_probe_s` (the real engines' speed just before a run, mean of the engines) is a metric beside the
    others, so a `--seeds N` run keeps one per repetition; a run without probes (the simulator) has none."""
    speeds = iter([0.3, 0.2, 0.25, 0.4])

    def fake_run_one(sc, system, quick, seed, workdir, backend=None):
        run = RunData(scenario=sc.id, system=system, time_scale=1.0, replicas=["127.0.0.1:1"], duration=1.0)
        run.records = [Record(user=0, attempt=0, sdk_attempt=0, kind="short", start=0.0, first_token=0.1, end=0.2,
                              status=200, done=True)]
        if system == "sluice":
            speed = next(speeds)
            run.extra["engine_probe_s"] = {"a": speed, "b": speed + 0.1}
        return run, {"system": system, "notes": [], "wall_s": 0.1}

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    out = run_scenarios([_Fake()], ["sluice", "envoy-rr"], quick=True, seed=1, results_dir=tmp_path, plots=False,
                        seeds=3)
    sluice = out["P3"]["sluice"]
    assert [rep["engine_probe_s"] for rep in sluice["per_rep"]] == [0.35, 0.25, 0.3]
    assert sluice["engine_probe_s"] == 0.3 and sluice["diagnostics"]["engine_probe_s"] == {"a": 0.25, "b": 0.35}
    assert "engine_probe_s" not in out["P3"]["envoy-rr"]


def test_combine_reps_keeps_each_repetitions_class_goodputs():
    reps = [{"slo_goodput_rps": 1.0, "class_slo_goodput": {"a": 1.0}},
            {"slo_goodput_rps": 2.0, "class_slo_goodput": {"a": 2.0}}]
    assert combine_reps(reps)["per_rep_class_slo_goodput"] == [{"a": 1.0}, {"a": 2.0}]


def test_the_seeds_report_judges_each_repetition_on_its_own_numbers(tmp_path: Path):
    """Each repetition's ratio and worst class come from that repetition's systems (not the medians), the counts
    say how many reach the bars, and a scenario whose own bar stands is shown but not counted."""
    from bench.seeds_report import MARKERS, main, table
    from bench.real import markers

    def system(goodputs: list[float], classes: list[dict], offered: float = 10.0) -> dict:
        return {"slo_goodput_rps": sorted(goodputs)[len(goodputs) // 2], "offered_rps": offered,
                "refused_classes": [], "per_rep": [{"slo_goodput_rps": g, "offered_rps": offered} for g in goodputs],
                "per_rep_class_slo_goodput": classes}
    row = {"sluice": system([6.0, 5.0, 4.0], [{"a": 3.0, "b": 3.0}, {"a": 2.0, "b": 3.0}, {"a": 2.0, "b": 2.0}]),
           "envoy-rr": system([4.0, 5.0, 5.0], [{"a": 2.0, "b": 2.0}, {"a": 2.5, "b": 2.5}, {"a": 2.5, "b": 2.5}])}
    result = {"P3": row, "P12": row, "_meta": {"command": "sluice bench run all --quick --seeds 3", "commit": "abc",
                                               "seeds": 3}}
    text = table(result)
    p3 = next(ln for ln in text.splitlines() if ln.startswith("| P3 |"))
    assert "| 5 [6, 5, 4] |" in p3 and "| 5 [4, 5, 5] |" in p3
    assert "| 1.5, 1, 0.8 | 1 of 3 |" in p3                    # 6/4, 5/5, 4/5: each repetition's own best
    assert "| 1.5, 0.8, 0.8 | 1 of 3 |" in p3                   # worst class: a 3/2, then a 2/2.5 twice
    assert "| own bar |" in next(ln for ln in text.splitlines() if ln.startswith("| P12 |"))
    docs = tmp_path / "docs.md"
    begin, end = markers(MARKERS)
    docs.write_text(f"# b\n\n{begin}\nold\n{end}\n")
    src = tmp_path / "seeds.json"
    src.write_text(json.dumps(result))
    assert main([str(src), "--docs", str(docs)]) == 0
    assert "old" not in docs.read_text() and "at commit `abc`" in docs.read_text()


def test_a_runs_table_goes_between_the_markers_it_is_given(tmp_path: Path):
    """A run of a few scenarios (`--markers NAME`) gets its own block and leaves the whole run's untouched: the
    block is written between NAME's markers and carries them, so the next regeneration finds them again."""
    from bench.seeds_report import MARKERS, main
    from bench.real import markers

    row = {"sluice": {"slo_goodput_rps": 5.0, "offered_rps": 10.0, "refused_classes": [],
                      "per_rep": [{"slo_goodput_rps": 5.0, "offered_rps": 10.0}], "per_rep_class_slo_goodput": []}}
    src = tmp_path / "seeds.json"
    src.write_text(json.dumps({"P3": row, "_meta": {"command": "sluice bench run P3 --seeds 1", "commit": "def"}}))
    whole, mine = markers(MARKERS), markers("seeds-subset")
    docs = tmp_path / "docs.md"
    docs.write_text(f"{whole[0]}\nthe whole run\n{whole[1]}\n\n{mine[0]}\nold\n{mine[1]}\n")
    for _ in range(2):
        assert main([str(src), "--docs", str(docs), "--markers", "seeds-subset"]) == 0
    text = docs.read_text()
    assert "the whole run" in text and "old" not in text and text.count("at commit `def`") == 1
    assert text.count(mine[0]) == 1 and text.count(whole[0]) == 1


def test_one_scenarios_table_shows_each_value_as_the_file_holds_it():
    """A whole number loses its `.0`, anything else keeps every digit (11.125, not fmt's 11.1), the median comes
    before each repetition's value in brackets, and a metric no system has (the simulator's engine probe) is no
    row."""
    from bench.seeds_report import scenario_table

    def system(goodputs: list[float], failed: list[float]) -> dict:
        return {"slo_goodput_rps": sorted(goodputs)[1], "failed": sorted(failed)[1], "engine_probe_s": None,
                "per_rep": [{"slo_goodput_rps": g, "failed": f} for g, f in zip(goodputs, failed)]}
    result = {"PX": {"envoy-rr": system([1.05, 0.175, 0.0], [142.0, 222.0, 396.0]),
                     "sluice": system([12.625, 11.125, 10.8], [121.0, 169.0, 195.0])},
              "_meta": {"quick": True, "backend": "sim", "seeds": 3}}
    lines = scenario_table([result], "PX").splitlines()
    assert lines[0] == "| PX, 12 s, simulator, median [per repetition] | sluice | envoy-rr |"
    assert lines[2] == "| `slo_goodput_rps` (req/s) | 11.125 [12.625, 11.125, 10.8] | 0.175 [1.05, 0.175, 0] |"
    assert lines[3] == "| calls that failed for good | 169 [121, 169, 195] | 222 [142, 222, 396] |"
    assert len(lines) == 4                                          # no offered, hit rate, p95 or probe row
    result["_meta"].update(quick=False, backend="vllm-cpu")
    assert scenario_table([result], "PX").startswith("| PX, 40 s, real engines, median [per repetition] |")


def test_the_px_full_length_tables_regenerate_in_place_and_unchanged(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """The committed tables are what their JSON renders to, and writing them again leaves the page as it was."""
    from bench.seeds_report import main

    monkeypatch.chdir(Path(__file__).resolve().parents[2])         # the page names its sources from the root
    page = tmp_path / "benchmarks.md"
    committed = Path("docs/benchmarks.md").read_text()
    page.write_text(committed)
    for _ in range(2):
        for kind in ("real", "sim"):
            src = f"bench/results/px-full/{kind}-turns.json"
            assert main([src, "--scenario", "PX", "--docs", str(page), "--markers", f"px-full-{kind}-turns"]) == 0
        assert page.read_text() == committed
    with pytest.raises(SystemExit):                                 # would overwrite the whole run's seeds table
        main([src, "--scenario", "PX", "--docs", str(page)])


def test_several_files_side_by_side_name_each_column_by_its_label(tmp_path: Path):
    """Two runs of P1f (one default changed in a worktree) as `system (label)` columns, P1f's documented metrics as
    rows; several files without one label each are refused."""
    from bench.seeds_report import main, scenario_table

    def run(ratio: float, flood: float) -> dict:
        return {"P1f": {"sluice": {"slo_goodput_rps": flood / 2, "other_tenant_ttft_p95_ratio": ratio,
                                   "flood_goodput_rps": flood}}, "_meta": {"quick": True, "backend": "sim"}}
    lines = scenario_table([run(3.14, 28.0), run(1.34, 11.5)], "P1f", ["shipped", "share 0.5"]).splitlines()
    assert lines[0] == "| P1f, 18 s, simulator, median [per repetition] | sluice (shipped) | sluice (share 0.5) |"
    assert "| `other_tenant_ttft_p95_ratio` (x) | 3.14 | 1.34 |" in lines
    assert "| `flood_goodput_rps` (req/s) | 28 | 11.5 |" in lines
    files = []
    for k, r in enumerate((run(3.14, 28.0), run(1.34, 11.5))):
        files.append(tmp_path / f"r{k}.json")
        files[-1].write_text(json.dumps(r))
    with pytest.raises(SystemExit):
        main([str(f) for f in files] + ["--scenario", "P1f", "--labels", "only-one"])


def test_classes_add_a_row_per_class_with_each_repetitions_value():
    """`--classes`: a row per class of class_slo_goodput, the median then each repetition's value, '-' for a system
    without that class; without it no class row (the published tables stay as they are)."""
    from bench.seeds_report import scenario_table

    def run(long: list[float]) -> dict:
        reps = [{"long": v, "short": 4.0} for v in long]
        return {"P9": {"sluice": {"slo_goodput_rps": 5.0, "per_rep_class_slo_goodput": reps},
                       "smg": {"slo_goodput_rps": 4.0, "per_rep_class_slo_goodput": [{"short": 3.0}] * 3}},
                "_meta": {"quick": True, "backend": "vllm-cpu"}}

    text = scenario_table([run([1.0, 1.25, 0.5]), run([1.5, 1.5, 1.0])], "P9", ["before", "after"], classes=True)
    rows = {line.split(" | ")[0]: line for line in text.splitlines()}
    assert rows["| `class_slo_goodput` long (req/s)"].split(" | ")[1:] == [
        "1 [1, 1.25, 0.5]", "-", "1.5 [1.5, 1.5, 1]", "- |"]
    assert "short" in text and "class_slo_goodput" not in scenario_table([run([1.0] * 3)], "P9")
