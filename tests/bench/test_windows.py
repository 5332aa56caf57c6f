"""bench.windows: a run's user calls split by when they were first sent, with what became of them (issue 15: a
run's length decides what its averages say)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench import windows


def _attempt(user: int, attempt: int, start: float, status: int, first_token: float | None, done: bool,
             call: int = 0) -> dict:
    return {"user": user, "attempt": attempt, "sdk_attempt": attempt, "kind": "single", "start": start,
            "first_send": start if attempt == 0 else None, "first_token": first_token, "end": start + 0.5,
            "status": status, "done": done, "call": call}


def _write(path: Path, rows: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_a_call_counts_once_by_its_first_send_with_its_whole_latency(tmp_path: Path) -> None:
    rows = [
        _attempt(0, 0, 1.0, 200, 1.2, True),               # within the SLO
        _attempt(1, 0, 2.0, 429, None, False),             # shed, then served by its retry 0.4 s after the first
        _attempt(1, 1, 2.3, 200, 2.4, True),               # send: within a 0.5 s SLO
        _attempt(2, 0, 9.0, 429, None, False),             # shed, retried in the next window, served late:
        _attempt(2, 1, 10.5, 200, 10.6, True),             # counted in the window of its first send
        _attempt(3, 0, 12.0, 429, None, False),            # refused for good
        _attempt(4, 0, 13.0, 200, 13.1, False),            # a first token, but the stream never completed
        _attempt(4, 0, 14.0, 200, 15.0, True, call=1),     # the same user's next call (a session's turn): late
    ]
    path = _write(tmp_path / "PX-sluice-seed1.jsonl", rows)
    counts = windows.by_window(windows.read_calls(path), slo_s=0.5, window_s=10.0)
    assert counts == {0: {"within SLO": 2, "late": 1, "failed": 0},
                      10: {"within SLO": 0, "late": 1, "failed": 2}}


def test_the_table_has_a_row_per_run_and_a_column_per_window(tmp_path: Path) -> None:
    _write(tmp_path / "PX-smg-seed1.jsonl", [_attempt(0, 0, 1.0, 200, 3.0, True)])
    _write(tmp_path / "PX-sluice-seed1.jsonl.gz", [_attempt(0, 0, 11.0, 200, 11.1, True)])  # as committed
    _write(tmp_path / "P1-sluice-seed1.jsonl", [_attempt(0, 0, 1.0, 429, None, False)])
    text = windows.table(sorted(tmp_path.glob("PX*")), slo_s=0.5, window_s=10.0)
    lines = text.splitlines()
    assert lines[2] == "| run | 0-10 s | 10-20 s |"
    assert "| PX-sluice-seed1 | 0 / 0 / 0 | 1 / 0 / 0 |" in lines
    assert "| PX-smg-seed1 | 0 / 1 / 0 | 0 / 0 / 0 |" in lines
    assert not any("P1-" in line for line in lines)


def test_no_records_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no records"):
        windows.main([str(tmp_path), "--slo", "0.5"])


def test_the_split_puts_a_retrys_wait_before_the_replica_and_the_prefill_after_it(tmp_path: Path) -> None:
    """A call shed and served by its retry waited 0.3 s before the replica answered (its first send to the retry's
    headers) and 0.1 s after; calls first sent before `since` and calls without a first token are left out."""
    def with_headers(row: dict, headers_at: float | None, kind: str) -> dict:
        return {**row, "headers_at": headers_at, "kind": kind}
    rows = [
        with_headers(_attempt(0, 0, 1.0, 200, 1.5, True), 1.1, "steady"),     # before `since`
        with_headers(_attempt(1, 0, 10.0, 429, None, False), 10.01, "steady"),
        with_headers(_attempt(1, 1, 10.2, 200, 10.4, True), 10.3, "steady"),  # 0.3 before, 0.1 after
        with_headers(_attempt(2, 0, 11.0, 200, 11.25, True), 11.05, "flood"),  # 0.05 before, 0.2 after
        with_headers(_attempt(3, 0, 12.0, 503, None, False), 12.0, "flood"),  # no first token
    ]
    path = _write(tmp_path / "P1f-sluice-seed1.jsonl", rows)
    parts = windows.split(windows.read_calls(path), since_s=9.0)
    assert set(parts) == {"steady", "flood"}
    assert [round(x, 3) for x in parts["steady"][0]] == [0.3] and [round(x, 3) for x in parts["steady"][1]] == [0.1]
    assert [round(x, 3) for x in parts["flood"][1]] == [0.2]
    lines = windows.split_table([path], since_s=9.0).splitlines()
    assert "| P1f-sluice-seed1 | steady | 1 | 0.300 / 0.300 | 0.100 / 0.100 |" in lines


def test_the_split_needs_no_slo_and_the_windows_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "P1f-sluice-seed1.jsonl",
                  [{**_attempt(1, 0, 10.0, 200, 10.4, True), "headers_at": 10.3, "kind": "steady"}])
    windows.main([str(path.parent), "--split", "--since", "9"])
    assert "| P1f-sluice-seed1 | steady | 1 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        windows.main([str(path.parent)])
    assert "--slo is required without --split" in capsys.readouterr().err
