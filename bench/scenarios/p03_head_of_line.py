"""P3 head-of-line blocking: one very long prompt drags a stream of short ones.

Workload (2 replicas, tiny-cpu, time_scale 1): short chat requests (B/C/D: 500, 800 and 1,000 prompt tokens,
16 output tokens) arrive as a seeded Poisson stream at 0.2 x the pool's capacity for them (`2 x
capacity_rps(767, 16)`, bench/capacity.py: 7 requests/s at the calibrated tiny-cpu) for the whole run; a long
request A arrives every `LONG_PERIOD` = 1.75 x its prefill time. A is the longest prompt whose prefill alone
takes at most 2 s (`prompt_for_ttft(2.0)`: 6,500 tokens at the calibrated preset, 16,300 on an AVX-512 BF16
CPU, under the real engine's 16,384-token context; the document's 100K scaled to the tiny model), 8 output
tokens. The engine schedules running requests first, so while A's chunks fill each step's token budget (2,048)
the short requests queued behind it on the same replica get nothing. Prompts are unique (no shared prefix).

SLO: the first token within `slo_ttft_s(ttft_alone(1,000))` (5x the TTFT of the largest short request on an
idle replica, at least 0.5 s, rounded up: 0.5 s at the calibrated preset) of the user's first send (retries
included) and the response completed (a long prompt's prefill alone takes longer, so no system serves the
`long` class within it: that class only shows what a lane costs the long prompts).
Classes: `short` and `long`.

Headline metrics: `slo_goodput_rps`, `short_ttft_p95_s` of short requests started while a long prompt was being
prefilled (from A's send to A's first token, as the client saw it), `short_ttft_p95_idle_s` of short requests
started outside those windows, and `hol_slowdown` = their ratio. Reproduced on envoy-rr when hol_slowdown >= 3.
Sluice is told: the SLO (`admission.ttft_target_s`). Lanes at their defaults (short <= 1,024, normal <=
8,192, long above on at most half the replicas: `max_replica_share: 0.5`).
"""

from __future__ import annotations


from bench.openloop import Arrival
from bench.capacity import BENCH_PRESET, EngineSpec, capacity_rps, prompt_for_ttft, slo_ttft_s, ttft_alone_s
from bench.scenarios.base import (Metric, RunData, Scenario, Workload, chat, in_windows, pct, ratio, rnd, workload_rng)

SHORT_SIZES = (500, 800, 1000)
SHORT_OUT, LONG_OUT = 16, 8
SPEC = EngineSpec.of(BENCH_PRESET)
SHORT_RPS = 0.2 * 2 * capacity_rps(SPEC, round(sum(SHORT_SIZES) / 3), SHORT_OUT)
LONG_PROMPT = prompt_for_ttft(SPEC, 2.0, LONG_OUT)
LONG_PERIOD = round(1.75 * ttft_alone_s(SPEC, LONG_PROMPT), 2)
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, max(SHORT_SIZES)))


class S(Scenario):
    id = "P3"
    title = "head-of-line blocking"
    problem = "one very long request drags a batch of short ones"
    replicas = 2
    time_scale = 1.0
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"short (req/s)": SHORT_RPS, "long prompt": LONG_PROMPT, "long period (s)": LONG_PERIOD}
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
        rng = workload_rng(3)
        arrivals: list[Arrival] = []
        t = 0.2
        n = 0
        while t < duration:
            size = SHORT_SIZES[n % 3]
            arrivals.append(Arrival(at=t, body=chat(size, SHORT_OUT, salt=n), kind="short"))
            n += 1
            t += rng.expovariate(SHORT_RPS)
        t = 1.5
        while t < duration - 2.5:
            arrivals.append(Arrival(at=t, body=chat(LONG_PROMPT, LONG_OUT, salt=900000 + n), kind="long"))
            n += 1
            t += LONG_PERIOD
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
