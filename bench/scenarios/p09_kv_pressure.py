"""P9 KV cache pressure: no more requests, but mixed long and short contexts make preemption (vLLM's OOM) sudden.

Workload (2 replicas, tiny-cpu, time_scale 1): short (300 prompt, 24 output tokens) or long (800 prompt, 640
output tokens: a long context that keeps growing while it answers) requests, unique prompts (no shared prefix), at
0.7 of the pool's compute capacity for the late mix (the document's "GPU at 70 %": `2 x mix_capacity_rps` of one
long in two with the preset's full KV cache, bench/capacity.py; seeded Poisson) all along. Each replica's KV cache
holds 3.8 long requests at their full length (`--num-gpu-blocks blocks_for_tokens(3.8 x 1,440)` = 43 blocks of 128
tokens: the document's "one long request more than fits"). For the first 4 s (quick; 10 s full) one request in
ten is long and everything is fine; then the mix changes to one in two long at the same request rate. Compute
stays far from saturated (a "GPU at 70 %" view says there is headroom), but vLLM admits a prompt once the prompt's
own blocks fit (`scheduler_reserve_full_isl`, its default) and a long request then grows from 7 blocks to 12 as it
decodes: several admitted together outgrow the cache, and running requests are preempted (their KV dropped,
recomputed later), the engine's stand-in for the sudden OOM. Preemption lengthens every request, which keeps KV
use high.

Why these sizes: vLLM 0.32 checks a waiting prompt's whole length against the free blocks before admitting it, so
KV pressure comes from what requests grow by while decoding, not from their prompts. Long requests of 3,000
prompt and 240 output tokens (8 % growth) preempted 0-2 times on two real vLLM-CPU engines whatever the router
(`bench/results/real-xeon-38a2d45.json`), and so does the simulator, which checks admission the same way.

SLO: the first token within `slo_ttft_s(ttft_alone(800))` (5x the TTFT alone of the long prompt, at least 0.5 s,
rounded up) of the user's first send (retries included) and the response completed.
Classes: `short` and `long` requests.

Headline metrics: `slo_goodput_rps`, `preemptions` (vllm:num_preemptions_total summed), `ttft_p99_s` (every
attempt; one still waiting for its first token when the run ends counts with the time it waited, a lower bound),
`kv_usage_max`, `slo_miss`, `ttft_p99_before_s` (the calm phase).
Reproduced on envoy-rr when preemptions >= 10.
Sluice is told: the SLO (`admission.ttft_target_s`); the KV margin at its default (`admission.kv_margin`
0.1: admit on KV free vs the request's footprint, keeping 10 % free).
"""

from __future__ import annotations

import random

from bench.openloop import Arrival
from bench.capacity import BENCH_PRESET, EngineSpec, blocks_for_tokens, mix_capacity_rps, slo_ttft_s, ttft_alone_s
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, pct, rnd, ttfts_censored, workload_rng

SHORT, LONG = (300, 24), (800, 640)
_BASE = EngineSpec.of(BENCH_PRESET)  # the engine's compute, with the preset's full KV cache
KV_BLOCKS = blocks_for_tokens(_BASE, round(3.8 * sum(LONG)))
SPEC = EngineSpec.of(BENCH_PRESET, ["--num-gpu-blocks", str(KV_BLOCKS)])
RATE = 0.7 * 2 * mix_capacity_rps(_BASE, [(0.5, *SHORT), (0.5, *LONG)])  # "GPU at 70 %": KV is what runs out
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, LONG[0]))
# Time for the last long requests to finish: 640 tokens decoded under KV pressure (preempted ones recompute).
DRAIN_S = 14.0


def mix_stream(rng: random.Random, rate: float, t_mix: float, duration: float) -> list[tuple[float, bool]]:
    """P9's arrivals as (time, long?): Poisson at `rate` from 0.1 s to `duration`, one long request in ten before
    `t_mix` and one in two after (bench/p9_admission.py replays the same stream offline)."""
    out = []
    t = 0.1
    while t < duration:
        out.append((t, rng.random() < (0.1 if t < t_mix else 0.5)))
        t += rng.expovariate(rate)
    return out


class S(Scenario):
    id = "P9"
    title = "KV cache pressure"
    problem = "KV cache fragmentation makes OOM sudden"
    replicas = 2
    time_scale = 1.0
    sim_args = ["--num-gpu-blocks", str(KV_BLOCKS)]
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"rate (req/s)": RATE, "KV blocks": KV_BLOCKS}
    headline = ('slo_goodput_rps', 'preemptions', 'ttft_p99_s')
    metrics_doc = [
        Metric("preemptions", "vLLM preemptions summed over replicas", ""),
        Metric("ttft_p99_s", "p99 TTFT of all requests", "s"),
        Metric("ttft_p50_s", "median TTFT of all requests", "s"),
        Metric("ttft_p99_before_s", "p99 TTFT while the mix was mostly short", "s"),
        Metric("kv_usage_max", "highest KV usage seen on any replica", "fraction", ""),
        Metric("slo_miss", f"share of requests with TTFT > {SLO_TTFT_S} s or failed", ""),
    ]

    def phases(self, quick: bool) -> tuple[float, float]:
        return (4.0, 12.0) if quick else (10.0, 40.0)

    def workload(self, quick: bool) -> Workload:
        t_mix, duration = self.phases(quick)
        arrivals = [Arrival(at=t, body=chat(*LONG, salt=n) if long_ else chat(*SHORT, salt=n),
                            kind="long" if long_ else "short")
                    for n, (t, long_) in enumerate(mix_stream(workload_rng(9), RATE, t_mix, duration))]
        return Workload(arrivals=arrivals, duration=duration, drain=DRAIN_S)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ts = run.time_scale
        t_mix = self.phases(run.extra.get("quick", True))[0] / ts
        recs = run.records
        miss = [r for r in recs if not r.ok or r.ttft is None or r.ttft * ts > SLO_TTFT_S]
        censored = ttfts_censored(run, recs)
        return {
            "preemptions": run.counter_total("preemptions"),
            "ttft_p99_s": rnd(pct(censored, 99)),
            "ttft_p50_s": rnd(pct(censored, 50)),
            "ttft_p99_before_s": rnd(pct(ttfts_censored(run, [r for r in recs if r.start < t_mix]), 99)),
            "kv_usage_max": rnd(run.max_over_replicas("kv")),
            "slo_miss": rnd(len(miss) / len(recs) if recs else None),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("preemptions")
        return (v is not None and v >= 10), f"preemptions {v} (needs >= 10)"
