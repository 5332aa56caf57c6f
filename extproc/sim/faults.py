"""Fault switches of one simulated replica, and parsing of fault commands.

A fault command is a name and an optional value, from ``--fault NAME[=VALUE]`` at start or
``POST /sim/fault {"fault": NAME, "value": VALUE}`` at run time:

=============  ==========  =====================================================================
name           value       effect
=============  ==========  =====================================================================
slow           factor>0    every engine step takes FACTOR times longer; /health stays 200
hang           [bool]      requests are accepted and queued but no step ever runs
crash          -           API listener closed, in-flight connections reset, engine state lost
recover        -           API listener reopened on the same port with an empty engine
error-rate     0..1        that share of requests is answered 500 at once
kv-shrink      0..0.99     that fraction of KV blocks is lost (running work may be preempted)
no-abort       [bool]      a client disconnect does not abort the request (ghost tokens)
metrics-       seconds or  every GET /metrics answer waits that long (seconds), or a latency drawn
latency        contended   from the preset's measurement of two busy engines on one machine
clear          -           every fault off (and recover if crashed)
=============  ==========  =====================================================================

Slow with value 1, hang/no-abort with value false, error-rate/kv-shrink/metrics-latency with 0 switch one
off.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Faults", "FaultError", "FAULT_NAMES", "parse_fault", "parse_fault_arg"]

FAULT_NAMES = ("slow", "hang", "crash", "recover", "error-rate", "kv-shrink", "no-abort", "metrics-latency",
               "clear")


class FaultError(ValueError):
    """A fault command that names no fault or carries a bad value."""


@dataclass
class Faults:
    slow: float = 1.0
    hang: bool = False
    crashed: bool = False
    error_rate: float = 0.0
    kv_shrink: float = 0.0
    no_abort: bool = False
    metrics_latency: float | str = 0.0  # seconds, or "contended"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bool(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    s = str(value).strip().lower()
    if s in ("1", "true", "on", "yes", ""):
        return True
    if s in ("0", "false", "off", "no"):
        return False
    raise FaultError(f"expected a boolean, got {value!r}")


def _float(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if value is None:
        raise FaultError(f"fault {name!r} needs a value")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise FaultError(f"fault {name!r}: {value!r} is not a number") from None
    if v != v or v > hi or v < lo or (lo_open and v == lo):
        raise FaultError(f"fault {name!r}: value {v} out of range")
    return v


def parse_fault(name: str, value: Any = None) -> tuple[str, Any]:
    """Validate a fault command; returns (canonical name, typed value)."""
    n = str(name).strip().lower().replace("_", "-")
    if n == "slow":
        return n, _float(n, value, 0.0, 1e6, lo_open=True)
    if n in ("hang", "no-abort"):
        return n, _bool(value)
    if n in ("crash", "recover", "clear"):
        return n, None
    if n == "error-rate":
        return n, _float(n, value, 0.0, 1.0)
    if n == "kv-shrink":
        return n, _float(n, value, 0.0, 0.99)
    if n == "metrics-latency":
        if isinstance(value, str) and value.strip().lower() == "contended":
            return n, "contended"
        return n, _float(n, value, 0.0, 3600.0)
    raise FaultError(f"unknown fault {name!r}; known: {', '.join(FAULT_NAMES)}")


def parse_fault_arg(arg: str) -> tuple[str, Any]:
    """Parse the CLI form ``NAME`` or ``NAME=VALUE``."""
    name, sep, value = arg.partition("=")
    return parse_fault(name, value if sep else None)
