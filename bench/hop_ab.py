"""`python -m bench.hop_ab NAME=SPEC ...`: sidecar variants side by side in one session, for the overhead work.

Starts one simulated replica, Envoy alone in front of it (`envoy-only`) and one sluice stack per variant (each its
own Envoy and sidecar), then measures them and the replica itself (`direct`) in interleaved rounds, as `sluice
bench overhead` does: per round, each path's c=1 p50, then each path's c=32 requests/s with the sidecar's and
Envoy's CPU per request (from /proc; the c=32 order alternates between rounds). It prints each path's medians over
the rounds and every round's value; `added_p50_ms` is a path's c=1 p50 minus direct's in the same round, the
quantity of `sluice bench overhead`'s `added_p50_ms_c1`.
The machine is shared and drifts by about 20 %: compare variants within one run, never across runs.

SPEC is `CODE_DIR[:MODULE][+PATCH][@WORKERS][%VAR=VALUE,...]`:
  CODE_DIR  the directory the sidecar runs from (e.g. a `git archive` of another commit; empty: this one)
  MODULE    run this module instead of `extproc.cli` (e.g. `bench.noop_sidecar`, grpc.aio's floor)
  PATCH     an Envoy rendering change for this variant only: `noretry` (no retry policy on the ext_proc stream)
  WORKERS   sidecar.workers (default: the policy's default for this machine)
  VAR=VALUE environment variables for this variant's sidecar only (e.g. `%GRPC_EXPERIMENTS=...`)
Example: `python -m bench.hop_ab base=/tmp/base noop=:bench.noop_sidecar new=` (run it under the CPU lock).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import extproc.xds as xds
from bench import overhead as O
from bench.loadgen import chat_body, closed_loop, percentile
from bench.procstat import cpu_seconds
from extproc.supervisor import Stack, free_ports

PATCHES: dict[str, tuple[str, object]] = {"noretry": ("_ext_proc_retry", lambda: None)}


@dataclass
class Variant:
    name: str
    code_dir: str
    module: str
    patch: str
    workers: int
    env: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """NAME=CODE_DIR[:MODULE][+PATCH][@WORKERS][%VAR=VALUE,...]"""
        name, spec = text.split("=", 1)
        spec, _, env_text = spec.partition("%")
        env = dict(item.split("=", 1) for item in env_text.split(",") if item)
        spec, _, workers = spec.partition("@")
        spec, _, patch = spec.partition("+")
        code_dir, _, module = spec.partition(":")
        return cls(name, code_dir, module, patch, int(workers or 0), env)

    def wrapper(self) -> Callable[[list[str]], list[str]]:
        """The sidecar's command line: another module, from another directory."""
        def wrap(argv: list[str]) -> list[str]:
            if self.module:
                argv = [self.module if a == "extproc.cli" else a for a in argv]
            if self.code_dir:
                argv = ["sh", "-c", f'cd "{self.code_dir}" && exec "$@"', "sh", *argv]
            if self.env:
                argv = ["env", *(f"{k}={v}" for k, v in self.env.items()), *argv]
            return argv
        return wrap


def start_variant(tmp: Path, replica: str, v: Variant) -> Stack:
    """A sluice stack running the variant's sidecar, its Envoy rendered with the variant's patch (if any)."""
    stack = O._stack(tmp / v.name, replica, "sluice", v.workers)
    stack.sidecar_wrapper = v.wrapper()
    saved: dict[str, object] = {}
    if v.patch:
        attr, value = PATCHES[v.patch]
        saved[attr] = getattr(xds, attr)
        setattr(xds, attr, value)
    try:
        stack.start()
    finally:
        for attr, value in saved.items():
            setattr(xds, attr, value)
    return stack


async def measure(urls: dict[str, str], sidecars: dict[str, list[int]], envoys: dict[str, int], rounds: int,
                  n_c1: int, n_c32: int) -> dict[str, dict[str, list[float]]]:
    """Per path and round: c=1 p50 (ms), c=32 req/s, sidecar and Envoy CPU per request (ms) over the c=32 run."""
    body = chat_body(O.MODEL, max_tokens=1)
    out = {n: {"p50_ms": [], "added_p50_ms": [], "rps": [], "sidecar_cpu_ms": [], "envoy_cpu_ms": []} for n in urls}
    for r in range(rounds):
        for name, url in urls.items():
            res = await closed_loop(url, body, 1, n_c1, warmup=5)
            out[name]["p50_ms"].append(percentile(res.latencies_s, 50) * 1000)
        for name in urls:
            out[name]["added_p50_ms"].append(out[name]["p50_ms"][-1] - out["direct"]["p50_ms"][-1])
        order = list(urls) if r % 2 == 0 else list(urls)[::-1]
        for name in order:
            pids = sidecars.get(name, [])
            envoy = envoys.get(name)
            before = sum(cpu_seconds(p) for p in pids), cpu_seconds(envoy) if envoy else 0.0
            res = await closed_loop(urls[name], body, 32, n_c32, warmup=50)
            count = max(1, res.count)
            out[name]["rps"].append(res.rps)
            out[name]["sidecar_cpu_ms"].append((sum(cpu_seconds(p) for p in pids) - before[0]) / count * 1000)
            out[name]["envoy_cpu_ms"].append(((cpu_seconds(envoy) - before[1]) if envoy else 0.0) / count * 1000)
            if res.errors:
                print(f"{name}: {res.errors} errors {res.statuses}", file=sys.stderr)
    return out


def run(variants: list[Variant], rounds: int, n_c1: int, n_c32: int) -> dict[str, dict[str, list[float]]]:
    with tempfile.TemporaryDirectory(prefix="sluice-hop-ab-") as tmp_s:
        tmp = Path(tmp_s)
        port, admin = free_ports(2)
        replica_addr = f"127.0.0.1:{port}"
        replica = O._start_replica(tmp, port, admin)
        stacks: dict[str, Stack] = {}
        try:
            stacks["envoy-only"] = O._stack(tmp, replica_addr, "envoy-rr")
            stacks["envoy-only"].start()
            for v in variants:
                stacks[v.name] = start_variant(tmp, replica_addr, v)
            urls = {"direct": f"http://{replica_addr}/v1/chat/completions"}
            urls.update({n: s.base_url + "/v1/chat/completions" for n, s in stacks.items()})
            sidecars = {n: [O._pid(s.child(f"sidecar[{w}]")) for w in range(s.policy.sidecar.workers)]
                        for n, s in stacks.items() if n != "envoy-only"}
            envoys = {n: O._pid(s.child("envoy")) for n, s in stacks.items()}
            return asyncio.run(measure(urls, sidecars, envoys, rounds, n_c1, n_c32))
        finally:
            for s in stacks.values():
                s.stop()
            replica.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hop_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="NAME=CODE_DIR[:MODULE][+PATCH][@WORKERS][%%VAR=VALUE,...]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-c1", type=int, default=200, help="requests per path and round at c=1")
    parser.add_argument("--requests-c32", type=int, default=2000, help="requests per path and round at c=32")
    parser.add_argument("--json", help="also write the medians and rounds here, with the commit and command line")
    args = parser.parse_args(argv)
    out = run([Variant.parse(v) for v in args.variants], args.rounds, args.requests_c1, args.requests_c32)
    result: dict[str, object] = {}
    for name, series in out.items():
        medians = {k: round(statistics.median(v), 3) for k, v in series.items()}
        rounds = {k: [round(x, 3) for x in v] for k, v in series.items()}
        print(name, json.dumps(medians), json.dumps(rounds))
        result[name] = {"median": medians, "rounds": rounds}
    if args.json:
        Path(args.json).write_text(json.dumps({"paths": result, "commit": O.git_commit(),
                                               "command": "python -m bench.hop_ab " + " ".join(argv or sys.argv[1:])},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
