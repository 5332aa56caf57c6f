"""The P12/P13 memory metrics: streams held open at once, RSS growth and drift, per-part RSS sampling."""

from __future__ import annotations

import os

from bench.openloop import Record
from bench.runner import _sample_rss
from bench.scenarios.base import RunData
from bench.scenarios.p12_connections import _held_open_max, _max_overlap
from bench.scenarios.p13_slow_consumers import _drift_mb, _growth_mb


def test_max_overlap_closes_before_it_opens_at_the_same_instant():
    assert _max_overlap([(0.0, 2.0), (1.0, 3.0), (2.0, 4.0)]) == 2
    assert _max_overlap([]) == 0


def test_held_open_counts_queued_and_unfinished_attempts():
    run = RunData(scenario="P12", system="sluice", time_scale=1.0, replicas=[], duration=10.0)
    run.records = [Record(user=0, attempt=0, sdk_attempt=0, kind="stream", start=0.0, end=None, status=200),
                   Record(user=1, attempt=0, sdk_attempt=0, kind="stream", start=1.0, end=9.0, status=0),
                   Record(user=2, attempt=0, sdk_attempt=0, kind="stream", start=2.0, end=2.1, status=429)]
    assert _held_open_max(run) == 3


def test_growth_and_drift():
    flat = [(float(t), 100_000_000 + (5_000_000 if t >= 3 else 0)) for t in range(30)]
    assert _growth_mb(flat) == 5.0
    assert _drift_mb(flat, 30.0) == 0.0
    growing = [(float(t), 100_000_000 + t * 1_000_000) for t in range(30)]
    assert _drift_mb(growing, 30.0) == 10.0
    assert _growth_mb([]) is None and _drift_mb([], 30.0) is None


def test_rss_is_sampled_per_part_and_in_total():
    run = RunData(scenario="P13", system="sluice", time_scale=1.0, replicas=[])
    _sample_rss({"envoy": [os.getpid()], "sidecar": [os.getpid()], "none": []}, run, 0.5)
    (t, total), = run.gateway_rss
    assert t == 0.5 and total > 0
    assert set(run.extra["rss"]) == {"envoy", "sidecar"}
    assert run.extra["rss"]["envoy"][0][1] + run.extra["rss"]["sidecar"][0][1] == total
