"""Clients that abandon requests before the body arrives (issue #19, finding 8): HTTP/1 clients that close after
the headers and HTTP/2 streams cancelled with RST_STREAM, each while the sidecar holds its ext_proc stream. After
them every per-request count and map in the sidecar is empty (read in the process through bench/sidecar_probe.py,
not from RSS, so the check is exact). The memory soak over tens of thousands of aborts is a bench:
`python -m bench.abort_soak` (numbers in docs/reliability.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.abort_soak import run

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
PER_ROUND, BATCH = 150, 50


def test_aborted_requests_leave_no_state_in_the_sidecar(tmp_path: Path) -> None:
    rounds = run(rounds=2, per_round=PER_ROUND, batch=BATCH, run_dir=tmp_path, log=lambda *_: None)
    start, *after = rounds
    for r in after:
        # every abort happened while the sidecar held the request's ext_proc stream
        assert r["min_held_http1"] >= BATCH and r["min_held_http2"] >= BATCH, r
        assert r["open_streams_after"] == 0, r
        assert not any(r["gateway_state"].values()), r["gateway_state"]
        # no task or object left per aborted request (600 aborts here)
        assert r["asyncio_tasks"] <= start["asyncio_tasks"] + 8, (start["asyncio_tasks"], r["asyncio_tasks"])
    assert after[-1]["gc_objects"] - after[0]["gc_objects"] < 100, (after[0]["gc_objects"], after[-1]["gc_objects"])
