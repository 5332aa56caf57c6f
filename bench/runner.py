"""`sluice bench run SCENARIO... [--systems sluice,envoy-rr,envoy-tuned,smg] [--quick] [--seeds N] [--json FILE]`

Runs the P1..P13 scenarios (`all` = every one) against each system in turn: `sluice` (Envoy + the sidecar at its
shipped defaults, told only the scenario's deployment facts: `_meta.sluice_policy`), `envoy-rr` (Envoy round
robin, Envoy's defaults: the naive baseline), `envoy-tuned` (Envoy as an experienced operator configures it for
an LLM pool, extproc/baselines.py) and `smg` (the Shepherd Model Gateway, cache_aware, its defaults). For each (scenario, system) it
starts the same simulated replica pool fresh (same preset, same seeds) with that system in front
(`extproc.supervisor.Stack`), replays the scenario's open-loop workload (`bench/openloop.py`), polls every
replica's /sim/state every 250 ms (running, waiting, KV usage, preemptions, ghost tokens), samples Envoy and
sidecar memory and the sidecar metrics the scenario asks for, injects the scenario's faults, then stops the
stack (by PID, in order) and computes the scenario's metrics.

Repetitions: `--seeds N` runs each (scenario, system) N times; repetition k replays another workload of the
same shape and rate (every scenario draws its arrivals from `base.workload_rng`, Random(seed + 1000 k)) with
the simulators and clients seeded seed + k, and reports per metric the median over the repetitions, with
`spread` ([min, max]) and `per_rep` next to it in the JSON and "median [min-max]" in the tables. A single run
of a noisy scenario decides nothing; judge it on the medians.

Outputs:
  --json FILE                 {"P3": {"sluice": {metric: value|null|{class: value}}, "envoy-rr": {...}, ...}, ...,
                              "_meta": {...}}; every system's metrics include the SLO goodput and its classes
                              (bench/scenarios/base.py: slo_metrics), sluice's also `worst_class_ratio`
  bench/results/PN.md         one table per scenario (systems as columns)
  bench/results/PN.png        TTFT over time and KV usage per replica, every system on shared axes (committed)
  docs/benchmarks-scenarios.md  every table, the method, and the reproduced flags
A line per scenario says whether envoy-rr reproduced the problem (a scenario that does not is wrong).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import aiohttp

from bench.backends import SimBackend, VllmBackend, make_backend
from bench.capacity import BENCH_PRESET, LOAD_SCALE, EngineSpec, capacity_rps
from bench.openloop import Record, raise_nofile, run_open_loop
from bench.procstat import cpu_seconds, rss_bytes
from bench.scenarios import SCENARIOS, get_scenarios
from bench.scenarios.base import (MODEL, RunData, Scenario, Workload, requests_received, scale_arrivals,
                                  set_workload_rep, worst_class_ratio)
from extproc.baselines import BaselineOptions
from extproc.config import policy_from_dict
from extproc.supervisor import Child, Stack, StartupError, free_ports, with_free_ports
from extproc.sim.presets import get_preset

SYSTEMS = ("sluice", "envoy-rr", "envoy-tuned", "smg")
TENANT_SHARE = 0.5  # envoy-tuned's rate limit: each tenant at most this share of the pool's capacity
POLL_S = 0.25
RESULTS = Path("bench/results")
SUMMARY = Path("docs/benchmarks-scenarios.md")
PUBLISHED_PAGES = (Path("README.md"), Path("docs/benchmarks.md"))  # carry the results block (bench/report.py)


# ---- stack ------------------------------------------------------------------------------------------------------
def policy_dict(sc: Scenario, system: str, seed: int, with_sluice_sections: bool = True) -> dict[str, Any]:
    data: dict[str, Any] = {
        "pools": [{"model": MODEL, "replicas": [f"127.0.0.1:{i + 1}" for i in range(sc.replicas)]}],
        "simulator": {"enabled": True, "preset": sc.preset, "time_scale": float(sc.time_scale), "seed": seed,
                      "extra_args": list(sc.sim_args)},
        "gateway": {"envoy_log_level": "error", **sc.gateway},
        "sidecar": dict(sc.sidecar),
        "limits": dict(sc.limits),
    }
    if system == "sluice" and with_sluice_sections:
        for key, value in sc.sluice_policy.items():
            data[key] = value
    return data


def baseline_options(sc: Scenario) -> BaselineOptions:
    """What an operator sizes envoy-tuned with: the engine's max_num_seqs and, where the scenario has tenants, a
    per-tenant request rate of TENANT_SHARE x the pool's capacity for that tenant's requests (bench/capacity.py,
    from the simulator's cost model)."""
    spec = EngineSpec.of(sc.preset, sc.sim_args)
    rps = {t: TENANT_SHARE * sc.replicas * capacity_rps(spec, p, o) for t, (p, o) in sc.tenant_requests.items()}
    return BaselineOptions(max_num_seqs=spec.seqs, tenant_rps=rps)


def sluice_additions(sc: Scenario) -> dict[str, Any]:
    """Everything sluice is told beyond its shipped defaults, as `_meta.sluice_policy` lists it: the policy
    sections of `sc.sluice_policy`, the sidecar topology (`sidecar`) and a shared budget store."""
    out: dict[str, Any] = json.loads(json.dumps(sc.sluice_policy))
    if sc.sidecar:
        out["sidecar"] = dict(sc.sidecar)
    if getattr(sc, "redis", False):
        out.setdefault("budgets", {})["store"] = {"kind": "redis", "redis": {"url": "(a redis-server the harness starts)"}}
    return out


Backend = SimBackend | VllmBackend


def make_stack(sc: Scenario, system: str, run_dir: Path, seed: int, with_sluice_sections: bool = True,
               redis_url: str | None = None, backend: Backend | None = None) -> Stack:
    data = policy_dict(sc, system, seed, with_sluice_sections)
    if backend is not None:
        backend.prepare(sc, data)
    if redis_url and system == "sluice":
        budgets = data.setdefault("budgets", {})
        budgets["store"] = {"kind": "redis", "redis": {"url": redis_url}}
    policy = with_free_ports(policy_from_dict(data))
    if backend is not None and backend.real:  # the engines' own ports, not fresh ones
        policy.pools = [dataclasses.replace(policy.pools[0], replicas=list(data["pools"][0]["replicas"])),
                        *policy.pools[1:]]
    baseline = baseline_options(sc) if system == "envoy-tuned" else None
    return Stack(policy, run_dir=run_dir, mode=system, baseline=baseline)


def start_redis(run_dir: Path) -> tuple[Child, str]:
    """A private redis-server on a free loopback port, for scenarios whose sidecars share budgets."""
    import socket
    import time

    (port,) = free_ports(1)
    child = Child("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no"], run_dir / "logs" / "redis.log", "")
    child.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return child, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    child.stop()
    raise StartupError("redis-server did not start:\n" + child.log_tail())


def start_stack(sc: Scenario, system: str, run_dir: Path, seed: int,
                backend: Backend | None = None) -> tuple[Stack, list[str]]:
    """Start the stack; if the sidecar refuses the scenario's policy sections (capability parsers are stricter
    than this harness), start it once more without them and say so. Returns (stack, notes)."""
    notes: list[str] = []
    redis = redis_url = None
    if getattr(sc, "redis", False) and system == "sluice":
        redis, redis_url = start_redis(run_dir)
    try:
        stack = make_stack(sc, system, run_dir, seed, redis_url=redis_url, backend=backend)
        stack.start()
        if redis is not None:
            stack.children.append(redis)  # stopped with the stack
        return stack, notes
    except BaseException as exc:
        if redis is not None:
            redis.stop()
        if not isinstance(exc, StartupError):
            raise
        if system != "sluice" or not sc.sluice_policy:
            raise
        first = str(exc).splitlines()[-1][:300] if str(exc) else "startup error"
        notes.append(f"sidecar refused the scenario's policy sections ({first}); ran without them")
    stack = make_stack(sc, system, run_dir / "retry", seed, with_sluice_sections=False, backend=backend)
    stack.start()
    return stack, notes


def _gateway_pids(stack: Stack) -> dict[str, list[int]]:
    """Envoy's and the sidecar workers' PIDs, by part: memory is reported per part so a growth can be placed."""
    out: dict[str, list[int]] = {"envoy": [], "sidecar": [], "smg": []}
    for c in stack.children:
        if c.proc is None:
            continue
        if c.name in ("envoy", "smg"):
            out[c.name].append(c.proc.pid)
        elif c.name.startswith("sidecar"):
            out["sidecar"].append(c.proc.pid)
    return out


def _sample_rss(parts: dict[str, list[int]], run: RunData, t: float) -> None:
    """One RSS sample: the Envoy + sidecar total in `run.gateway_rss`, each part in `run.extra["rss"][part]`."""
    try:
        by_part = {part: sum(rss_bytes(p) for p in pids) for part, pids in parts.items() if pids}
    except OSError:
        return
    run.gateway_rss.append((t, sum(by_part.values())))
    per = run.extra.setdefault("rss", {})
    for part, value in by_part.items():
        per.setdefault(part, []).append((t, value))


def _cpu_by_process(stacks: list[Stack]) -> dict[tuple[str, int], float]:
    """CPU seconds used so far by each of the gateways' processes, keyed by (part, pid): Envoy, the sidecar
    workers, smg. A process that cannot be read (it has exited) is left out."""
    out: dict[tuple[str, int], float] = {}
    for stack in stacks:
        for part, pids in _gateway_pids(stack).items():
            for pid in pids:
                try:
                    out[(part, pid)] = cpu_seconds(pid)
                except OSError:
                    pass
    return out


def _cpu_used(start: dict[tuple[str, int], float], end: dict[tuple[str, int], float]) -> dict[str, float]:
    """CPU seconds per part between two `_cpu_by_process` readings, over the processes present in both."""
    used: dict[str, float] = {}
    for (part, pid), before in start.items():
        after = end.get((part, pid))
        if after is not None:
            used[part] = used.get(part, 0.0) + after - before
    return {part: round(v, 2) for part, v in used.items()}


def parse_prom(text: str, wanted: tuple[str, ...] | None = None) -> dict[str, float]:
    """Prometheus text -> {name: value summed over label sets}; only names in `wanted` when given."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        name = line[:name_end]
        if wanted is not None and name not in wanted:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def parse_prom_labels(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """All samples of one metric with their labels (small parser: label values without escaped quotes)."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            close = rest.find("}")
            for part in rest[1:close].split(","):
                if "=" in part:
                    k, v = part.split("=", 1)
                    labels[k.strip()] = v.strip().strip('"')
            rest = rest[close + 1:]
        elif not rest.startswith(" "):
            continue
        try:
            out.append((labels, float(rest.strip().split(" ")[0])))
        except ValueError:
            continue
    return out


# ---- one run ----------------------------------------------------------------------------------------------------
class Control:
    """What `Scenario.during` may use while the load runs."""

    def __init__(self, stack: Stack, run: RunData, session: aiohttp.ClientSession, t0: list[float],
                 backend: Backend) -> None:
        self.stack = stack
        self.backend = backend
        self.run = run
        self.session = session
        self._t0 = t0

    def now(self) -> float:
        return time.monotonic() - self._t0[0] if self._t0 else 0.0

    async def fault(self, replica: int, fault: str, value: Any = None) -> dict[str, Any]:
        addr = self.run.replicas[replica]
        t = self.now()
        try:
            ok = await self.backend.fault(self.session, replica, addr, fault, value)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            ok = False
            print(f"    fault {fault} on {addr} failed: {exc}", file=sys.stderr)
        self.run.events.append({"t": t, "replica": addr, "fault": fault, "value": value, "ok": ok})
        return {"ok": ok}

    async def sidecar_text(self) -> str | None:
        if self.stack.mode != "sluice":
            return None
        try:
            async with self.session.get(self.stack.metrics_url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                return await resp.text()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return None


async def _poll(stack: Stack, run: RunData, sc: Scenario, session: aiohttp.ClientSession, t0: list[float],
                stop: asyncio.Event, backend: Backend) -> None:
    """Replica state every POLL_S; sidecar metrics and gateway RSS when the scenario asks."""
    urls = {addr: addr for addr in run.replicas}
    parts = _gateway_pids(stack)
    rnd = 0

    async def one(addr: str, _url: str, t: float, k: int) -> None:
        try:
            st = await backend.state(session, addr)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return
        c = st.get("counters") or {}
        run.samples.setdefault(addr, []).append({
            "t": t, "round": k, "running": st.get("running"), "waiting": st.get("waiting"),
            "inflight": (st.get("running") or 0) + (st.get("waiting") or 0),
            "kv": st.get("kv_usage"), "preemptions": c.get("preemptions"), "ghost": c.get("ghost_tokens"),
            "gen": c.get("generation_tokens"), "prompt": c.get("prompt_tokens"),
            "crashed": (st.get("faults") or {}).get("crashed"), "slow": (st.get("faults") or {}).get("slow"),
            "finished": sum((c.get("finished") or {}).values()),
            "aborted": None if backend.real else (c.get("finished") or {}).get("abort", 0),
            "prefix_queries": c.get("prefix_cache_queries"), "prefix_hits": c.get("prefix_cache_hits"),
            "received": requests_received(st)})
        run.sim_final[addr] = st

    while not stop.is_set():
        t = time.monotonic() - t0[0] if t0 else 0.0
        jobs = [one(a, u, t, rnd) for a, u in urls.items()]
        if sc.poll_sidecar and stack.mode == "sluice" and rnd % 2 == 0:
            jobs.append(_poll_prom(stack.metrics_url, run.sidecar, sc.poll_sidecar, session, t))
        if sc.poll_envoy and rnd % 2 == 0:
            jobs.append(_poll_prom(stack.admin_url + "/stats/prometheus", run.envoy, sc.poll_envoy, session, t))
        await asyncio.gather(*jobs)
        if sc.rss_poll:
            _sample_rss(parts, run, t)
        rnd += 1
        try:
            await asyncio.wait_for(stop.wait(), POLL_S)
        except asyncio.TimeoutError:
            pass


async def _poll_prom(url: str, out: list, names: tuple[str, ...], session: aiohttp.ClientSession,
                     t: float) -> None:
    """Scrape a Prometheus endpoint (every other poll round: 500 ms) and keep the samples of `names`."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return
    out.append((t, {name: parse_prom_labels(text, name) for name in names}))


async def _faults(ctl: Control, wl: Workload, ts: float) -> None:
    for f in sorted(wl.faults, key=lambda f: f.at):
        delay = f.at / ts - ctl.now()
        if delay > 0:
            await asyncio.sleep(delay)
        await ctl.fault(f.replica, f.fault, f.value)


async def _settle(backend: Backend, run: RunData, session: aiohttp.ClientSession, limit_s: float) -> None:
    """After the load: wait (bounded) until no replica runs or queues anything, so end counters are complete."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy = 0
        for addr in run.replicas:
            try:
                st = await backend.state(session, addr)
                busy += int(st.get("running", 0)) + int(st.get("waiting", 0))
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                pass
        if busy == 0:
            return
        await asyncio.sleep(0.2)


async def _final(stack: Stack, run: RunData, session: aiohttp.ClientSession, backend: Backend) -> None:
    timeout = aiohttp.ClientTimeout(total=3)
    for addr in run.replicas:
        try:
            run.sim_final[addr] = await backend.state(session, addr, 3.0)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            pass
    try:
        async with session.get(stack.admin_url + "/stats/prometheus", timeout=timeout) as resp:
            text = await resp.text()
        run.envoy_stats = parse_prom(text)
        run.extra["envoy_prom_text"] = text
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        pass
    if stack.mode == "sluice":
        try:
            async with session.get(stack.metrics_url, timeout=timeout) as resp:
                text = await resp.text()
            run.sidecar_final = parse_prom(text)
            run.extra["sidecar_prom_text"] = text
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass
    if stack.mode == "smg":  # smg serves Prometheus on the gateway's admin port
        try:
            async with session.get(stack.admin_url + "/metrics", timeout=timeout) as resp:
                run.extra["smg_prom_text"] = await resp.text()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass


# What each gateway says it did, kept in the JSON (`diagnostics`) to explain a column: sidecar counters by label
# (sluice), Envoy counters of the operator's features (envoy-tuned, envoy-rr), smg's own counters.
SIDECAR_DIAG = {"rejections": ("sluice_rejections_total", ("status", "reason")),
                "shed": ("sluice_shed_total", ("lane", "reason")),
                "saturated": ("sluice_replica_saturated_total", ("reason",)),
                "wait_over_estimate": ("sluice_queue_wait_over_estimate_bucket", ("lane", "le")),
                "health": ("sluice_replica_health_transitions_total", ("replica", "from", "to", "reason")),
                "outcomes": ("sluice_requests_total", ("outcome",)),
                "retries_rejected": ("sluice_budget_retries_rejected_total", ()),
                "task_rejections": ("sluice_budget_task_rejections_total", ())}
ENVOY_DIAG = ("admission_control_rq_rejected", "http_local_rate_limit_rate_limited",
              "outlier_detection_ejections_enforced_total", "health_check_failure", "upstream_rq_retry",
              "upstream_rq_retry_overflow", "upstream_rq_pending_overflow", "upstream_cx_connect_fail",
              "upstream_rq_5xx", "upstream_rq_timeout", "upstream_rq_per_try_idle_timeout")
SMG_DIAG = ("smg_worker_retries_total", "smg_router_upstream_responses_total", "smg_worker_cb_",
            "smg_worker_health", "smg_http_requests_total", "smg_router_request_errors_total",
            "smg_worker_overload_fallback_total", "smg_cache_aware_policy_branch_total")


def gateway_cpu(run: RunData) -> dict[str, float]:
    """`gateway_cpu_s`: the CPU seconds all the gateway's processes used while serving (`drive`), a cost every
    scenario reports next to its goodput; its parts are under `diagnostics.gateway_cpu_s`."""
    parts = run.extra.get("gateway_cpu_s")
    return {"gateway_cpu_s": round(sum(parts.values()), 2)} if parts else {}


def engine_probe(run: RunData) -> dict[str, float]:
    """`engine_probe_s`: the real engines' mean TTFT for one probe prompt just before this run
    (`VllmBackend._probe`; each engine's under `diagnostics.engine_probe_s`). A number beside the metrics, so that
    `--seeds N` keeps one per repetition (`combine_reps`: `per_rep`) and a comparison can show how fast the
    engines were for each system in each repetition."""
    probes = run.extra.get("engine_probe_s")
    return {"engine_probe_s": round(sum(probes.values()) / len(probes), 4)} if probes else {}


def replica_shares(run: RunData) -> dict[str, dict[str, float]]:
    """Each replica's part of the run, from its counters at the end (`sim_final`, counted since the run began):
    the requests it received (`requests_received`) and, where the engine counts them, the prompt tokens it was
    queried for in its prefix cache and the share of them it found there. Real engines do not name the replica that
    answered, so this is where a router's placement shows on them (PX: how the apps' prompts were split between
    the engines, and how much of them each found cached)."""
    out: dict[str, dict[str, float]] = {}
    for addr, state in run.sim_final.items():
        counters = state.get("counters") or {}
        row = {"received": requests_received(state)}
        queries, hits = counters.get("prefix_cache_queries"), counters.get("prefix_cache_hits")
        if isinstance(queries, (int, float)) and isinstance(hits, (int, float)) and queries > 0:
            row["prefix_queries"] = float(queries)
            row["prefix_hit_rate"] = round(hits / queries, 3)
        out[addr] = row
    return out


def diagnostics(run: RunData) -> dict[str, Any]:
    out: dict[str, Any] = {}
    text = run.extra.get("sidecar_prom_text")
    if text:
        for key, (name, labels) in SIDECAR_DIAG.items():
            vals = {"/".join(lbl.get(k, "") for k in labels) or "total": v
                    for lbl, v in parse_prom_labels(text, name) if v and not name.endswith("_created")}
            if vals:
                out[key] = vals
    cpu = run.extra.get("gateway_cpu_s")
    if cpu:
        out["gateway_cpu_s"] = cpu  # a cost next to the wins: CPU the gateway's processes used while serving
    probes = run.extra.get("engine_probe_s")
    if probes:
        out["engine_probe_s"] = probes  # each real engine's speed before this system's run (VllmBackend._probe)
    replicas = replica_shares(run)
    if replicas:
        out["replicas"] = replicas
    envoy = {k: v for k, v in run.envoy_stats.items() if v and any(k.endswith(d) for d in ENVOY_DIAG)}
    if envoy:
        out["envoy"] = envoy
    smg = run.extra.get("smg_prom_text")
    if smg:
        out["smg"] = {f"{n}{{{','.join(f'{k}={v}' for k, v in sorted(lbl.items()))}}}": v
                      for n in sorted({ln.split('{')[0].split(' ')[0] for ln in smg.splitlines()
                                       if ln and ln[0] != '#' and any(ln.startswith(d) for d in SMG_DIAG)})
                      for lbl, v in parse_prom_labels(smg, n) if v}
    return out


def _spread(loads: list[tuple[list[Record], float]]) -> list[Record]:
    """The records of the open loops that replayed `arrivals[i::n]` (one per gateway), as one loop's: user ids
    back to the arrival's index, times onto the first loop's t0."""
    n = len(loads)
    t0 = loads[0][1]
    out: list[Record] = []
    for i, (records, loop_t0) in enumerate(loads):
        by = loop_t0 - t0
        for r in records:
            moved = {k: getattr(r, k) + by for k in ("sched", "start", "headers_at", "first_token", "end",
                                                      "first_send") if getattr(r, k) is not None}
            out.append(dataclasses.replace(r, user=i + r.user * n, **moved))
    return out


async def drive(sc: Scenario, stack: Stack, wl: Workload, run: RunData, quick: bool, seed: int,
                backend: Backend, gateways: list[Stack] | None = None) -> None:
    """Replay the workload through `stack`, or spread round robin over `gateways` (several gateways in front of
    the pool `stack` runs, as an L4 balancer would spread clients); poll, inject faults, collect."""
    ts = float(sc.time_scale)
    arrivals = scale_arrivals(wl.arrivals, ts)
    deadline = (wl.duration + wl.drain) / ts
    run.duration = wl.duration / ts
    run.extra["deadline"] = deadline
    urls = [g.base_url + "/v1/chat/completions" for g in (gateways or [stack])]
    t0: list[float] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as side:
        probes = await backend.begin_run(side, run.replicas)
        if probes:
            run.extra["engine_probe_s"] = probes
        ctl = Control(stack, run, side, t0, backend)
        started = asyncio.Event()

        def on_start(t: float) -> None:
            t0.append(t)
            started.set()

        n = len(urls)
        load = asyncio.ensure_future(asyncio.gather(*(
            run_open_loop(url, arrivals[i::n], deadline, seed=seed + i, on_start=on_start if i == 0 else None,
                          max_arrivals=20000, rcvbuf=sc.client_rcvbuf) for i, url in enumerate(urls))))
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait([load, waiter], return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():
            waiter.cancel()
            await load  # raises the generator's error (a bad workload), never hangs here
        cpu_start = _cpu_by_process(gateways or [stack])
        poller = asyncio.create_task(_poll(stack, run, sc, side, t0, stop, backend))
        helpers = [asyncio.create_task(_faults(ctl, wl, ts)),
                   asyncio.create_task(sc.during(ctl, run, quick))]
        try:
            loads = await load
            run.records = loads[0][0] if n == 1 else _spread(loads)
        finally:
            for h in helpers:
                if not h.done():
                    h.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if sc.settle_s > 0:
                await _settle(backend, run, side, sc.settle_s)
            stop.set()
            await poller
            run.extra["gateway_cpu_s"] = _cpu_used(cpu_start, _cpu_by_process(gateways or [stack]))
        await _final(stack, run, side, backend)


def run_one(sc: Scenario, system: str, quick: bool, seed: int, workdir: Path,
            backend: Backend | None = None) -> tuple[RunData | None, dict]:
    """Start the system, replay, stop. Returns (run data or None, info for _meta)."""
    backend = backend or SimBackend()
    info: dict[str, Any] = {"system": system, "notes": []}
    t_start = time.monotonic()
    run_dir = workdir / f"{sc.id}-{system}"
    try:
        stack, notes = start_stack(sc, system, run_dir, seed, backend)
        backend.attach(stack)
        wl = sc.workload(quick)  # after the backend is ready: real engines set the prompt text's scale
    except Exception as exc:  # noqa: BLE001 - report and continue with the next system
        info["error"] = f"start failed: {exc}"[:2000]
        return None, info
    info["notes"] += notes
    info["start_s"] = round(time.monotonic() - t_start, 2)
    run = RunData(scenario=sc.id, system=system, time_scale=float(sc.time_scale),
                  replicas=list(stack.policy.pools[0].replicas))
    run.extra["quick"] = quick
    run.extra["backend"] = backend.name
    try:
        asyncio.run(drive(sc, stack, wl, run, quick, seed, backend))
    except Exception as exc:  # noqa: BLE001
        info["error"] = f"run failed: {type(exc).__name__}: {exc}"
        traceback.print_exc()
        return None, info
    finally:
        backend.end_run()
        stack.stop()
    return finished(run, info, t_start)


def finished(run: RunData, info: dict[str, Any], t_start: float) -> tuple[RunData, dict[str, Any]]:
    """A system-run's wall time and request counts, into its `_meta` info."""
    run.wall_s = time.monotonic() - t_start
    info["wall_s"] = round(run.wall_s, 1)
    info["requests"] = len({r.user for r in run.records})
    info["attempts"] = len(run.records)
    return run, info


# ---- all runs ---------------------------------------------------------------------------------------------------
def preset_meta() -> dict[str, Any]:
    """The preset the scenarios derived their workload from (bench/capacity.py BENCH_PRESET): its name or file,
    and what it was fitted to."""
    p = get_preset(BENCH_PRESET)
    return {"preset": BENCH_PRESET, "name": p.name, "description": p.description, "load_scale": LOAD_SCALE}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def combine_reps(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's metrics over repetitions (`--seeds N`): each numeric metric is the median of the repetitions
    that produced it (statistics.median: the middle value, or the mean of the two middle ones), `spread` holds
    [min, max] per numeric metric, `per_rep` every repetition's numbers, `per_rep_class_slo_goodput` every
    repetition's class goodputs (to judge the per-class bars repetition by repetition), `reps` their count; other
    values (per class dicts, diagnostics) are the last repetition's. One repetition is returned unchanged."""
    if len(reps) == 1:
        return reps[0]
    out: dict[str, Any] = dict(reps[-1])
    spread: dict[str, list[float]] = {}
    keys = [k for k in reps[-1] if k not in ("spread", "per_rep", "reps")]
    for k in keys:
        vals = [m[k] for m in reps if _is_number(m.get(k))]
        if vals and all(m.get(k) is None or _is_number(m.get(k)) for m in reps):
            out[k] = round(statistics.median(vals), 4)
            spread[k] = [min(vals), max(vals)]
    out["spread"] = spread
    out["per_rep"] = [{k: m.get(k) for k in spread} for m in reps]
    out["per_rep_class_slo_goodput"] = [m.get("class_slo_goodput") for m in reps]
    out["reps"] = len(reps)
    return out


def write_records(run: RunData, path: Path) -> None:
    """Every client attempt of a run, one JSON object per line (`bench.openloop.Record`'s fields; times in wall
    seconds since the run's t0): the raw data every metric of the run is computed from, for a reader who wants
    to recompute one or look at the requests behind a percentile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for rec in sorted(run.records, key=lambda r: (r.start, r.user, r.attempt)):
            out.write(json.dumps(dataclasses.asdict(rec), separators=(",", ":")) + "\n")


Reps = tuple[list[tuple[RunData | None, dict[str, Any]]], list[dict[str, Any]]]


def system_order(systems: list[str], turn: int) -> list[str]:
    """`systems` rotated left by `turn`: the order in which one repetition of one scenario runs them.

    The systems of a scenario run one after another on the same replicas, and this shared machine changes speed
    within minutes (real engines: one 4,000-token prompt took 0.19 s and 0.29 s a minute apart; the probe before
    each run, `diagnostics.engine_probe_s`, moved up to 1.47x between the systems of one scenario). Rotating the
    order from one scenario and one repetition to the next gives no system the same place every time."""
    if not systems:
        return []
    k = turn % len(systems)
    return systems[k:] + systems[:k]


def run_reps(sc: Scenario, systems: list[str], quick: bool, seed: int, seeds: int, workdir: Path,
             backend: Backend, records_dir: Path | None = None, turn: int = 0,
             verbose: bool = False) -> dict[str, Reps]:
    """`seeds` repetitions of every system, repetition by repetition: each repetition runs every system once,
    in `system_order(systems, turn + k)`, so each repetition compares the systems within a few minutes.
    Repetition k builds the workload of `set_workload_rep(k)` (other arrivals of the same shape) and seeds the
    simulators and clients with seed + k. Returns, per system, every run with its info (a run whose metrics
    failed: its info's error) and the metrics of those that produced them. `records_dir`: each run's attempts
    go to `{scenario}-{system}-seed{seed}.jsonl` there (`write_records`)."""
    out: dict[str, Reps] = {system: ([], []) for system in systems}
    try:
        for k in range(max(1, seeds)):
            set_workload_rep(k)
            for system in system_order(systems, turn + k):
                done, metrics = out[system]
                if verbose:
                    print(f"[{sc.id}] {system}{f' (seed {seed + k})' if seeds > 1 else ''} ...", flush=True)
                if sc.systems:
                    run, info = sc.run_system(system, quick, seed + k, workdir, backend)
                else:
                    run, info = run_one(sc, system, quick, seed + k, workdir, backend)
                done.append((run, info))
                if run is None:
                    continue
                if records_dir is not None:
                    write_records(run, records_dir / f"{sc.id}-{system}-seed{seed + k}.jsonl")
                try:
                    metrics.append({**sc.slo(run), **sc.metrics(run), **gateway_cpu(run), **engine_probe(run),
                                    "diagnostics": diagnostics(run)})
                except Exception as exc:  # noqa: BLE001 - the other repetitions still count
                    traceback.print_exc()
                    info["error"] = f"metrics failed: {exc}"
    finally:
        set_workload_rep(0)
    return out


def run_scenarios(names: list[str | Scenario], systems: list[str], quick: bool, seed: int = 1,
                  plots: bool = True, results_dir: Path = RESULTS, keep_runs: bool = False,
                  verbose: bool = True, command: str = "", backend: Backend | None = None,
                  replicas: int | None = None, json_path: Path | None = None, seeds: int = 1,
                  records_dir: Path | None = None) -> dict[str, Any]:
    """Every scenario x system, each `seeds` times (`run_reps`; metrics the median over them, `combine_reps`). `replicas` runs each scenario on a pool of that size (rates that follow the pool
    scale with it); a real backend's pool is its engines (`backend.pool_size`). `json_path` is rewritten after
    every scenario, so a run cut short keeps the scenarios it finished."""
    from bench import report

    backend = backend or SimBackend()
    scenarios = [n for n in names if isinstance(n, Scenario)]
    scenarios += get_scenarios([n for n in names if isinstance(n, str)]) if any(isinstance(n, str) for n in names) \
        else []
    pool = replicas or backend.pool_size
    if pool:
        scenarios = [sc if sc.replicas == pool else sc.with_replicas(pool) for sc in scenarios]
    need_nofile = max([s.nofile for s in scenarios] + [4096])
    raise_nofile(need_nofile)
    out: dict[str, Any] = {}
    meta: dict[str, Any] = {"command": command or f"run_scenarios({names}, quick={quick})",
                            "commit": report.git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                            "runs": {}, "reproduced": {}, "why": {}, "quick": quick, "seed": seed, "seeds": seeds,
                            "systems": systems, "time_scale": {}, "errors": {}, "sluice_policy": {},
                            "baselines": {}, "reproduced_by": {}, "backend": backend.name, "skipped": {},
                            "replicas": {sc.id: sc.replicas for sc in scenarios},
                            "preset": preset_meta(), "sim_speed": getattr(backend, "speed", None)}
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    t_all = time.monotonic()
    turn = 0  # the place of the first system in the next scenario's order (`system_order`)
    try:
        for sc in scenarios:
            if not backend.supports(sc):
                meta["skipped"][sc.id] = f"does not fit the {backend.name} backend"
                print(f"[{sc.id}] skipped: does not fit the {backend.name} backend", flush=True)
                continue
            out[sc.id] = {}
            runs: dict[str, RunData] = {}
            meta["time_scale"][sc.id] = sc.time_scale
            scenario_systems = list(sc.systems or systems)
            by_system = run_reps(sc, scenario_systems, quick, seed, seeds, workdir, backend, records_dir, turn,
                                 verbose)
            turn += 1
            for system in scenario_systems:
                done, reps = by_system[system]
                run, info = next(((r, i) for r, i in reversed(done) if r is not None), done[-1])
                if seeds > 1:
                    info = {**info, "wall_s": round(sum(i.get("wall_s") or 0 for _r, i in done), 1),
                            "reps_ok": len(reps)}
                meta["runs"].setdefault(sc.id, {})[system] = info
                if not reps:
                    out[sc.id][system] = {m.key: None for m in sc.metrics_doc}
                    meta["errors"].setdefault(sc.id, {})[system] = info.get("error")
                    print(f"[{sc.id}] {system}: ERROR {info.get('error')}", flush=True)
                    if run is not None:
                        runs[system] = run
                    continue
                metrics = combine_reps(reps)
                out[sc.id][system] = metrics
                if run is not None:
                    runs[system] = run
                if verbose:
                    short = ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items() if not isinstance(v, (dict, list)))
                    print(f"[{sc.id}] {system}: {short}  ({info.get('wall_s')} s wall)", flush=True)
                    if metrics.get("reps"):
                        keys = [k for k in dict.fromkeys(("slo_goodput_rps", *sc.headline)) if k in metrics["spread"]]
                        print(f"[{sc.id}] {system}: per repetition: " + "; ".join(
                            f"{k} {[m.get(k) for m in metrics['per_rep']]}" for k in keys), flush=True)
            if "sluice" in out[sc.id] and out[sc.id]["sluice"]:
                ratio, cls = worst_class_ratio(out[sc.id], sc.refused_classes)
                out[sc.id]["sluice"]["worst_class_ratio"] = ratio
                out[sc.id]["sluice"]["worst_class"] = cls
            meta["sluice_policy"][sc.id] = sluice_additions(sc)
            if "envoy-tuned" in systems:
                meta["baselines"][sc.id] = {"envoy-tuned": dataclasses.asdict(baseline_options(sc))}
            if plots and runs:
                try:
                    from bench import plots as plotmod

                    plotmod.plot_scenario(sc, runs, results_dir / f"{sc.id}.png")
                except Exception as exc:  # noqa: BLE001 - a plot must not lose the numbers
                    print(f"[{sc.id}] plot failed: {exc}", file=sys.stderr)
            meta["reproduced_by"][sc.id] = {s: list(sc.reproduced(m)) for s, m in out[sc.id].items()
                                            if s in runs and m}
            judge = sc.reproduced_on
            rr = out[sc.id].get(judge)
            if rr is not None and runs.get(judge) is not None:
                ok, why = sc.reproduced(rr)
            else:
                ok, why = None, f"{judge} not run"
            meta["reproduced"][sc.id] = ok
            meta["why"][sc.id] = why
            print(f"{sc.id} reproduced on {judge}: {'yes' if ok else ('not run' if ok is None else 'no')}"
                  f" ({why})", flush=True)
            report.write_scenario(sc, out[sc.id], meta, results_dir)
            if json_path is not None:
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(json.dumps({**out, "_meta": meta}, indent=2))
    finally:
        backend.close()
        if not keep_runs:
            shutil.rmtree(workdir, ignore_errors=True)
    meta["wall_s"] = round(time.monotonic() - t_all, 1)
    out["_meta"] = meta
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """SIGTERM ends the run as an exception would: the `finally` blocks stop every stack, simulator and engine this
    run started (each in its own session, so a killed runner would leave them running). A second SIGTERM during
    that cleanup is ignored; SIGKILL is always there."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", help="P1..P13 or all (case-insensitive)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ",".join(SYSTEMS))
    parser.add_argument("--quick", action="store_true", help="shorter workloads (about 20 s per system-run)")
    parser.add_argument("--json", help="write {scenario: {system: {metric: value}}} here")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1,
                        help="run each system N times, repetition k with another workload of the same shape "
                             "(scenarios' workload_rng) and seed + k; metrics are the medians, with [min, max]")
    parser.add_argument("--results-dir", default=str(RESULTS), help="per-scenario tables and plots")
    parser.add_argument("--summary", default=None,
                        help=f"markdown summary of every table (default: {SUMMARY} when every scenario and system "
                             "runs, so a partial run never overwrites the published summary; '' = none)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--keep-runs", action="store_true", help="keep run dirs (logs, rendered configs)")
    parser.add_argument("--records", default=None, metavar="DIR",
                        help="write every client attempt of each run to DIR/SCENARIO-SYSTEM-seedN.jsonl")
    parser.add_argument("--backend", default="sim", choices=("sim", "vllm-cpu"),
                        help="the replicas: simulators (default) or two real vLLM-CPU engines, one per core")
    parser.add_argument("--replicas", type=int, default=None,
                        help="run every scenario on a pool of this many replicas (default: the scenario's own; "
                             "vllm-cpu: its two engines)")
    parser.add_argument("--vllm", default=None, help="the vllm-cpu venv (default: bench/vllm_cpu.py's VENV)")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        parser.error(f"unknown system(s) {', '.join(bad)}; known: {', '.join(SYSTEMS)}")
    try:
        names = [s.id for s in get_scenarios(args.scenarios)]
    except KeyError as exc:
        parser.error(str(exc))
    from bench import report

    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        backend = make_backend(args.backend, Path(tempfile.mkdtemp(prefix="sluice-vllm-logs-")), args.vllm)
        result = run_scenarios(names, systems, args.quick, args.seed, plots=not args.no_plots,
                               results_dir=results_dir, keep_runs=args.keep_runs,
                               command="sluice bench run " + " ".join(argv), backend=backend,
                               replicas=args.replicas, json_path=Path(args.json) if args.json else None,
                               seeds=args.seeds, records_dir=Path(args.records) if args.records else None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    meta = result["_meta"]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=False))
    summary = args.summary
    if summary is None:
        complete = (set(names) == {s.id for s in get_scenarios(["all"])} and set(systems) == set(SYSTEMS)
                    and args.backend == "sim" and args.replicas is None and args.seeds == 1)
        summary = str(SUMMARY) if complete else ""
    if summary:
        report.write_summary(result, Path(summary), results_dir)
        for page in PUBLISHED_PAGES:  # a complete run is the published one: its headline table goes there too
            report.update_results_block(result, page)
    print("\nreproduced on envoy-rr: " + ", ".join(
        f"{k}={'yes' if v else ('not run' if v is None else 'no')}" for k, v in meta["reproduced"].items()))
    print(f"total wall time: {meta['wall_s']} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))


__all__ = ["main", "run_scenarios", "run_one", "parse_prom", "parse_prom_labels", "SYSTEMS", "SCENARIOS"]
