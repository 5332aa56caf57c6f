"""The sidecar restart policy of `sluice up`: backoff doubling to a cap, and a limit per window."""

from __future__ import annotations

import sys
from pathlib import Path

from extproc.restarts import Restarter, RestartPolicy
from extproc.supervisor import Child


def test_delay_doubles_to_the_cap() -> None:
    p = RestartPolicy(backoff_s=0.5, max_backoff_s=3.0)
    assert [p.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_restarts_after_the_delay_and_gives_up_at_the_limit(tmp_path: Path) -> None:
    now = [0.0]
    lines: list[str] = []
    r = Restarter(RestartPolicy(backoff_s=1.0, max_backoff_s=8.0, max_restarts=2, window_s=100.0), {},
                  lines.append, clock=lambda: now[0])
    child = Child("sidecar[0]", [sys.executable, "-c", "pass"], tmp_path / "c.log", "")
    child.start()
    child.proc.wait(10)
    for delay in (1.0, 2.0):
        pid = child.proc.pid
        assert r.tend(child)  # exit seen: restart scheduled
        now[0] += delay - 0.01
        assert r.tend(child) and child.proc.pid == pid  # not due yet
        now[0] += 0.01
        assert r.tend(child) and child.proc.pid != pid  # restarted
        child.proc.wait(10)
    assert r.total() == 2
    assert not r.tend(child)  # a third exit within the window: give up
    assert "limit 2" in lines[-1] and "restart 1 of 2" in lines[0] and "restarted" in lines[1]
    now[0] += 100.0  # the window passed: restarts allowed again
    assert r.tend(child)
