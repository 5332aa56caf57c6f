"""The real-engine results: batches merge into one file, the sim-vs-real table flags a disagreement, and issue
16's bars judge the 2x margin and the goodput floor."""

import json
import os
from pathlib import Path

import pytest

from bench.bars import real_bars
from bench.real import BEGIN, END, bars_table, comparison, merge, section, winner, write_docs


def _run(sid: str, commit: str, rows: dict) -> dict:
    return {sid: rows, "_meta": {"command": f"sluice bench run {sid}", "commit": commit, "date": "d",
                                 "runs": {sid: {"sluice": {"wall_s": 10.0}}}, "reproduced": {sid: True},
                                 "systems": ["sluice"], "backend": "vllm-cpu"}}


def test_merge_keeps_each_scenarios_meta_and_names_the_commits():
    a = _run("P3", "abc", {"sluice": {"hol_slowdown": 1.0}})
    b = _run("P9", "abc", {"sluice": {"preemptions": 0.0}})
    c = _run("P3", "def", {"sluice": {"hol_slowdown": 2.0}})  # a rerun replaces the earlier P3
    merged = merge([a, b])
    assert merged["_meta"]["commit"] == "abc" and merged["_meta"]["reproduced"] == {"P3": True, "P9": True}
    assert merged["_meta"]["measured"]["P9"]["command"] == "sluice bench run P9"
    assert merged["_meta"]["wall_s"] == 20.0
    again = merge([a, b, c])
    assert again["P3"]["sluice"]["hol_slowdown"] == 2.0 and again["_meta"]["commit"] == "abc,def"


def test_winner_and_comparison_flag_where_simulator_and_engine_disagree():
    real = {"P3": {"sluice": {"hol_slowdown": 3.0, "slo_goodput_rps": 2.0},
                   "envoy-rr": {"hol_slowdown": 3.5, "slo_goodput_rps": 2.5},
                   "smg": {"hol_slowdown": 2.5, "slo_goodput_rps": 1.0}}}
    sim = {"P3": {"sluice": {"hol_slowdown": 1.2, "slo_goodput_rps": 5.0},
                  "envoy-rr": {"hol_slowdown": 28.0, "slo_goodput_rps": 4.0}}}
    assert winner(real["P3"], "hol_slowdown", "lower") == ("baseline", 3.0, 2.5)
    assert winner(sim["P3"], "hol_slowdown", "lower") == ("sluice", 1.2, 28.0)
    assert winner(real["P3"], "slo_goodput_rps", "higher") == ("baseline", 2.0, 2.5)
    assert winner(real["P3"], "short_ttft_p95_s", "lower")[0] is None  # not measured
    table = comparison(real, sim)
    row = next(ln for ln in table.splitlines() if "`hol_slowdown`" in ln)
    assert row.endswith("| **no** |") and "3 vs 2.5: baseline" in row and "1.2 vs 28: sluice" in row


def test_real_bars_need_twice_better_and_no_goodput_loss():
    results = {
        "P3": {"sluice": {"hol_slowdown": 1.5, "slo_goodput_rps": 3.0},
               "envoy-rr": {"hol_slowdown": 4.0, "slo_goodput_rps": 3.0}, "smg": {"hol_slowdown": 3.0}},
        "P7": {"sluice": {"ttft_p95_s": 1.0, "slo_goodput_rps": 2.0},
               "envoy-tuned": {"ttft_p95_s": 1.5, "slo_goodput_rps": 2.5}},
        "P9": {"sluice": {"preemptions": 0.0, "slo_goodput_rps": 1.0},
               "envoy-rr": {"preemptions": 0.0, "slo_goodput_rps": 1.0}},
    }
    v = {(sid, text.split(" ")[2]): ok for sid, text, ok, _m in real_bars(results)}
    assert v[("P3", "beats")] is True and v[("P3", "not")] is True          # 1.5 x 2 <= 3 (smg); 3 >= 3
    assert v[("P7", "beats")] is False and v[("P7", "not")] is False
    assert v[("P9", "beats")] is False                                      # 0 vs 0 beats nothing
    assert ("PX", "beats") not in v                                         # not run: no bar shown


def test_a_batch_without_issue_16s_scenarios_says_it_has_no_bar():
    results = {"P4": {"sluice": {"ghost_tokens_per_cancel": 0.1}, "envoy-rr": {"ghost_tokens_per_cancel": 20.0}},
               "P8": {"sluice": {"detect_s": 6.0}}, "_meta": {}}
    assert real_bars(results) == []
    assert bars_table(results) == "Issue 16 states no bar for P4, P8.\n"


def test_docs_section_is_replaced_between_its_markers(tmp_path: Path):
    page = tmp_path / "b.md"
    page.write_text("# B\n\nintro\n")
    write_docs(page, f"{BEGIN}\none\n{END}")
    write_docs(page, f"{BEGIN}\ntwo\n{END}")
    text = page.read_text()
    assert text.count(BEGIN) == 1 and "two" in text and "one" not in text and text.startswith("# B\n\nintro")


def test_a_section_of_another_name_leaves_the_default_one_alone(tmp_path: Path):
    """Another machine's runs go between their own markers; the published section stays as it was."""
    page = tmp_path / "b.md"
    page.write_text(f"# B\n\n{BEGIN}\nfirst machine\n{END}\n")
    a = _run("P3", "abc", {"sluice": {"hol_slowdown": 1.0}})
    text = section(merge([a]), merge([a]), "real-engines-xeon", ("x/real-xeon.json", "x/real-sim-xeon.json"))
    write_docs(page, text, "real-engines-xeon")
    write_docs(page, text, "real-engines-xeon")
    out = page.read_text()
    assert f"{BEGIN}\nfirst machine\n{END}" in out
    assert out.count("<!-- real-engines-xeon:begin -->") == 1
    assert "from x/real-xeon.json and x/real-sim-xeon.json" in out


def test_the_section_names_the_preset_and_the_machines_load_scale():
    preset = {"preset": "/x/preset.json", "name": "tiny-cpu", "description": "fitted to vLLM 0.32.0 here",
              "load_scale": 0.27}
    a = _run("P3", "abc", {"sluice": {"hol_slowdown": 1.0}})
    a["_meta"]["preset"] = preset
    merged = merge([a])
    assert merged["_meta"]["preset"] == preset
    text = section(merged, merged)
    assert "scaled by 0.27" in text and "fitted to vLLM 0.32.0 here" in text
    assert "ran at the preset's full speed" in text  # a simulated run written before `--speed`


def test_the_section_says_the_simulated_replicas_ran_at_the_rigs_speed():
    preset = {"preset": "/x/preset.json", "name": "tiny-cpu", "description": "d", "load_scale": 0.477}
    real, sim = _run("P3", "abc", {"sluice": {"hol_slowdown": 1.0}}), _run("P3", "abc", {"sluice": {}})
    real["_meta"]["preset"] = sim["_meta"]["preset"] = preset
    sim["_meta"]["sim_speed"] = 0.477
    merged_sim = merge([sim])
    assert merged_sim["_meta"]["sim_speed"] == 0.477
    text = section(merge([real]), merged_sim)
    assert "run at 0.477 of the preset's speed" in text and "full speed" not in text


def test_the_real_backend_warms_every_engine_with_each_shape_before_a_system_runs(monkeypatch, tmp_path: Path):
    from types import SimpleNamespace

    from bench import backends

    sent: list[tuple[str, int]] = []
    monkeypatch.setattr(backends.VllmBackend, "_post",
                        staticmethod(lambda url, body: sent.append((url, len(body["messages"][-1]["content"])))))
    b = backends.VllmBackend(tmp_path)
    b.engines = [SimpleNamespace(url="http://a"), SimpleNamespace(url="http://b")]
    b.text_scale = 0.5
    b._warm_up()
    per_engine = backends.WARM_UP_ROUNDS * len(backends.WARM_UP_PROMPTS)
    assert sorted({u for u, _ in sent}) == ["http://a", "http://b"] and len(sent) == 2 * per_engine
    sizes = sorted({n for u, n in sent if u == "http://a"})
    assert len(sizes) == len(backends.WARM_UP_PROMPTS)  # one body per shape, the longest a long prefill
    sent.clear()
    b.context = 96 * 128  # P9's engines: vLLM answers 400 to a prompt over their context
    b._warm_up()
    assert max(n for _, n in sent) < max(sizes) and len(sent) == 2 * backends.WARM_UP_ROUNDS * (len(sizes) - 1)
    assert backends.warm_up_prompts(96 * 128) == backends.WARM_UP_PROMPTS[:-1]


def test_an_engine_with_a_scenarios_small_kv_serves_the_context_its_blocks_hold(monkeypatch, tmp_path: Path):
    """vLLM refuses to start when its KV cannot hold one whole context: P9's 97 blocks hold 12,288 tokens, under
    the model's 16,384 positions (every P9 engine failed to start before the context followed the blocks)."""
    from bench import backends, vllm_cpu

    started: list[list[vllm_cpu.EngineSpec]] = []
    monkeypatch.setattr(vllm_cpu, "start_engines", lambda specs, log_dir, **kw: started.append(specs) or [])
    monkeypatch.setattr(backends.VllmBackend, "_measure_text_scale", lambda self: 1.0)
    monkeypatch.setattr(backends.VllmBackend, "_warm_up", lambda self: None)
    b = backends.VllmBackend(tmp_path)
    b._start(97, None)
    b._start(None, None)
    assert [s.max_model_len for s in started[0]] == [96 * 128] * 2
    assert "--num-gpu-blocks-override" in started[0][0].extra_args
    assert [s.max_model_len for s in started[1]] == [vllm_cpu.MAX_POSITIONS] * 2 and vllm_cpu.MAX_POSITIONS == 16384
    assert vllm_cpu.context_for_blocks(80) == 10_112  # what vLLM 0.32 said it could serve with 80 blocks


def test_an_engine_spec_names_the_cores_its_whole_engine_is_bound_to():
    """`start_engines` binds every process of an engine to these (bench/contend.py: floating, they slowed the
    other engine's prefills)."""
    from bench.vllm_cpu import EngineSpec, engine_specs

    assert EngineSpec(port=1, cpu="1").cores() == {1}
    assert EngineSpec(port=1, cpu="0-1").cores() == {0, 1}
    assert EngineSpec(port=1, cpu="0,2-3").cores() == {0, 2, 3}
    ncpu = os.cpu_count() or 1
    assert [s.cores() for s in engine_specs([1, 2])] == [{0}, {1 % ncpu}]


def test_the_section_shows_each_systems_engine_speed_and_their_spread():
    probe = {"sluice": {"slo_goodput_rps": 1.0, "diagnostics": {"engine_probe_s": {"a": 0.3, "b": 0.28}}},
             "envoy-rr": {"slo_goodput_rps": 1.0, "diagnostics": {"engine_probe_s": {"a": 0.2, "b": 0.2}}}}
    text = section(merge([_run("P3", "abc", probe)]), merge([_run("P3", "abc", probe)]))
    assert "slowest / fastest" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| P3 |") and ln.endswith("| 1.45 |"))
    assert "0.29" in row and "0.2" in row  # sluice's mean of its two engines, envoy-rr's
    without = section(merge([_run("P3", "abc", {"sluice": {"slo_goodput_rps": 1.0}})]),
                      merge([_run("P3", "abc", {"sluice": {"slo_goodput_rps": 1.0}})]))
    assert "slowest / fastest" not in without  # the simulator's runs have no probe


def test_a_seeded_section_shows_each_repetition_and_the_spread_per_repetition():
    """With `--seeds N` a cell is the median with every repetition in brackets, the probe table shows each
    repetition's speed and the slowest over the fastest system within each repetition (not across them), and
    the bars judge the medians."""
    def seeded(goodputs: list[float], probes: list[float]) -> dict:
        return {"slo_goodput_rps": sorted(goodputs)[1], "hol_slowdown": 1.0, "engine_probe_s": sorted(probes)[1],
                "reps": 3, "per_rep": [{"slo_goodput_rps": g, "hol_slowdown": 1.0, "engine_probe_s": p}
                                       for g, p in zip(goodputs, probes)]}
    rows = {"sluice": seeded([7.0, 5.0, 6.0], [0.3, 0.2, 0.25]), "envoy-rr": seeded([4.0, 8.0, 5.0], [0.2, 0.2, 0.2])}
    text = section(merge([_run("P3", "abc", rows)]), merge([_run("P3", "abc", rows)]))
    assert "median of 3 repetitions" in text
    goodput = next(ln for ln in text.splitlines() if ln.startswith("| P3 | `slo_goodput_rps`"))
    assert "| 6 [7, 5, 6] |" in goodput and "| 5 [4, 8, 5] |" in goodput
    assert "6 vs 5: sluice" in goodput  # the medians decide
    speed = next(ln for ln in text.splitlines() if ln.startswith("| P3 |") and "slowest" not in ln
                 and "[0.3, 0.2, 0.25]" in ln)
    assert speed.endswith("| 1.50, 1.00, 1.25 |")  # per repetition, not the slowest run over the fastest run
    assert "median of" not in section(merge([_run("P3", "abc", {"sluice": {"slo_goodput_rps": 1.0}})]),
                                      merge([_run("P3", "abc", {"sluice": {"slo_goodput_rps": 1.0}})]))


async def test_the_real_backend_times_one_prefill_per_engine_before_each_run(tmp_path: Path):
    """`begin_run` returns each replica's probe: one PROBE_TOKENS-token prompt, answered with one token (a
    simulator stands in for the engine here; the probe only needs the OpenAI completions API and /metrics)."""
    import aiohttp

    from bench import backends
    from bench.scenarios.base import MODEL
    from extproc.sim import SimConfig, start_sim

    sim = await start_sim(SimConfig(port=0, model=MODEL, time_scale=20))
    try:
        addr = sim.url.removeprefix("http://")
        b = backends.VllmBackend(tmp_path)
        async with aiohttp.ClientSession() as session:
            first = await b.begin_run(session, [addr])
            second = await b.begin_run(session, [addr])
            async with session.get(sim.url + "/metrics") as resp:
                text = await resp.text()
        assert list(first) == [addr] and first[addr] > 0 and second[addr] > 0
        prompt_tokens = next(float(ln.split()[-1]) for ln in text.splitlines()
                             if ln.startswith("vllm:prompt_tokens_total"))
        assert prompt_tokens == 2 * backends.PROBE_TOKENS
        assert b.base[addr]["running"] == 0  # the counters' base is taken after the probe
    finally:
        await sim.stop()


def test_a_seeded_runs_bars_say_in_how_many_repetitions_they_held():
    """The bars judge the medians, and each says how many repetitions met it on their own numbers."""
    from bench.bars import real_bars

    def seeded(**per: list[float]) -> dict:
        keys = list(per)
        reps = [dict(zip(keys, vals)) for vals in zip(*per.values())]
        return {**{k: sorted(v)[1] for k, v in per.items()}, "reps": 3, "per_rep": reps}
    results = {"P3": {"sluice": seeded(hol_slowdown=[1.0, 5.0, 1.5], slo_goodput_rps=[6.0, 6.0, 4.0]),
                      "envoy-rr": seeded(hol_slowdown=[9.0, 6.0, 2.0], slo_goodput_rps=[5.0, 5.0, 5.0])}}
    bars = {text.split(" ")[1]: (ok, shown) for sid, text, ok, shown in real_bars(results) if sid == "P3"}
    assert bars["hol_slowdown"][0] is True and bars["hol_slowdown"][1].endswith("(met in 1 of 3 repetitions)")
    assert bars["slo_goodput_rps"][0] is True and bars["slo_goodput_rps"][1].endswith("(met in 2 of 3 repetitions)")
    single = {"P3": {"sluice": {"hol_slowdown": 1.0}, "envoy-rr": {"hol_slowdown": 3.0}}}
    assert "repetitions" not in real_bars(single)[0][3]


def test_the_brief_for_the_readme_names_the_runs_and_the_bars(tmp_path: Path):
    from bench.real import BRIEF, main, markers

    rows = {"sluice": {"slo_goodput_rps": 2.0, "hol_slowdown": 1.0}, "envoy-rr": {"slo_goodput_rps": 1.0,
                                                                                   "hol_slowdown": 5.0}}
    real, sim, docs, readme = (tmp_path / n for n in ("real.json", "sim.json", "docs.md", "README.md"))
    real.write_text(json.dumps(merge([_run("P3", "abc", rows)])))
    sim.write_text(json.dumps(merge([_run("P3", "abc", rows)])))
    docs.write_text("# docs\n")
    begin, end = markers(BRIEF)
    readme.write_text(f"# sluice\n\n{begin}\nold\n{end}\n\nmore\n")
    assert main(["docs", str(real), str(sim), "--docs", str(docs), "--brief", str(readme)]) == 0
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{end}\n\nmore\n") and "at commit `abc`" in text
    assert ("| P3 | sluice hol_slowdown beats the best baseline's by >= 2x | sluice 1, best baseline envoy-rr 5 "
            "| met |") in text


def test_the_comparison_without_a_page_is_printed_and_no_page_is_written(tmp_path: Path, monkeypatch,
                                                                         capsys: pytest.CaptureFixture[str]):
    from bench.real import main

    rows = {"sluice": {"slo_goodput_rps": 2.0, "hol_slowdown": 1.0}, "envoy-rr": {"slo_goodput_rps": 1.0,
                                                                                   "hol_slowdown": 5.0}}
    real, sim = tmp_path / "real.json", tmp_path / "sim.json"
    real.write_text(json.dumps(merge([_run("P3", "abc", rows)])))
    sim.write_text(json.dumps(merge([_run("P3", "abc", rows)])))
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "benchmarks.md"
    page.write_text("# the published page\n")
    monkeypatch.chdir(tmp_path)  # where `docs/benchmarks.md` was the default page
    assert main(["docs", str(real), str(sim), "--markers", "elsewhere"]) == 0
    assert "<!-- elsewhere:begin -->" in capsys.readouterr().out
    assert page.read_text() == "# the published page\n"


def test_fidelity_counts_the_engines_conclusions_and_the_typical_factor_off(tmp_path: Path, capsys):
    """`python -m bench.real fidelity`: per simulated run, the rows with the engines' conclusion and
    exp(median |ln(sim / real)|) over the values both have."""
    from bench.real import agreement, main

    real = {"P3": {"sluice": {"slo_goodput_rps": 4.0, "hol_slowdown": 1.0, "short_ttft_p95_s": 0.1},
                   "envoy-rr": {"slo_goodput_rps": 2.0, "hol_slowdown": 10.0, "short_ttft_p95_s": 2.0}}}
    near = {"P3": {"sluice": {"slo_goodput_rps": 4.0, "hol_slowdown": 2.0, "short_ttft_p95_s": 0.1},
                   "envoy-rr": {"slo_goodput_rps": 2.0, "hol_slowdown": 10.0, "short_ttft_p95_s": 2.0}}}
    far = {"P3": {"sluice": {"slo_goodput_rps": 2.0, "hol_slowdown": 4.0, "short_ttft_p95_s": 0.6},
                  "envoy-rr": {"slo_goodput_rps": 8.0, "hol_slowdown": 2.5, "short_ttft_p95_s": 0.5}}}
    assert agreement(real, near) == (3, 3) and agreement(real, far) == (0, 3)
    files = []
    for name, data in (("real", real), ("near", near), ("far", far)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(data))
    out = tmp_path / "fidelity.md"
    assert main(["fidelity", str(files[0]), f"near={files[1]}", f"far={files[2]}", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| near | 3 of 3 rows | 1.00x | 6 |" in text  # five values equal, one 2x off: the median is 1
    assert "| far | 0 of 3 rows | 4.00x | 6 |" in text  # values 2x-6x off, four of them 4x
    assert "| P3 | `hol_slowdown` | sluice | 1 | 2 | 4 |" in text
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- fid:begin -->\nold\n<!-- fid:end -->\nafter\n")
    assert main(["fidelity", str(files[0]), f"near={files[1]}", "--docs", str(page), "--markers", "fid"]) == 0
    written = page.read_text()
    assert "| near | 3 of 3 rows | 1.00x | 6 |" in written and "old" not in written
    assert "| P3 | `hol_slowdown`" not in written and written.endswith("<!-- fid:end -->\nafter\n")
    with pytest.raises(SystemExit):
        main(["fidelity", str(files[0]), str(files[1])])  # a simulated run without its label
