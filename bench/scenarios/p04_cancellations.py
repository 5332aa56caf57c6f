"""P4 mass cancellations while the model keeps computing (ghost load).

Workload (2 replicas, tiny-cpu, time_scale 1, every replica started with `--fault no-abort`): the replicas do
not abort a request when its client goes away, the way a serving stack behaves when the disconnect does not
reach the engine (a non-propagating hop, an engine that only notices at the end). Requests of 1,500 prompt and
120 output tokens arrive at 20/s (seeded Poisson), a little above what the pool serves, so queues form. Every
client has a 3 s deadline (sent as `x-stainless-read-timeout`, as the openai SDK does) and gives up (closes the
connection) when it passes; one user in five closes the page after 5 tokens.

Envoy propagates a disconnect within milliseconds, but a no-abort replica keeps generating, so what a gateway
can still save is the work it never sends: requests it holds in its own queue (a client that leaves while held
costs nothing) and requests whose deadline it knows cannot be met.

Headline metrics: `ghost_tokens` (the replicas' `sim_ghost_tokens_total`: tokens generated after the client had
gone), `ghost_tokens_per_cancel` (per client that disconnected or timed out), `wasted_tokens` (ghost tokens plus
tokens streamed to clients that then gave up), `goodput_rps` (completed requests per second).
Reproduced on envoy-rr when ghost_tokens_per_cancel >= 20.
Sluice knobs: `admission.max_wait_s: 3` (hold in the sidecar's queue instead of forwarding; the client's
`x-stainless-read-timeout` tells the sidecar when waiting is pointless).
"""

from __future__ import annotations

import random

from bench.openloop import Arrival, ClientSpec
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, rnd

TIMEOUT_S = 3.0


class S(Scenario):
    id = "P4"
    title = "cancellations and ghost load"
    problem = "mass cancellations while the model keeps computing"
    replicas = 2
    time_scale = 1.0
    sim_args = ["--fault", "no-abort"]
    settle_s = 6.0  # let abandoned work finish so every ghost token is counted
    sluice_policy = {"admission": {"max_wait_s": 3.0}}
    headline = ('ghost_tokens_per_cancel', 'goodput_rps')
    metrics_doc = [
        Metric("ghost_tokens", "tokens generated for clients that had already gone (sim_ghost_tokens_total)", "tok"),
        Metric("ghost_tokens_per_cancel", "ghost_tokens / clients that disconnected or timed out", "tok"),
        Metric("wasted_tokens", "ghost tokens + tokens streamed to clients that then gave up", "tok"),
        Metric("cancels", "clients that disconnected (page closed) or timed out", "", ""),
        Metric("goodput_rps", "requests completed per second of offered load", "req/s", "higher"),
    ]

    def workload(self, quick: bool) -> Workload:
        duration = 10.0 if quick else 30.0
        rng = random.Random(4)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            leaves = n % 5 == 4
            spec = ClientSpec(timeout_s=TIMEOUT_S, send_read_timeout=True,
                              cancel_after_tokens=5 if leaves else None)
            arrivals.append(Arrival(at=t, body=chat(1500, 120, salt=n), kind="leaves" if leaves else "waits",
                                    client=spec))
            n += 1
            t += rng.expovariate(20.0)
        return Workload(arrivals=arrivals, duration=duration, drain=TIMEOUT_S + 2.0)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ghost = run.counter_total("ghost_tokens")
        gone = [r for r in run.records if r.cancelled or r.timed_out]
        streamed_then_gone = sum(r.tokens for r in gone)
        ok = [r for r in run.records if r.ok]
        return {
            "ghost_tokens": ghost,
            "ghost_tokens_per_cancel": rnd(ghost / len(gone), 1) if gone else None,
            "wasted_tokens": ghost + streamed_then_gone,
            "cancels": float(len(gone)),
            "goodput_rps": rnd(len(ok) / (run.duration * run.time_scale), 2),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("ghost_tokens_per_cancel")
        return (v is not None and v >= 20), f"ghost_tokens_per_cancel {v} (needs >= 20)"
