"""P6 thundering herd: the model is down, the backlog waits, and all of it rushes back on the first green check.

Workload (3 replicas, tiny-cpu, time_scale 1): users send requests of 1,000 prompt and 32 output tokens at
40/s (seeded Poisson, about half the pool's capacity). Clients retry like the openai SDK (max_retries 2,
backoff 0.5 s x 2^n) inside a business loop that tries again every second up to 8 times, so users keep
knocking while the model is down. At t=3 s every replica crashes (`crash` fault: connections refused, state
lost); at t=8 s they `recover` with empty engines (the document's 30 s outage and 1,000 queued requests,
scaled). The backlog of retrying users and the new arrivals land on the fresh replicas at once.

A replica is "over its limit" while `num_requests_waiting` > 16 (it then misses the TTFT SLO of 2 s); it is back
under when waiting <= 8.

Headline metrics: `recollapses` = times a replica crossed over its limit after recovery (summed over
replicas), `time_to_full_s` = time from recovery until the pool completes requests at 90 % of its pre-outage
rate (1 s windows), `ttft_p95_after_s` (attempts sent in the 3 s after recovery), `goodput_after_rps`.
Reproduced on envoy-rr when recollapses >= 1.
Sluice knobs: `routing.health.slow_start_steps: [0.1, 0.3, 0.5, 1.0]` with `slow_start_step_s: 1` (the
scenario is short) and `admission.max_wait_s: 5` (paced release of the backlog).
"""

from __future__ import annotations

import random

from bench.openloop import Arrival, ClientSpec
from bench.scenarios.base import Fault, Metric, RunData, Scenario, Workload, chat, pct, rnd

OVER, UNDER = 16, 8
SLO_TTFT_S = 2.0


class S(Scenario):
    id = "P6"
    title = "thundering herd after recovery"
    problem = "everything rushes back when the model recovers"
    replicas = 3
    time_scale = 1.0
    sluice_policy = {"routing": {"health": {"slow_start_steps": [0.1, 0.3, 0.5, 1.0], "slow_start_step_s": 1.0}},
                     "admission": {"max_wait_s": 5.0}}
    headline = ('recollapses', 'time_to_full_s', 'goodput_after_rps')
    metrics_doc = [
        Metric("recollapses", f"times a replica went over its limit (waiting > {OVER}) after recovery", ""),
        Metric("time_to_full_s", "recovery -> pool completes at 90 % of its pre-outage rate", "s"),
        Metric("replica_waiting_max_after", "largest replica waiting queue after recovery", "req"),
        Metric("ttft_p95_after_s", "p95 TTFT of attempts sent in the 3 s after recovery", "s"),
        Metric("goodput_after_rps", f"completions with TTFT <= {SLO_TTFT_S} s per second after recovery", "req/s",
               "higher"),
    ]

    def phases(self, quick: bool) -> tuple[float, float, float]:
        return (3.0, 8.0, 13.0) if quick else (5.0, 35.0, 50.0)

    def workload(self, quick: bool) -> Workload:
        down, up, duration = self.phases(quick)
        rng = random.Random(6)
        spec = ClientSpec(sdk_max_retries=2, sdk_backoff_s=0.5, business_retries=8, business_backoff_s=1.0,
                          timeout_s=20.0)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            arrivals.append(Arrival(at=t, body=chat(1000, 32, salt=n), kind="user", client=spec))
            n += 1
            t += rng.expovariate(40.0)
        faults = [Fault(down, i, "crash") for i in range(self.replicas)]
        faults += [Fault(up, i, "recover") for i in range(self.replicas)]
        return Workload(arrivals=arrivals, duration=duration, drain=6.0, faults=faults)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        quick = run.extra.get("quick", True)
        ts = run.time_scale
        down, up, _d = (x / ts for x in self.phases(quick))
        rec_t = [e["t"] for e in run.events if e["fault"] == "recover"]
        t_up = max(rec_t) if rec_t else up
        recollapses = 0
        wmax = 0.0
        for addr in run.replicas:
            over = False
            for x in run.samples.get(addr, []):
                if x["t"] < t_up or x.get("waiting") is None:
                    continue
                w = x["waiting"]
                wmax = max(wmax, w)
                if not over and w > OVER:
                    over = True
                    recollapses += 1
                elif over and w <= UNDER:
                    over = False
        # completion rate per 1 s window from the client's view (successful attempts by end time)
        ends = sorted(r.end for r in run.records if r.ok and r.end is not None)
        win = 1.0 / ts

        def rate(a: float, b: float) -> float:
            return sum(1 for e in ends if a <= e < b) / ((b - a) * ts)

        base = rate(max(0.0, down - 2.0 * win), down)
        time_to_full = None
        t = t_up
        horizon = max(ends) if ends else t_up
        while t + win <= horizon + 1e-9:
            if base > 0 and rate(t, t + win) >= 0.9 * base:
                time_to_full = (t + win - t_up) * ts
                break
            t += win / 4
        after = [r for r in run.records if t_up <= r.start <= t_up + 3.0 / ts]
        good_after = [r for r in run.records if r.ok and r.start >= t_up and r.ttft is not None
                      and r.ttft * ts <= SLO_TTFT_S]
        span = (run.duration - t_up) * ts
        return {
            "recollapses": float(recollapses),
            "time_to_full_s": rnd(time_to_full, 2),
            "replica_waiting_max_after": wmax,
            "ttft_p95_after_s": rnd(pct(run.ttfts(after), 95)),
            "goodput_after_rps": rnd(len(good_after) / span, 2) if span > 0 else None,
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("recollapses")
        return (v is not None and v >= 1), f"recollapses {v} (needs >= 1)"
