"""`sluice bench overhead`: what the gateway adds per request, side by side in one run.

Three paths to the same simulated replica (run fast, so the replica's own time is small and steady):
  direct      client -> replica
  envoy-only  client -> Envoy (round robin, no ext_proc) -> replica
  sluice      client -> Envoy -> ext_proc sidecar decides -> replica
At concurrency 1 it reports p50/p99 latency (added = path minus direct); at concurrency 32 requests/s; and the
sidecar's CPU per request from /proc over the concurrency-32 run. The machine is shared and noisy, so the paths
are interleaved in one run and the headline numbers are differences and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.loadgen import chat_body, closed_loop, percentile
from bench.procstat import cpu_seconds
from bench.report import git_commit
from extproc.config import policy_from_dict
from extproc.supervisor import Child, Stack, free_ports, http_ok, with_free_ports

MODEL = "sim-model"


def _start_replica(tmp: Path, port: int, admin_port: int) -> Child:
    argv = [sys.executable, "-m", "extproc.sim", "--port", str(port), "--admin-port", str(admin_port),
            "--model", MODEL, "--preset", "tiny-cpu", "--time-scale", "50"]
    child = Child("replica", argv, tmp / "replica.log", f"http://127.0.0.1:{port}/health")
    child.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not http_ok(child.ready_url):
        time.sleep(0.05)
    if not http_ok(child.ready_url):
        child.stop()
        raise RuntimeError("replica did not start:\n" + child.log_tail())
    return child


def _stack(tmp: Path, replica: str, mode: str, workers: int = 0) -> Stack:
    policy = with_free_ports(policy_from_dict({
        "pools": [{"model": MODEL, "replicas": [replica]}],
        "simulator": {"enabled": False},
        "sidecar": {"workers": workers},
    }))
    policy.pools[0].replicas = [replica]  # with_free_ports reassigns replica ports: keep the shared one
    return Stack(policy, run_dir=tmp / mode, mode=mode)


def _pid(child: Child) -> int:
    assert child.proc is not None
    return child.proc.pid


def _row(name: str, c1, c32) -> dict:
    return {"path": name, "p50_ms_c1": percentile(c1.latencies_s, 50) * 1000,
            "p99_ms_c1": percentile(c1.latencies_s, 99) * 1000, "rps_c32": c32.rps,
            "errors": c1.errors + c32.errors}


def _cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


async def _measure(urls: dict[str, str], n_c1: int, n_c32: int, sidecar_pids: list[int],
                   envoy_pid: int) -> tuple[dict, float, float]:
    body = chat_body(MODEL, max_tokens=1)
    c1 = {name: [] for name in urls}
    # Interleave the paths in rounds so drift on a shared machine hits them alike.
    rounds = 5
    for _ in range(rounds):
        for name, url in urls.items():
            c1[name].append(await closed_loop(url, body, 1, n_c1 // rounds, warmup=5))
    c32, sidecar_cpu, envoy_cpu = {}, 0.0, 0.0
    for name, url in urls.items():
        before, envoy_before = _cpu(sidecar_pids), cpu_seconds(envoy_pid)
        c32[name] = await closed_loop(url, body, 32, n_c32, warmup=50)
        if name == "sluice":
            count = max(1, c32[name].count)
            sidecar_cpu = (_cpu(sidecar_pids) - before) / count
            envoy_cpu = (cpu_seconds(envoy_pid) - envoy_before) / count
    merged = {}
    for name in urls:
        res = c1[name][0]
        for extra in c1[name][1:]:
            res.latencies_s += extra.latencies_s
            res.errors += extra.errors
        merged[name] = _row(name, res, c32[name])
    return merged, sidecar_cpu, envoy_cpu


def run(n_c1: int, n_c32: int, workers: int = 0) -> dict:
    with tempfile.TemporaryDirectory(prefix="sluice-overhead-") as tmp_s:
        tmp = Path(tmp_s)
        port, admin = free_ports(2)
        replica_addr = f"127.0.0.1:{port}"
        replica = _start_replica(tmp, port, admin)
        stacks = {mode: _stack(tmp, replica_addr, mode, workers) for mode in ("envoy-rr", "sluice")}
        try:
            for s in stacks.values():
                s.start()
            sluice = stacks["sluice"]
            workers = sluice.policy.sidecar.workers
            sidecar_pids = [_pid(sluice.child(f"sidecar[{w}]")) for w in range(workers)]
            urls = {"direct": f"http://{replica_addr}/v1/chat/completions",
                    "envoy-only": stacks["envoy-rr"].base_url + "/v1/chat/completions",
                    "sluice": stacks["sluice"].base_url + "/v1/chat/completions"}
            rows, cpu, envoy_cpu = asyncio.run(_measure(urls, n_c1, n_c32, sidecar_pids,
                                                        _pid(sluice.child("envoy"))))
        finally:
            for s in stacks.values():
                s.stop()
            replica.stop()
    d, e, s = rows["direct"], rows["envoy-only"], rows["sluice"]
    return {
        "added_p50_ms_c1": s["p50_ms_c1"] - d["p50_ms_c1"],
        "added_p99_ms_c1": s["p99_ms_c1"] - d["p99_ms_c1"],
        "envoy_only_added_p50_ms_c1": e["p50_ms_c1"] - d["p50_ms_c1"],
        "envoy_only_added_p99_ms_c1": e["p99_ms_c1"] - d["p99_ms_c1"],
        "ext_proc_added_p50_ms_c1": s["p50_ms_c1"] - e["p50_ms_c1"],
        "rps_c32": s["rps_c32"],
        "envoy_only_rps_c32": e["rps_c32"],
        "direct_rps_c32": d["rps_c32"],
        "rps_c32_vs_envoy_only": s["rps_c32"] / max(1e-9, e["rps_c32"]),
        "sidecar_cpu_ms_per_request": cpu * 1000,
        "envoy_cpu_ms_per_request": envoy_cpu * 1000,
        "sidecar_workers": workers,
        "rows": [d, e, s],
        "requests": {"c1_per_path": n_c1, "c32_per_path": n_c32},
    }


def table(result: dict) -> str:
    lines = ["| path | p50 ms (c=1) | p99 ms (c=1) | req/s (c=32) | errors |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['path']} | {r['p50_ms_c1']:.2f} | {r['p99_ms_c1']:.2f} | {r['rps_c32']:.0f} | "
                     f"{r['errors']} |")
    lines += [
        "",
        "| headline | value | target |",
        "|---|---|---|",
        f"| added p50 at c=1 (sluice - direct) | {result['added_p50_ms_c1']:.2f} ms | <= 1 ms |",
        f"| added p99 at c=1 (sluice - direct) | {result['added_p99_ms_c1']:.2f} ms | |",
        f"| added p50 at c=1 (Envoy alone - direct) | {result['envoy_only_added_p50_ms_c1']:.2f} ms | |",
        f"| ext_proc hop p50 (sluice - Envoy alone) | {result['ext_proc_added_p50_ms_c1']:.2f} ms | |",
        f"| sidecar CPU per request ({result['sidecar_workers']} workers, summed) | "
        f"{result['sidecar_cpu_ms_per_request']:.3f} ms | <= 0.40 ms |",
        f"| Envoy CPU per request (sluice path) | {result['envoy_cpu_ms_per_request']:.3f} ms | |",
        f"| requests/s at c=32: sluice / Envoy alone | {result['rps_c32']:.0f} / {result['envoy_only_rps_c32']:.0f}"
        f" = {result['rps_c32_vs_envoy_only']:.2f} | >= 0.35 |",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--requests-c1", type=int, default=500, help="requests per path at concurrency 1")
    parser.add_argument("--requests-c32", type=int, default=3000, help="requests per path at concurrency 32")
    parser.add_argument("--workers", type=int, default=0,
                        help="sidecar workers (default 0: the policy's default for this machine)")
    parser.add_argument("--markdown", default="bench/results/overhead.md", help="write the table here")
    args = parser.parse_args(argv)
    result = run(args.requests_c1, args.requests_c32, args.workers)
    result["commit"] = git_commit()
    result["command"] = "sluice bench overhead " + " ".join(argv)
    text = table(result)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(f"<!-- {result['command']} at commit {result['commit']} -->\n{text}\n")
    return 0
