"""Shared fixtures: a real gateway stack (Envoy binary + sidecar process + simulated replicas) on free ports."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.config import policy_from_dict
from extproc.supervisor import Stack, with_free_ports
from tests.waiting import wait_for  # noqa: F401  (re-exported: the integration and reliability tests wait with it)

BASE_POLICY = {
    "pools": [{"model": "sim-model", "replicas": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}],
    "simulator": {"enabled": True, "preset": "tiny-cpu", "time_scale": 1.0},
    "limits": {"max_body_bytes": 1048576},
}


def make_stack(tmp: Path, overrides: dict | None = None, mode: str = "sluice") -> Stack:
    data = {**BASE_POLICY, **(overrides or {})}
    policy = with_free_ports(policy_from_dict(data))
    return Stack(policy, run_dir=tmp, mode=mode)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = make_stack(tmp_path_factory.mktemp("stack"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for (sample, lbls), value in scrape(url).items():
        if sample == name and all(dict(lbls).get(k) == v for k, v in labels.items()):
            total += value
    return total


def sim_metric(addr: str, name: str) -> float:
    return metric_sum(f"http://{addr}/metrics", name)


REPLICA_HEADER = re.compile(r"^127\.0\.0\.1:\d+$")
