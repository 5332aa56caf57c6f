"""P1 instant flood peak: steady load, then a batch of 300 requests lands within one second.

Workload (3 replicas, tiny-cpu, time_scale 1): chat requests of 1,000 prompt tokens and 64 output tokens
(about 0.4 s each alone). A seeded Poisson background of 16 requests/s (about 6-10 in flight) runs all along;
at t=4 s 12 requests arrive together, during t=5..6 s 300 requests arrive spread evenly over one second, during
t=6..7 s 20 more (the document's 10:00:00 12 req, 10:00:01 300 req, 10:00:02 20 req). The pool's prefill
capacity is about 75 such requests/s, so the burst is 4 s of work offered in 1 s.

Clients are the openai SDK (max_retries 2, honouring retry-after and x-should-retry): a shed request comes back.

SLO: the first token within 2 s of the user's first send (retries included) and the response completed.
Classes: `background`, `pre-burst`, `burst`, `post-burst` (the arrival's part of the peak).

Headline metrics: `slo_goodput_rps`, `ttft_p95_s` (every user request from its first send, refused ones censored
at the time their user waited), `shed_fraction` (user requests that ended refused 4xx/5xx), `shed_latency_p99_s`
(how fast a refused attempt learns it: the point of shedding early), `replica_waiting_max` (the replicas' own
queues). Reproduced on envoy-rr when replica_waiting_max >= 20 and ttft_p95_s > 2 s.
Sluice is told: the SLO (`admission.ttft_target_s: 2`); everything else at its shipped defaults.
"""

from __future__ import annotations

import random

from bench.openloop import Arrival
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, pct, rnd

SLO_TTFT_S = 2.0
PROMPT, OUT = 1000, 64


class S(Scenario):
    id = "P1"
    title = "burst (instant flood peak)"
    problem = "instant flood peaks, not sustained load"
    replicas = 3
    time_scale = 1.0
    slo_ttft_s = SLO_TTFT_S
    headline = ('slo_goodput_rps', 'ttft_p95_s', 'shed_latency_p99_s')
    metrics_doc = [
        Metric("ttft_p95_s", "p95 TTFT of every user request from its first send (refused ones censored)", "s"),
        Metric("burst_ttft_p95_s", "the same for the requests of the 300-request second", "s"),
        Metric("shed_fraction", "share of requests answered 4xx/5xx by the gateway", "", ""),
        Metric("shed_latency_p99_s", "p99 time to the rejection of shed requests", "s"),
        Metric("replica_waiting_max", "largest vllm:num_requests_waiting seen on any replica", "req"),
        Metric("failed", "requests that got neither a complete stream nor a clean HTTP error", "", "lower"),
    ]

    def workload(self, quick: bool) -> Workload:
        duration = 10.0 if quick else 30.0
        rng = random.Random(1)
        arrivals: list[Arrival] = []
        n = 0

        def add(t: float, kind: str) -> None:
            nonlocal n
            arrivals.append(Arrival(at=t, body=chat(PROMPT, OUT, salt=n), kind=kind))
            n += 1

        t = 0.1
        while t < duration:
            add(t, "background")
            t += rng.expovariate(16.0)
        for _ in range(12):
            add(4.0, "pre-burst")
        for i in range(300):
            add(5.0 + i / 300.0, "burst")
        for i in range(20):
            add(6.0 + i / 20.0, "post-burst")
        return Workload(arrivals=arrivals, duration=duration, drain=5.0)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ts = run.time_scale
        calls = run.calls()
        shed = [r for r in run.records if 400 <= r.status < 600]
        refused = [c for c in calls if 400 <= c.final.status < 600]
        failed = [c for c in calls if not c.ok and not (400 <= c.final.status < 600)]
        return {
            "ttft_p95_s": rnd(pct([c.waited * ts for c in calls], 95)),
            "burst_ttft_p95_s": rnd(pct([c.waited * ts for c in calls if c.kind == "burst"], 95)),
            "shed_fraction": rnd(len(refused) / len(calls) if calls else None),
            "shed_latency_p99_s": rnd(pct([r.latency * ts for r in shed if r.latency is not None], 99)),
            "replica_waiting_max": run.max_over_replicas("waiting"),
            "failed": float(len(failed)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        w, p = m.get("replica_waiting_max"), m.get("ttft_p95_s")
        ok = w is not None and w >= 20 and p is not None and p > SLO_TTFT_S
        return ok, f"replica_waiting_max {w} (needs >= 20), ttft_p95_s {p} (needs > {SLO_TTFT_S})"
