"""P5 retry storm: the model slows a little, timeouts trigger retries at every layer, retries kill it.

Workload (2 replicas, tiny-cpu, time_scale 1): a business service sends non-streaming requests of 1,000 prompt
(unique: no shared prefix) and 48 output tokens at half the pool's capacity for them (`2 x capacity_rps(1000,
48)`, bench/capacity.py: 10 requests/s at the calibrated tiny-cpu; seeded Poisson). Each goes through a
business layer that retries the whole call twice on timeouts and 5xx (0.2 s pause), around an SDK that behaves
like the openai SDK: a timeout of 1.5x the SLO for the whole answer (non-streaming: the response arrives
complete, so the timeout covers it; sent as `x-stainless-read-timeout`), max_retries 2 with exponential
backoff 0.5 s x 2^n and jitter,
honouring `x-should-retry` and `retry-after-ms` / `retry-after`, sending `x-stainless-retry-count`. So one user
request can become up to 9 attempts (more behind envoy-lr, which retries 5xx and resets itself). At t=3 s both
replicas slow down (`slow` fault: "the model was only slow") until t=9 s (quick; 5..15 s full), by the factor
that makes the backlog built during the slowdown twice the SDK timeout: the offered half of the pool's capacity
becomes rho = 1 + 2 x timeout / slowdown length times what it can serve (factor rho / 0.5: 3.5x quick, 2.9x
full at the calibrated preset).

SLO: the answer within `slo_ttft_s(latency_alone(1,000, 48))` (5x the whole answer's time on an idle replica,
rounded up: 1.5 s at the calibrated preset) of the user's first send (business and SDK retries included; a
non-streaming answer's first token is the whole answer). Classes: `before`, `during` and `after` the slowdown (by the user request's first send).

Headline metrics: `slo_goodput_rps`, `amplification` = requests that reached a replica / distinct user requests
(from the replicas' own counters), `client_attempts_per_user`, `goodput_rps` (user requests that finally
succeeded, any TTFT, per second), `ttft_p95_after_s` (attempts sent after the slowdown ended, censored: does the
storm outlive its cause?). Reproduced on envoy-rr when amplification >= 3.
Sluice is told: the SLO (`admission.ttft_target_s`). The retry budget runs at its shipped defaults
(`budgets.retry`: enabled, max_share 0.1, window_s 10, floor 3: retries may be 10 % of admitted traffic; beyond
it 429 with `x-should-retry: false`).
"""

from __future__ import annotations


from bench.openloop import Arrival, ClientSpec
from bench.capacity import BENCH_PRESET, EngineSpec, latency_alone_s, pool_rps, slo_ttft_s
from bench.scenarios.base import Call, Fault, Metric, RunData, Scenario, Workload, chat, pct, phase_of, rnd, workload_rng

PROMPT, OUT = 1000, 48
SPEC = EngineSpec.of(BENCH_PRESET)
LOAD_SHARE = 0.5
RATE = LOAD_SHARE * pool_rps(SPEC, 2, PROMPT, OUT)
SLO_TTFT_S = slo_ttft_s(latency_alone_s(SPEC, PROMPT, OUT))
SDK_TIMEOUT_S = 1.5 * SLO_TTFT_S


class S(Scenario):
    id = "P5"
    title = "retry storm"
    problem = "retries at every layer multiply load 1 -> 2 -> 4 -> 8"
    replicas = 2
    time_scale = 1.0
    settle_s = 3.0
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"rate (req/s)": RATE, "SDK timeout (s)": SDK_TIMEOUT_S}
    headline = ('slo_goodput_rps', 'amplification', 'goodput_rps')
    metrics_doc = [
        Metric("amplification", "requests that reached a replica / distinct user requests", "x"),
        Metric("client_attempts_per_user", "attempts the clients sent / distinct user requests", "x"),
        Metric("goodput_rps", "user requests that finally succeeded, per second of offered load", "req/s",
               "higher"),
        Metric("user_success", "share of user requests that finally succeeded", "", "higher"),
        Metric("ttft_p95_after_s", "p95 TTFT of attempts sent after the slowdown ended", "s"),
        Metric("told_not_to_retry", "responses carrying x-should-retry: false", "", ""),
    ]

    def phases(self, quick: bool) -> tuple[float, float, float]:
        return (3.0, 9.0, 13.0) if quick else (5.0, 15.0, 30.0)

    def workload(self, quick: bool) -> Workload:
        s0, s1, duration = self.phases(quick)
        rng = workload_rng(5)
        spec = ClientSpec(timeout_s=SDK_TIMEOUT_S, business_retries=2, business_backoff_s=0.2)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            arrivals.append(Arrival(at=t, body=chat(PROMPT, OUT, salt=n, stream=False), kind="user", client=spec))
            n += 1
            t += rng.expovariate(RATE)
        slow = round((1.0 + 2.0 * SDK_TIMEOUT_S / (s1 - s0)) / LOAD_SHARE, 2)
        faults = [Fault(s0, i, "slow", slow) for i in range(self.replicas)]
        faults += [Fault(s1, i, "slow", 1.0) for i in range(self.replicas)]
        # the tail of a user's retries may run 9 x 1.5 s + backoffs after its arrival; what is still open 6 s after
        # the last arrival is cancelled and counts as not served
        return Workload(arrivals=arrivals, duration=duration, drain=6.0, faults=faults)

    def call_class(self, call: Call, run: RunData) -> str:
        s0, s1, _d = self.phases(run.extra.get("quick", True))
        return phase_of(call, run, [("before", s0), ("during", s1)], "after")

    def metrics(self, run: RunData) -> dict[str, float | None]:
        quick = run.extra.get("quick", True)
        _s0, s1, _d = (x / run.time_scale for x in self.phases(quick))
        users = run.users()
        n_users = len(users)
        succeeded = sum(1 for rs in users.values() if any(r.ok for r in rs))
        after = [r for r in run.records if r.start >= s1]
        return {
            "amplification": rnd(run.replica_requests_total() / n_users, 2) if n_users else None,
            "client_attempts_per_user": rnd(len(run.records) / n_users, 2) if n_users else None,
            "goodput_rps": rnd(succeeded / (run.duration * run.time_scale), 2),
            "user_success": rnd(succeeded / n_users) if n_users else None,
            "ttft_p95_after_s": rnd(pct(run.ttfts(after), 95)),
            "told_not_to_retry": float(sum(1 for r in run.records if r.should_retry == "false")),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("amplification")
        return (v is not None and v >= 3.0), f"amplification {v} (needs >= 3)"
