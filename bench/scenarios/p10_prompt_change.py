"""P10 a business changes its prompt and capacity drops: same users, same QPS, much lower throughput.

Workload (2 replicas, tiny-cpu, time_scale 1): one app (`x-sluice-app: agent-x`) sends 5 requests/s (seeded
Poisson), 48 output tokens each. Before the change its prompt is system 330 + knowledge 500 + user 170 = about
1,000 tokens (the document's 2K + 3K + 1K, divided by 6 for the tiny model); at t=5 s (quick) the app ships a
new prompt: system 1,330 + knowledge 1,670 + history 2,500 = about 5,500 tokens (8K + 10K + 15K, divided by 6).
QPS and users do not change; the pool's capacity for this app drops below the offered 5/s.

Headline metrics: `detect_s` = time from the change until the gateway reports the shift (sidecar metric
`sluice_prompt_shift_events_total` > 0; null when the metric is absent or never fires), and
`capacity_estimate_error` = |the gateway's capacity estimate for the app after the shift (sidecar gauge
`sluice_prompt_capacity_requests_per_second{app}`) - the measured capacity| / measured (null when there is no
estimate). The measured capacity is the pool's prompt-token throughput while saturated after the change (replica
counters) divided by the new prompt size.
Also `cost_ratio` (prompt tokens per request after / before, from usage), `ttft_p95_before_s`,
`ttft_p95_after_s`.
Reproduced on envoy-rr when ttft_p95_after_s / ttft_p95_before_s >= 3 at unchanged QPS and no system signal
(detect_s null).
Sluice knobs: `budgets.prompt_shift` (threshold 0.3, baseline_requests 15, sustain_requests 5) and
`streaming.sample_rate: 0.1` (observed responses calibrate the prompt-token estimate the capacity uses).
"""

from __future__ import annotations

import random
from typing import Any

from bench.openloop import Arrival
from bench.scenarios.base import MODEL, Metric, RunData, Scenario, Workload, mean, pct, rnd, text_of

SHIFT_METRIC = "sluice_prompt_shift_events_total"
CAPACITY_METRIC = "sluice_prompt_capacity_requests_per_second"


def body(system: int, knowledge: int, user: int, salt: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 48, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": text_of(system - 4, 1000 + system)},
                         {"role": "system", "content": text_of(knowledge - 4, 2000 + knowledge)},
                         {"role": "user", "content": text_of(user - 8, salt)}]}


class S(Scenario):
    id = "P10"
    title = "prompt change cuts capacity"
    problem = "a business changes its prompt and capacity drops"
    replicas = 2
    time_scale = 1.0
    poll_sidecar = (SHIFT_METRIC, CAPACITY_METRIC)
    sluice_policy = {"budgets": {"prompt_shift": {"enabled": True, "threshold": 0.3, "baseline_requests": 15,
                                                  "sustain_requests": 5}},
                     # observe 10% of responses: their usage calibrates the token estimate behind the capacity
                     "streaming": {"sample_rate": 0.1}}
    headline = ('detect_s', 'capacity_estimate_error', 'ttft_p95_after_s')
    metrics_doc = [
        Metric("detect_s", "prompt change -> the gateway reports the shift (none: no signal)", "s"),
        Metric("capacity_estimate_error", "|gateway capacity estimate - measured capacity| / measured", ""),
        Metric("cost_ratio", "prompt tokens per request after / before the change (usage)", "x", ""),
        Metric("measured_capacity_rps", "pool prompt tokens/s while saturated after the change / new prompt size",
               "req/s", ""),
        Metric("ttft_p95_before_s", "p95 TTFT before the change", "s"),
        Metric("ttft_p95_after_s", "p95 TTFT after the change (same QPS)", "s"),
    ]

    def phases(self, quick: bool) -> tuple[float, float]:
        return (5.0, 12.0) if quick else (10.0, 40.0)

    def workload(self, quick: bool) -> Workload:
        t_change, duration = self.phases(quick)
        rng = random.Random(10)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            after = t >= t_change
            b = body(1330, 1670, 2500, n) if after else body(330, 500, 170, n)
            arrivals.append(Arrival(at=t, body=b, kind="after" if after else "before",
                                    headers={"x-sluice-app": "agent-x"}))
            n += 1
            t += rng.expovariate(5.0)
        return Workload(arrivals=arrivals, duration=duration, drain=6.0)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ts = run.time_scale
        t_change = self.phases(run.extra.get("quick", True))[0] / ts
        before, after = run.recs("before"), run.recs("after")
        detect = run.first_time("sidecar", SHIFT_METRIC, lambda l, v: v > 0, after=t_change)
        # measured capacity: the pool's prompt-token throughput while saturated after the change (the
        # replicas' prompt_tokens counters, from 2 s after the change to the end of the load) divided by the
        # new prompt size; prefill dominates this workload's cost
        a, b = t_change + 2.0 / ts, run.duration
        measured = None
        pa_est = mean([float(r.prompt_tokens) for r in after if r.prompt_tokens])
        tps = 0.0
        for addr in run.replicas:
            pts = [(t, v) for t, v in run.series(addr, "prompt") if a <= t <= b]
            if len(pts) >= 2:
                tps += (pts[-1][1] - pts[0][1]) / ((pts[-1][0] - pts[0][0]) * ts)
        if pa_est and tps > 0:
            measured = tps / pa_est
        estimate = None
        for t, values in run.sidecar:
            if t >= t_change:
                for lbl, v in values.get(CAPACITY_METRIC, []):
                    if lbl.get("app") == "agent-x":
                        estimate = v
        pb = mean([float(r.prompt_tokens) for r in before if r.prompt_tokens])
        pa = mean([float(r.prompt_tokens) for r in after if r.prompt_tokens])
        err = abs(estimate - measured) / measured if estimate is not None and measured else None
        return {
            "detect_s": rnd((detect - t_change) * ts, 2) if detect is not None else None,
            "capacity_estimate_error": rnd(err),
            "cost_ratio": rnd(pa / pb, 2) if pa and pb else None,
            "measured_capacity_rps": rnd(measured, 2),
            "ttft_p95_before_s": rnd(pct(run.ttfts(before), 95)),
            "ttft_p95_after_s": rnd(pct(run.ttfts(after), 95)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        b, a = m.get("ttft_p95_before_s"), m.get("ttft_p95_after_s")
        slow = b is not None and a is not None and b > 0 and a / b >= 3
        return (slow and m.get("detect_s") is None,
                f"ttft_p95 after/before {rnd(a / b, 1) if slow or (a and b) else None} (needs >= 3), "
                f"detect_s {m.get('detect_s')} (needs none)")
