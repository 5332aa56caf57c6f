"""The `budgets:` section: defaults, a YAML round trip, and validation errors naming the field."""

from __future__ import annotations

import pytest
import yaml

from extproc.budgets.policy import BudgetPolicy
from extproc.config import parse_section
from extproc.schema import to_dict


def test_defaults() -> None:
    p = parse_section("budgets", None)
    assert p == parse_section("budgets", {}) == BudgetPolicy()
    assert p.store.kind == "memory" and p.store.fallback_share is None
    assert (p.retry.max_share, p.retry.window_s, p.retry.dedupe_window_s, p.retry.floor) == (0.1, 10.0, 30.0, 3)
    assert p.tasks.max_calls == 0 and not p.tasks.enabled
    assert p.tenants.tokens_per_minute == {} and p.tenants.default == 0 and not p.tenants.enabled
    assert p.prompt_shift.threshold == 0.3


def test_yaml_round_trip_is_the_defaults() -> None:
    """Every default written out as YAML (what `sluice up` hands its sidecars) parses back to the defaults."""
    text = yaml.safe_dump({"budgets": to_dict(BudgetPolicy())})
    assert "redis" in text and "tokens_per_minute" in text
    assert parse_section("budgets", yaml.safe_load(text)["budgets"]) == BudgetPolicy()


def test_full_dict() -> None:
    p = parse_section("budgets", {
        "store": {"kind": "redis", "fallback_share": 0.25, "redis": {"url": "redis://10.0.0.1:6379/1"}},
        "retry": {"max_share": 0.2, "floor": 5, "use_fingerprint": False},
        "tasks": {"max_calls": 20, "max_tokens": 50000, "max_wall_s": 300, "max_depth": 8},
        "tenants": {"tokens_per_minute": {"acme": 100000, "free": 1000}, "default": 5000},
        "prompt_shift": {"threshold": 0.5, "sustain_requests": 3},
    })
    assert p.store.redis.url == "redis://10.0.0.1:6379/1" and p.store.fallback_share == 0.25
    assert p.retry.max_share == 0.2 and p.retry.use_fingerprint is False
    assert p.tasks.max_wall_s == 300.0 and isinstance(p.tasks.max_wall_s, float) and p.tasks.enabled
    assert p.tenants.limit_for("acme") == 100000 and p.tenants.limit_for("other") == 5000
    assert p.prompt_shift.sustain_requests == 3


@pytest.mark.parametrize("d, field", [
    ({"retry": {"max_share": 1.5}}, "budgets.retry.max_share"),
    ({"retry": {"max_share": "lots"}}, "budgets.retry.max_share"),
    ({"retry": {"window_s": 0}}, "budgets.retry.window_s"),
    ({"retry": {"floor": 2.5}}, "budgets.retry.floor"),
    ({"retry": {"enabled": "yes"}}, "budgets.retry.enabled"),
    ({"retry": {"max_sahre": 0.1}}, "budgets.retry.max_sahre: unknown field"),
    ({"store": {"kind": "etcd"}}, "budgets.store.kind"),
    ({"store": {"fallback_share": 0}}, "budgets.store.fallback_share"),
    ({"store": {"redis": {"url": "http://x"}}}, "budgets.store.redis.url"),
    ({"store": {"redis": {"socket_timeout_s": -1}}}, "budgets.store.redis.socket_timeout_s"),
    ({"store": {"redis": {"probe_interval_s": 2, "probe_max_interval_s": 1}}},
     "budgets.store.redis.probe_max_interval_s"),
    ({"store": "redis"}, "budgets.store: expected a mapping"),
    ({"tasks": {"max_calls": -1}}, "budgets.tasks.max_calls"),
    ({"tasks": {"max_calls": True}}, "budgets.tasks.max_calls"),
    ({"tasks": {"header": "x-task"}}, "budgets.tasks.header: unknown field"),  # the headers are fixed
    ({"tenants": {"tokens_per_minute": {"acme": -5}}}, "budgets.tenants.tokens_per_minute.acme"),
    ({"tenants": {"tokens_per_minute": {"acme": "10k"}}}, "budgets.tenants.tokens_per_minute.acme"),
    ({"tenants": {"tokens_per_minute": [1, 2]}}, "budgets.tenants.tokens_per_minute: expected a mapping"),
    ({"prompt_shift": {"threshold": 0}}, "budgets.prompt_shift.threshold"),
    ({"bogus": {}}, "budgets.bogus: unknown field"),
])
def test_validation_errors_name_the_field(d: dict, field: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_section("budgets", d)
    assert field in str(exc.value)


def test_not_a_mapping() -> None:
    with pytest.raises(ValueError, match="budgets: expected a mapping"):
        parse_section("budgets", [1])  # type: ignore[arg-type]
