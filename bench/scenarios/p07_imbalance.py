"""P7 same replica count, very unequal pressure: round robin balances requests, not KV cache.

Workload (4 replicas, tiny-cpu, time_scale 1): a batch client cycles through four request types: L long
context (`prompt_for_ttft(0.5)`, the longest prompt whose prefill alone takes 0.5 s: 2,900 tokens at the
calibrated preset, 48 output), S short (300 prompt, 16 output), G long generation (400 prompt, 300 output), T
tiny (60 prompt, 4 output); prompts are unique (no shared prefix). It sends one every `PERIOD`, chosen so the
pool runs at 0.6 of its compute capacity for that mix (`4 x mix_capacity_rps` with the preset's full KV cache,
bench/capacity.py: one every 0.067 s at the calibrated preset). Each replica's KV
cache holds 8 long-context requests (`--num-gpu-blocks blocks_for_tokens(8 x (2,900 + 48))` = 185 blocks of
128 tokens at the calibrated preset): the long-context requests are what fills KV. Round robin hands
each replica the same number of requests; with four replicas and a four-step cycle the same replica gets the
same type (the document's model-01 long contexts, 02 short, 03 long generations, 04 idle). The gateway runs one
Envoy worker thread (`gateway.envoy_concurrency: 1`, every system) so round robin is one rotation, as with one
Nginx worker; with two workers the pattern is the same with noise.

The pool as a whole has headroom (0.6), but round robin gives replica 0 every long-context request: about
twice what that replica can serve. On a pool of two (the real engines, `--backend vllm-cpu`, or `--replicas 2`)
the period follows the pool (`period_s`) and round robin gives replica 0 the long-context and long-generation
requests, replica 1 the short and tiny ones: the same imbalance, half as steep.

SLO: the first token within `slo_ttft_s(0.5 s)` (5x the TTFT alone of the largest prompt, rounded up: 3 s at
the calibrated preset) of the user's first send (retries included) and the response completed.
Classes: the four request types.

Headline metrics: `slo_goodput_rps`, `kv_usage_spread` = time average over the load window of (max - min) KV
usage across replicas, `kv_usage_max_mean` (time-averaged KV usage of the fullest replica), `ttft_p95_s`
(every attempt, censored), `preemptions`. Reproduced on envoy-rr when kv_usage_spread >= 0.3.
Sluice is told: the SLO (`admission.ttft_target_s`); the placement score at its defaults.
The one Envoy worker thread (`gateway.envoy_concurrency: 1`) is environment: every Envoy-based system runs it.
"""

from __future__ import annotations

from bench.openloop import Arrival
from bench.capacity import (BENCH_PRESET, EngineSpec, blocks_for_tokens, mix_capacity_rps, prompt_for_ttft, slo_ttft_s,
                            ttft_alone_s)
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, mean, pct, rnd

_BASE = EngineSpec.of(BENCH_PRESET)
LONG_PROMPT, LONG_OUT = prompt_for_ttft(_BASE, 0.5, 48), 48
TYPES = (("long-context", LONG_PROMPT, LONG_OUT), ("short", 300, 16), ("long-generation", 400, 300),
         ("tiny", 60, 4))
KV_BLOCKS = blocks_for_tokens(_BASE, 8 * (LONG_PROMPT + LONG_OUT))
SPEC = EngineSpec.of(BENCH_PRESET, ["--num-gpu-blocks", str(KV_BLOCKS)])
LOAD = 0.6  # of the pool's compute capacity for the mix


def period_s(replicas: int) -> float:
    """Seconds between requests: the pool (`replicas` x one replica's capacity for the mix) at LOAD."""
    return round(1.0 / (LOAD * replicas * mix_capacity_rps(_BASE, [(1.0, p, o) for _k, p, o in TYPES])), 4)


PERIOD = period_s(4)
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, LONG_PROMPT))


class S(Scenario):
    id = "P7"
    title = "KV imbalance under round robin"
    problem = "same replica count, very unequal pressure"
    replicas = 4
    time_scale = 1.0
    sim_args = ["--num-gpu-blocks", str(KV_BLOCKS)]
    gateway = {"envoy_concurrency": 1}
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"long prompt": LONG_PROMPT, "period (s)": PERIOD, "KV blocks": KV_BLOCKS}
    headline = ('slo_goodput_rps', 'kv_usage_spread', 'ttft_p95_s')
    metrics_doc = [
        Metric("kv_usage_spread", "time-averaged (max - min) KV usage across replicas", "fraction"),
        Metric("kv_usage_max_mean", "time-averaged KV usage of the fullest replica", "fraction"),
        Metric("ttft_p95_s", "p95 TTFT of all requests", "s"),
        Metric("slo_miss", f"share of requests with TTFT > {SLO_TTFT_S} s or failed", ""),
        Metric("preemptions", "vLLM preemptions summed over replicas", ""),
    ]

    def workload(self, quick: bool) -> Workload:
        duration = 10.0 if quick else 40.0
        arrivals = []
        i = 0
        t = 0.1
        while t < duration:
            kind, prompt, out = TYPES[i % 4]
            arrivals.append(Arrival(at=t, body=chat(prompt, out, salt=i), kind=kind))
            i += 1
            t += period_s(self.replicas)
        return Workload(arrivals=arrivals, duration=duration, drain=4.0)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        lo, hi = 1.0 / run.time_scale, run.duration
        grid = run.time_grid(lo, hi)
        spreads = [max(x["kv"] for x in g.values()) - min(x["kv"] for x in g.values()) for g in grid]
        maxes = [max(x["kv"] for x in g.values()) for g in grid]
        recs = run.records
        miss = [r for r in recs if not r.ok or r.ttft is None or r.ttft * run.time_scale > SLO_TTFT_S]
        return {
            "kv_usage_spread": rnd(mean(spreads)),
            "kv_usage_max_mean": rnd(mean(maxes)),
            "ttft_p95_s": rnd(pct(run.ttfts(recs), 95)),
            "slo_miss": rnd(len(miss) / len(recs) if recs else None),
            "preemptions": run.counter_total("preemptions"),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("kv_usage_spread")
        return (v is not None and v >= 0.3), f"kv_usage_spread {v} (needs >= 0.3)"
