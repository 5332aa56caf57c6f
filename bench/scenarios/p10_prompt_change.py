"""P10 a business changes its prompt and capacity drops: same users, same QPS, much lower throughput.

Workload (2 replicas, tiny-cpu, time_scale 1): one app (`x-sluice-app: agent-x`) sends 48 output tokens per
request at twice the pool's capacity for the NEW prompt (`2 x 2 x capacity_rps(5500, 48)`, bench/capacity.py:
2.3 requests/s at the calibrated tiny-cpu, a tenth of the pool's capacity for the old prompt; seeded
Poisson). Before the change its prompt is system 330 + knowledge 500 + user 170 = about 1,000 tokens (the
document's 2K + 3K + 1K, divided by 6 for the tiny model); at t=5 s (quick) the app ships a new prompt: system
1,330 + knowledge 1,670 + history 2,500 = about 5,500 tokens (8K + 10K + 15K, divided by 6). QPS and users do
not change; the pool's capacity for this app drops to half the offered rate. Every prompt is unique from its
first token (the request's salt leads the system prompt): the prefix cache plays no part, so the cost model's
capacity for a 5,500-token prompt is the true one.

SLO: the first token within `slo_ttft_s(ttft_alone(5,500))` (5x the new prompt's TTFT on an idle replica,
rounded up: 8 s at the calibrated preset; the user keeps one SLO that the new prompt can meet) of the user's
first send (retries included) and the response completed.
Classes: `before` and `after` the change.

Headline metrics: `slo_goodput_rps`, `detect_s` = time from the change until the gateway reports the shift
(sidecar metric `sluice_prompt_shift_events_total` > 0; null when the metric is absent or never fires), and
`capacity_estimate_error` = |the gateway's capacity estimate for the app after the shift (sidecar gauge
`sluice_prompt_capacity_requests_per_second{app}`, its last value) - the pool's true capacity| / true capacity.
The true capacity comes from the simulator's cost model, not from anything the gateway could read:
`bench.capacity.capacity_rps` drives the preset's engine offline, saturated with the new requests (prompt size
from the responses' usage, 48 output tokens), times the replicas (`true_capacity_rps`).
Also `rejected_after` (attempts of the new prompt answered 4xx/5xx), `cost_ratio` (prompt tokens per request
after / before, from usage), `ttft_p95_before_s`, `ttft_p95_after_s` (attempts, censored).
Reproduced on envoy-rr when ttft_p95_after_s / ttft_p95_before_s >= 3 at unchanged QPS and no system signal
(detect_s null).
Sluice is told: the SLO (`admission.ttft_target_s`). The prompt-shift detector runs at its shipped defaults
(`budgets.prompt_shift`: enabled, threshold 0.3, baseline_requests 20, sustain_requests 5); responses are not
observed (`streaming.sample_rate` 0, the default): prompt estimates are calibrated from the engines' counters.
"""

from __future__ import annotations

from typing import Any

from bench.openloop import Arrival
from bench.capacity import BENCH_PRESET, EngineSpec, capacity_rps, engine_capacity_rps, slo_ttft_s, ttft_alone_s
from bench.scenarios.base import MODEL, Metric, RunData, Scenario, Workload, mean, pct, rnd, text_of, workload_rng

SHIFT_METRIC = "sluice_prompt_shift_events_total"
CAPACITY_METRIC = "sluice_prompt_capacity_requests_per_second"


OUTPUT = 48
AFTER_PROMPT = 5500  # system 1,330 + knowledge 1,670 + history 2,500 (the usage's count replaces it when known)
SPEC = EngineSpec.of(BENCH_PRESET)
RATE = 2 * 2 * capacity_rps(SPEC, AFTER_PROMPT, OUTPUT)
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, AFTER_PROMPT))


def body(system: int, knowledge: int, user: int, salt: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": OUTPUT, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": text_of(system - 4, salt)},
                         {"role": "system", "content": text_of(knowledge - 4, 2000 + knowledge)},
                         {"role": "user", "content": text_of(user - 8, salt)}]}


class S(Scenario):
    id = "P10"
    title = "prompt change cuts capacity"
    problem = "a business changes its prompt and capacity drops"
    replicas = 2
    time_scale = 1.0
    poll_sidecar = (SHIFT_METRIC, CAPACITY_METRIC)
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"rate (req/s)": RATE}
    headline = ('slo_goodput_rps', 'detect_s', 'capacity_estimate_error')
    metrics_doc = [
        Metric("detect_s", "prompt change -> the gateway reports the shift (none: no signal)", "s"),
        Metric("capacity_estimate_error", "|gateway capacity estimate - true capacity| / true capacity", ""),
        Metric("capacity_estimate_rps", "the gateway's capacity estimate for the app after the change", "req/s", ""),
        Metric("true_capacity_rps", "the pool's capacity for the new requests, from the simulator's cost model",
               "req/s", ""),
        Metric("rejected_after", "attempts of the new prompt answered 4xx/5xx", "", ""),
        Metric("cost_ratio", "prompt tokens per request after / before the change (usage)", "x", ""),
        Metric("ttft_p95_before_s", "p95 TTFT before the change", "s"),
        Metric("ttft_p95_after_s", "p95 TTFT after the change (same QPS)", "s"),
    ]

    def phases(self, quick: bool) -> tuple[float, float]:
        return (5.0, 12.0) if quick else (10.0, 40.0)

    def workload(self, quick: bool) -> Workload:
        t_change, duration = self.phases(quick)
        rng = workload_rng(10)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            after = t >= t_change
            b = body(1330, 1670, 2500, n) if after else body(330, 500, 170, n)
            arrivals.append(Arrival(at=t, body=b, kind="after" if after else "before",
                                    headers={"x-sluice-app": "agent-x"}))
            n += 1
            t += rng.expovariate(RATE)
        return Workload(arrivals=arrivals, duration=duration, drain=4.0)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ts = run.time_scale
        t_change = self.phases(run.extra.get("quick", True))[0] / ts
        before, after = run.recs("before"), run.recs("after")
        detect = run.first_time("sidecar", SHIFT_METRIC, lambda l, v: v > 0, after=t_change)
        pb = mean([float(r.prompt_tokens) for r in before if r.prompt_tokens])
        pa = mean([float(r.prompt_tokens) for r in after if r.prompt_tokens])
        spec = EngineSpec.of(self.preset, self.sim_args)
        true_cap = len(run.replicas) * engine_capacity_rps(spec, round(pa or AFTER_PROMPT), OUTPUT)
        estimate = None
        for t, values in run.sidecar:
            if t >= t_change:
                for lbl, v in values.get(CAPACITY_METRIC, []):
                    if lbl.get("app") == "agent-x":
                        estimate = v
        err = abs(estimate - true_cap) / true_cap if estimate is not None and true_cap else None
        return {
            "detect_s": rnd((detect - t_change) * ts, 2) if detect is not None else None,
            "capacity_estimate_error": rnd(err),
            "capacity_estimate_rps": rnd(estimate, 2),
            "true_capacity_rps": rnd(true_cap, 2),
            "rejected_after": float(sum(1 for r in after if 400 <= r.status < 600)),
            "cost_ratio": rnd(pa / pb, 2) if pa and pb else None,
            "ttft_p95_before_s": rnd(pct(run.ttfts(before), 95)),
            "ttft_p95_after_s": rnd(pct(run.ttfts(after), 95)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        b, a = m.get("ttft_p95_before_s"), m.get("ttft_p95_after_s")
        slow = b is not None and a is not None and b > 0 and a / b >= 3
        return (slow and m.get("detect_s") is None,
                f"ttft_p95 after/before {rnd(a / b, 1) if slow or (a and b) else None} (needs >= 3), "
                f"detect_s {m.get('detect_s')} (needs none)")
