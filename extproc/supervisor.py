"""Start and stop a whole gateway stack: simulated replicas, sidecar worker(s), Envoy.

Used by `sluice up`, the integration tests and the benchmark harness, so all three run exactly the same
processes. Every child is started by this object and stopped by PID, in order (Envoy first so no new
traffic arrives, then the sidecar, then the replicas).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from extproc.config import Policy, is_loopback, policy_to_dict, split_addr
from extproc.ports import port_is_free
from extproc.xds import envoy_binary, envoy_environment, render


class StartupError(RuntimeError):
    """A component failed to start; the message says which and shows its log tail."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as an outbound connection's source port (Linux default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (for tests and benches that run several stacks), chosen below the kernel's
    ephemeral range: a port from bind(0) is an ephemeral one, which any outbound connection (Envoy to a replica, a
    client) may take as its source port before the component given it binds (a sidecar failed to start so in a
    CI run). Below that range only another listener can take it, and the bind here checks for that. Ports handed
    out earlier in this process are not handed out again (until every one has been): a component may not have
    bound its port yet when the next stack asks for ports (a simulator failed to start so in a CI run)."""
    low = _ephemeral_low()
    first = max(1024, low - 12000)
    with _ISSUED_LOCK:
        candidates = [p for p in range(first, low) if p not in _ISSUED]
        if len(candidates) < n:
            _ISSUED.clear()
            candidates = list(range(first, low))
        ports = _bindable(candidates, n)
        _ISSUED.update(ports)
    if len(ports) < n:
        raise RuntimeError(f"fewer than {n} free loopback ports in {first}-{low - 1}")
    return ports


_ISSUED: set[int] = set()  # ports free_ports handed out in this process
_ISSUED_LOCK = threading.Lock()


def _bindable(candidates: list[int], n: int) -> list[int]:
    """Up to n of `candidates`, in random order, that a loopback listener could bind now."""
    rng = random.Random()
    rng.shuffle(candidates)
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for port in candidates:
            if len(ports) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def http_ok(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    ready_url: str
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # variables this child sets on top of the shared environment

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        child_env = {**(os.environ if env is None else env), **self.env} if self.env else env
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=child_env, start_new_session=True)
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class Stack:
    """One gateway in front of one replica pool. `mode` is sluice, envoy-rr or envoy-lr (see xds.py), or a
    benchmark baseline (envoy-tuned, smg: extproc/baselines.py, sized by `baseline`)."""

    policy: Policy
    run_dir: Path
    mode: str = "sluice"
    sim_args: list[str] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)
    sim_admin_ports: dict[str, int] = field(default_factory=dict)  # replica address -> simulator admin port
    policy_file: Path | None = None  # the user's policy file (sluice up): watched for reloads; else a run copy
    # wraps each sidecar's command line (tests: run it in a private mount namespace with its own /etc/hosts)
    sidecar_wrapper: Callable[[list[str]], list[str]] | None = None
    baseline: Any = None  # BaselineOptions of a baseline mode (extproc/baselines.py)

    @property
    def base_url(self) -> str:
        return f"http://{self.policy.gateway.host}:{self.policy.gateway.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.policy.gateway.admin_host}:{self.policy.gateway.admin_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.policy.sidecar.metrics_host}:{self.policy.sidecar.metrics_port}/metrics"

    def simulated_replicas(self) -> list[tuple[str, str]]:
        """(model, address) of each replica `sluice up` must simulate."""
        if not self.policy.simulator.enabled:
            return []
        return [(p.model, a) for p in self.policy.pools for a in p.addresses if is_loopback(split_addr(a)[0])]

    def _ports_to_check(self) -> list[tuple[str, str, int]]:
        gw, sc = self.policy.gateway, self.policy.sidecar
        ports = [("Envoy listener (gateway.port)", gw.host, gw.port),
                 ("Envoy admin (gateway.admin_port)", gw.admin_host, gw.admin_port)]
        if self.mode == "sluice":
            for i in range(sc.workers):
                ports.append((f"sidecar gRPC (sidecar.grpc_port+{i})", sc.host, sc.grpc_port + i))
                ports.append((f"sidecar metrics (sidecar.metrics_port+{i})", sc.metrics_host, sc.metrics_port + i))
                ports.append((f"sidecar admin (sidecar.admin_port+{i})", "127.0.0.1", sc.admin_port + i))
        for _model, addr in self.simulated_replicas():
            host, port = split_addr(addr)
            ports.append((f"simulated replica {addr}", host, port))
        return ports

    def check_ports(self) -> None:
        taken = [f"{what}: {host}:{port}" for what, host, port in self._ports_to_check()
                 if not port_is_free(host, port)]
        if taken:
            raise StartupError("port(s) already in use: " + "; ".join(taken)
                               + ". Stop what uses them or change the policy file.")

    def _build_children(self) -> list[Child]:
        py = sys.executable
        logs = self.run_dir / "logs"
        sim = self.policy.simulator
        children: list[Child] = []
        sims = self.simulated_replicas()
        self.sim_admin_ports = dict(zip([a for _m, a in sims], free_ports(len(sims))))
        for i, (model, addr) in enumerate(sims):
            host, port = split_addr(addr)
            argv = [py, "-m", "extproc.sim", "--host", host, "--port", str(port), "--model", model,
                    "--name", addr, "--admin-port", str(self.sim_admin_ports[addr]),
                    "--preset", sim.preset, "--time-scale", str(sim.time_scale),
                    "--seed", str(sim.seed + i), *sim.extra_args, *self.sim_args]
            children.append(Child(f"sim {addr}", argv, logs / f"sim-{port}.log", f"http://{addr}/health"))
        if self.mode == "sluice":
            sc = self.policy.sidecar
            policy_file = self.policy_file.resolve() if self.policy_file else self.run_dir / "policy.yaml"
            for w in range(sc.workers):
                argv = [py, "-m", "extproc.cli", "serve", "--config", str(policy_file), "--worker", str(w),
                        "--xds-out", str((self.run_dir / "envoy").resolve())]
                if self.sidecar_wrapper is not None:
                    argv = self.sidecar_wrapper(argv)
                children.append(Child(f"sidecar[{w}]", argv, logs / f"sidecar-{w}.log",
                                      f"http://{sc.metrics_host}:{sc.metrics_port + w}/ready"))
        if self.mode == "smg":  # the Shepherd Model Gateway instead of Envoy (a benchmark baseline)
            from extproc.baselines import smg_argv, smg_ready_url

            children.append(Child("smg", smg_argv(self.policy), logs / "smg.log", smg_ready_url(self.policy)))
            return children
        gw = self.policy.gateway
        argv = [envoy_binary(), "-c", str(self.run_dir / "envoy" / "bootstrap.yaml"), "--disable-hot-restart",
                "--log-level", gw.envoy_log_level, "--concurrency", str(gw.envoy_concurrency)]
        children.append(Child("envoy", argv, logs / "envoy.log", f"{self.admin_url}/ready",
                              env=envoy_environment(self.child_env())))
        return children

    def start(self, timeout: float = 60.0) -> None:
        """Start everything and wait until each part answers its readiness check."""
        self.check_ports()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "policy.yaml").write_text(yaml.safe_dump(policy_to_dict(self.policy), sort_keys=False))
        render(self.policy, self.run_dir / "envoy", self.mode, baseline=self.baseline)
        self.children = self._build_children()
        env = self.child_env()
        try:
            for child in self.children:
                child.start(env)
            deadline = time.monotonic() + timeout
            for child in self.children:
                self._wait_ready(child, deadline)
            self._wait_listener(deadline)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def child_env() -> dict[str, str]:
        """The environment every child starts (and restarts) with."""
        return dict(os.environ, PYTHONUNBUFFERED="1")

    def _wait_ready(self, child: Child, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not child.alive():
                raise StartupError(f"{child.name} exited during start-up (log {child.log_path}):\n"
                                   f"{child.log_tail()}")
            if http_ok(child.ready_url):
                return
            time.sleep(0.05)
        raise StartupError(f"{child.name} was not ready in time ({child.ready_url}); log {child.log_path}:\n"
                           f"{child.log_tail()}")

    def _wait_listener(self, deadline: float) -> None:
        gw = self.policy.gateway
        while time.monotonic() < deadline:
            with socket.socket() as s:
                s.settimeout(0.2)
                if s.connect_ex((gw.host, gw.port)) == 0:
                    return
            time.sleep(0.05)
        raise StartupError(f"Envoy did not open its listener {gw.host}:{gw.port}; log:\n"
                           f"{self.children[-1].log_tail()}")

    def sim_admin_url(self, addr: str) -> str:
        """Where to inject faults into the simulated replica at `addr` (POST /sim/fault)."""
        return f"http://{split_addr(addr)[0]}:{self.sim_admin_ports[addr]}"

    def child(self, name: str) -> Child:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    def stop(self) -> None:
        """Envoy first (no new traffic), then sidecars, then replicas."""
        for child in reversed(self.children):
            child.stop()

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def with_free_ports(policy: Policy, replicas_per_pool: int | None = None) -> Policy:
    """A copy of the policy on fresh loopback ports (tests and benches run stacks side by side); a pool of replicas
    by name keeps its entries."""
    p = dataclasses.replace(policy)
    n_rep = sum(replicas_per_pool or len(pool.replicas) for pool in policy.pools)
    ports = free_ports(5 + n_rep)
    gw = dataclasses.replace(policy.gateway, port=ports[0], admin_port=ports[1])
    sc = dataclasses.replace(policy.sidecar, grpc_port=ports[2], metrics_port=ports[3], admin_port=ports[4])
    # workers use consecutive ports: pick a base well away from the random ones
    if policy.sidecar.workers > 1:
        base = _consecutive_free(3 * policy.sidecar.workers)
        sc = dataclasses.replace(sc, grpc_port=base, metrics_port=base + policy.sidecar.workers,
                                 admin_port=base + 2 * policy.sidecar.workers)
    rest = iter(ports[5:])
    pools = []
    for pool in policy.pools:
        if pool.discovered:  # replicas by name: the caller's names and ports stand
            pools.append(pool)
            continue
        count = replicas_per_pool or len(pool.replicas)
        pools.append(dataclasses.replace(pool, replicas=[f"127.0.0.1:{next(rest)}" for _ in range(count)]))
    p.gateway, p.sidecar, p.pools = gw, sc, pools
    return p


def _consecutive_free(n: int) -> int:
    for base in range(20000, 60000, 97):
        if all(port_is_free("127.0.0.1", base + i) for i in range(n)):
            return base
    raise StartupError("no block of consecutive free ports found")
