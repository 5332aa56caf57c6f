"""P12 streaming exhausts connections first: thousands of open SSE streams, the gateway runs out before the GPU.

Workload (2 replicas, tiny-cpu, time_scale 1): 1,000 streaming requests (quick; 5,000 full) open over 5 s (10 s
full) and stay open: 20 prompt tokens, 400 output tokens. The replicas are made big enough to hold every stream
the gateway lets through (`--max-num-seqs 4096`, a KV cache for every stream at full length, blocks of the
preset's size, `--max-num-batched-tokens 16384`, and `--fault slow=K` with K chosen from the preset's decode
cost so that the quick run's streams, half on each replica, flow at about one token per second each, and last
the whole run): the gateway must run out first. Prompts are unique (no shared prefix). The gateway's connection capacity is `gateway.max_downstream_connections` = 800
(quick; 4,000 full), the same for every system: Envoy's overload manager closes connections beyond it at
accept. The harness raises RLIMIT_NOFILE to 12,000 (the stack it starts inherits it).

SLO: the first token within `slo_ttft_s(one engine step with every quick stream decoding)` (5x the time a
new stream waits for the next step of such an engine, rounded up: about 5 s at the calibrated preset) of the
user's first send (retries included) and the stream still flowing (or completed) when the run ends: the
streams are built to outlive the run. Class: `stream`.

Headline metrics: `slo_goodput_rps`, `open_streams_max` (streams open at once with a 200, client view),
`rejected` (attempts that did not get a stream), `rejected_clean` (share of rejections that were clean HTTP
errors, 429/503 with a body, as opposed to closed or reset connections), `admitted_flowing` (share of admitted
streams that received tokens), `gateway_kb_per_open_stream` (gateway RSS growth, max - start, divided by
`held_open_max`, the most attempts in flight at once, queued ones included), `gateway_rss_mb` (gateway RSS, max
during the run: Envoy + sidecar, or smg). Reproduced on envoy-rr when streams were rejected and less than half
of the rejections were clean.
Every stream carries `x-sluice-tenant: streams`.
Sluice is told: the SLO (`admission.ttft_target_s`). Its open-request cap is derived by default
(`sidecar.max_open_requests` 0: 90 % of the connection limit), so it answers the excess with a clean 429 before
Envoy runs out of connections; admission (per-replica concurrency from the engine's learned max_num_seqs, the waiting and TTFT limits) at
its defaults. The connection limit (`gateway.max_downstream_connections`) is environment: every Envoy-based system
gets it; smg has no such setting and runs with its own defaults.
"""

from __future__ import annotations

from bench.capacity import BENCH_PRESET, EngineSpec, blocks_for_tokens, decode_tok_s, slo_ttft_s
from bench.openloop import Arrival, ClientSpec
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, rnd

PROMPT, OUT = 20, 400
QUICK_STREAMS, FULL_STREAMS = 1000, 5000
_BASE = EngineSpec.of(BENCH_PRESET)
_PER_REPLICA = QUICK_STREAMS // 2
SLOW = max(1, round(decode_tok_s(_BASE, _PER_REPLICA, PROMPT + OUT // 2)))  # -> ~1 token/s per stream
KV_BLOCKS = blocks_for_tokens(_BASE, FULL_STREAMS * (PROMPT + OUT + 64))
SLO_TTFT_S = slo_ttft_s(SLOW / decode_tok_s(_BASE, _PER_REPLICA, PROMPT + OUT // 2))


class S(Scenario):
    id = "P12"
    title = "open streams exhaust connections"
    problem = "streaming exhausts connections first"
    replicas = 2
    time_scale = 1.0
    # Replicas big enough to hold every stream the gateway lets through (the gateway must run out first, not the
    # "GPU"): thousands of sequences and KV blocks, a prefill budget that starts a whole arrival burst in one
    # step, and every step 3x slower so thousands of streams flow at about one token per second (cheap for the
    # simulator, Envoy and the load generator on a small machine).
    sim_args = ["--max-num-seqs", "4096", "--num-gpu-blocks", str(KV_BLOCKS), "--max-num-batched-tokens", "16384",
                "--fault", f"slow={SLOW}"]
    rss_poll = True
    nofile = 12000
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"slow factor": SLOW, "KV blocks": KV_BLOCKS}
    streams_outlive_run = True
    headline = ('slo_goodput_rps', 'rejected_clean', 'open_streams_max')
    metrics_doc = [
        Metric("open_streams_max", "streams open at once (client view)", "streams", "higher"),
        Metric("rejected", "attempts that did not get a stream", "", ""),
        Metric("admitted_flowing", "share of admitted streams (200) that received tokens", "", "higher"),
        Metric("rejected_clean", "share of rejections that were clean HTTP errors (4xx/5xx)", "", "higher"),
        Metric("gateway_rss_mb", "max gateway RSS during the run (Envoy + sidecar, or smg)", "MB"),
        Metric("gateway_kb_per_open_stream", "gateway RSS growth (max - start) / streams held open at once "
               "(streaming or waiting in the gateway)", "KB"),
        Metric("held_open_max", "streams held open at once (client view: sent, not yet ended or rejected)",
               "streams", "higher"),
        Metric("streams_offered", "streams the clients opened", "", ""),
    ]

    def __init__(self) -> None:
        self._quick = True

    @property
    def gateway(self) -> dict:  # type: ignore[override]
        return {"max_downstream_connections": 800 if self._quick else 4000}

    def workload(self, quick: bool) -> Workload:
        self._quick = quick
        n, ramp, duration = (QUICK_STREAMS, 5.0, 9.0) if quick else (FULL_STREAMS, 10.0, 20.0)
        spec = ClientSpec(timeout_s=60.0)
        arrivals = [Arrival(at=0.1 + ramp * i / n, body=chat(PROMPT, OUT, salt=i), kind="stream", client=spec,
                            headers={"x-sluice-tenant": "streams"}) for i in range(n)]
        return Workload(arrivals=arrivals, duration=duration, drain=0.5)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        best = _max_overlap([(r.headers_at, r.end if r.end is not None else run.duration)
                             for r in run.records if r.status == 200 and r.headers_at is not None])
        rejected = [r for r in run.records if r.status != 200 and r.error != "unfinished"]
        ok = [r for r in run.records if r.status == 200]
        clean = [r for r in rejected if 400 <= r.status < 600]
        rss = max((v for _t, v in run.gateway_rss), default=None)
        held = _held_open_max(run)
        growth = (rss - run.gateway_rss[0][1]) if rss else None
        return {
            "open_streams_max": float(best),
            "rejected": float(len(rejected)),
            "admitted_flowing": rnd(sum(1 for r in ok if r.tokens > 0) / len(ok)) if ok else None,
            "rejected_clean": rnd(len(clean) / len(rejected)) if rejected else None,
            "gateway_rss_mb": rnd(rss / 1e6, 1) if rss else None,
            "gateway_kb_per_open_stream": rnd(growth / held / 1e3, 1) if growth is not None and held else None,
            "held_open_max": float(held),
            "streams_offered": float(len({r.user for r in run.records})),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        rej, clean = m.get("rejected"), m.get("rejected_clean")
        ok = rej is not None and rej > 0 and clean is not None and clean < 0.5
        return ok, f"rejected {rej} (needs > 0), rejected_clean {clean} (needs < 0.5)"


def _held_open_max(run: RunData) -> int:
    """Most attempts in flight at once: sent and not yet ended (a rejection ends one; a stream still open at
    the run's end counts to the end). Queued streams count: they hold a connection in Envoy and a gRPC stream in
    the sidecar just like flowing ones, so memory per open stream is divided by these."""
    spans = [(r.start, r.end if r.end is not None else run.duration) for r in run.records]
    return _max_overlap(spans)


def _max_overlap(spans: list[tuple[float, float]]) -> int:
    """Most spans open at the same instant (an end at t closes before a start at t opens)."""
    events = sorted([(a, 1) for a, _b in spans] + [(b, -1) for _a, b in spans])
    cur = best = 0
    for _t, d in events:
        cur += d
        best = max(best, cur)
    return best
