"""bench/stack_tax.py's arithmetic (the probe itself needs two real engines: `python -m bench.stack_tax`)."""

from __future__ import annotations

import os
import time

from bench.stack_tax import PATHS, SHAPES, Window, group_cpu_s, pid_cpu_s, table


def test_a_window_counts_only_what_ends_inside_it():
    now = time.monotonic()
    w = Window(now - 1.0, now + 60.0)
    w.count(32)
    late = Window(now + 60.0, now + 70.0)
    late.count(32)
    assert (w.completions, w.output_tokens) == (1, 32) and late.completions == 0


def test_a_process_groups_cpu_includes_its_members():
    spent = time.process_time() + 0.05
    while time.process_time() < spent:  # bounded: 50 ms of CPU
        pass
    assert group_cpu_s(os.getpgid(0)) >= pid_cpu_s(os.getpid()) > 0


def test_the_table_gives_each_path_as_a_share_of_the_direct_probe():
    result = {p: {s: {"completions_per_s": 10.0 if p == "direct aiohttp" else 5.0, "output_tokens_per_s": 1.0,
                      "cores": {"engines": 1.5, "clients": 0.3}} for s in SHAPES} for p in PATHS}
    rows = table(result).splitlines()
    assert len(rows) == 2 + len(SHAPES) * len(PATHS)
    assert "| sluice | 5.0 | 0.50 |" in rows[2 + PATHS.index("sluice")]
    assert "| direct aiohttp | 10.0 | 1.00 |" in rows[2]
