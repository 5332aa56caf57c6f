"""P3 head-of-line blocking: one very long prompt drags a stream of short ones.

Workload (2 replicas, tiny-cpu, time_scale 1): short chat requests (B/C/D: 500, 800 and 1,000 prompt tokens,
16 output tokens) arrive as a seeded Poisson stream at 6/s for the whole run; every 3.5 s a long request A
(12,000 prompt tokens, 8 output tokens; the document's 100K scaled to the tiny model, whose chunked prefill
of 2,048 tokens per step makes A's prefill take about 2.4 s) arrives. The engine schedules running requests
first, so while A's chunks fill each step's token budget the short requests queued behind it on the same
replica get nothing.

SLO: the first token within 0.5 s of the user's first send (retries included) and the response completed (a
long prompt's prefill alone takes longer, so no system serves the `long` class within it: that class only shows
what a lane costs the long prompts).
Classes: `short` and `long`.

Headline metrics: `slo_goodput_rps`, `short_ttft_p95_s` of short requests started while a long prompt was being
prefilled (from A's send to A's first token, as the client saw it), `short_ttft_p95_idle_s` of short requests
started outside those windows, and `hol_slowdown` = their ratio. Reproduced on envoy-rr when hol_slowdown >= 3.
Sluice is told: the SLO (`admission.ttft_target_s: 0.5`). Lanes at their defaults (short <= 1,024, normal <=
8,192, long above on at most half the replicas: `max_replica_share: 0.5`).
"""

from __future__ import annotations

import random

from bench.openloop import Arrival
from bench.scenarios.base import (Metric, RunData, Scenario, Workload, chat, in_windows, pct, ratio, rnd)

SHORT_SIZES = (500, 800, 1000)
SLO_TTFT_S = 0.5


class S(Scenario):
    id = "P3"
    title = "head-of-line blocking"
    problem = "one very long request drags a batch of short ones"
    replicas = 2
    time_scale = 1.0
    slo_ttft_s = SLO_TTFT_S
    headline = ('slo_goodput_rps', 'hol_slowdown', 'short_ttft_p95_s')
    metrics_doc = [
        Metric("short_ttft_p95_s", "p95 TTFT of short requests sent while a long prompt was prefilling", "s"),
        Metric("short_ttft_p95_idle_s", "p95 TTFT of short requests sent outside those windows", "s"),
        Metric("hol_slowdown", "short_ttft_p95_s / short_ttft_p95_idle_s", "x"),
        Metric("short_slo_miss", f"share of short requests with TTFT > {SLO_TTFT_S} s or failed", ""),
        Metric("long_ttft_p50_s", "median TTFT of the long prompts (a lane may delay them; shown for honesty)",
               "s", ""),
        Metric("failed", "requests without a complete response", "", "lower"),
    ]

    def workload(self, quick: bool) -> Workload:
        duration = 11.0 if quick else 40.0
        rng = random.Random(3)
        arrivals: list[Arrival] = []
        t = 0.2
        n = 0
        while t < duration:
            size = SHORT_SIZES[n % 3]
            arrivals.append(Arrival(at=t, body=chat(size, 16, salt=n), kind="short"))
            n += 1
            t += rng.expovariate(6.0)
        t = 1.5
        while t < duration - 2.5:
            arrivals.append(Arrival(at=t, body=chat(12000, 8, salt=900000 + n), kind="long"))
            n += 1
            t += 3.5
        return Workload(arrivals=arrivals, duration=duration, drain=4.0)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        longs = run.recs("long")
        windows = [(r.start, r.first_token if r.first_token is not None else (r.end or r.start))
                   for r in longs]
        shorts = run.recs("short")
        during = [r for r in shorts if in_windows(r.start, windows)]
        idle = [r for r in shorts if not in_windows(r.start, windows)]
        p_during = pct(run.ttfts(during), 95)
        p_idle = pct(run.ttfts(idle), 95)
        miss = [r for r in shorts if not r.ok or r.ttft is None or r.ttft * run.time_scale > SLO_TTFT_S]
        return {
            "short_ttft_p95_s": rnd(p_during),
            "short_ttft_p95_idle_s": rnd(p_idle),
            "hol_slowdown": rnd(ratio(p_during, p_idle), 2),
            "short_slo_miss": rnd(len(miss) / len(shorts) if shorts else None),
            "long_ttft_p50_s": rnd(pct(run.ttfts(longs), 50)),
            "failed": float(sum(1 for r in run.records if not r.ok)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("hol_slowdown")
        return (v is not None and v >= 3.0), f"hol_slowdown {v} (needs >= 3)"
