"""P1 instant flood peak: steady load, then four seconds of the pool's work lands within one second.

Workload (3 replicas, tiny-cpu, time_scale 1): chat requests of 1,000 prompt tokens and 64 output tokens. Every
rate is a share of the pool's capacity for them, `CAP` = 3 x `capacity_rps(1000, 64)` (bench/capacity.py, from
the preset's cost model; 28 requests/s at the calibrated tiny-cpu): a seeded Poisson background of 0.25 x CAP
runs all along; at t=4 s 0.16 x CAP requests arrive together, during t=5..6 s 4 x CAP requests arrive spread
evenly over one second (four seconds of the pool's work offered in one), during t=6..7 s 0.27 x CAP more (the
document's 10:00:00 12 req, 10:00:01 300 req, 10:00:02 20 req, as shares of a 75 req/s pool). Prompts are
unique (no shared prefix: the prefix cache plays no part).

Clients are the openai SDK (max_retries 2, honouring retry-after and x-should-retry): a shed request comes back.

SLO: the first token within `slo_ttft_s(ttft_alone(1,000))` (bench/capacity.py: 5x the TTFT on an idle
replica, at least 0.5 s, rounded up to a number a user writes: 0.5 s at the calibrated preset) of the user's
first send (retries included) and the response completed.
Classes: `background`, `pre-burst`, `burst`, `post-burst` (the arrival's part of the peak).

Headline metrics: `slo_goodput_rps`, `ttft_p95_s` (every user request from its first send, refused ones censored
at the time their user waited), `shed_fraction` (user requests that ended refused 4xx/5xx), `shed_latency_p99_s`
(how fast a refused attempt learns it: the point of shedding early), `replica_waiting_max` (the replicas' own
queues), `replica_inflight_max` (running + waiting on one replica). Reproduced on envoy-rr when the burst
lands in the replicas' queues: burst_ttft_p95_s > 2 x SLO and ttft_p95_s > SLO (the old rule, waiting >= 20,
cannot hold on an engine whose 64 sequences all run at once: the burst then queues inside its batch, not in
its waiting queue).
Sluice is told: the SLO (`admission.ttft_target_s`); everything else at its shipped defaults.
"""

from __future__ import annotations


from bench.openloop import Arrival
from bench.capacity import BENCH_PRESET, EngineSpec, pool_rps, slo_ttft_s, ttft_alone_s
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, pct, rnd, workload_rng

PROMPT, OUT = 1000, 64
REPLICAS = 3
SPEC = EngineSpec.of(BENCH_PRESET)
CAP = pool_rps(SPEC, REPLICAS, PROMPT, OUT)          # the pool's requests/s for these requests
BACKGROUND_RPS = 0.25 * CAP
PRE_BURST, BURST, POST_BURST = round(0.16 * CAP), round(4.0 * CAP), round(0.27 * CAP)
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, PROMPT))


class S(Scenario):
    id = "P1"
    title = "burst (instant flood peak)"
    problem = "instant flood peaks, not sustained load"
    replicas = REPLICAS
    derived_values = {"CAP (req/s)": CAP, "background (req/s)": BACKGROUND_RPS, "pre-burst": PRE_BURST,
                      "burst": BURST, "post-burst": POST_BURST}
    time_scale = 1.0
    slo_ttft_s = SLO_TTFT_S
    headline = ('slo_goodput_rps', 'ttft_p95_s', 'shed_latency_p99_s')
    metrics_doc = [
        Metric("ttft_p95_s", "p95 TTFT of every user request from its first send (refused ones censored)", "s"),
        Metric("burst_ttft_p95_s", "the same for the requests of the 300-request second", "s"),
        Metric("shed_fraction", "share of requests answered 4xx/5xx by the gateway", "", ""),
        Metric("shed_latency_p99_s", "p99 time to the rejection of shed requests", "s"),
        Metric("replica_waiting_max", "largest vllm:num_requests_waiting seen on any replica", "req"),
        Metric("replica_inflight_max", "largest running + waiting seen on any replica", "req"),
        Metric("failed", "requests that got neither a complete stream nor a clean HTTP error", "", "lower"),
    ]

    def workload(self, quick: bool) -> Workload:
        duration = 10.0 if quick else 30.0
        rng = workload_rng(1)
        arrivals: list[Arrival] = []
        n = 0

        def add(t: float, kind: str) -> None:
            nonlocal n
            arrivals.append(Arrival(at=t, body=chat(PROMPT, OUT, salt=n), kind=kind))
            n += 1

        t = 0.1
        while t < duration:
            add(t, "background")
            t += rng.expovariate(BACKGROUND_RPS)
        for _ in range(PRE_BURST):
            add(4.0, "pre-burst")
        for i in range(BURST):
            add(5.0 + i / BURST, "burst")
        for i in range(POST_BURST):
            add(6.0 + i / POST_BURST, "post-burst")
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
            "replica_inflight_max": run.max_over_replicas("inflight"),
            "failed": float(len(failed)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        b, p = m.get("burst_ttft_p95_s"), m.get("ttft_p95_s")
        ok = b is not None and b > 2 * SLO_TTFT_S and p is not None and p > SLO_TTFT_S
        return ok, f"burst_ttft_p95_s {b} (needs > {2 * SLO_TTFT_S}), ttft_p95_s {p} (needs > {SLO_TTFT_S})"
