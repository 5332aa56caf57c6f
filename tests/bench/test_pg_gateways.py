"""The PG scenario (several gateways, one pool) is registered and its gateways are configured with deployment facts
only: each sidecar at the shipped defaults plus the pool, the SLO and, in the shared setup, the Redis they share.
The run itself (and its numbers) is `sluice bench run PG --quick`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from bench.backends import SimBackend
from bench.runner import run_scenarios
from bench.scenarios import SCENARIOS, get_scenarios
from bench.scenarios.base import RunData
from bench.scenarios.pg_gateways import INDEPENDENT, SHARED, TURNS
from extproc.config import Policy, policy_from_dict, policy_to_dict

ENVIRONMENT = {"pools", "simulator", "gateway", "sidecar", "limits"}  # where the pool runs, ports, Envoy settings
REDIS = "redis://127.0.0.1:6399/0"


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in sorted(set(a) | set(b)) for p in _diff(a.get(k), b.get(k), f"{path}{k}.")]
    return [] if a == b else [path[:-1]]


def _stacks(system: str, tmp_path: Path) -> list[Any]:
    [sc] = get_scenarios(["pg"])
    return sc.gateway_stacks(tmp_path, 1, REDIS if system in (SHARED, TURNS) else None, SimBackend(),
                             take_turns=system == TURNS)


def test_pg_is_registered_and_compares_sluice_deployments():
    assert SCENARIOS["PG"] == "pg_gateways"
    [sc] = get_scenarios(["pg"])
    assert sc.id == "PG" and sc.systems == (INDEPENDENT, SHARED, TURNS) and sc.reproduced_on == INDEPENDENT
    assert sc.preset == "tiny-cpu" and sc.gateways >= 2
    assert {"ttft_p95_s", "preemptions", "kv_usage_spread"} <= set(sc.headline)


@pytest.mark.parametrize("system", [INDEPENDENT, SHARED, TURNS])
def test_each_gateway_is_told_deployment_facts_only(system: str, tmp_path: Path):
    """The turns setup is the shared one with the opt-in `take_turns` on, to show what it costs and buys."""
    [sc] = get_scenarios(["pg"])
    stacks = _stacks(system, tmp_path)
    assert len(stacks) == sc.gateways
    replicas = stacks[0].policy.pools[0].replicas
    assert len(replicas) == sc.replicas
    facts: dict[str, Any] = {"pools": [{"model": "sim-model", "replicas": ["127.0.0.1:1"]}],
                             "admission": {"ttft_target_s": sc.slo_ttft_s}}
    if system in (SHARED, TURNS):
        facts["budgets"] = {"store": {"kind": "redis", "redis": {"url": REDIS}}}
    if system == TURNS:
        facts["routing"] = {"shared_load": {"take_turns": True}}
    told = policy_to_dict(policy_from_dict(facts))  # the shipped defaults plus the deployment facts
    for g, stack in enumerate(stacks):
        assert stack.mode == "sluice"
        assert stack.policy.pools[0].replicas == replicas, "every gateway fronts the same pool"
        assert stack.policy.simulator.enabled == (g == 0), "gateway 0 runs the pool, once"
        extra = [p for p in _diff(policy_to_dict(stack.policy), told) if p.split(".")[0] not in ENVIRONMENT]
        assert extra == [], f"gateway {g} is told more than the deployment facts"
        default = Policy().routing.shared_load
        assert stack.policy.routing.shared_load == dataclasses.replace(default, take_turns=system == TURNS)
        assert stack.policy.budgets.store.kind == ("memory" if system == INDEPENDENT else "redis")


def test_the_harness_runs_pg_through_its_own_systems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`sluice bench run PG` runs the scenario's three setups (not the harness's systems) and judges the independent
    column for the reproduction."""
    [sc] = get_scenarios(["pg"])
    seen: list[str] = []

    def fake(system: str, quick: bool, seed: int, workdir: Any, backend: Any) -> tuple[RunData, dict]:
        seen.append(system)
        run = RunData(scenario="PG", system=system, time_scale=1.0, replicas=["127.0.0.1:1"], duration=1.0)
        run.sim_final = {"127.0.0.1:1": {"counters": {"preemptions": 40 if system == INDEPENDENT else 0}}}
        return run, {"system": system, "notes": []}

    monkeypatch.setattr(sc, "run_system", fake)
    out = run_scenarios([sc], ["sluice", "envoy-rr"], quick=True, results_dir=tmp_path, plots=False)
    assert seen == [INDEPENDENT, SHARED, TURNS]
    assert set(out["PG"]) == {INDEPENDENT, SHARED, TURNS}
    assert out["PG"][INDEPENDENT]["preemptions"] == 40 and out["PG"][SHARED]["preemptions"] == 0
    assert out["_meta"]["reproduced"] == {"PG": True}
    assert out["_meta"]["sluice_policy"]["PG"]["budgets"]["store"]["kind"] == "redis"
