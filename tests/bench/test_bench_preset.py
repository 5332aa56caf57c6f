"""SLUICE_BENCH_PRESET: the scenarios derive their workload from a preset fitted to the engines at hand."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from extproc.sim.presets import TINY_CPU, preset_to_json

REPO = Path(__file__).resolve().parents[2]
PROBE = ("from bench.scenarios import get_scenarios; import json; s = get_scenarios(['P3'])[0]; "
         "print(json.dumps({'preset': s.preset, **s.derived_values}))")


def _derived(env_preset: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_BENCH_PRESET"}
    if env_preset:
        env["SLUICE_BENCH_PRESET"] = env_preset
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_faster_engines_preset_rescales_a_scenario(tmp_path: Path) -> None:
    # an engine whose prefill is 4x faster: P3's short load (a share of the pool's capacity) goes up, and its
    # long prompt (the longest whose prefill takes 2 s) grows until it meets the real engine's context cap
    fast = dataclasses.replace(TINY_CPU, name="fast",
                               cost=dataclasses.replace(TINY_CPU.cost, prefill_tok=TINY_CPU.cost.prefill_tok / 4))
    path = tmp_path / "fast.json"
    path.write_text(json.dumps(preset_to_json(fast)))
    default, fitted = _derived(None), _derived(str(path))
    assert default["preset"] == "tiny-cpu" and fitted["preset"] == str(path)
    assert fitted["short (req/s)"] > 1.2 * default["short (req/s)"]
    assert fitted["long prompt"] > default["long prompt"]
