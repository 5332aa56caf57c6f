"""Calibration: tiny-cpu against its committed measurement of real vLLM, the fit, preset files."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from extproc.sim import cli
from extproc.sim.calibrate import HIGH, LOW, SPEC_BY_NAME, calibrate, fit_preset, load_measurement
from extproc.sim.presets import PRESETS, TINY_CPU, get_preset, measurement_path, preset_from_json, preset_to_json


@pytest.fixture(scope="module")
def measurement() -> dict:
    path = measurement_path(TINY_CPU)
    assert path is not None, "tiny-cpu must name its committed measurement under bench/results/"
    return load_measurement(path)


def test_tiny_cpu_is_within_range_of_real_vllm_on_every_row(measurement: dict) -> None:
    rows = calibrate(TINY_CPU, measurement)
    assert len(rows) >= 8
    assert sum(not r.fit for r in rows) >= 6  # held-out rows check the fit
    bad = [(r.name, r.ratio) for r in rows if r.ratio is None or not LOW <= r.ratio <= HIGH]
    assert not bad, bad
    kinds = {SPEC_BY_NAME[r.name].kind for r in rows}
    assert kinds >= {"ttft", "decode", "hol_mean", "hol_max", "prefix_hit", "kv", "abort", "preempt", "metrics"}


def test_measurement_names_the_engine_and_the_machine(measurement: dict) -> None:
    assert measurement["engine"]["version"].startswith("0.32")
    assert measurement["machine"]["cpu_model"] and measurement["machine"]["cores"] >= 1
    assert measurement["command"] and measurement["date"]
    assert all(len(m["samples"]) >= 1 for m in measurement["measurements"].values())


def test_tiny_cpu_constants_are_the_committed_fit(measurement: dict) -> None:
    stored = preset_from_json(measurement["preset"])
    assert stored.cost == TINY_CPU.cost
    assert (stored.num_gpu_blocks, stored.block_size, stored.max_num_seqs, stored.max_num_batched_tokens) == \
        (TINY_CPU.num_gpu_blocks, TINY_CPU.block_size, TINY_CPU.max_num_seqs, TINY_CPU.max_num_batched_tokens)
    assert stored.metrics_contended == TINY_CPU.metrics_contended


def test_the_fit_never_reads_held_out_rows(measurement: dict) -> None:
    skewed = copy.deepcopy(measurement)
    for name, m in skewed["measurements"].items():
        if name in SPEC_BY_NAME and not SPEC_BY_NAME[name].fit:
            m["value"] *= 10
    a = fit_preset(TINY_CPU, measurement, "a", "a")
    b = fit_preset(TINY_CPU, skewed, "a", "a")
    assert a == b


def test_offline_cli_compares_with_the_committed_measurement(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    assert cli.main(["calibrate", "--preset", "tiny-cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["use"] for r in rows} == {"fit", "held-out"}
    assert all(LOW <= r["ratio"] <= HIGH for r in rows)
    printed = capsys.readouterr().out
    assert "hol_short_ttft_max" in printed
    # the knee sluice's admission.prefill_knee_tokens describes, from the fitted cost model
    assert f"admission.prefill_knee_tokens for this engine: {TINY_CPU.cost.prefill_tok / TINY_CPU.cost.attn_ctx_pair:,.0f}" \
        in printed


def test_a_preset_without_measurement_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["calibrate", "--preset", "llama-8b-h100"]) == 2
    assert cli.main(["calibrate", "--preset", "nope"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_every_preset_simulates_every_row(measurement: dict) -> None:
    for p in PRESETS.values():
        rows = {r.name: r.simulated for r in calibrate(p, measurement)}
        assert rows["ttft_128"] < rows["ttft_4000"] < rows["ttft_8000"]


def test_written_preset_file_round_trips_and_serves(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(preset_to_json(TINY_CPU)))
    assert get_preset(str(path)) == TINY_CPU
    args = cli.build_parser().parse_args(["--port", "0", "--preset", str(path)])
    assert args.preset == str(path)
    assert asdict(get_preset(str(path)).cost) == asdict(TINY_CPU.cost)


def test_a_measurement_file_names_the_preset_it_was_fitted_to(tmp_path: Path, measurement: dict) -> None:
    """`--preset calibration.json`: the preset stored in a `sluice sim calibrate --json` measurement."""
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({**measurement, "preset": preset_to_json(TINY_CPU)}))
    assert get_preset(str(path)) == TINY_CPU


def test_the_fit_gives_back_the_decode_rows_of_a_known_model(measurement: dict) -> None:
    """A measurement that is exactly tiny-cpu's own simulation (decode rows by batch rate, as `measure` takes them)
    is fitted back within a few percent on every decode row: the fit simulates the rows as they were measured."""
    from extproc.sim.calibrate import simulate

    known = copy.deepcopy(measurement)
    known["extra"]["decode_method"] = "batch"
    for name, m in known["measurements"].items():
        if name in SPEC_BY_NAME and SPEC_BY_NAME[name].kind in ("ttft", "decode", "prefix_hit"):
            m["value"] = simulate(SPEC_BY_NAME[name], TINY_CPU, known["extra"])
    fitted = fit_preset(TINY_CPU, known, "known", "known")
    decode = {r.name: round(r.ratio, 3) for r in calibrate(fitted, known) if SPEC_BY_NAME[r.name].kind == "decode"}
    assert len(decode) >= 5 and all(0.97 <= v <= 1.03 for v in decode.values()), decode


def test_the_fit_finds_the_api_servers_share_of_the_core_from_the_tiny_closed_loop_row(measurement: dict) -> None:
    """A measurement that is exactly the simulation of tiny-cpu with the API server on the engine's core (2 ms a
    request) and a closed-loop row of tiny requests: fitted from tiny-cpu (server_core 0), server_core comes back,
    and the held-out closed-loop rows follow it."""
    from dataclasses import replace

    from extproc.sim.calibrate import simulate

    shared = replace(TINY_CPU, cost=replace(TINY_CPU.cost, server_core=0.002))
    known = copy.deepcopy(measurement)
    known["extra"]["decode_method"] = "batch"
    for name in ("closed_loop_rps_16_1", "closed_loop_rps_800_32"):
        known["measurements"][name] = {"value": 0.0}
    for name, m in known["measurements"].items():
        if name in SPEC_BY_NAME and SPEC_BY_NAME[name].kind in ("ttft", "decode", "prefix_hit", "closed_loop"):
            m["value"] = simulate(SPEC_BY_NAME[name], shared, known["extra"])
    assert known["measurements"]["closed_loop_rps_16_1"]["value"] < 0.6 * simulate(
        SPEC_BY_NAME["closed_loop_rps_16_1"], TINY_CPU, known["extra"])  # the API server's share is most of it
    fitted = fit_preset(TINY_CPU, known, "known", "known")
    assert fitted.cost.server_core == pytest.approx(0.002, rel=0.1)
    rows = {r.name: r.ratio for r in calibrate(fitted, known) if SPEC_BY_NAME[r.name].kind == "closed_loop"}
    assert set(rows) == {"closed_loop_rps_16_1", "closed_loop_rps_800_32"}
    assert all(0.97 <= v <= 1.03 for v in rows.values()), rows


def test_hol_rows_compare_with_the_long_prompt_measured_beside_the_trials(measurement: dict) -> None:
    """The offsets are cut from a long prefill measured before the HOL trials; when the machine's speed drifted in
    between, the long measured alone between the trials (``hol_long_ttfts``) is the reference: a short sent at
    0.75x of that long's TTFT is compared with the simulated short at 0.75x of the simulated long, whatever the
    offsets were cut from."""
    from extproc.sim.calibrate import HOL_LONG, hol_offsets, sim_hol, sim_ttft, simulate

    long_alone = sim_ttft(TINY_CPU, HOL_LONG)  # the engine as fast as the model: scale 1
    drifted = copy.deepcopy(measurement)
    drifted["extra"]["hol_offsets"] = hol_offsets(1.4 * long_alone)  # cut from a long measured 40 % slower
    drifted["extra"]["hol_long_ttfts"] = [long_alone * f for f in (0.98, 1.0, 1.03)]
    expected = sim_hol(TINY_CPU, drifted["extra"]["hol_offsets"])
    mean = simulate(SPEC_BY_NAME["hol_short_ttft_mean"], TINY_CPU, drifted["extra"])
    assert mean == pytest.approx(sum(expected) / len(expected), rel=1e-9)
    del drifted["extra"]["hol_long_ttfts"]  # without it: the long the offsets were cut from (1.4x) is the reference
    assert simulate(SPEC_BY_NAME["hol_short_ttft_mean"], TINY_CPU, drifted["extra"]) > 1.2 * mean


def test_refit_fits_a_stored_measurement_again_and_can_leave_rows_out(capsys: pytest.CaptureFixture[str]) -> None:
    """`--refit`: no engine, the stored measurement fitted again (tiny-cpu's gives tiny-cpu's rows back in range);
    `--fit-without` leaves a row out of the fit and shows it held out; an unknown row is a usage error."""
    from extproc.sim.calibrate import main

    assert main(["--refit", "--preset", "tiny-cpu"]) == 0
    out = capsys.readouterr().out
    assert "refitted to" in out and "ttft_128" in out
    main(["--refit", "--preset", "tiny-cpu", "--fit-without", "ttft_8000"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("ttft_8000"))
    assert line.endswith("held-out")
    assert main(["--refit", "--fit-without", "no_such_row"]) == 2
    assert "no_such_row" in capsys.readouterr().err
