"""P6 thundering herd: the model is down, the backlog waits, and all of it rushes back on the first green check.

Workload (3 replicas, tiny-cpu, time_scale 1): users send requests of 1,000 prompt (unique: no shared prefix)
and 32 output tokens at half the pool's capacity for them (`3 x capacity_rps(1000, 32)`, bench/capacity.py: 17
requests/s at the calibrated tiny-cpu; seeded Poisson). Clients retry like the openai SDK (max_retries 2,
backoff 0.5 s x 2^n) inside a business loop that tries again every second up to 8 times, so users keep
knocking while the model is down. At t=3 s every replica crashes (`crash` fault: connections refused, state
lost); at t=8 s they `recover` with empty engines (the document's 30 s outage and 1,000 queued requests,
scaled). The backlog of retrying users and the new arrivals land on the fresh replicas at once.

SLO: the first token within `slo_ttft_s(ttft_alone(1,000))` (5x the TTFT on an idle replica, at least 0.5 s,
rounded up: 0.5 s at the calibrated preset) of the user's first send (SDK and business retries included) and
the response completed. Classes: `before` the crash, during the `outage`, `after` the recovery (by the user request's first
send).

The collapse is judged where the users see it, not in a queue a gateway controls: the pool's SLO goodput per
1 s window (calls meeting the SLO, by the time of their first token). The pool is "recovered" in the first
window after the recovery at >= 90 % of its rate in the 2 s before the crash; it "recollapses" each time a
later window falls under 50 % of that rate (counted again only after it was back at >= 90 %). A gateway that
lets the herd through and one that refuses it both fail this.

Headline metrics: `slo_goodput_rps`, `recollapses`, `time_to_full_s` (recovery -> first recovered window),
`replica_inflight_max_after` (running + waiting on one replica after recovery, informational), `ttft_p95_after_s`
(user requests first sent in the 3 s after recovery, censored).
Reproduced on envoy-rr when replica_inflight_max_after > OVER (the herd lands in the engines: a replica with
more requests in it, running or waiting, than it completes within the SLO, `SLO x capacity_rps`, misses the
SLO; requests all run at once on an engine of 64 sequences, so running counts, not only waiting) or
recollapses >= 1.
Sluice is told: the SLO (`admission.ttft_target_s`); slow start (`routing.health.slow_start_*`) and the queue
wait at their defaults.
"""

from __future__ import annotations


from bench.openloop import Arrival, ClientSpec
from bench.capacity import BENCH_PRESET, EngineSpec, capacity_rps, slo_ttft_s, ttft_alone_s
from bench.scenarios.base import Call, Fault, Metric, RunData, Scenario, Workload, chat, pct, phase_of, rnd, workload_rng

PROMPT, OUT = 1000, 32
SPEC = EngineSpec.of(BENCH_PRESET)
RATE = 0.5 * 3 * capacity_rps(SPEC, PROMPT, OUT)
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, PROMPT))
OVER = max(1, round(SLO_TTFT_S * capacity_rps(SPEC, PROMPT, OUT)))  # requests in a replica beyond the SLO


class S(Scenario):
    id = "P6"
    title = "thundering herd after recovery"
    problem = "everything rushes back when the model recovers"
    replicas = 3
    time_scale = 1.0
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"rate (req/s)": RATE, "OVER (req)": OVER}
    headline = ('slo_goodput_rps', 'recollapses', 'time_to_full_s')
    metrics_doc = [
        Metric("recollapses", "times the pool's SLO goodput fell under 50 % of its pre-outage rate after it had "
               "recovered (1 s windows)", ""),
        Metric("time_to_full_s", "recovery -> the pool's SLO goodput is back at 90 % of its pre-outage rate", "s"),
        Metric("replica_inflight_max_after", "most requests (running + waiting) in one replica after recovery",
               "req"),
        Metric("ttft_p95_after_s", "p95 TTFT of user requests first sent in the 3 s after recovery", "s"),
    ]

    def phases(self, quick: bool) -> tuple[float, float, float]:
        return (3.0, 8.0, 13.0) if quick else (5.0, 35.0, 50.0)

    def workload(self, quick: bool) -> Workload:
        down, up, duration = self.phases(quick)
        rng = workload_rng(6)
        spec = ClientSpec(business_retries=8, business_backoff_s=1.0, timeout_s=20.0)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            arrivals.append(Arrival(at=t, body=chat(PROMPT, OUT, salt=n), kind="user", client=spec))
            n += 1
            t += rng.expovariate(RATE)
        faults = [Fault(down, i, "crash") for i in range(self.replicas)]
        faults += [Fault(up, i, "recover") for i in range(self.replicas)]
        return Workload(arrivals=arrivals, duration=duration, drain=4.0, faults=faults)

    def call_class(self, call: Call, run: RunData) -> str:
        down, up, _d = self.phases(run.extra.get("quick", True))
        return phase_of(call, run, [("before", down), ("outage", up)], "after")

    def metrics(self, run: RunData) -> dict[str, float | None]:
        quick = run.extra.get("quick", True)
        ts = run.time_scale
        down, up, _d = (x / ts for x in self.phases(quick))
        rec_t = [e["t"] for e in run.events if e["fault"] == "recover"]
        t_up = max(rec_t) if rec_t else up
        wmax = max([x["inflight"] for ss in run.samples.values() for x in ss
                    if x["t"] >= t_up and x.get("inflight") is not None], default=0.0)
        calls = run.calls()
        good_at = sorted(c.final.first_token for c in calls
                         if c.ok and c.ttft is not None and c.ttft * ts <= SLO_TTFT_S)
        win = 1.0 / ts

        def rate(a: float, b: float) -> float:
            return sum(1 for e in good_at if a <= e < b) / ((b - a) * ts)

        base = rate(max(0.0, down - 2.0 * win), down)
        time_to_full, recollapses, low = None, 0, False
        t = t_up
        horizon = run.duration
        while t + win <= horizon + 1e-9 and base > 0:
            r = rate(t, t + win)
            if time_to_full is None:
                if r >= 0.9 * base:
                    time_to_full = (t + win - t_up) * ts
            elif not low and r < 0.5 * base:
                low, recollapses = True, recollapses + 1
            elif low and r >= 0.9 * base:
                low = False
            t += win / 4
        after = [c for c in calls if t_up <= c.first_send <= t_up + 3.0 / ts]
        return {
            "recollapses": float(recollapses),
            "time_to_full_s": rnd(time_to_full, 2),
            "replica_inflight_max_after": wmax,
            "ttft_p95_after_s": rnd(pct([c.waited * ts for c in after], 95)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v, w = m.get("recollapses"), m.get("replica_inflight_max_after")
        ok = (v is not None and v >= 1) or (w is not None and w > OVER)
        return ok, f"recollapses {v} (needs >= 1) or replica_inflight_max_after {w} (needs > {OVER})"
