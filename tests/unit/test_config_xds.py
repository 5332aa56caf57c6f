"""The policy file and the Envoy config rendered from it."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import yaml

from extproc.cli import validate_with_envoy
from extproc.config import EMBEDDED_POLICY, Policy, PolicyError, load_policy, policy_from_dict
from extproc.xds import DESTINATION_KEY, EXTPROC_CLUSTER, LB_NAMESPACE, envoy_environment, render

BASE = {"pools": [{"model": "m", "replicas": ["127.0.0.1:8101", "127.0.0.1:8102"]}]}


def test_default_policy_loads():
    policy = load_policy(EMBEDDED_POLICY)
    assert policy.default_pool.model == "sim-model"
    assert len(policy.default_pool.replicas) == 3


@pytest.mark.parametrize("data, words", [
    ({}, "at least one pool"),
    ({"pools": [{"model": "m", "replicas": ["nohostport"]}]}, "host:port"),
    ({"pools": [{"model": "m", "replicas": []}]}, "at least one replica"),
    ({**BASE, "gateway": {"port": 70000}}, "outside"),
    ({**BASE, "gateway": {"prot": 1}}, "unknown field"),
    ({**BASE, "bogus": {}}, "unknown section"),
    ({**BASE, "gateway": {"port": "80"}}, "gateway.port: expected an integer"),
    ({**BASE, "gateway": {"retry_budget_percent": "x"}}, "gateway.retry_budget_percent: expected a number"),
    ({**BASE, "sidecar": {"failure_mode_allow": "yes"}}, "true/false"),
    ({**BASE, "gateway": {"port": 9100}}, "both use port"),
    ({"pools": BASE["pools"] * 2}, "listed twice"),
])
def test_invalid_policies_name_the_problem(data, words):
    with pytest.raises(PolicyError) as exc:
        policy_from_dict(data)
    assert words in str(exc.value)


SECTIONS = ("gateway", "sidecar", "limits", "simulator", "pools", "admission", "routing", "budgets", "tenants",
            "streaming", "epp")


def _with_typo(section: str) -> tuple[dict, str]:
    """BASE with an unknown field in `section`, and the path `sluice check` must name."""
    if section == "pools":
        return {"pools": [{**BASE["pools"][0], "no_such_knob": 1}]}, "pools[0].no_such_knob"
    return {**BASE, section: {"no_such_knob": 1}}, f"{section}.no_such_knob"


@pytest.mark.parametrize("section", SECTIONS)
def test_sluice_check_names_an_unknown_field_in_every_section(section, tmp_path, capsys):
    from extproc.cli import main

    assert sorted(SECTIONS) == sorted(f.name for f in dataclasses.fields(Policy) if f.name != "source")
    data, path = _with_typo(section)
    policy_file = tmp_path / "sluice.yaml"
    policy_file.write_text(yaml.safe_dump(data))
    assert main(["check", "--config", str(policy_file)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: unknown field" in err, err


@pytest.mark.parametrize("data, path", [
    ({"admission": {"lanes": [{"name": "a", "max_prefill_of_target": 0.1},
                              {"name": "b", "max_prefill_of_target": 0.5, "max_tokens2": 1}]}},
     "admission.lanes[1].max_tokens2"),
    ({"routing": {"health": {"min_sample": 1}}}, "routing.health.min_sample"),
    ({"budgets": {"store": {"redis": {"uri": "redis://x"}}}}, "budgets.store.redis.uri"),
    ({"streaming": {"slow_consumer": {"grace": 1}}}, "streaming.slow_consumer.grace"),
    ({"routing": {"score": {}}}, "routing.score"),
])
def test_nested_unknown_fields_are_named_by_their_full_path(data, path):
    with pytest.raises(PolicyError) as exc:
        policy_from_dict({**BASE, **data})
    assert str(exc.value).startswith(f"{path}: unknown field"), exc.value


def test_load_policy_reports_yaml_errors(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("pools: [\n")
    with pytest.raises(PolicyError) as exc:
        load_policy(bad)
    assert "invalid YAML" in str(exc.value)


def _resources(path):
    return yaml.safe_load(path.read_text())["resources"]


def test_render_sluice_mode_pins_through_override_host(tmp_path):
    policy = policy_from_dict(BASE)
    paths = render(policy, tmp_path, "sluice")
    clusters = {c["name"]: c for c in _resources(paths["cds"])}
    assert set(clusters) == {EXTPROC_CLUSTER, "pool-m"}
    lb = clusters["pool-m"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert lb["name"] == "envoy.load_balancing_policies.override_host"
    src = lb["typed_config"]["override_host_sources"][0]["metadata"]
    assert src == {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_KEY}]}
    assert clusters["pool-m"]["per_connection_buffer_limit_bytes"] == 65536
    hcm = _resources(paths["lds"])[0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    assert hcm["early_header_mutation_extensions"][0]["name"] == "envoy.http.early_header_mutation.header_mutation"
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["metadata_options"]["receiving_namespaces"]["untyped"] == [LB_NAMESPACE]
    assert ext["processing_mode"]["request_body_mode"] == "BUFFERED"
    boot = yaml.safe_load(paths["bootstrap"].read_text())
    assert boot["dynamic_resources"]["lds_config"]["path_config_source"]["path"].endswith("lds.yaml")


def test_render_baselines_have_no_ext_proc(tmp_path):
    policy = policy_from_dict(BASE)
    for mode, lb_name in (("envoy-rr", "round_robin"), ("envoy-lr", "least_request")):
        paths = render(policy, tmp_path / mode, mode)
        clusters = _resources(paths["cds"])
        assert [c["name"] for c in clusters] == ["pool-m"]
        assert lb_name in clusters[0]["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"]
        hcm = _resources(paths["lds"])[0]["filter_chains"][0]["filters"][0]["typed_config"]
        assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]


def test_render_unknown_mode_fails(tmp_path):
    with pytest.raises(ValueError):
        render(policy_from_dict(BASE), tmp_path, "nginx")


@pytest.mark.parametrize("mode", ["sluice", "envoy-rr", "envoy-lr"])
def test_envoy_validate_accepts_rendered_config(mode):
    ok, out = validate_with_envoy(policy_from_dict(BASE), mode)
    assert ok, out


def test_committed_envoy_files_match_the_default_policy(tmp_path):
    """envoy/ holds the files rendered from the default policy (what docker-compose mounts); they must not go
    stale."""
    render(load_policy(EMBEDDED_POLICY), tmp_path, "sluice")
    repo_envoy = Path(__file__).resolve().parents[2] / "envoy"
    for name in ("lds.yaml", "cds.yaml"):
        assert (repo_envoy / name).read_text() == (tmp_path / name).read_text(), f"run `sluice render` ({name})"


def test_sidecar_workers_default_to_the_cores_left_after_envoys_share() -> None:
    from extproc.config import default_workers

    assert [default_workers(c) for c in (1, 2, 3, 4, 8, 16)] == [1, 1, 2, 2, 5, 10]
    pools = [{"model": "m", "replicas": ["127.0.0.1:1"]}]
    assert policy_from_dict({"pools": pools}).sidecar.workers == default_workers()
    assert policy_from_dict({"pools": pools, "sidecar": {"workers": 3}}).sidecar.workers == 3


@pytest.mark.parametrize("given, expected", [
    (None, "glibc.pthread.rseq=0"),
    ("", "glibc.pthread.rseq=0"),
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.pthread.rseq=0"),
    ("glibc.pthread.rseq=1:glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.pthread.rseq=0"),
])
def test_envoy_runs_with_glibc_rseq_off_keeping_other_tunables(given, expected) -> None:
    env = {} if given is None else {"GLIBC_TUNABLES": given}
    assert envoy_environment(env) == {"GLIBC_TUNABLES": expected}
