"""P1f fairness: one tenant floods at 10x another's rate; does the other tenant keep its TTFT?

A variant of P1 (a flood peak) where the flood comes from one tenant. Workload (3 replicas, tiny-cpu,
time_scale 1): tenant `steady` sends chat requests of 2,000 prompt and 32 output tokens at 4/s (seeded
Poisson) all along; it is alone for the first 10 s (its solo value). From t=10 s to the end (22 s) tenant
`flood` sends the same requests at 40/s (10x), about 1.5x what the pool can prefill. Tenants
are named the way the gateway identifies them without API keys: the `x-sluice-tenant` header.

Headline metrics: `other_tenant_ttft_p95_ratio` = `steady`'s p95 TTFT while the flood runs / its p95 TTFT alone,
measured side by side in the same run (the first second of the flood is left out: the phase change itself).
A request of `steady` refused by the gateway has no TTFT, so the shares of `steady` refused or failed are
reported too (`other_tenant_refused`): a ratio bought by refusing the quiet tenant would show there.
Reproduced on envoy-rr when the ratio is >= 3 (round robin serves the tenants in arrival order: the quiet
tenant waits behind the flood's queue).
Sluice knobs: `admission.ttft_target_s: 0.3` (keep each replica's own prefill backlog short: a quiet tenant's
request put ahead of the flood by the fair queue must not then wait behind the flood inside the engine) and
`admission.max_wait_s: 1.0`; tenants at equal weight (the token-weighted fair queue, `extproc/admission/queue.py`);
`admission.tenant_prefill_share: 0.5` (opt-in, off by default: while one tenant dominates, it may prefill on at
most half of the replicas, so a quiet tenant's prompt starts on a free replica; the flood's throughput pays).

"""

from __future__ import annotations

import random

from bench.openloop import Arrival
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, pct, ratio, rnd

PROMPT, OUT = 2000, 32
STEADY_RPS = 4.0
FLOOD_X = 10.0
SETTLE_S = 1.0  # seconds after the flood starts left out of the flood phase


class S(Scenario):
    id = "P1f"
    title = "fairness (one tenant floods at 10x)"
    problem = "instant flood peaks, not sustained load (from one tenant)"
    replicas = 3
    time_scale = 1.0
    sluice_policy = {"admission": {"ttft_target_s": 0.3, "max_wait_s": 1.0, "tenant_prefill_share": 0.5}}
    headline = ("other_tenant_ttft_p95_ratio", "other_tenant_ttft_p95_s", "other_tenant_ttft_p95_solo_s")
    metrics_doc = [
        Metric("other_tenant_ttft_p95_ratio", "steady tenant's p95 TTFT with the flood / alone", "x"),
        Metric("other_tenant_ttft_p95_s", "steady tenant's p95 TTFT while the other tenant floods", "s"),
        Metric("other_tenant_ttft_p95_solo_s", "steady tenant's p95 TTFT alone (first phase)", "s"),
        Metric("other_tenant_refused", "share of the steady tenant's requests refused or failed during the flood",
               "", "lower"),
        Metric("flood_goodput_rps", "flooding tenant's requests completed per second of the flood", "req/s",
               "higher"),
    ]

    def phases(self, quick: bool) -> tuple[float, float]:
        """(flood start, end of offered load), scenario seconds."""
        return (10.0, 22.0) if quick else (20.0, 50.0)

    def workload(self, quick: bool) -> Workload:
        t_flood, duration = self.phases(quick)
        arrivals: list[Arrival] = []
        n = 0
        for tenant, rate, start, seed in (("steady", STEADY_RPS, 0.1, 21), ("flood", STEADY_RPS * FLOOD_X, t_flood, 22)):
            rng = random.Random(seed)
            t = start
            while t < duration:
                arrivals.append(Arrival(at=t, body=chat(PROMPT, OUT, salt=n), kind=tenant,
                                        headers={"x-sluice-tenant": tenant}))
                n += 1
                t += rng.expovariate(rate)
        return Workload(arrivals=arrivals, duration=duration, drain=4.0)  # quick budget: 26 s per system-run

    def metrics(self, run: RunData) -> dict[str, float | None]:
        t_flood, duration = (x / run.time_scale for x in self.phases(run.extra.get("quick", True)))
        steady = run.recs("steady")
        solo = [r for r in steady if r.start < t_flood]
        busy = [r for r in steady if r.start >= t_flood + SETTLE_S / run.time_scale]
        solo_p95 = pct(run.ttfts([r for r in solo if r.status == 200]), 95)
        busy_p95 = pct(run.ttfts([r for r in busy if r.status == 200]), 95)
        refused = [r for r in busy if not r.ok]
        flood_ok = [r for r in run.recs("flood") if r.ok]
        return {
            "other_tenant_ttft_p95_ratio": rnd(ratio(busy_p95, solo_p95), 2),
            "other_tenant_ttft_p95_s": rnd(busy_p95),
            "other_tenant_ttft_p95_solo_s": rnd(solo_p95),
            "other_tenant_refused": rnd(len(refused) / len(busy)) if busy else None,
            "flood_goodput_rps": rnd(len(flood_ok) / ((duration - t_flood) * run.time_scale), 2),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        r = m.get("other_tenant_ttft_p95_ratio")
        return r is not None and r >= 3, f"other_tenant_ttft_p95_ratio {r} (needs >= 3)"
