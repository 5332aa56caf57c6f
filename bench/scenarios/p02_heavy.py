"""P2 requests get heavier, not more numerous: same QPS, a batch of heavy prompts.

Workload (2 replicas, tiny-cpu, time_scale 1): 14 requests/s all along (seeded Poisson). Normal requests have
1,000 prompt and 48 output tokens (the document's 2K / 500, scaled to the tiny model). During the heavy phase
(t=3..8 s quick, 5..25 s full) a quarter of the arrivals are a batch's heavy requests, 6,000 prompt and 96
output tokens (the document's 25K / 4K): QPS and the number of requests in flight barely change, the tokens
offered grow by about 4x, past the pool's prefill capacity.

SLO: the first token within 1 s of the user's first send (retries included) and the response completed.
Classes: `normal` and `heavy` requests.

Headline metrics: `slo_goodput_rps`, `ttft_p95_s` of normal requests sent during the heavy phase,
`ttft_p95_before_s` of normal requests before it, `heavy_slowdown` = their ratio (attempts without a first token
censored at the time they waited), `heavy_ttft_p50_s`. Reproduced on envoy-rr when heavy_slowdown >= 5.
Sluice is told: the SLO (`admission.ttft_target_s: 1`). Lanes stay at the defaults (short <= 1,024, normal <=
8,192, long above on at most half the replicas): the 6,000-token heavy prompts share the normal lane.
"""

from __future__ import annotations

import random

from bench.openloop import Arrival
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, pct, ratio, rnd

SLO_TTFT_S = 1.0


class S(Scenario):
    id = "P2"
    title = "heavier requests at the same QPS"
    problem = "requests get heavier, not more numerous"
    replicas = 2
    time_scale = 1.0
    slo_ttft_s = SLO_TTFT_S
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
        rng = random.Random(2)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            heavy = h0 <= t < h1 and n % 4 == 3
            body = chat(6000, 96, salt=n) if heavy else chat(1000, 48, salt=n)
            arrivals.append(Arrival(at=t, body=body, kind="heavy" if heavy else "normal"))
            n += 1
            t += rng.expovariate(14.0)
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
