"""P4n ghost load that remains when the replicas never abort (the `no-abort` variant of P4).

Workload: P4's (2 replicas, tiny-cpu, time_scale 1, 1,500-token prompts at 1.3x the pool's capacity, client
deadlines of 1.5x the SLO sent as `x-stainless-read-timeout`; 2 in 5 clients close at the deadline, 2 in 5
linger behind a hop that does not propagate the abort, 1 in 5 close the page after 5 tokens), but every
replica runs with
`--fault no-abort`: it keeps generating after the connection closes, the way a serving stack behaves when the
disconnect never reaches the engine (a non-propagating hop in front of the engine, an engine that only notices
at the end). No gateway can stop the tokens of a request it has already forwarded here; what it can still save
is the work it never sends: requests it holds in its own queue (a client that leaves while held costs nothing)
and requests whose deadline it knows cannot be met. What the operator can do is in docs/benchmarks.md (P4).

Ghost tokens are P4's (replica side: `sim_ghost_tokens_total` + `late_tokens`).

SLO: P4's (derived from the engine's TTFT, the first token within it, and completed); classes: P4's.
Headline metrics: `slo_goodput_rps`, `ghost_tokens_per_cancel`, `wasted_tokens` (ghost tokens plus tokens
streamed to clients that then gave up: the work the pool did for nobody). Informational bar: sluice wastes no
more than envoy-rr (the <= 1 token per cancel bar of P4 cannot hold when the engine ignores disconnects).
Reproduced on envoy-rr when ghost_tokens_per_cancel >= 20.
Sluice is told: P4's SLO (`admission.ttft_target_s`), nothing else.
"""

from __future__ import annotations

from bench.scenarios.p04_cancellations import S as P4


class S(P4):
    id = "P4n"
    title = "ghost load with no-abort replicas"
    problem = "mass cancellations while the model keeps computing, on an engine that ignores disconnects"
    sim_args = ["--fault", "no-abort"]
    headline = ('slo_goodput_rps', 'ghost_tokens_per_cancel', 'wasted_tokens')
