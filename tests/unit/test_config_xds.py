"""The policy file and the Envoy config rendered from it."""

import shutil

import pytest
import yaml

from extproc.cli import validate_with_envoy
from extproc.config import PolicyError, default_policy_path, load_policy, policy_from_dict
from extproc.xds import DESTINATION_KEY, EXTPROC_CLUSTER, LB_NAMESPACE, render

BASE = {"pools": [{"model": "m", "replicas": ["127.0.0.1:8101", "127.0.0.1:8102"]}]}


def test_default_policy_loads():
    policy = load_policy(default_policy_path())
    assert policy.default_pool.model == "sim-model"
    assert len(policy.default_pool.replicas) == 3


@pytest.mark.parametrize("data, words", [
    ({}, "at least one pool"),
    ({"pools": [{"model": "m", "replicas": ["nohostport"]}]}, "host:port"),
    ({"pools": [{"model": "m", "replicas": []}]}, "at least one replica"),
    ({**BASE, "gateway": {"port": 70000}}, "outside"),
    ({**BASE, "gateway": {"prot": 1}}, "unknown field"),
    ({**BASE, "bogus": {}}, "unknown section"),
    ({**BASE, "gateway": {"port": "80"}}, "expected a number"),
    ({**BASE, "sidecar": {"failure_mode_allow": "yes"}}, "true/false"),
    ({**BASE, "gateway": {"port": 9100}}, "both use port"),
    ({"pools": BASE["pools"] * 2}, "listed twice"),
])
def test_invalid_policies_name_the_problem(data, words):
    with pytest.raises(PolicyError) as exc:
        policy_from_dict(data)
    assert words in str(exc.value)


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
    """envoy/ holds the files rendered from sluice.yaml (what docker-compose mounts); they must not go stale."""
    render(load_policy(default_policy_path()), tmp_path, "sluice")
    repo_envoy = default_policy_path().parent / "envoy"
    for name in ("lds.yaml", "cds.yaml"):
        assert (repo_envoy / name).read_text() == (tmp_path / name).read_text(), f"run `sluice render` ({name})"
