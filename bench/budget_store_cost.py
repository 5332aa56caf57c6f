"""`python -m bench.budget_store_cost [--admits 5000] [--json FILE]`: what one budget admit costs against a real
redis-server, with and without the retry share, beside the memory store.

Why it exists: since ed11d2d every admit with the retry share on reads the 8 retry-window counters in
lua/admit.lua and returns them, and RedisStore mirrors them into its `seen` MemoryStore (for `retry_refused`);
before, the 8 reads ran for retries only and nothing was mirrored. Issue 15 asks for costs next to wins: this
measures what that costs per admit.

It builds `Budgets` as the sidecar does (extproc/gateway.py) from the shipped default policy
(extproc/default_policy.yaml: retry share on, no task or tenant budgets), each Redis store on its own
redis-server (Debian package `redis-server`; free loopback port, `--save "" --appendonly no`, killed by PID at
the end) with the policy's own timeouts. Then, one request at a time, it admits and settles fresh requests (a new
request id each, not retries) of one tenant and model: a lone call is one EVALSHA round trip, no pipeline. Three
stores, taking turns admit by admit (the order reversed every other turn) so the shared machine's drift hits them
alike:

  redis          RedisStore, retry share on (the default)
  redis-noretry  RedisStore without the retry share: the admit op without its RetryCheck (admit.lua's r_on = 0);
                 the in-flight markers, i.e. the duplicate check, stay (the policy's `retry.enabled: false` would
                 drop them too, and then nothing reaches Redis)
  memory         MemoryStore, the default store, for reference

Per store: the latency of `await Budgets.admit(req)` (mean, p50, p99, in us), admits/s (admits over the time its
admit + settle pairs took), and per admit + settle: this process's CPU, its redis-server's CPU (/proc, 10 ms
ticks), that server's own time in the scripts and the commands they ran (INFO commandstats, reset after the
warm-up). A store that fell back to its local share during the run (Redis slower than the policy's 50 ms
timeout) makes the run fail: its numbers would not be Redis's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench import event_loop
from bench.loadgen import percentile
from bench.procstat import cpu_seconds
from bench.redis_server import RedisProc
from bench.report import git_commit
from extproc.budgets import BudgetExceeded, Budgets
from extproc.budgets.ops import AdmitOp
from extproc.config import EMBEDDED_POLICY, Policy, load_policy
from extproc.request import LLMRequest

STORES = ("redis", "redis-noretry", "memory")
MODEL = "sim-model"  # the default policy's pool


class NoRetryShareBudgets(Budgets):
    """Budgets whose admits carry no retry-share check (admit.lua's r_on = 0); markers are kept."""

    def _admit_op(self, req: LLMRequest, now: float) -> AdmitOp | None:
        op = super()._admit_op(req, now)
        if op is not None:
            op.retry = None
        return op


def _cpu_s(server: RedisProc) -> float:
    assert server.proc is not None
    return cpu_seconds(server.proc.pid)


def redis_version() -> str:
    out = subprocess.run([shutil.which("redis-server") or "redis-server", "--version"], capture_output=True,
                         text=True, check=False).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), out.strip())


@dataclass
class Series:
    """One store's measurements."""

    admit_us: list[float] = field(default_factory=list)
    pair_s: float = 0.0          # wall time of its admit + settle pairs
    cpu_s: float = 0.0           # this process's CPU over them
    redis_cpu_s: float = 0.0     # its redis-server's CPU over the measured part of the run
    script_us: float = 0.0       # that server's own time in the scripts (INFO commandstats: evalsha usec)
    commands: dict[str, int] = field(default_factory=dict)  # commands it ran (the scripts' own included)
    refused: int = 0

    def summary(self) -> dict[str, Any]:
        n = len(self.admit_us)
        return {"admits": n, "refused": self.refused,
                "mean_us": round(statistics.fmean(self.admit_us), 1),
                "p50_us": round(percentile(self.admit_us, 50), 1),
                "p99_us": round(percentile(self.admit_us, 99), 1),
                "admits_per_s": round(n / self.pair_s, 1),
                "cpu_us_per_admit_settle": round(1e6 * self.cpu_s / n, 1),
                "redis_cpu_us_per_admit_settle": round(1e6 * self.redis_cpu_s / n, 1),
                "script_us_per_admit_settle": round(self.script_us / n, 1),
                "redis_commands_per_admit_settle": {c: round(k / n, 2) for c, k in sorted(self.commands.items())}}


def budgets_for(policy: Policy, store: str, url: str | None, run: str) -> Budgets:
    """The sidecar's Budgets (extproc/gateway.py's make_budgets) on the given store (`url`: its Redis)."""
    b = policy.budgets
    if url is not None:
        redis = dataclasses.replace(b.store.redis, url=url, key_prefix=f"bench-{run}-{store}:")
        b = dataclasses.replace(b, store=dataclasses.replace(b.store, kind="redis", redis=redis))
    cls = NoRetryShareBudgets if store == "redis-noretry" else Budgets
    return cls(b, sidecar_count_hint=policy.sidecar.workers)


class Requests:
    """Fresh requests of one tenant and model: a new request id (one in-flight marker) each."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.n = 0

    def next(self) -> LLMRequest:
        self.n += 1
        return LLMRequest(request_id=f"{self.name}-{self.n}", endpoint="chat", model=MODEL, stream=False,
                          prompt_tokens=200, max_output_tokens=64, tenant="bench")


async def _pair(budgets: Budgets, req: LLMRequest, out: Series | None) -> None:
    """One admit + settle, measured into `out` unless None (warm-up)."""
    clock = time.perf_counter
    cpu0 = time.process_time()
    t0 = clock()
    try:
        charge = await budgets.admit(req)
    except BudgetExceeded:  # not expected for fresh requests: counted, not timed
        if out is not None:
            out.refused += 1
        return
    t1 = clock()
    await budgets.settle(charge, completed=True, prompt_tokens=200, completion_tokens=64)
    if out is not None:
        out.pair_s += clock() - t0
        out.cpu_s += time.process_time() - cpu0
        out.admit_us.append((t1 - t0) * 1e6)


async def _server_stats(admin: Any, out: Series) -> None:
    """Add the server's command statistics since the last reset to `out`."""
    for name, st in (await admin.info("commandstats")).items():
        cmd = name.removeprefix("cmdstat_")
        if cmd.startswith(("config", "info")):
            continue
        out.commands[cmd] = out.commands.get(cmd, 0) + int(st["calls"])
        if cmd in ("evalsha", "eval"):
            out.script_us += float(st["usec"])


async def measure(admits: int, warmup: int, max_seconds: float,
                  stores: tuple[str, ...] = STORES) -> dict[str, Any]:
    """`warmup` then `admits` turns (fewer if `max_seconds` pass), each one admit + settle on every store."""
    policy = load_policy(EMBEDDED_POLICY)
    run = os.urandom(3).hex()
    servers: dict[str, RedisProc] = {}
    admins: dict[str, Any] = {}
    made: dict[str, Budgets] = {}
    try:
        for s in stores:
            if s != "memory":
                servers[s] = RedisProc()
                servers[s].start()
                admins[s] = aioredis.Redis.from_url(servers[s].url, socket_timeout=10)
            made[s] = budgets_for(policy, s, servers[s].url if s in servers else None, run)
            await made[s].start()
        series = {s: Series() for s in stores}
        reqs = {s: Requests(f"{run}-{s}") for s in stores}
        turns = list(stores), list(reversed(stores))
        for i in range(warmup):
            for s in turns[i % 2]:
                await _pair(made[s], reqs[s].next(), None)
        for admin in admins.values():
            await admin.config_resetstat()
        rcpu0 = {s: _cpu_s(srv) for s, srv in servers.items()}
        until = time.monotonic() + max_seconds
        for i in range(admits):
            for s in turns[i % 2]:
                await _pair(made[s], reqs[s].next(), series[s])
            if time.monotonic() > until:
                break
        for s, srv in servers.items():
            series[s].redis_cpu_s = _cpu_s(srv) - rcpu0[s]
            await _server_stats(admins[s], series[s])
        fallbacks = {s: b.store.stats().get("fallback_count", 0) for s, b in made.items()}
        versions = {redis_version()} if servers else set()
    finally:
        for b in made.values():
            await b.close()
        for admin in admins.values():
            await admin.aclose()
        for srv in servers.values():
            srv.kill()
    return {"stores": {s: series[s].summary() for s in stores}, "fallbacks": fallbacks,
            "redis_server": ", ".join(sorted(versions)), "retry_policy": dataclasses.asdict(policy.budgets.retry)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.budget_store_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--admits", type=int, default=5000, help="measured admits per store (default 5000)")
    ap.add_argument("--warmup", type=int, default=200, help="unmeasured admits per store first (default 200)")
    ap.add_argument("--max-seconds", type=float, default=60.0,
                    help="stop the measured admits after this long (default 60)")
    ap.add_argument("--loop", choices=event_loop.LOOPS, default=None,
                    help="event loop (default: uvloop when installed, like the sidecar)")
    ap.add_argument("--json", metavar="FILE", help="write the numbers there (bench/results/budget-store-cost.json)")
    args = ap.parse_args(argv)
    coro = measure(args.admits, args.warmup, args.max_seconds)
    res, loop_name = event_loop.run(coro, args.loop)
    res = {"commit": git_commit(), "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "command": " ".join(["python -m bench.budget_store_cost", *(sys.argv[1:] if argv is None else argv)]),
           "loop": loop_name, "python": sys.version.split()[0], "admits": args.admits, "warmup": args.warmup, **res}
    print(f"budget store admit cost at {res['commit']} ({loop_name}, redis-server {res['redis_server']}), "
          f"{args.admits} admits per store, the stores taking turns")
    print(f"{'store':<14} {'admits':>6} {'mean us':>8} {'p50 us':>8} {'p99 us':>8} {'admits/s':>9} "
          f"{'cpu us':>7} {'redis us':>8} {'script us':>9}  redis commands")
    for name, s in res["stores"].items():
        cmds = " ".join(f"{c}={k:g}" for c, k in s["redis_commands_per_admit_settle"].items())
        print(f"{name:<14} {s['admits']:>6} {s['mean_us']:>8} {s['p50_us']:>8} {s['p99_us']:>8} "
              f"{s['admits_per_s']:>9} {s['cpu_us_per_admit_settle']:>7} {s['redis_cpu_us_per_admit_settle']:>8} "
              f"{s['script_us_per_admit_settle']:>9}  {cmds}")
    print("per admit + settle: cpu us = this process's CPU, redis us = the store's redis-server's CPU (/proc, 10 ms\n"
          "ticks), script us = that server's time in the two scripts, redis commands = the commands it ran")
    bad = {s: n for s, n in res["fallbacks"].items() if n}
    if bad:
        print(f"FAILED: fell back to the local store during the run: {bad}", file=sys.stderr)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"written {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
