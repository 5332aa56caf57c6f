"""`python -m bench.soak [--minutes 10] [--json FILE]`: a bounded soak of one gateway stack (issue #10).

Mixed load for a fixed time against Envoy + sidecar + 3 simulated replicas (one of them answering a share of its
requests with 500, the `error-rate` fault): short and long prompts, streams and non-streams, clients that hang up
mid-stream, clients with deadlines the gateway cannot or can just meet. Every `--sample-s` seconds the sidecar's and
Envoy's RSS (bench/procstat.py) and the sidecar's own gauges are sampled.

Verdict (printed, in the JSON, and the exit code):
  memory     RSS growth after warm-up <= --max-growth (default 5%) for the sidecar and for Envoy: the mean of the
             last three samples against the mean of the first three after warm-up
  settled    after the load stops: sidecar in-flight requests / tokens, queue depth, open ext_proc streams and every
             replica's running + waiting requests are back to 0
  counters   sluice_admitted_total == the sum of sluice_requests_total over its outcomes (completed, cancelled,
             failed, timeout); requests the sidecar answered itself are in sluice_rejections_total
             (sluice_shed_total for the admission share of them), not in either side
The load is closed-loop (`--concurrency` clients); each request is bounded by a client timeout, the run by its
duration. Processes are started and stopped by PID through extproc.supervisor.Stack.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.procstat import rss_bytes
from bench.report import git_commit
from extproc.config import policy_from_dict
from extproc.supervisor import Stack, with_free_ports

MODEL = "sim-model"
OUTCOMES = ("completed", "cancelled", "failed", "timeout")
WORDS = ("alpha", "beta", "gamma", "delta", "queue", "token", "replica", "gateway", "stream", "budget")


def policy(time_scale: float, seed: int) -> dict[str, Any]:
    return {
        "pools": [{"model": MODEL, "replicas": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}],
        "simulator": {"enabled": True, "preset": "tiny-cpu", "time_scale": time_scale, "seed": seed},
        "gateway": {"envoy_log_level": "error"},
        "limits": {"max_body_bytes": 1048576},
        "tenants": {"max_streams_per_tenant": 0},
    }


# ---- metrics ------------------------------------------------------------------------------------------------
def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return sum(v for (n, lbls), v in samples.items()
               if n == name and all(dict(lbls).get(k) == val for k, val in labels.items()))


def residue(stack: Stack) -> dict[str, float]:
    """What is still counted anywhere (all zero once everything admitted has been released)."""
    s = scrape(stack.metrics_url)
    out = {name: total(s, name) for name in ("sluice_inflight_requests", "sluice_inflight_tokens",
                                             "sluice_queue_depth", "sluice_open_streams",
                                             "sluice_lane_inflight_requests")}
    for addr in stack.policy.default_pool.replicas:
        r = scrape(f"http://{addr}/metrics")
        out[f"running@{addr}"] = total(r, "vllm:num_requests_running")
        out[f"waiting@{addr}"] = total(r, "vllm:num_requests_waiting")
    return out


# ---- load -----------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    sent: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    client_cancelled: int = 0
    client_errors: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, table: dict[str, int]) -> None:
        table[key] = table.get(key, 0) + 1


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_request(rng: random.Random) -> tuple[str, dict[str, Any], dict[str, str], int | None]:
    """(kind, body, headers, read this many SSE events then hang up | None)."""
    tenant = f"tenant-{rng.randrange(6)}"
    headers = {"x-sluice-tenant": tenant, "x-sluice-app": f"app-{rng.randrange(4)}"}
    roll = rng.random()
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "system", "content": "You are terse."},
                                                         {"role": "user", "content": _prompt(rng, 20)}]}
    cancel_after = None
    if roll < 0.35:
        kind = "short"
        body["max_tokens"] = rng.randint(8, 64)
    elif roll < 0.65:
        kind = "stream"
        body.update(stream=True, max_tokens=rng.randint(32, 256), stream_options={"include_usage": True})
    elif roll < 0.75:
        kind = "long_prompt"
        body["messages"][1]["content"] = _prompt(rng, rng.randint(2500, 5000))
        body["max_tokens"] = rng.randint(8, 48)
    elif roll < 0.90:
        kind = "cancel"
        body.update(stream=True, max_tokens=rng.randint(200, 600))
        cancel_after = rng.randint(1, 40)
    elif roll < 0.95:
        kind = "deadline_tight"  # may time out at the replica, or be refused as unmeetable
        body.update(stream=rng.random() < 0.5, max_tokens=rng.randint(100, 400))
        headers["x-sluice-deadline-ms"] = str(rng.randint(150, 900))
    else:
        kind = "deadline_ok"
        body["max_tokens"] = rng.randint(8, 32)
        headers["x-stainless-read-timeout"] = "60"
    return kind, body, headers, cancel_after


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally) -> None:
    kind, body, headers, cancel_after = make_request(rng)
    tally.sent += 1
    tally.add(kind, tally.kinds)
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            tally.add(str(resp.status), tally.statuses)
            if cancel_after is not None and resp.status == 200:
                seen = 0
                async for line in resp.content:
                    seen += line.startswith(b"data:")
                    if seen >= cancel_after:
                        tally.client_cancelled += 1
                        resp.close()  # hang up mid-stream
                        return
            else:
                await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        tally.add(type(exc).__name__, tally.client_errors)


async def load(base_url: str, seconds: float, concurrency: int, seed: int, tally: Tally) -> None:
    url = base_url + "/v1/chat/completions"
    stop_at = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency * 2)) as session:
        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < stop_at:
                await one(session, url, rng, tally)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


# ---- sampling ----------------------------------------------------------------------------------------------
class Sampler(threading.Thread):
    def __init__(self, stack: Stack, every_s: float) -> None:
        super().__init__(daemon=True)
        self.stack, self.every_s = stack, every_s
        self.samples: list[dict[str, float]] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        pids = {"sidecar": self.stack.child("sidecar[0]").proc.pid, "envoy": self.stack.child("envoy").proc.pid}
        while not self.stop.is_set():
            row = {"t_s": round(time.monotonic() - self.t0, 1)}
            for name, pid in pids.items():
                row[f"{name}_rss_mb"] = round(rss_bytes(pid) / 2 ** 20, 2)
            try:
                s = scrape(self.stack.metrics_url)
                row["open_streams"] = total(s, "sluice_open_streams")
                row["inflight"] = total(s, "sluice_inflight_requests")
                row["queued"] = total(s, "sluice_queue_depth")
            except OSError:
                pass
            self.samples.append(row)
            self.stop.wait(self.every_s)


def growth(samples: list[dict[str, float]], key: str, warmup_s: float) -> dict[str, float] | None:
    after = [s[key] for s in samples if s["t_s"] >= warmup_s and key in s]
    if len(after) < 4:
        return None
    n = min(3, len(after) // 2)
    base, end = statistics.mean(after[:n]), statistics.mean(after[-n:])
    return {"after_warmup_mb": round(base, 2), "end_mb": round(end, 2), "max_mb": round(max(after), 2),
            "growth_pct": round(100.0 * (end - base) / base, 2)}


# ---- the run -------------------------------------------------------------------------------------------------
def fault(stack: Stack, addr: str, name: str, value: Any) -> None:
    req = urllib.request.Request(stack.sim_admin_url(addr) + "/sim/fault", method="POST",
                                 data=json.dumps({"fault": name, "value": value}).encode(),
                                 headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()


def write_report(path: Path | None, report: dict[str, Any]) -> None:
    """A bench's `--json FILE`: the whole report, every sample included (nothing when no file was asked for)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


def wait_until(pred: Callable[[], bool], timeout: float, interval_s: float = 0.2) -> bool:
    """Poll `pred` every `interval_s` until it holds or `timeout` seconds have passed; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def batches(total_n: int, size: int) -> list[int]:
    """`total_n` split into batches of at most `size`."""
    return [min(size, total_n - i) for i in range(0, total_n, size)]


def run_soak(seconds: float, *, concurrency: int = 12, sample_s: float = 5.0, warmup_s: float | None = None,
             error_rate: float = 0.1, time_scale: float = 2.0, seed: int = 1, max_growth_pct: float = 5.0,
             run_dir: Path | None = None, log=print) -> dict[str, Any]:
    """Run one soak and return its report (see the module docstring); `passed` says whether every check held."""
    warmup_s = seconds * 0.2 if warmup_s is None else warmup_s
    commit = git_commit()  # the code the stack runs: read before it starts
    tmp = None
    if run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="sluice-soak-")
        run_dir = Path(tmp.name)
    stack = Stack(with_free_ports(policy_from_dict(policy(time_scale, seed))), run_dir=run_dir)
    stack.start()
    try:
        replicas = stack.policy.default_pool.replicas
        fault(stack, replicas[-1], "error-rate", error_rate)
        sampler = Sampler(stack, sample_s)
        tally = Tally()
        log(f"soak: {seconds:.0f}s, {concurrency} clients, error-rate {error_rate} on {replicas[-1]}, "
            f"time scale {time_scale}, sampling every {sample_s}s (warm-up {warmup_s:.0f}s)")
        sampler.start()
        t0 = time.monotonic()
        asyncio.run(load(stack.base_url, seconds, concurrency, seed, tally))
        load_s = time.monotonic() - t0
        fault(stack, replicas[-1], "clear", None)
        settled = wait_until(lambda: not any(residue(stack).values()), 15)
        left = residue(stack)
        time.sleep(max(0.5, sample_s))  # the access log flushes every 100 ms; one more memory sample at rest
        sampler.stop.set()
        sampler.join(10)
        s = scrape(stack.metrics_url)
        admitted = total(s, "sluice_admitted_total")
        outcomes = {o: total(s, "sluice_requests_total", outcome=o) for o in OUTCOMES}
        rejected = {f"{dict(l)['status']} {dict(l)['reason']}": v for (n, l), v in s.items()
                    if n == "sluice_rejections_total" and v}
        shed = total(s, "sluice_shed_total")
        mem = {name: growth(sampler.samples, f"{name}_rss_mb", warmup_s) for name in ("sidecar", "envoy")}
        counters_ok = admitted == sum(outcomes.values())
        memory_ok = all(m is not None and m["growth_pct"] <= max_growth_pct for m in mem.values())
        report = {
            "commit": commit,
            "command": " ".join([Path(sys.executable).name, "-m", "bench.soak", *sys.argv[1:]])
            if Path(sys.argv[0]).stem == "soak" else None,
            "config": {"seconds": seconds, "concurrency": concurrency, "sample_s": sample_s, "warmup_s": warmup_s,
                       "error_rate": error_rate, "time_scale": time_scale, "seed": seed,
                       "max_growth_pct": max_growth_pct},
            "load_s": round(load_s, 1),
            "client": {"sent": tally.sent, "requests_per_s": round(tally.sent / load_s, 1), "kinds": tally.kinds,
                       "statuses": tally.statuses, "hung_up_mid_stream": tally.client_cancelled,
                       "errors": tally.client_errors},
            "sidecar": {"admitted": admitted, "outcomes": outcomes, "outcomes_sum": sum(outcomes.values()),
                        "rejections": rejected, "rejected_total": sum(rejected.values()), "shed_total": shed},
            "memory": mem,
            "residue": left,
            "checks": {"memory": memory_ok, "settled": settled, "counters": counters_ok},
            "samples": sampler.samples,
        }
        report["passed"] = all(report["checks"].values())
        return report
    finally:
        stack.stop()
        if tmp is not None:
            tmp.cleanup()


def summary(report: dict[str, Any]) -> str:
    c, sc, mem = report["client"], report["sidecar"], report["memory"]
    lines = [f"soak ({report['commit']}): {report['load_s']}s of load, {c['sent']} requests "
             f"({c['requests_per_s']}/s), statuses {c['statuses']}, hung up mid-stream {c['hung_up_mid_stream']}, "
             f"client errors {c['errors']}",
             f"  sidecar: admitted {sc['admitted']:.0f} = outcomes {sc['outcomes_sum']:.0f} {sc['outcomes']}; "
             f"answered by the sidecar {sc['rejected_total']:.0f} {sc['rejections']} (shed {sc['shed_total']:.0f})"]
    for name, m in mem.items():
        lines.append(f"  {name} RSS: {m['after_warmup_mb']} MB after warm-up -> {m['end_mb']} MB at the end "
                     f"({m['growth_pct']:+.2f}%), max {m['max_mb']} MB" if m else f"  {name} RSS: too few samples")
    lines.append(f"  residue after the load: {report['residue']}")
    lines.append("  checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in report["checks"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--warmup-s", type=float, default=None, help="default: 20%% of the run")
    p.add_argument("--error-rate", type=float, default=0.1, help="share of 500s from one replica")
    p.add_argument("--time-scale", type=float, default=2.0, help="simulated engine speed-up")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-growth", type=float, default=5.0, help="allowed RSS growth after warm-up, percent")
    p.add_argument("--json", type=Path, default=None, help="write the full report (with every sample) here")
    args = p.parse_args(argv)
    if not 0 < args.minutes <= 240:
        p.error("--minutes must be in (0, 240]")
    report = run_soak(args.minutes * 60, concurrency=args.concurrency, sample_s=args.sample_s,
                      warmup_s=args.warmup_s, error_rate=args.error_rate, time_scale=args.time_scale,
                      seed=args.seed, max_growth_pct=args.max_growth)
    print(summary(report))
    write_report(args.json, report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
