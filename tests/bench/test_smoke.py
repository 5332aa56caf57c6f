"""One end-to-end run of a tiny scenario against real stacks (Envoy + simulated replicas, and the sidecar)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.openloop import Arrival
from bench.runner import run_scenarios
from bench.scenarios.base import Workload, chat
from bench.scenarios.p03_head_of_line import S as P3

pytestmark = pytest.mark.integration


class TinyP3(P3):
    """P3 shrunk to about 3 s: short requests at 5/s and one long prompt."""

    def workload(self, quick: bool) -> Workload:
        arrivals = [Arrival(at=0.1 + 0.2 * i, body=chat(400, 4, salt=i), kind="short") for i in range(14)]
        arrivals.append(Arrival(at=0.8, body=chat(6000, 4, salt=999), kind="long"))
        return Workload(arrivals=arrivals, duration=3.0, drain=3.0)


def test_tiny_scenario_end_to_end(tmp_path: Path):
    out = run_scenarios([TinyP3()], ["envoy-rr", "sluice"], quick=True, results_dir=tmp_path, plots=False,
                        command="pytest smoke", verbose=False)
    json.dumps(out)
    assert set(out) == {"P3", "_meta"}
    assert set(out["P3"]) == {"envoy-rr", "sluice"}
    keys = {m.key for m in P3.metrics_doc}
    for system in ("envoy-rr", "sluice"):
        metrics = out["P3"][system]
        assert keys <= set(metrics), (system, out["_meta"]["errors"])
        assert metrics["slo_goodput_rps"] > 0 and set(metrics["class_slo_goodput"]) == {"short", "long"}
        assert all(v is None or isinstance(v, (int, float)) for k, v in metrics.items() if k in keys)
        assert metrics["short_ttft_p95_idle_s"] is not None and metrics["short_ttft_p95_idle_s"] > 0
        assert metrics["failed"] == 0
        info = out["_meta"]["runs"]["P3"][system]
        assert info["requests"] == 15 and "error" not in info
    assert out["_meta"]["reproduced"]["P3"] in (True, False)
    assert (tmp_path / "P3.md").exists()
