"""Routing metrics: one-hot state series, cached children, forgetting a replica."""

from __future__ import annotations

import uuid

from prometheus_client import REGISTRY

from extproc.routing import metrics as rm


def value(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_state_series_are_one_hot_and_children_cached():
    pool = f"p-{uuid.uuid4().hex[:6]}"
    m = rm.replica_metrics(pool, "1.2.3.4:5")
    assert rm.replica_metrics(pool, "1.2.3.4:5") is m
    m.state("healthy", 1.0)
    assert [value("sluice_replica_state", pool=pool, replica="1.2.3.4:5", state=s) for s in rm.STATES] == \
        [1.0, 0.0, 0.0, 0.0]
    m.state("ejected", 0.0)
    assert [value("sluice_replica_state", pool=pool, replica="1.2.3.4:5", state=s) for s in rm.STATES] == \
        [0.0, 0.0, 1.0, 0.0]
    assert value("sluice_replica_weight", pool=pool, replica="1.2.3.4:5") == 0.0
    m.transition("healthy", "ejected", "unreachable")
    m.transition("healthy", "ejected", "unreachable")
    assert value("sluice_replica_health_transitions_total", pool=pool, replica="1.2.3.4:5", **{
        "from": "healthy", "to": "ejected", "reason": "unreachable"}) == 2.0


def test_forget_replica_drops_its_series():
    pool = f"p-{uuid.uuid4().hex[:6]}"
    m = rm.replica_metrics(pool, "h:1")
    m.state("degraded", 0.25)
    m.transition("healthy", "degraded", "ttft_p95")
    m.age_from(lambda: 0.0, 0.0)
    assert value("sluice_replica_weight", pool=pool, replica="h:1") == 0.25
    rm.forget_replica(pool, "h:1")
    assert value("sluice_replica_weight", pool=pool, replica="h:1") is None
    assert value("sluice_replica_state", pool=pool, replica="h:1", state="degraded") is None
    assert value("sluice_replica_health_transitions_total", pool=pool, replica="h:1",
                 **{"from": "healthy", "to": "degraded", "reason": "ttft_p95"}) is None
    assert value("sluice_replica_scrape_age_seconds", pool=pool, replica="h:1") is None
    assert rm.replica_metrics(pool, "h:1") is not m
