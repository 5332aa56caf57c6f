"""P13 upstream faster than downstream: slow stream readers.

Workload (2 replicas, tiny-cpu, time_scale 1): 100 slow streams (10 s quick; 30 s full) ask for 1,500 output tokens
(with 60 streams decoding, a replica produces `decode_tok_s(60)` = about 54 tokens/s per stream at the
calibrated preset, bench/capacity.py) and read 256 bytes every 0.25 s (about 5 tokens/s: a slow WebSocket
bridge or mobile network), with a 16 KiB socket receive buffer; 20 normal streams of 200 tokens read at full
speed alongside. Prompts are unique (no shared prefix). Envoy's per-connection buffer limit (64 KiB, `gateway.buffer_limit_bytes`) and a
16 KiB socket send buffer toward clients (`gateway.socket_send_buffer_bytes`), both for every system, pause
reading from the replica when a slow client's buffers fill, so gateway memory stays bounded, but nothing cuts
the slow streams: the replica keeps generating tokens nobody will read in time.

SLO: the first token within 1 s of the user's first send (retries included) and the response completed (a slow
stream reading 5 tokens/s cannot complete 1,500 tokens within the run: no system serves the `slow` class within
it, and a gateway that cuts slow streams refuses them by design).
Classes: `slow` and `normal` streams.

Headline metrics: `slo_goodput_rps`, `normal_ttft_p95_s` (censored), `slow_streams_cut` (share of slow streams
the gateway ended before completion: the client saw the stream end early, or the replica aborted it, before the
run's end; a cut client may only notice once it has drained its buffers), `unread_tokens` (tokens the replicas
generated that no client read) and its share of all generated, `gateway_rss_mb_per_slow_stream` (gateway RSS
growth during the run / slow streams).
Reproduced on envoy-rr when no slow stream was cut and more than half of the generated tokens went unread.
Sluice is told: the SLO (`admission.ttft_target_s`). Slow-consumer cutting (`streaming.slow_consumer`) is
off by default (`min_bytes_per_s` 0), so sluice runs without it here. The 16 KiB socket send buffer toward
clients (`gateway.socket_send_buffer_bytes`) and the 64 KiB buffer limit are environment: every Envoy-based
system gets them.
"""

from __future__ import annotations

from bench.capacity import BENCH_PRESET, EngineSpec, slo_ttft_s, ttft_alone_s
from bench.openloop import Arrival, ClientSpec
from bench.scenarios.base import Metric, RunData, Scenario, Workload, chat, pct, rnd

SLO_TTFT_S = slo_ttft_s(ttft_alone_s(EngineSpec.of(BENCH_PRESET), 300))


class S(Scenario):
    id = "P13"
    title = "slow consumers"
    problem = "upstream faster than downstream"
    replicas = 2
    time_scale = 1.0
    rss_poll = True
    client_rcvbuf = 16384
    gateway = {"socket_send_buffer_bytes": 16384}
    slo_ttft_s = SLO_TTFT_S
    headline = ('slo_goodput_rps', 'normal_ttft_p95_s', 'slow_streams_cut')
    metrics_doc = [
        Metric("gateway_rss_mb_per_slow_stream", "gateway RSS growth / slow streams", "MB"),
        Metric("gateway_rss_growth_mb", "gateway RSS max - RSS at start (Envoy + sidecar, or smg)", "MB"),
        Metric("envoy_rss_growth_mb", "Envoy's part of the growth (its RSS max - RSS at start)", "MB"),
        Metric("sidecar_rss_growth_mb", "the sidecar's part (its RSS max - RSS at start)", "MB"),
        Metric("gateway_rss_drift_mb", "Envoy + sidecar RSS: mean of the last third of the run - mean of the "
               "middle third (flat over time: near 0; full run only)", "MB"),
        Metric("slow_streams_cut", "share of slow streams the gateway ended before completion", "", "higher"),
        Metric("unread_tokens", "tokens the replicas generated that no client read", "tok"),
        Metric("unread_tokens_share", "unread_tokens / tokens generated", ""),
        Metric("normal_ttft_p95_s", "p95 TTFT of the normal-speed streams", "s"),
    ]

    def workload(self, quick: bool) -> Workload:
        # 100 slow streams in both modes: the bar is stated for 100 slow consumers, and with fewer the
        # gateway's one-time costs (first ext_proc connection, code paged in) would be divided by too few streams.
        n_slow, duration = (100, 10.0) if quick else (100, 30.0)
        slow = ClientSpec(read_bytes=256, read_interval_s=0.25, timeout_s=120.0)
        arrivals = [Arrival(at=0.5 + 2.0 * i / n_slow, body=chat(200, 1500, salt=i), kind="slow", client=slow)
                    for i in range(n_slow)]
        arrivals += [Arrival(at=1.0 + (duration - 3.0) * i / 20, body=chat(300, 200, salt=10_000 + i),
                             kind="normal") for i in range(20)]
        return Workload(arrivals=arrivals, duration=duration, drain=0.5)

    def metrics(self, run: RunData) -> dict[str, float | None]:
        slow = run.recs("slow")
        # Cut by the gateway: the client saw the stream end (error or EOF) before [DONE] by its own choice or the
        # run's end, or the replica aborted the request before the run's end. A cut client may learn of it only
        # when it has drained what its buffers hold, so the replicas' abort counters are the reliable view (no
        # P13 client leaves on its own before the run ends).
        client_cut = [r for r in slow if r.status == 200 and not r.done and not r.cancelled and not r.timed_out
                      and r.error != "unfinished"]
        deadline = run.extra.get("deadline", run.duration) - 0.3
        aborted = 0.0
        for addr in run.replicas:
            before = [x.get("aborted") or 0 for x in run.samples.get(addr, []) if x["t"] <= deadline]
            aborted += max(before, default=0)
        n_cut = max(float(len(client_cut)), aborted)
        growth = _growth_mb(run.gateway_rss)
        parts = run.extra.get("rss") or {}
        generated = run.counter_total("generation_tokens")
        read = sum(r.tokens for r in run.records)
        unread = max(0.0, generated - read)
        return {
            "gateway_rss_mb_per_slow_stream": rnd(growth / len(slow), 3) if growth is not None and slow else None,
            "gateway_rss_growth_mb": rnd(growth, 1),
            "envoy_rss_growth_mb": rnd(_growth_mb(parts.get("envoy") or []), 1),
            "sidecar_rss_growth_mb": rnd(_growth_mb(parts.get("sidecar") or []), 1),
            # Judged on the full run only: in 10 s the slow streams' buffers are still filling in the middle third.
            "gateway_rss_drift_mb": None if run.extra.get("quick")
            else rnd(_drift_mb(run.gateway_rss, run.duration), 1),
            "slow_streams_cut": rnd(min(1.0, n_cut / len(slow))) if slow else None,
            "unread_tokens": unread,
            "unread_tokens_share": rnd(unread / generated) if generated else None,
            "normal_ttft_p95_s": rnd(pct(run.ttfts(run.recs("normal")), 95)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        cut, unread = m.get("slow_streams_cut"), m.get("unread_tokens_share")
        ok = cut is not None and cut == 0 and unread is not None and unread > 0.5
        return ok, f"slow_streams_cut {cut} (needs 0), unread_tokens_share {unread} (needs > 0.5)"


def _growth_mb(samples: list[tuple[float, int]]) -> float | None:
    """RSS max during the run minus the first sample (taken before the first stream arrives), in MB."""
    if not samples:
        return None
    return (max(v for _t, v in samples) - samples[0][1]) / 1e6


def _drift_mb(samples: list[tuple[float, int]], duration: float) -> float | None:
    """Mean RSS over the last third of the offered load minus the mean over the middle third, in MB: every slow
    stream has arrived by then, so a gateway whose memory per stream is bounded stays flat (about 0), and one that
    keeps buffering what slow clients do not read keeps growing."""
    mid = [v for t, v in samples if duration / 3 <= t < 2 * duration / 3]
    last = [v for t, v in samples if 2 * duration / 3 <= t <= duration]
    if not mid or not last:
        return None
    return (sum(last) / len(last) - sum(mid) / len(mid)) / 1e6
