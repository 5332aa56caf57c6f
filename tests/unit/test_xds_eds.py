"""What `sluice render` (and the sidecar with --xds-out) writes for replicas found at run time: the pool becomes an
EDS cluster reading its endpoints from the watched directory, its first EDS file holds the fixed addresses and is
never clobbered by a re-render, the sidecar's own cluster resolves a name when Envoy reaches it by one; every
shape passes `envoy --mode validate`."""

from __future__ import annotations

import stat

import pytest
import yaml

from extproc.cli import validate_with_envoy
from extproc.config import policy_from_dict
from extproc.discovery.eds import write_eds
from extproc.xds import EXTPROC_CLUSTER, render, render_clusters

NAMED = {"pools": [{"model": "m", "replicas": ["10.0.0.9:8000", {"dns": "vllm.test:8000"}]},
                   {"model": "fixed", "replicas": ["10.0.0.1:8000"]}]}


def _clusters(path) -> dict[str, dict]:
    return {c["name"]: c for c in yaml.safe_load(path.read_text())["resources"]}


def _eds_addresses(path) -> list[str]:
    (assignment,) = yaml.safe_load(path.read_text())["resources"]
    return [f"{e['endpoint']['address']['socket_address']['address']}:"
            f"{e['endpoint']['address']['socket_address']['port_value']}"
            for e in assignment["endpoints"][0].get("lb_endpoints", [])]


def test_a_pool_with_names_is_an_eds_cluster_and_a_fixed_one_stays_static(tmp_path):
    policy = policy_from_dict(NAMED)
    paths = render(policy, tmp_path, xds_dir="/etc/envoy")
    clusters = _clusters(paths["cds"])
    named, fixed = clusters["pool-m"], clusters["pool-fixed"]
    assert named["type"] == "EDS" and "load_assignment" not in named
    source = named["eds_cluster_config"]["eds_config"]["path_config_source"]
    assert source == {"path": "/etc/envoy/eds-pool-m.yaml", "watched_directory": {"path": "/etc/envoy"}}
    assert named["load_balancing_policy"] == fixed["load_balancing_policy"]  # pinning works the same way
    assert fixed["type"] == "STATIC" and "eds_cluster_config" not in fixed
    # the first EDS file: what is known before any name is resolved
    assert _eds_addresses(paths["eds-pool-m"]) == ["10.0.0.9:8000"]
    assert not (tmp_path / "eds-pool-fixed.yaml").exists()
    # Envoy may run as another user (its image's, reading a shared volume)
    for path in paths.values():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_a_re_render_keeps_the_endpoints_the_sidecar_wrote_unless_given_new_ones(tmp_path):
    policy = policy_from_dict(NAMED)
    render(policy, tmp_path)
    write_eds(tmp_path, "pool-m", ["10.0.0.9:8000", "10.0.0.5:8000"])  # the sidecar resolved the name
    paths = render(policy, tmp_path)  # a reload re-renders LDS/CDS
    assert _eds_addresses(paths["eds-pool-m"]) == ["10.0.0.5:8000", "10.0.0.9:8000"]
    render(policy, tmp_path, endpoints={"pool-m": ["10.0.0.7:8000"]})
    assert _eds_addresses(paths["eds-pool-m"]) == ["10.0.0.7:8000"]


def test_an_eds_cluster_needs_the_directory_envoy_reads():
    with pytest.raises(ValueError, match="xDS directory"):
        render_clusters(policy_from_dict(NAMED), "sluice", None)


def test_a_sidecar_reached_by_name_is_a_strict_dns_cluster(tmp_path):
    policy = policy_from_dict({**NAMED, "sidecar": {"host": "0.0.0.0", "advertise_host": "sluice", "workers": 2}})
    sidecar = _clusters(render(policy, tmp_path)["cds"])[EXTPROC_CLUSTER]
    assert sidecar["type"] == "STRICT_DNS" and sidecar["dns_lookup_family"] == "V4_PREFERRED"
    hosts = [e["endpoint"]["address"]["socket_address"] for e in sidecar["load_assignment"]["endpoints"][0]
             ["lb_endpoints"]]
    assert hosts == [{"address": "sluice", "port_value": 50051}, {"address": "sluice", "port_value": 50052}]
    by_address = policy_from_dict({**NAMED, "sidecar": {"host": "0.0.0.0", "advertise_host": "10.1.2.3"}})
    sidecar = _clusters(render(by_address, tmp_path / "ip")["cds"])[EXTPROC_CLUSTER]
    assert sidecar["type"] == "STATIC"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sidecar", [{}, {"host": "0.0.0.0", "advertise_host": "sluice"}])
def test_envoy_validates_the_eds_and_strict_dns_shapes(sidecar):
    ok, out = validate_with_envoy(policy_from_dict({**NAMED, "sidecar": sidecar}))
    assert ok, out
