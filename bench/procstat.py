"""CPU time and memory of processes we started, read from /proc (Linux)."""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command name (field 3, the state, is index 0)."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds consumed by `pid` so far."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICKS


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group `pgid` (a vLLM engine: its API server leads
    the group, EngineCore and the worker are in it)."""
    return sum(group_cpu_by_name(pgid).values())


def group_cpu_by_name(pgid: int) -> dict[str, float]:
    """`group_cpu_seconds` per command name (/proc/PID/comm: a vLLM engine's are `vllm`, its API server,
    `VLLM::EngineCor` and `VLLM::Worker`), summed over the processes of that name."""
    out: dict[str, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                text = fh.read()
        except OSError:
            continue
        name, fields = text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
