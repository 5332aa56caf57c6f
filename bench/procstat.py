"""CPU time and memory of processes we started, read from /proc (Linux)."""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK")


def _named_stat(pid: int | str) -> tuple[str, list[str]]:
    """/proc/PID/stat's command name and the fields after it (field 3, the state, is index 0)."""
    with open(f"/proc/{pid}/stat") as fh:
        text = fh.read()
    close = text.rindex(")")  # the name may hold parentheses and spaces; the last ")" ends it
    return text[text.index("(") + 1:close], text[close + 1:].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds consumed by `pid` so far."""
    return _cpu_of(_named_stat(pid)[1])


def _cpu_of(fields: list[str]) -> float:
    """utime + stime (fields 14 and 15 of /proc/PID/stat) in seconds."""
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
            name, fields = _named_stat(entry.name)
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out[name] = out.get(name, 0.0) + _cpu_of(fields)
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
