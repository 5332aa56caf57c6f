"""P8 half-dead replica: /health says 200, TTFT is 40 s.

Workload (3 replicas, tiny-cpu, time_scale 1): requests of 500 prompt (unique: no shared prefix) and 32
output tokens at a third of the pool's capacity for them (`3 x capacity_rps(500, 32)`, bench/capacity.py: 27
requests/s at the calibrated tiny-cpu; seeded Poisson). At t=3 s replica 0 turns half-dead: the `slow` fault
makes every engine step 20x longer (its third of the load becomes 6.7x what it can serve: TTFT from tens of ms
to seconds and growing) while its /health keeps answering 200 and it keeps accepting connections. Clients
wait up to 30x the SLO (15 s). On a pool of two (the real engines, `--backend vllm-cpu`, or `--replicas 2`) the
rate follows the pool (`rate_rps`: a third of its capacity) and the sick replica gets half of it under round robin.

SLO: the first token within `slo_ttft_s(ttft_alone(500))` (5x the TTFT on an idle replica, at least 0.5 s,
rounded up: 0.5 s at the calibrated preset) of the user's first send (retries included) and the response
completed.
Classes: `before` and `after` the fault (by the user request's first send).

Headline metrics: `slo_goodput_rps`, `detect_s` = time from the fault until the gateway reports the replica
unhealthy (sluice: a sidecar metric `sluice_replica_state{replica=...,state!="healthy"}` = 1 or
`sluice_replica_healthy{replica}` = 0; envoy-tuned: Envoy's outlier detection
`envoy_cluster_outlier_detection_ejections_active` > 0; null when the system has no such signal or never raised
it), `sick_share_after_detect` = share of new requests sent to the sick replica after detection (when nothing is
detected: after the fault starts; a fair share is 0.33), `ttft_p95_s` of attempts sent after the fault (censored).
Reproduced on envoy-rr when sick_share_after_detect >= 0.25 (no detection, the sick replica keeps its share).
Sluice is told: the SLO (`admission.ttft_target_s`); business health (`routing.health`: the degraded TTFT
threshold, 15 s by default, TPS floor, error rate, drain, probe, slow start) at its defaults.
"""

from __future__ import annotations


from bench.openloop import Arrival, ClientSpec
from bench.capacity import BENCH_PRESET, EngineSpec, pool_rps, slo_ttft_s, ttft_alone_s
from bench.scenarios.base import Call, Fault, Metric, RunData, Scenario, Workload, chat, pct, phase_of, rnd, workload_rng

SLOW = 20.0
PROMPT, OUT = 500, 32
SPEC = EngineSpec.of(BENCH_PRESET)
LOAD = 1 / 3  # of the pool's capacity


def rate_rps(replicas: int) -> float:
    return LOAD * pool_rps(SPEC, replicas, PROMPT, OUT)


RATE = rate_rps(3)
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, PROMPT))
CLIENT_TIMEOUT_S = 30 * SLO_TTFT_S


class S(Scenario):
    id = "P8"
    title = "half-dead replica"
    problem = "health 200 but TTFT 40 s"
    replicas = 3
    time_scale = 1.0
    poll_sidecar = ("sluice_replica_state", "sluice_replica_healthy")
    poll_envoy = ("envoy_cluster_outlier_detection_ejections_active",)
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"rate (req/s)": RATE, "client timeout (s)": CLIENT_TIMEOUT_S}
    headline = ('slo_goodput_rps', 'detect_s', 'sick_share_after_detect')
    metrics_doc = [
        Metric("detect_s", "fault -> the gateway reports the replica unhealthy (none: no signal)", "s"),
        Metric("sick_share_after_detect", "share of new requests sent to the sick replica after detection "
               "(or after the fault when nothing detects it); fair share 0.33", ""),
        Metric("ttft_p95_s", "p95 TTFT of requests sent after the fault", "s"),
        Metric("failed_after", "requests sent after the fault that did not complete", ""),
    ]

    def phases(self, quick: bool) -> tuple[float, float]:
        # quick: 9 s after the fault (the bar's 10 s detection leaves little to judge after it; the full run has 35 s)
        return (3.0, 12.0) if quick else (5.0, 40.0)

    def workload(self, quick: bool) -> Workload:
        t_fault, duration = self.phases(quick)
        rng = workload_rng(8)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            arrivals.append(Arrival(at=t, body=chat(PROMPT, OUT, salt=n), kind="user",
                                    client=ClientSpec(timeout_s=CLIENT_TIMEOUT_S)))
            n += 1
            t += rng.expovariate(rate_rps(self.replicas))
        return Workload(arrivals=arrivals, duration=duration, drain=3.0, faults=[Fault(t_fault, 0, "slow", SLOW)])

    def call_class(self, call: Call, run: RunData) -> str:
        return phase_of(call, run, [("before", self.phases(run.extra.get("quick", True))[0])], "after")

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ts = run.time_scale
        faults = [e for e in run.events if e["fault"] == "slow"]
        t_fault = faults[0]["t"] if faults else self.phases(run.extra.get("quick", True))[0] / ts
        sick = run.replicas[0]
        detect = None
        if run.system == "sluice":
            a = run.first_time("sidecar", "sluice_replica_state",
                               lambda l, v: l.get("replica") == sick and l.get("state") != "healthy" and v >= 1,
                               after=t_fault)
            b = run.first_time("sidecar", "sluice_replica_healthy",
                               lambda l, v: l.get("replica") == sick and v == 0, after=t_fault)
            cands = [x for x in (a, b) if x is not None]
            detect = min(cands) if cands else None
        else:
            detect = run.first_time("envoy", "envoy_cluster_outlier_detection_ejections_active",
                                    lambda l, v: v > 0, after=t_fault)
        t_from = detect if detect is not None else t_fault
        after_fault = [r for r in run.records if r.start >= t_fault]
        return {
            "detect_s": rnd((detect - t_fault) * ts, 2) if detect is not None else None,
            "sick_share_after_detect": rnd(self.sick_share(run, sick, t_from)),
            "ttft_p95_s": rnd(pct(run.ttfts(after_fault), 95)),
            "failed_after": float(sum(1 for r in after_fault if not r.ok)),
        }

    @staticmethod
    def sick_share(run: RunData, sick: str, t_from: float) -> float | None:
        """Share of the requests sent from `t_from` on that went to `sick`: by the replica each response names
        (simulators), or, where responses name none (real engines), by what each engine received meanwhile
        (`RunData.received_after`)."""
        after = [r for r in run.records if r.start >= t_from and r.replica]
        if after:
            return sum(1 for r in after if r.replica == sick) / len(after)
        got = {a: run.received_after(a, t_from) for a in run.replicas}
        total = sum(v for v in got.values() if v is not None)
        return (got[sick] or 0.0) / total if total > 0 else None

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("sick_share_after_detect")
        return (v is not None and v >= 0.25), f"sick_share_after_detect {v} (needs >= 0.25), detect_s {m.get('detect_s')}"
