"""bench/stack_tax.py's arithmetic (the probe itself needs two real engines: `python -m bench.stack_tax`)."""

from __future__ import annotations

import os
import time

from bench.procstat import cpu_seconds, group_cpu_seconds
from bench.stack_tax import PATHS, SHAPES, Window, table


def test_a_window_counts_only_what_ends_inside_it():
    now = time.monotonic()
    w = Window(now - 1.0, now + 60.0)
    w.token()
    w.count()
    late = Window(now + 60.0, now + 70.0)
    late.token()
    late.count()
    assert (w.completions, w.output_tokens) == (1, 1) and (late.completions, late.output_tokens) == (0, 0)


def test_a_process_groups_cpu_includes_its_members():
    spent = time.process_time() + 0.05
    while time.process_time() < spent:  # bounded: 50 ms of CPU
        pass
    own = cpu_seconds(os.getpid())  # read first: the group's scan, read after, can only have more of it
    assert group_cpu_seconds(os.getpgid(0)) >= own > 0


def test_the_table_gives_each_path_as_a_share_of_the_direct_probe():
    result = {p: {s: {"completions_per_s": 10.0 if p == "direct aiohttp" else 5.0, "output_tokens_per_s": 1.0,
                      "cores": {"engines": 1.5, "clients": 0.3}} for s in SHAPES} for p in PATHS}
    rows = table(result).splitlines()
    assert len(rows) == 2 + len(SHAPES) * len(PATHS)
    assert "| sluice | 5.0 | 0.50 |" in rows[2 + PATHS.index("sluice")]
    assert "| direct aiohttp | 10.0 | 1.00 |" in rows[2]


def test_show_prints_the_table_of_a_written_file(tmp_path, capsys):
    import json

    from bench.stack_tax import main

    paths = {p: {s: {"completions_per_s": 4.0, "output_tokens_per_s": 8.0, "cores": {"engines": 1.9}}
                 for s in SHAPES} for p in PATHS}
    f = tmp_path / "tax.json"
    f.write_text(json.dumps({"date": "d", "machine": {"cpu_model": "cpu"}, "streams_per_engine": 16,
                             "window_s": 8.0, "paths": paths}))
    assert main(["--show", str(f)]) == 0
    out = capsys.readouterr().out
    assert "cpu, d, 2 engines, 16 streams per engine, 8 s window" in out
    assert out.count("| sluice | 4.0 | 1.00 |") == len(SHAPES)


def test_a_run_of_one_path_shows_that_path_alone():
    result = {"direct aiohttp": {s: {"completions_per_s": 3.0, "output_tokens_per_s": 1.0, "cores": {}}
                                 for s in SHAPES}}
    rows = table(result).splitlines()
    assert len(rows) == 2 + len(SHAPES) and all("| direct aiohttp | 3.0 | 1.00 |" in r for r in rows[2:])


def test_the_table_gives_each_path_as_a_share_of_the_model_and_the_engines_by_part():
    cores = {"engines": 1.0, "api server": 0.2, "engine core": 0.1, "worker": 0.7, "clients": 0.1}
    result = {"direct aiohttp": {s: {"completions_per_s": 6.0, "output_tokens_per_s": 1.0, "cores": cores}
                                 for s in SHAPES}}
    rows = table(result, {s: 12.0 for s in SHAPES}).splitlines()
    assert rows[0].count("|") == rows[1].count("|") == rows[2].count("|")
    assert all("| 0.50 of 12.0 |" in r and "| 1.0 (0.2 / 0.1 / 0.7) |" in r for r in rows[2:])
