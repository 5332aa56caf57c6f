"""`sluice sim calibrate --against URL` end to end, against simulators: measuring a replica whose model is known
must give that model back (the probes and the simulated rows describe the same scenarios)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Iterator

import pytest

from extproc.sim import SimConfig, SimServer, start_sim
from extproc.sim.calibrate import HIGH, LOW, SPEC_BY_NAME, main
from extproc.sim.presets import get_preset

TIME_SCALE = 20  # the probes run 20x faster; latencies of the HTTP path itself are then not modelled


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimServer]]:
    """A normal replica and a small-KV one, served from their own event loop in a thread."""
    ready, stop, out = threading.Event(), threading.Event(), []

    async def serve() -> None:
        cfgs = [SimConfig(port=0, time_scale=TIME_SCALE, model="m"),
                SimConfig(port=0, time_scale=TIME_SCALE, model="m", num_gpu_blocks=80)]
        out.extend([await start_sim(c) for c in cfgs])
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for s in out:
            await s.stop()

    t = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    t.start()
    assert ready.wait(10)
    yield out
    stop.set()
    t.join(10)


def test_calibrating_against_a_simulator_recovers_its_model(sims: list[SimServer], tmp_path: Path) -> None:
    out, preset_file = tmp_path / "m.json", tmp_path / "p.json"
    main(["--against", sims[0].url, "--preempt-url", sims[1].url, "--repeats", "5", "--max-num-seqs", "64",
          "--json", str(out), "--write-preset", str(preset_file)])
    m = json.loads(out.read_text())
    assert m["engine"]["version"] == "0.32.0+sluice.sim"
    assert m["engine"]["num_gpu_blocks"] * m["engine"]["block_size"] == 512 * 128
    rows = {r["name"]: r for r in m["rows"]}
    assert len(rows) >= 8 and {r["use"] for r in rows.values()} == {"fit", "held-out"}
    engine_rows = [n for n in rows if SPEC_BY_NAME[n].kind in ("ttft", "decode", "hol_mean", "hol_max", "prefix_hit",
                                                                "kv", "preempt")]
    off = {n: rows[n]["ratio"] for n in engine_rows if not LOW <= rows[n]["ratio"] <= HIGH}
    assert not off, off
    longs = m["extra"]["hol_long_ttfts"]  # the long prompt alone, once before each HOL trial (8 offsets x 3)
    assert len(longs) == 24 and LOW <= sorted(longs)[12] / rows["ttft_4000"]["measured"] <= HIGH
    fitted = get_preset(str(preset_file))
    assert (fitted.num_gpu_blocks, fitted.block_size, fitted.max_num_seqs) == (512, 128, 64)
