"""A ~20 s run of the soak harness (bench/soak.py), so the harness itself stays working. The real soak (10 minutes,
memory verdict) runs outside the suite: `python -m bench.soak --minutes 10`; its numbers are in docs/reliability.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import run_soak, summary

pytestmark = [pytest.mark.reliability, pytest.mark.integration]


def test_soak_harness_smoke(tmp_path: Path) -> None:
    report = run_soak(12, concurrency=8, sample_s=1.0, warmup_s=4, run_dir=tmp_path, log=lambda *_: None)
    print(summary(report))
    client, sidecar = report["client"], report["sidecar"]
    assert client["sent"] > 50
    assert set(client["kinds"]) >= {"short", "stream", "cancel"}
    # every status a client saw is a success, a governed rejection or the injected replica 500
    assert set(client["statuses"]) <= {"200", "429", "500", "504"}, client["statuses"]
    assert report["checks"]["settled"], report["residue"]
    assert report["checks"]["counters"], sidecar
    assert sidecar["outcomes"]["cancelled"] >= 1 and sidecar["outcomes"]["failed"] >= 1, sidecar
    # 12 s is too short for the 5% verdict; it only guards against a gross leak
    for name, mem in report["memory"].items():
        assert mem is not None and mem["growth_pct"] < 25, (name, mem)
