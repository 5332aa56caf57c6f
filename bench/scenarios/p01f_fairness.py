"""P1f fairness: one tenant floods at 10x another's rate; does the other tenant keep its TTFT?

A variant of P1 (a flood peak) where the flood comes from one tenant. Workload (3 replicas, tiny-cpu,
time_scale 1): chat requests of 1,000 prompt and 32 output tokens (unique prompts: no shared prefix). With
`CAP` = 3 x `capacity_rps(1000, 32)` (bench/capacity.py, the preset's cost model; 34 requests/s at the
calibrated tiny-cpu), tenant `flood` sends 1.5 x CAP (half as much again as the pool can serve) and tenant
`steady` a tenth of that, 0.15 x CAP (seeded Poisson). `steady` is alone for the first 8 s (quick; 20 s full:
its solo value); from then to the end (18 s quick) `flood` runs too. Tenants are named the way the gateway
identifies them without API keys: the `x-sluice-tenant` header.

SLO: the first token within `slo_ttft_s(ttft_alone(1,000))` (5x the TTFT on an idle replica, at least 0.5 s,
rounded up: 0.5 s at the calibrated preset) of the user's first send (retries included) and the response
completed. Classes: the tenants `steady` and `flood`.

Headline metrics: `slo_goodput_rps`, `other_tenant_ttft_p95_ratio` = `steady`'s p95 TTFT while the flood runs /
its p95 TTFT alone, measured side by side in the same run (the first second of the flood is left out: the phase
change itself), both from the first send of each user request, refused ones censored at the time their user
waited. `other_tenant_refused`: share of `steady`'s requests that ended refused or failed during the flood.
Reproduced on envoy-rr when the ratio is >= 3 (round robin serves the tenants in arrival order: the quiet
tenant waits behind the flood's queue).
Sluice is told: the SLO (`admission.ttft_target_s`). The tenants are named by the `x-sluice-tenant` header,
which the sidecar trusts by default (`tenants.trust_tenant_header`), so no tenant setting is needed; the fair
queue treats them at equal weight (default). `admission.tenant_prefill_share` stays at its default (1.0: off).
`envoy-tuned` gets a per-tenant `local_ratelimit` (bench/baselines.py: each tenant at most half the pool).
"""

from __future__ import annotations


from bench.openloop import Arrival
from bench.capacity import BENCH_PRESET, EngineSpec, pool_rps, slo_ttft_s, ttft_alone_s
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, pct, ratio, rnd, workload_rng

PROMPT, OUT = 1000, 32
SPEC = EngineSpec.of(BENCH_PRESET)
CAP = pool_rps(SPEC, 3, PROMPT, OUT)
FLOOD_X = 10.0
STEADY_RPS = 1.5 * CAP / FLOOD_X
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, PROMPT))
SETTLE_S = 1.0  # seconds after the flood starts left out of the flood phase


class S(Scenario):
    id = "P1f"
    title = "fairness (one tenant floods at 10x)"
    problem = "instant flood peaks, not sustained load (from one tenant)"
    replicas = 3
    time_scale = 1.0
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"CAP (req/s)": CAP, "steady (req/s)": STEADY_RPS, "flood (req/s)": STEADY_RPS * FLOOD_X}
    tenant_requests = {"steady": (PROMPT, OUT), "flood": (PROMPT, OUT)}
    headline = ("slo_goodput_rps", "other_tenant_ttft_p95_ratio", "other_tenant_ttft_p95_s")
    metrics_doc = [
        Metric("other_tenant_ttft_p95_ratio", "steady tenant's p95 TTFT with the flood / alone", "x"),
        Metric("other_tenant_ttft_p95_s", "steady tenant's p95 TTFT while the other tenant floods", "s"),
        Metric("other_tenant_ttft_p95_solo_s", "steady tenant's p95 TTFT alone (first phase)", "s"),
        Metric("other_tenant_refused", "share of the steady tenant's requests refused or failed during the flood",
               "", "lower"),
        Metric("flood_goodput_rps", "flooding tenant's requests completed (any TTFT) per second of the flood", "req/s",
               "higher"),
    ]

    def phases(self, quick: bool) -> tuple[float, float]:
        """(flood start, end of offered load), scenario seconds."""
        return (8.0, 18.0) if quick else (20.0, 50.0)

    def workload(self, quick: bool) -> Workload:
        t_flood, duration = self.phases(quick)
        arrivals: list[Arrival] = []
        n = 0
        for tenant, rate, start, seed in (("steady", STEADY_RPS, 0.1, 21), ("flood", STEADY_RPS * FLOOD_X, t_flood, 22)):
            rng = workload_rng(seed)
            t = start
            while t < duration:
                arrivals.append(Arrival(at=t, body=chat(PROMPT, OUT, salt=n), kind=tenant,
                                        headers={"x-sluice-tenant": tenant}))
                n += 1
                t += rng.expovariate(rate)
        return Workload(arrivals=arrivals, duration=duration, drain=3.0)  # quick budget: 21 s per system-run

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ts = run.time_scale
        t_flood, duration = (x / ts for x in self.phases(run.extra.get("quick", True)))
        steady = [c for c in run.calls() if c.kind == "steady"]
        solo = [c for c in steady if c.first_send < t_flood]
        busy = [c for c in steady if c.first_send >= t_flood + SETTLE_S / ts]
        solo_p95 = pct([c.waited * ts for c in solo], 95)
        busy_p95 = pct([c.waited * ts for c in busy], 95)
        refused = [c for c in busy if not c.ok]
        flood_ok = [c for c in run.calls() if c.kind == "flood" and c.ok]
        return {
            "other_tenant_ttft_p95_ratio": rnd(ratio(busy_p95, solo_p95), 2),
            "other_tenant_ttft_p95_s": rnd(busy_p95),
            "other_tenant_ttft_p95_solo_s": rnd(solo_p95),
            "other_tenant_refused": rnd(len(refused) / len(busy)) if busy else None,
            "flood_goodput_rps": rnd(len(flood_ok) / ((duration - t_flood) * ts), 2),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        r = m.get("other_tenant_ttft_p95_ratio")
        return r is not None and r >= 3, f"other_tenant_ttft_p95_ratio {r} (needs >= 3)"
