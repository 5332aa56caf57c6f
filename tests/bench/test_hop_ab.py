"""`python -m bench.hop_ab` end to end at a tiny size: the replica itself, Envoy alone and a no-op sidecar on the
sidecar's default gRPC server (bench/noop_sidecar.py) all serve, and each path's added latency is counted against
direct's in the same round (the quantity of issue #17's c=1 bar)."""

from __future__ import annotations

import pytest

from bench import hop_ab

pytestmark = pytest.mark.integration


def test_noop_floor_beside_envoy_alone_and_direct(capsys: pytest.CaptureFixture[str]) -> None:
    out = hop_ab.run([hop_ab.Variant.parse("noop=:bench.noop_sidecar")], rounds=1, n_c1=20, n_c32=400)
    assert list(out) == ["direct", "envoy-only", "noop"]
    for name, series in out.items():
        assert series["rps"][0] > 0 and series["p50_ms"][0] > 0, name
        assert series["added_p50_ms"][0] == pytest.approx(series["p50_ms"][0] - out["direct"]["p50_ms"][0])
    assert out["direct"]["envoy_cpu_ms"] == [0.0]
    # the no-op sidecar answered the ext_proc streams itself: its CPU is read from /proc in 10 ms ticks, which the
    # 114 streams of a c=32 run of 64 (50 of warm-up) did not always reach; 450 streams do
    assert out["noop"]["sidecar_cpu_ms"][0] > 0
    assert "errors" not in capsys.readouterr().err  # every request of every path got a 200
