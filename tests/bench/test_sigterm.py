"""A benchmark run stopped with SIGTERM stops what it started (its stacks run in their own sessions, so a runner
killed outright would leave Envoy, the sidecar and the simulators running)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_every_process_the_run_started(tmp_path: Path):
    cmd = [sys.executable, "-m", "extproc.cli", "bench", "run", "P4", "--quick", "--systems", "sluice",
           "--no-plots", "--results-dir", str(tmp_path), "--summary", ""]
    runner = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and runner.poll() is None:
            started |= _descendants(runner.pid)
            if len([p for p in started if _alive(p)]) >= 3:  # simulators, Envoy, the sidecar
                break
            time.sleep(0.5)
        time.sleep(2.0)
        started |= _descendants(runner.pid)
        assert runner.poll() is None and len(started) >= 3, f"the run did not start its stack: {started}"
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=90) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in started):
            time.sleep(0.5)
        assert not [p for p in started if _alive(p)], "processes the run started outlived it"
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for pid in started:  # on failure: what the run started and left behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
