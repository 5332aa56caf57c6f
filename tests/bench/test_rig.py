"""bench/rig.py and SLUICE_BENCH_RIG: the real-engine scenarios offer the same share of what the machine delivers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import rig
from bench.capacity import LOAD_SCALE, EngineSpec, _rig_load_scale, closed_loop_rps, engine_capacity_rps
from bench.scenarios.base import MODEL
from extproc.sim import SimConfig, start_sim

REPO = Path(__file__).resolve().parents[2]
PROBE = ("from bench.scenarios import get_scenarios, px_prefix; import json; from bench.capacity import LOAD_SCALE; "
         "s = get_scenarios(['P3'])[0]; print(json.dumps({'scale': LOAD_SCALE, **s.derived_values, "
         "'px single': px_prefix.single_rate(True, 2) + px_prefix.SESSIONS * px_prefix.TURNS / 12.0}))")


def _derived(rig_file: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SLUICE_BENCH_RIG", "SLUICE_BENCH_PRESET")}
    if rig_file:
        env["SLUICE_BENCH_RIG"] = rig_file
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_load_scale_is_the_delivered_share_of_the_model_at_most_one() -> None:
    assert rig.load_scale(10.0, 40.0) == 0.25
    assert rig.load_scale(50.0, 40.0) == 1.0  # a machine faster than the model does not raise the load
    assert rig.load_scale(5.0, 0.0) == 1.0


def test_a_rig_file_scales_every_scenario_load_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "rig.json"
    path.write_text(json.dumps({"load_scale": 0.25}))
    plain, scaled = _derived(None), _derived(str(path))
    assert plain["scale"] == 1.0 and scaled["scale"] == 0.25
    assert scaled["short (req/s)"] == pytest.approx(0.25 * plain["short (req/s)"])
    assert scaled["px single"] < 0.6 * plain["px single"]  # PX sizes its load on its own (floor: 0.5 req/s)
    assert scaled["long prompt"] == plain["long prompt"]  # sizes and SLOs follow the engine, not the machine


def test_a_load_scale_out_of_range_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "rig.json"
    path.write_text(json.dumps({"load_scale": 0}))
    with pytest.raises(ValueError, match="load_scale"):
        _rig_load_scale(str(path))
    assert _rig_load_scale(None) == 1.0


def test_the_probe_counts_completions_in_its_window_and_no_more_than_the_engines_serve() -> None:
    """Two simulated replicas (the cost model's own engines) kept busy by the probe: it measures what the cost
    model gives for the same clients (closed_loop_rps), which is less than its backlog capacity."""

    async def run() -> float:
        sims = [await start_sim(SimConfig(port=0, model=MODEL)) for _ in range(2)]
        try:
            return await rig.measure_rps([s.url for s in sims], streams=4, warmup_s=0.5, window_s=1.5)
        finally:
            for s in sims:
                await s.stop()

    measured = asyncio.run(run())
    model = 2 * closed_loop_rps(EngineSpec.of("tiny-cpu"), 4, rig.PROMPT, rig.OUTPUT)
    assert 0.8 * model <= measured <= 1.1 * model  # a repeated prompt (prefix cache) measured 1.5x the model
    assert model < 2 * engine_capacity_rps(EngineSpec.of("tiny-cpu"), rig.PROMPT, rig.OUTPUT)


def test_with_a_rig_the_simulated_replicas_run_at_its_speed_and_without_one_as_the_preset() -> None:
    """make bench-real's simulated side: the same scaled loads on replicas as fast as the rig's engines were."""
    from bench.backends import SimBackend
    from bench.runner import policy_dict
    from bench.scenarios import get_scenarios

    sc = get_scenarios(["P9"])[0]
    rigged, plain = policy_dict(sc, "sluice", 1), policy_dict(sc, "sluice", 1)
    SimBackend(speed=0.477).prepare(sc, rigged)
    SimBackend(speed=1.0).prepare(sc, plain)
    assert rigged["simulator"]["extra_args"] == [*sc.sim_args, "--speed", "0.477"]
    assert plain["simulator"]["extra_args"] == list(sc.sim_args)
    assert SimBackend().speed == LOAD_SCALE  # the default: the rig of SLUICE_BENCH_RIG, 1.0 without one


def test_the_closed_loop_model_is_the_backlog_capacity_once_the_clients_fill_the_engine() -> None:
    """16 clients keep fewer sequences in flight than a backlog of 400 on an engine of 64: each step's fixed cost is
    shared by fewer, so the model serves less; 64 clients of a one-token answer fill it as the backlog does."""
    spec = EngineSpec.of("tiny-cpu")
    assert closed_loop_rps(spec, 16, 100, 256) < 0.8 * engine_capacity_rps(spec, 100, 256)
    assert closed_loop_rps(spec, 64, 800, 1) == pytest.approx(engine_capacity_rps(spec, 800, 1), rel=0.05)
