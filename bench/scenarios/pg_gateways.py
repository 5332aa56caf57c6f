"""PG several gateways, one pool: each Envoy + sidecar pair places blind to the others' requests in flight.

Workload (3 gateways, each an Envoy + sluice sidecar, in front of one pool of 3 replicas, tiny-cpu, time_scale 1;
clients spread over the gateways round robin, as an L4 balancer would): each replica's KV cache holds `FITS`
long generations at their full length (`--num-gpu-blocks blocks_for_tokens(FITS x (400 + 700))`, bench/capacity.py:
86 blocks of 128 tokens at the calibrated preset). A seeded Poisson background of short chats (300 prompt, 32
output tokens) at 0.1 of the pool's capacity for them runs all along; at t=2 s (quick; 4 s full) a burst of
`BURST` long generations (400 prompt, 700 output tokens: 2.5 x what the pool's KV holds) lands on all gateways
within half a second. A long generation reserves 1,100 tokens of KV but shows only its prompt when a replica is
scraped right after it starts. Prompts are unique (no shared prefix). Clients are the openai SDK (max_retries 2,
honouring retry-after and x-should-retry): a shed request comes back.

The first two systems are two sluice deployments, both at the shipped defaults; they differ in one deployment fact:
  shared       every sidecar uses the same Redis (`budgets.store.kind: redis`, a real redis-server): each
               publishes its requests in flight per replica and adds the others' fresh share to what it scraped
               (`routing.shared_load`, on by default with a Redis store): together they admit what the
               replicas' KV holds; the rest waits in the sidecars' own queues (queues stay local)
  independent  each sidecar has its own in-memory store (the default): it reserves KV for its own requests only
               and sees the others' through scrapes, which show what a request holds now, not the output it will
               still generate: three sidecars admit up to three times what fits, and the replicas preempt (vLLM
               drops and recomputes running requests)
The third shows what the opt-in `routing.shared_load.take_turns` costs and buys, side by side:
  turns        shared, and between two views each sidecar fills only its share of a replica's headroom, the last
               places in turn (routing/turns.py): two gateways no longer take the same last place in one interval

SLO: the first token within `slo_ttft_s(ttft_alone(400))` (5x the TTFT alone, at least 0.5 s, rounded up) of the
user's first send (retries included) and the response completed.
Classes: `background`, `burst`.

Headline metrics: `slo_goodput_rps`, `ttft_p95_s` (every user request from its first send, every attempt of it
counted; refused or unanswered ones censored at the time their user waited), `preemptions` (summed over
replicas), `kv_usage_spread` (time average over the burst of max - min KV usage across replicas),
`kv_usage_max`, `burst_ttft_p95_s`.
Reproduced on independent: preemptions >= 10 (the gateways together overcommit the pool's KV). envoy-rr is not
run: the problem is between sluice sidecars. Bar: the shared setup's ttft_p95_s <= 0.7 x the independent one's.
Sluice is told: the SLO (`admission.ttft_target_s`), and, in the shared setup, the Redis its sidecars share
(`budgets.store`); everything else at its shipped defaults.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import traceback
from pathlib import Path
from typing import Any

from bench.capacity import BENCH_PRESET, EngineSpec, blocks_for_tokens, pool_rps, slo_ttft_s, ttft_alone_s
from bench.openloop import Arrival
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, mean, pct, rnd, workload_rng

LONG, SHORT = (400, 700), (300, 32)
REPLICAS, GATEWAYS = 3, 3
FITS = 10                                     # long generations one replica's KV holds at their full length
_BASE = EngineSpec.of(BENCH_PRESET)
KV_BLOCKS = blocks_for_tokens(_BASE, FITS * sum(LONG))
SPEC = EngineSpec.of(BENCH_PRESET, ["--num-gpu-blocks", str(KV_BLOCKS)])
BURST = round(2.5 * FITS * REPLICAS)
BACKGROUND_RPS = 0.1 * pool_rps(SPEC, REPLICAS, *SHORT)
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, LONG[0]))
SHARED, INDEPENDENT, TURNS = "shared", "independent", "turns"


class S(Scenario):
    id = "PG"
    title = "several gateways in front of one pool"
    problem = "each gateway places blind to the others' requests in flight"
    replicas = REPLICAS
    gateways = GATEWAYS
    time_scale = 1.0
    sim_args = ["--num-gpu-blocks", str(KV_BLOCKS)]
    slo_ttft_s = SLO_TTFT_S
    systems = (INDEPENDENT, SHARED, TURNS)
    reproduced_on = INDEPENDENT
    redis = True  # the shared setup's sidecars share a Redis (`_meta.sluice_policy` lists it)
    derived_values = {"KV blocks per replica": KV_BLOCKS, "burst": BURST, "background (req/s)": BACKGROUND_RPS}
    headline = ("slo_goodput_rps", "ttft_p95_s", "preemptions", "kv_usage_spread")
    metrics_doc = [
        Metric("ttft_p95_s", "p95 TTFT of every user request from its first send (unanswered ones censored)", "s"),
        Metric("burst_ttft_p95_s", "the same for the burst's long generations", "s"),
        Metric("preemptions", "vLLM preemptions summed over replicas", ""),
        Metric("kv_usage_spread", "time-averaged (max - min) KV usage across replicas from the burst on", "fraction"),
        Metric("kv_usage_max", "highest KV usage seen on any replica", "fraction", ""),
        Metric("shed_fraction", "share of user requests that ended refused 4xx/5xx", "", ""),
        Metric("completed", "user requests completed", "", "higher"),
    ]

    def phases(self, quick: bool) -> tuple[float, float, float]:
        """(burst start, burst length, end of the offered load) in scenario seconds."""
        return (2.0, 0.5, 3.0) if quick else (4.0, 0.5, 8.0)

    def workload(self, quick: bool) -> Workload:
        start, length, end = self.phases(quick)
        rng = workload_rng(7)
        arrivals: list[Arrival] = []
        t = 0.1
        while t < end:
            arrivals.append(Arrival(at=t, body=chat(*SHORT, salt=len(arrivals)), kind="background"))
            t += rng.expovariate(BACKGROUND_RPS)
        for i in range(BURST):
            arrivals.append(Arrival(at=start + length * i / BURST, body=chat(*LONG, salt=len(arrivals)),
                                    kind="burst"))
        return Workload(arrivals=arrivals, duration=end, drain=23.0 if quick else 40.0)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ts = run.time_scale
        start, _length, _end = self.phases(run.extra.get("quick", True))
        calls = run.calls()
        grid = run.time_grid(start / ts, run.extra.get("deadline", run.duration))
        spreads = [max(x["kv"] for x in g.values()) - min(x["kv"] for x in g.values()) for g in grid]
        return {
            "ttft_p95_s": rnd(pct([c.waited * ts for c in calls], 95)),
            "burst_ttft_p95_s": rnd(pct([c.waited * ts for c in calls if c.kind == "burst"], 95)),
            "preemptions": run.counter_total("preemptions"),
            "kv_usage_spread": rnd(mean(spreads)),
            "kv_usage_max": rnd(run.max_over_replicas("kv")),
            "shed_fraction": rnd(sum(1 for c in calls if 400 <= c.final.status < 600) / len(calls) if calls else None),
            "completed": float(sum(1 for c in calls if c.ok)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("preemptions")
        return (v is not None and v >= 10), f"preemptions {v} (needs >= 10)"

    def gateway_stacks(self, run_dir: Path, seed: int, redis_url: str | None, backend: Any,
                       take_turns: bool = False) -> list[Any]:
        """The gateway pairs, not started: each sluice at its shipped defaults plus the scenario's facts (and the
        shared Redis when `redis_url` is given; `take_turns`: routing.shared_load.take_turns on). Gateway 0's
        stack runs the simulated pool; the others front the same replicas."""
        from bench import runner

        stacks = [runner.make_stack(self, "sluice", run_dir / f"gateway-{g}", seed, redis_url=redis_url,
                                    backend=backend) for g in range(self.gateways)]
        pool = stacks[0].policy.pools[0]
        if take_turns:
            for stack in stacks:
                routing = stack.policy.routing
                shared = dataclasses.replace(routing.shared_load, take_turns=True)
                stack.policy.routing = dataclasses.replace(routing, shared_load=shared)
        for stack in stacks[1:]:
            stack.policy.simulator = dataclasses.replace(stack.policy.simulator, enabled=False)
            stack.policy.pools = [dataclasses.replace(stack.policy.pools[0], replicas=list(pool.replicas))]
        return stacks

    def run_system(self, system: str, quick: bool, seed: int, workdir: Any,
                   backend: Any) -> tuple[RunData | None, dict[str, Any]]:
        """Gateway 0's stack starts the pool; the other gateways front the same replicas. The shared setup's
        sidecars all get one fresh redis-server. Stopped by PID, the other gateways first, the pool's last."""
        from bench import runner

        info: dict[str, Any] = {"system": system, "notes": [], "gateways": self.gateways}
        t_start = time.monotonic()
        run_dir = Path(workdir) / f"{self.id}-{system}"
        stacks: list[Any] = []
        redis = redis_url = None
        try:
            if system in (SHARED, TURNS):
                redis, redis_url = runner.start_redis(run_dir)
            if system == TURNS:  # beyond the deployment facts `_meta.sluice_policy` lists: shown for its cost
                info["notes"].append("routing.shared_load.take_turns: true (the opt-in, off by default)")
            for stack in self.gateway_stacks(run_dir, seed, redis_url, backend, take_turns=system == TURNS):
                stacks.append(stack)
                stack.start()
            backend.attach(stacks[0])
            info["start_s"] = round(time.monotonic() - t_start, 2)
            run = RunData(scenario=self.id, system=system, time_scale=float(self.time_scale),
                          replicas=list(stacks[0].policy.pools[0].replicas))
            run.extra["quick"] = quick
            run.extra["backend"] = backend.name
            asyncio.run(runner.drive(self, stacks[0], self.workload(quick), run, quick, seed, backend,
                                     gateways=stacks))
        except Exception as exc:  # noqa: BLE001 - report and continue with the next system
            info["error"] = f"run failed: {type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc()
            return None, info
        finally:
            for stack in reversed(stacks):
                stack.stop()
            if redis is not None:
                redis.stop()
        return runner.finished(run, info, t_start)
