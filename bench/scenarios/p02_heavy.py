"""P2 requests get heavier, not more numerous: same QPS, a batch of heavy prompts.

Workload (2 replicas, tiny-cpu, time_scale 1): a seeded Poisson stream at 0.35 x the pool's capacity for normal
requests (`2 x capacity_rps(1000, 48)`, bench/capacity.py: 7.2 requests/s at the calibrated tiny-cpu) all along.
Normal requests have 1,000 prompt and 48 output tokens (the document's 2K / 500, scaled to the tiny model).
During the heavy phase (t=3..8 s quick, 5..25 s full) a share `HEAVY_SHARE` of the arrivals are a batch's heavy
requests, 6,000 prompt and 96 output tokens (the document's 25K / 4K), the share chosen so that the phase
offers 1.5x the pool's capacity for the mix (solved from `capacity_rps` of both kinds: about 1 in 9 at the
calibrated preset): QPS and the number of requests in flight do not change, the work offered grows past
what the pool can do. Prompts are unique (no shared prefix).

SLO: the first token within `slo_ttft_s(ttft_alone(1,000))` (5x the TTFT of a normal request on an idle
replica, at least 0.5 s, rounded up: 0.5 s at the calibrated preset) of the user's first send (retries
included) and the response completed. A heavy prompt's prefill alone takes longer (1.7 s), so no system
serves the `heavy` class within it: it shows what a gateway costs the heavy requests.
Classes: `normal` and `heavy` requests.

Headline metrics: `slo_goodput_rps`, `ttft_p95_s` of normal requests sent during the heavy phase,
`ttft_p95_before_s` of normal requests before it, `heavy_slowdown` = their ratio (attempts without a first token
censored at the time they waited), `heavy_ttft_p50_s`. Reproduced on envoy-rr when heavy_slowdown >= 5.
Sluice is told: the SLO (`admission.ttft_target_s`). Lanes stay at the defaults, cut by predicted prefill seconds
relative to the SLO (short <= 0.1 x, normal <= 0.5 x, long above on at most half the replicas): the 6,000-token
heavy prompts (1.7 s of prefill against a 0.5 s SLO) go to the long lane.
"""

from __future__ import annotations


from bench.openloop import Arrival
from bench.capacity import BENCH_PRESET, EngineSpec, capacity_rps, slo_ttft_s, ttft_alone_s
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, pct, ratio, rnd, workload_rng

NORMAL, HEAVY = (1000, 48), (6000, 96)
SPEC = EngineSpec.of(BENCH_PRESET)
_CN, _CH = capacity_rps(SPEC, *NORMAL), capacity_rps(SPEC, *HEAVY)
RATE = 0.35 * 2 * _CN
# share s of heavy arrivals with RATE x (s / C_heavy + (1 - s) / C_normal) = 1.5 x replicas
HEAVY_SHARE = (1.5 * 2 / RATE - 1 / _CN) / (1 / _CH - 1 / _CN)
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, NORMAL[0]))


class S(Scenario):
    id = "P2"
    title = "heavier requests at the same QPS"
    problem = "requests get heavier, not more numerous"
    replicas = 2
    time_scale = 1.0
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"rate (req/s)": RATE, "heavy share": HEAVY_SHARE}
    headline = ('slo_goodput_rps', 'ttft_p95_s', 'heavy_ttft_p50_s')
    metrics_doc = [
        Metric("ttft_p95_s", "p95 TTFT of normal requests sent during the heavy phase", "s"),
        Metric("ttft_p95_before_s", "p95 TTFT of normal requests before the heavy phase", "s"),
        Metric("heavy_slowdown", "ttft_p95_s / ttft_p95_before_s", "x"),
        Metric("heavy_ttft_p50_s", "median TTFT of the heavy requests (shown for honesty)", "s", ""),
        Metric("rejected", "requests answered 4xx/5xx", "", ""),
    ]

    def phase(self, quick: bool) -> tuple[float, float, float]:
        return (3.0, 8.0, 11.0) if quick else (5.0, 25.0, 30.0)

    def workload(self, quick: bool) -> Workload:
        h0, h1, duration = self.phase(quick)
        rng = workload_rng(2)
        arrivals = []
        t, n, owed = 0.1, 0, 0.0
        while t < duration:
            heavy = False
            if h0 <= t < h1:  # every 1 / HEAVY_SHARE-th arrival of the phase is heavy (deterministic)
                owed += HEAVY_SHARE
                heavy = owed >= 1.0
                owed -= 1.0 if heavy else 0.0
            body = chat(*HEAVY, salt=n) if heavy else chat(*NORMAL, salt=n)
            arrivals.append(Arrival(at=t, body=body, kind="heavy" if heavy else "normal"))
            n += 1
            t += rng.expovariate(RATE)
        return Workload(arrivals=arrivals, duration=duration, drain=4.0)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        quick = run.extra.get("quick", True)
        h0, h1, duration = (x / run.time_scale for x in self.phase(quick))
        normal = run.recs("normal")
        during = [r for r in normal if h0 <= r.sched <= h1]
        before = [r for r in normal if r.sched < h0]
        p_during, p_before = pct(run.ttfts(during), 95), pct(run.ttfts(before), 95)
        return {
            "ttft_p95_s": rnd(p_during),
            "ttft_p95_before_s": rnd(p_before),
            "heavy_slowdown": rnd(ratio(p_during, p_before), 2),
            "heavy_ttft_p50_s": rnd(pct(run.ttfts(run.recs("heavy")), 50)),
            "rejected": float(sum(1 for r in run.records if 400 <= r.status < 600)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("heavy_slowdown")
        return (v is not None and v >= 5.0), f"heavy_slowdown {v} (needs >= 5)"
