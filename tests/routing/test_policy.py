"""The `routing:` section: defaults, validation naming the field."""

from __future__ import annotations

import pytest

from extproc.config import parse_section
from extproc.routing.policy import HealthPolicy
from extproc.schema import build


def test_defaults():
    p = parse_section("routing", None)
    assert p == parse_section("routing", {})
    assert p.scrape_interval_s == 0.2 and p.stale_after_s == pytest.approx(1.0) and p.window_s == 10.0
    assert p.scrape_timeout_s == 1.0
    h = p.health
    assert h.ttft_p95_degraded_s == 15.0 and h.degraded_vs_pool == 3.0 and h.unresponsive_after_s == 5.0
    assert h.slow_start_steps == (0.1, 0.25, 0.5, 1.0) and h.slow_start_step_s == 1.0
    assert h.degraded_weight == 0.25 and h.enabled is True


def test_stale_after_follows_the_interval_unless_set():
    assert parse_section("routing", {"scrape_interval_s": 0.5}).stale_after_s == pytest.approx(2.5)
    assert parse_section("routing", {"scrape_interval_s": 0.5, "stale_after_s": 0.9}).stale_after_s == 0.9


def test_nested_health():
    p = parse_section("routing", {"health": {"ttft_p95_degraded_s": 2, "slow_start_steps": [0.2, 0.6],
                                             "min_samples": 3}})
    assert p.health.ttft_p95_degraded_s == 2.0 and isinstance(p.health.ttft_p95_degraded_s, float)
    assert p.health.slow_start_steps == (0.2, 0.6) and p.health.min_samples == 3


@pytest.mark.parametrize("d, field", [
    ({"scrape_intervall_s": 1}, "routing.scrape_intervall_s"),
    ({"scrape_interval_s": "fast"}, "routing.scrape_interval_s"),
    ({"scrape_interval_s": 0}, "routing.scrape_interval_s"),
    ({"scrape_interval_s": True}, "routing.scrape_interval_s"),
    ({"scrape_timeout_s": -1}, "routing.scrape_timeout_s"),
    ({"stale_after_s": 0.1}, "routing.stale_after_s"),
    ({"window_s": 0.3}, "routing.window_s"),
    ({"score": {}}, "routing.score: unknown field"),  # nothing read it: deleted
    ({"health": []}, "routing.health"),
    ({"health": {"bogus": 1}}, "routing.health.bogus"),
    ({"health": {"min_samples": 0}}, "routing.health.min_samples"),
    ({"health": {"min_samples": 2.5}}, "routing.health.min_samples"),
    ({"health": {"enabled": "yes"}}, "routing.health.enabled"),
    ({"health": {"degraded_weight": 1.5}}, "routing.health.degraded_weight"),
    ({"health": {"fallback_weight": 0}}, "routing.health.fallback_weight"),
    ({"health": {"error_rate_degraded": 0}}, "routing.health.error_rate_degraded"),
    ({"health": {"slow_start_steps": []}}, "routing.health.slow_start_steps"),
    ({"health": {"slow_start_steps": [0.5, 0.5]}}, "routing.health.slow_start_steps[1]"),
    ({"health": {"slow_start_steps": [0.5, 1.2]}}, "routing.health.slow_start_steps[1]"),
    ({"health": {"slow_start_steps": [0.1, "x"]}}, "routing.health.slow_start_steps[1]"),
    ({"health": {"scrape_failures_ejected": 1}}, "routing.health.scrape_failures_ejected"),
    ({"health": {"eject_after_s": float("nan")}}, "routing.health.eject_after_s"),
])
def test_invalid_values_name_the_field(d, field):
    with pytest.raises(ValueError) as exc:
        parse_section("routing", d)
    assert field in str(exc.value)


def test_not_a_mapping():
    with pytest.raises(ValueError, match="routing: expected a mapping"):
        parse_section("routing", [1])


def test_health_policy_is_usable_alone():
    h = build(HealthPolicy, {"probe_interval_s": 1}, "routing.health")
    assert h.probe_interval_s == 1.0
    with pytest.raises(ValueError, match="routing.health.probe_interval_s"):
        build(HealthPolicy, {"probe_interval_s": 0}, "routing.health")
