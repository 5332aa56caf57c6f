"""P4 mass cancellations while the model keeps computing (ghost load).

Workload (2 replicas, tiny-cpu, time_scale 1; the replicas abort a request when its connection closes, as vLLM
does): requests of 1,500 prompt tokens (unique: no shared prefix) and SHORT_OUTPUT output tokens, a quarter of
them LONG_OUTPUT, arrive at 1.3x the pool's capacity for that mix (`2 x mix_capacity_rps`, bench/capacity.py:
10 requests/s at the calibrated tiny-cpu; seeded Poisson), above what the pool serves, so queues form. Every
client has a deadline `TIMEOUT_S` = 1.5 x the SLO, sent as `x-stainless-read-timeout` as the openai SDK does,
and gives up when it passes. LONG_OUTPUT is what one stream decodes in twice that deadline with half the
engine's batch busy (`decode_tok_s`): those answers outlast the deadline; SHORT_OUTPUT is a quarter of it.
Three kinds of client, by arrival index:
  * `waits` (2 in 5): the SDK closes the connection at its deadline;
  * `lingers` (2 in 5): a business service whose call times out at the deadline, but a hop between it and the
    gateway does not propagate the abort (a proxy with `proxy_ignore_client_abort`, a connection pool that
    drains the response) and keeps the connection open and reading until the response ends (capped at 30 s and
    by the run's end). This is the issue's "the upstream service has a 30 s HTTP timeout, yet vLLM keeps
    generating";
  * `leaves` (1 in 5): the user closes the page after 5 tokens.
A disconnect reaches an aborting replica through any gateway in milliseconds, so the ghost load here is the
lingering connections': round robin forwards them and the replica generates until the end for nobody.

Ghost tokens are counted by the replicas (server side, so nothing a client or gateway reports enters the
number): `sim_ghost_tokens_total` (generated after the client's connection closed) plus `late_tokens`
(generated after the client's deadline while its connection was still open; every client sends its absolute
deadline in `x-sim-deadline`, a benchmark probe only the simulator reads). `late_tokens_received` is the
client-side cross-check: content the lingering connections received after their deadline; where a gateway does
not forward `x-sim-deadline` (smg drops it), the replicas cannot count late tokens and this lower bound is used.
On real vLLM engines (`--backend vllm-cpu`), which count neither, ghost tokens are the engines' generated tokens
minus what the clients read in time (`real_ghost_tokens`).

Every client is the openai SDK with that timeout: it retries a timeout (max_retries 2), so a user request may
cost three attempts.

SLO: the first token within `slo_ttft_s(ttft_alone(1,500))` (5x the TTFT on an idle replica, at least 0.5 s,
rounded up: 1 s at the calibrated preset) of the user's first send (retries included) and the response
completed (before the client's deadline, or it does not complete). Classes: `waits`, `lingers`, `leaves` (a user who closes the
page after 5 tokens never completes: no system serves that class, it only counts as offered).

Headline metrics: `slo_goodput_rps`, `ghost_tokens_per_cancel` (ghost tokens per attempt that disconnected or
timed out; the bar is one decode step, i.e. at most 1 token per cancelled sequence), `ghost_tokens`,
`wasted_tokens` (ghost tokens plus tokens streamed to clients that then gave up), `goodput_rps` (completed user
requests per second, any TTFT). Reproduced on envoy-rr when ghost_tokens_per_cancel >= 20.
Sluice is told: the SLO (`admission.ttft_target_s`). From the client's `x-stainless-read-timeout` the sidecar
knows when waiting is pointless and sets Envoy's `x-envoy-upstream-rq-timeout-ms` to the time left, so Envoy
resets the upstream stream at the deadline and the replica aborts even though the client's connection stays
open; the queue wait is the default (`sidecar.max_queue_wait_ms`).
The `no-abort` variant (P4n, `p04n_no_abort.py`) runs the same workload on replicas that never abort.
"""

from __future__ import annotations


from bench.openloop import Arrival, ClientSpec
from bench.capacity import BENCH_PRESET, EngineSpec, decode_tok_s, mix_capacity_rps, slo_ttft_s, ttft_alone_s
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, rnd, workload_rng

PROMPT = 1500
SPEC = EngineSpec.of(BENCH_PRESET)
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, PROMPT))
TIMEOUT_S = 1.5 * SLO_TTFT_S
LINGER_CAP_S = 30.0
LONG_SHARE = 0.25  # a quarter ask for long answers that outlast the deadline
LONG_OUTPUT = round(2 * TIMEOUT_S * decode_tok_s(SPEC, SPEC.seqs // 2, PROMPT))
SHORT_OUTPUT = LONG_OUTPUT // 4
RATE = 1.3 * 2 * mix_capacity_rps(SPEC, [(1 - LONG_SHARE, PROMPT, SHORT_OUTPUT), (LONG_SHARE, PROMPT, LONG_OUTPUT)])


def client_for(n: int) -> tuple[str, ClientSpec]:
    """The kind and behaviour of arrival `n`: 2 in 5 wait, 2 in 5 linger, 1 in 5 close the page early."""
    kind = ("waits", "lingers", "waits", "lingers", "leaves")[n % 5]
    spec = ClientSpec(timeout_s=TIMEOUT_S, send_read_timeout=True, mark_deadline=True,
                      cancel_after_tokens=5 if kind == "leaves" else None,
                      linger_s=LINGER_CAP_S if kind == "lingers" else None)
    return kind, spec


def real_ghost_tokens(run: RunData) -> float:
    """A real engine does not know its client left: its ghost tokens are what it generated (vLLM's
    generation_tokens_total over the run) minus what the clients read in time (content events before a
    disconnect or the client's timeout; a completed answer counts its usage.completion_tokens, which a stream may
    pack into fewer events). Tokens read after a deadline are in the difference: generated for nobody."""
    delivered = sum(r.tokens if (r.cancelled or r.timed_out) else max(r.tokens, r.completion_tokens)
                    for r in run.records)
    return max(0.0, run.counter_total("generation_tokens") - delivered)


class S(Scenario):
    id = "P4"
    title = "cancellations and ghost load"
    problem = "mass cancellations while the model keeps computing"
    replicas = 2
    time_scale = 1.0
    sim_args: list[str] = []
    settle_s = 6.0  # let abandoned work finish so every ghost token is counted
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"rate (req/s)": RATE, "deadline (s)": TIMEOUT_S, "outputs": f"{SHORT_OUTPUT}/{LONG_OUTPUT}"}
    headline = ('slo_goodput_rps', 'ghost_tokens_per_cancel', 'goodput_rps')
    metrics_doc = [
        Metric("ghost_tokens", "tokens generated after the client had gone or its deadline had passed "
               "(replicas' sim_ghost_tokens_total + late_tokens)", "tok"),
        Metric("ghost_tokens_per_cancel", "ghost_tokens / clients that disconnected or timed out", "tok"),
        Metric("wasted_tokens", "ghost tokens + tokens streamed to clients that then gave up", "tok"),
        Metric("late_tokens_received", "client-side check: tokens lingering connections read after their "
               "deadline", "tok"),
        Metric("cancels", "clients that disconnected (page closed) or timed out", "", ""),
        Metric("goodput_rps", "user requests completed (any TTFT) per second of offered load", "req/s", "higher"),
    ]

    def workload(self, quick: bool) -> Workload:
        duration = 8.0 if quick else 30.0
        rng, lengths = workload_rng(4), workload_rng(44)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            kind, spec = client_for(n)
            out = LONG_OUTPUT if lengths.random() < LONG_SHARE else SHORT_OUTPUT
            arrivals.append(Arrival(at=t, body=chat(PROMPT, out, salt=n), kind=kind, client=spec))
            n += 1
            t += rng.expovariate(RATE)
        return Workload(arrivals=arrivals, duration=duration, drain=TIMEOUT_S + 2.0)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        # A gateway that does not forward x-sim-deadline (smg) leaves the replicas blind to the deadline: the
        # tokens the lingering clients read after it are then the lower bound of the late tokens.
        received_late = float(sum(r.late_tokens for r in run.records))
        if run.extra.get("backend") == "vllm-cpu":
            ghost = real_ghost_tokens(run)
        else:
            ghost = run.counter_total("ghost_tokens") + max(run.counter_total("late_tokens"), received_late)
        gone = [r for r in run.records if r.cancelled or r.timed_out]
        streamed_then_gone = sum(r.tokens for r in gone)
        ok = [c for c in run.calls() if c.ok]
        return {
            "ghost_tokens": ghost,
            "ghost_tokens_per_cancel": rnd(ghost / len(gone), 2) if gone else None,
            "wasted_tokens": ghost + streamed_then_gone,
            "late_tokens_received": received_late,
            "cancels": float(len(gone)),
            "goodput_rps": rnd(len(ok) / (run.duration * run.time_scale), 2),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v = m.get("ghost_tokens_per_cancel")
        return (v is not None and v >= 20), f"ghost_tokens_per_cancel {v} (needs >= 20)"
