"""The thirteen scenarios, one module per problem (P1..P13 in /work/shared/PROBLEMS.md and docs/problems.md).

`get_scenarios(["P3", "all"])` returns scenario instances in P-order; names are case-insensitive. A variant of a
problem's scenario carries a suffix (P4n: P4 on replicas that never abort) and sorts right after it.
"""

from __future__ import annotations

import importlib
import re

from bench.scenarios.base import Scenario

# id -> module (bench/scenarios/<module>.py, class `S`)
SCENARIOS: dict[str, str] = {
    "P1": "p01_burst",
    "P1f": "p01f_fairness",
    "P2": "p02_heavy",
    "P3": "p03_head_of_line",
    "P4": "p04_cancellations",
    "P4n": "p04n_no_abort",
    "P5": "p05_retry_storm",
    "P6": "p06_thundering_herd",
    "P7": "p07_imbalance",
    "P8": "p08_half_dead",
    "P9": "p09_kv_pressure",
    "P10": "p10_prompt_change",
    "P11": "p11_agents",
    "P12": "p12_connections",
    "P13": "p13_slow_consumers",
    "PX": "px_prefix",
}


def load(sid: str) -> Scenario:
    mod = importlib.import_module(f"bench.scenarios.{SCENARIOS[sid]}")
    return mod.S()


def _order(sid: str) -> tuple[int, str]:
    """P-order: by problem number, a variant (suffix) after its problem's scenario."""
    m = re.fullmatch(r"P(\d+)(.*)", sid)
    return (int(m.group(1)), m.group(2)) if m else (10 ** 6, sid)


def get_scenarios(names: list[str]) -> list[Scenario]:
    by_upper = {k.upper(): k for k in SCENARIOS}
    wanted: list[str] = []
    for name in names:
        key = name.strip().upper()
        if key == "ALL":
            wanted.extend(SCENARIOS)
            continue
        if key not in by_upper:
            raise KeyError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}, all")
        wanted.append(by_upper[key])
    seen: list[str] = []
    for k in wanted:
        if k not in seen:
            seen.append(k)
    seen.sort(key=_order)
    return [load(k) for k in seen]
