"""`python -m bench.scrape_cost [--replicas 20] [--seconds 10]`: CPU the sidecar spends scraping replicas.

A child process serves N tiny aiohttp replicas on loopback, each with a realistic vLLM 0.32 /metrics page
(rendered by prometheus-client like vLLM does: ~30 families, a dozen histograms with vLLM's bucket layouts,
`_created` series, process/python collectors, HTTP instrumentator series; ~500 lines, ~45 KB) whose values move
every 100 ms. This process runs the real `Scraper` (and a `HealthTracker` on every round, as the sidecar does)
at the given interval for the given seconds and reports the CPU it used, from `time.process_time()`, as a
share of one core. Bar: < 5 % for 20 replicas every 200 ms.

Prints a table and writes bench/results/scrape_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from bench import event_loop

RESULTS = Path(__file__).parent / "results" / "scrape_cost.json"
BAR_PERCENT = 5.0
MODEL = "Qwen/Qwen2.5-1.5B-Instruct"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LAT_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 32768]
ITER_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


# ---- the replica side (child process) ------------------------------------------------------------------------

class FakeVllm:
    """The metric families of one vLLM 0.32 engine, moved by `step()`."""

    def __init__(self, seed: int) -> None:
        from prometheus_client import (CollectorRegistry, Counter, GCCollector, Gauge, Histogram, Info,
                                       PlatformCollector, ProcessCollector)

        self.rng = random.Random(seed)
        reg = self.registry = CollectorRegistry()
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        self.http = Counter("http_requests", "Total number of requests by method, status and handler.",
                            ["handler", "method", "status"], registry=reg)
        self.http_lat = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler.",
                                  ["handler", "method"], registry=reg, buckets=(0.1, 0.5, 1.0))
        self.http_size = Histogram("http_request_size_bytes", "Content length of incoming requests by handler.",
                                   ["handler"], registry=reg)
        L, v = ["model_name", "engine"], [MODEL, "0"]

        def g(n: str, d: str) -> Gauge:
            return Gauge(n, d, L, registry=reg).labels(*v)

        def c(n: str, d: str) -> Counter:
            return Counter(n, d, L, registry=reg).labels(*v)

        def h(n: str, d: str, b: list[float]) -> Histogram:
            return Histogram(n, d, L, registry=reg, buckets=b).labels(*v)

        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.pq = c("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.ph = c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preempt = c("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.gen = c("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               L + ["finished_reason"], registry=reg)
        self.req_hists = [h(n, d, TOKEN_BUCKETS) for n, d in (
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
            ("vllm:request_generation_tokens", "Number of generation tokens processed."),
            ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens."),
            ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."))]
        self.n_hist = h("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.iter_hist = h("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                           ITER_BUCKETS)
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                      TTFT_BUCKETS)
        self.lat_hists = [h(n, d, b) for n, d, b in (
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", ITL_BUCKETS),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LAT_BUCKETS),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LAT_BUCKETS),
            ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
             LAT_BUCKETS),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             LAT_BUCKETS),
            ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
             LAT_BUCKETS))]
        Info("vllm:cache_config", "Information of the LLMEngine CacheConfig", registry=reg).info(
            {"block_size": "16", "cache_dtype": "auto", "calculate_kv_scales": "False", "cpu_offload_gb": "0",
             "enable_prefix_caching": "True", "engine": "0", "gpu_memory_utilization": "0.9",
             "is_attention_free": "False", "num_cpu_blocks": "None", "num_gpu_blocks": "27648",
             "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "builtin", "sliding_window": "None",
             "swap_space": "4", "swap_space_bytes": "4294967296"})
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(*v, reason)
        self.labels = v
        self.page = b""
        self.step()

    def step(self) -> None:
        """100 ms of a busy engine: a few requests finish, tokens flow, values move."""
        r = self.rng
        self.running.set(r.randint(4, 24))
        self.waiting.set(r.randint(0, 6))
        self.kv.set(r.uniform(0.2, 0.9))
        self.pq.inc(r.randint(2000, 8000))
        self.ph.inc(r.randint(500, 2000))
        if r.random() < 0.05:
            self.preempt.inc()
        self.prompt.inc(r.randint(2000, 6000))
        self.gen.inc(r.randint(300, 900))
        self.http.labels("/v1/chat/completions", "POST", "2xx").inc(2)
        self.http.labels("/metrics", "GET", "2xx").inc()
        self.http_lat.labels("/v1/chat/completions", "POST").observe(r.uniform(0.1, 3))
        self.http_size.labels("/v1/chat/completions").observe(r.randint(500, 9000))
        for _ in range(2):
            self.success.labels(*self.labels, "stop" if r.random() < 0.9 else "length").inc()
            for hh in self.req_hists:
                hh.observe(r.randint(10, 4000))
            self.n_hist.observe(1)
            self.ttft.observe(r.lognormvariate(-2.5, 0.8))
            for hh in self.lat_hists:
                hh.observe(r.lognormvariate(-1.0, 1.0))
        for _ in range(5):
            self.iter_hist.observe(r.randint(1, 4096))
        from prometheus_client import generate_latest
        self.page = generate_latest(self.registry)


async def _serve(n: int) -> None:
    from aiohttp import web

    engines = [FakeVllm(i) for i in range(n)]
    addresses = []
    runners = []
    for eng in engines:
        async def metrics(_req: web.Request, eng: FakeVllm = eng) -> web.Response:
            return web.Response(body=eng.page, content_type="text/plain", charset="utf-8")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        addresses.append(f"{host}:{port}")
    lines = engines[0].page.count(b"\n")
    print(json.dumps({"addresses": addresses, "page_bytes": len(engines[0].page), "page_lines": lines}),
          flush=True)
    while True:  # until the parent closes our stdin (or kills us)
        await asyncio.sleep(0.1)
        for eng in engines:
            eng.step()
        if os.getppid() == 1:
            return


def _serve_main(n: int) -> None:
    loop = asyncio.new_event_loop()
    task = loop.create_task(_serve(n))
    loop.add_reader(sys.stdin.fileno(), lambda: task.cancel() if not sys.stdin.readline() else None)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass


# ---- the scraping side (this process) ------------------------------------------------------------------------

async def _measure(addresses: list[str], seconds: float, interval: float) -> dict:
    from extproc.config import PoolConfig
    from extproc.routing.health import HealthTracker
    from extproc.routing.policy import RoutingPolicy
    from extproc.routing.pool import Pool
    from extproc.routing.scrape import Scraper

    pool = Pool.from_config(PoolConfig(model="bench", replicas=addresses))
    policy = RoutingPolicy(scrape_interval_s=interval)
    scraper = Scraper([pool], policy)
    tracker = HealthTracker(pool, policy.health)
    scraper.listeners.append(tracker.on_scrape_round)
    ok = await scraper.scrape_once()  # warm up: connections open, parsers built
    if ok != len(addresses):
        raise SystemExit(f"warm-up scraped {ok}/{len(addresses)} replicas")
    ok0, failed0, rounds0 = scraper.scrapes_ok, scraper.scrapes_failed, scraper.rounds
    cpu0, wall0 = time.process_time(), time.monotonic()
    await scraper.start()
    await asyncio.sleep(seconds)
    await scraper.stop()
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    scrapes = scraper.scrapes_ok - ok0
    now = time.monotonic()
    stale_max = max(now - r.engine.scraped_at for r in pool.replicas)
    return {
        "replicas": len(addresses),
        "interval_s": interval,
        "seconds": round(wall, 3),
        "rounds": scraper.rounds - rounds0,
        "scrapes_ok": scrapes,
        "scrapes_failed": scraper.scrapes_failed - failed0,
        "cpu_s": round(cpu, 4),
        "cpu_percent_of_one_core": round(100.0 * cpu / wall, 3),
        "cpu_us_per_scrape": round(1e6 * cpu / max(scrapes, 1), 1),
        "max_metrics_age_s_at_end": round(stale_max, 3),
        "states": sorted({r.state for r in pool.replicas}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scrape_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=0.2, help="scrape interval, seconds (default 0.2)")
    ap.add_argument("--loop", choices=event_loop.LOOPS, default=None,
                    help="event loop of the scraping process (default: uvloop when installed, like the sidecar)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        _serve_main(args.replicas)
        return 0

    child = subprocess.Popen([sys.executable, "-m", "bench.scrape_cost", "--serve", "--replicas",
                              str(args.replicas)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=str(Path(__file__).resolve().parent.parent))
    try:
        line = child.stdout.readline() if child.stdout else ""
        if not line:
            raise SystemExit("the replica process did not start")
        info = json.loads(line)
        coro = _measure(info["addresses"], args.seconds, args.interval)
        res, loop_name = event_loop.run(coro, args.loop)
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    res.update({"loop": loop_name, "page_bytes": info["page_bytes"], "page_lines": info["page_lines"],
                "bar_percent": BAR_PERCENT, "pass": res["cpu_percent_of_one_core"] < BAR_PERCENT,
                "python": sys.version.split()[0]})
    rows = [("replicas", res["replicas"]), ("interval", f"{res['interval_s']} s"),
            ("duration", f"{res['seconds']} s"), ("event loop", res["loop"]),
            ("page", f"{res['page_lines']} lines, {res['page_bytes']} bytes"),
            ("rounds", res["rounds"]), ("scrapes ok / failed", f"{res['scrapes_ok']} / {res['scrapes_failed']}"),
            ("CPU", f"{res['cpu_s']} s"),
            ("CPU per scrape", f"{res['cpu_us_per_scrape']} us"),
            ("CPU, % of one core", f"{res['cpu_percent_of_one_core']} %  (bar < {BAR_PERCENT} %)"),
            ("result", "PASS" if res["pass"] else "FAIL")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"written {out}")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
