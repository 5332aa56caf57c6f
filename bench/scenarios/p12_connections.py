"""P12 streaming exhausts connections first: thousands of open SSE streams, the gateway runs out before the GPU.

Workload (2 replicas, tiny-cpu, time_scale 1, replicas started `--fault slow=10` so a stream of 400 tokens
lasts the whole run, like the document's 30 s streams): 1,000 streaming requests (quick; 5,000 full) open over
5 s (10 s full) and stay open. The gateway's connection capacity is `gateway.max_downstream_connections` = 800
(quick; 4,000 full), the same for every system: Envoy's overload manager closes connections beyond it at
accept. The load generator raises its own RLIMIT_NOFILE to fit.

Headline metrics: `open_streams_max` (streams open at once, client view), `rejected` (attempts that did not
get a stream), `rejected_clean` (share of rejections that were clean HTTP errors, 429/503 with a body, as
opposed to closed or reset connections), `gateway_rss_mb` (Envoy + sidecar RSS, max during the run).
Reproduced on envoy-rr when streams were rejected and less than half of the rejections were clean.
Every stream carries `x-sluice-tenant: streams`.
Sluice knobs: `tenants.max_streams_per_tenant` = 700 (quick; 3,500 full), below the connection limit, so the
sidecar answers the excess with a clean 429 before Envoy runs out of connections; and
`admission.max_concurrency_per_replica: 512` so the sidecar forwards as many streams as the replicas accept
(max_num_seqs 256, the rest in their own queues, headers already sent).
"""

from __future__ import annotations

from bench.openloop import Arrival, ClientSpec
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, rnd


class S(Scenario):
    id = "P12"
    title = "open streams exhaust connections"
    problem = "streaming exhausts connections first"
    replicas = 2
    time_scale = 1.0
    sim_args = ["--fault", "slow=10"]
    rss_poll = True
    nofile = 12000
    headline = ('rejected_clean', 'open_streams_max', 'gateway_rss_mb')
    metrics_doc = [
        Metric("open_streams_max", "streams open at once (client view)", "streams", "higher"),
        Metric("rejected", "attempts that did not get a stream", "", ""),
        Metric("rejected_clean", "share of rejections that were clean HTTP errors (4xx/5xx)", "", "higher"),
        Metric("gateway_rss_mb", "max Envoy + sidecar RSS during the run", "MB"),
        Metric("streams_offered", "streams the clients opened", "", ""),
    ]

    def __init__(self) -> None:
        self._quick = True

    @property
    def gateway(self) -> dict:  # type: ignore[override]
        return {"max_downstream_connections": 800 if self._quick else 4000}

    @property
    def sluice_policy(self) -> dict:  # type: ignore[override]
        return {"tenants": {"max_streams_per_tenant": 700 if self._quick else 3500},
                "admission": {"max_concurrency_per_replica": 512}}

    def workload(self, quick: bool) -> Workload:
        self._quick = quick
        n, ramp, duration = (1000, 5.0, 9.0) if quick else (5000, 10.0, 20.0)
        spec = ClientSpec(timeout_s=60.0)
        arrivals = [Arrival(at=0.1 + ramp * i / n, body=chat(100, 400, salt=i), kind="stream", client=spec,
                            headers={"x-sluice-tenant": "streams"}) for i in range(n)]
        return Workload(arrivals=arrivals, duration=duration, drain=0.5)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        events = []
        for r in run.records:
            if r.status == 200 and r.headers_at is not None:
                events.append((r.headers_at, 1))
                events.append((r.end if r.end is not None else run.duration, -1))
        events.sort()
        cur = best = 0
        for _t, d in events:
            cur += d
            best = max(best, cur)
        rejected = [r for r in run.records if r.status != 200 and r.error != "unfinished"]
        clean = [r for r in rejected if 400 <= r.status < 600]
        rss = max((v for _t, v in run.gateway_rss), default=None)
        return {
            "open_streams_max": float(best),
            "rejected": float(len(rejected)),
            "rejected_clean": rnd(len(clean) / len(rejected)) if rejected else None,
            "gateway_rss_mb": rnd(rss / 1e6, 1) if rss else None,
            "streams_offered": float(len({r.user for r in run.records})),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        rej, clean = m.get("rejected"), m.get("rejected_clean")
        ok = rej is not None and rej > 0 and clean is not None and clean < 0.5
        return ok, f"rejected {rej} (needs > 0), rejected_clean {clean} (needs < 0.5)"
