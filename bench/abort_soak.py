"""`python -m bench.abort_soak [--rounds 10] [--per-round 2000] [--json FILE]`: clients that abandon requests before
the body arrives (issue #19, finding 8), round after round, and the sidecar's memory and state after each round.

Each round sends `--per-round` HTTP/1 aborts and as many cancelled HTTP/2 streams through Envoy to the sidecar:

  HTTP/1   `--batch` connections each send a chat completion's request line and headers (Content-Length set, the
           body never sent); once the sidecar holds an ext_proc stream for every one of them
           (`sluice_open_streams`), the connections are closed
  HTTP/2   one prior-knowledge h2c connection per batch opens `--batch` streams with HEADERS only (no END_STREAM);
           once the sidecar holds them, each stream is cancelled with RST_STREAM(CANCEL), then the connection ends
           with GOAWAY

After each round, once `sluice_open_streams` is back to 0: the sidecar's RSS (/proc VmRSS) and its Python-level state,
read in the process through bench/sidecar_probe.py (SIGUSR1): open streams and requests, tenant stream counts,
InFlight's live / detached request-id maps, queue lengths, asyncio tasks alive, gc-tracked objects (and the traced
Python heap with `--tracemalloc`).

Verdict (printed, in the JSON, and the exit code):
  state     after every round every per-request count and map is empty (0)
  objects   gc-tracked objects and live asyncio tasks do not grow after warm-up (last round - first round after
            warm-up, within `--max-object-growth`)
  memory    RSS growth per round after the warm-up rounds tends to 0: the mean growth over the second half of the
            rounds after warm-up is at most `--max-mb-per-round`
Every loop is bounded (rounds, batches, and a deadline per wait); processes are started and stopped by PID through
extproc.supervisor.Stack.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import h2.config
import h2.connection
import h2.errors

from bench.procstat import rss_bytes
from bench.soak import batches, git_commit, scrape, total, wait_until, write_report
from extproc.config import policy_from_dict
from extproc.supervisor import Stack, with_free_ports

MODEL = "sim-model"
PATH = "/v1/chat/completions"
BODY_LENGTH = 96  # announced in Content-Length, never sent


def abort_policy() -> dict[str, Any]:
    return {"pools": [{"model": MODEL, "replicas": ["127.0.0.1:1"]}],
            "simulator": {"enabled": True, "preset": "tiny-cpu", "time_scale": 50.0},
            "gateway": {"envoy_log_level": "error"},
            "tenants": {"max_streams_per_tenant": 0}}


class Target:
    """The stack under test: where to connect, and what the sidecar holds."""

    def __init__(self, stack: Stack, probe_out: Path) -> None:
        self.stack = stack
        self.host, self.port = stack.policy.gateway.host, stack.policy.gateway.port
        self.sidecar_pid = stack.child("sidecar[0]").proc.pid
        self.probe_out = probe_out

    def open_streams(self) -> float:
        return total(scrape(self.stack.metrics_url), "sluice_open_streams")

    def wait_open_streams(self, at_least: int | None = None, at_most: int | None = None,
                          timeout_s: float = 15.0) -> float:
        seen = 0.0

        def ok() -> bool:
            nonlocal seen
            seen = self.open_streams()
            return (at_least is None or seen >= at_least) and (at_most is None or seen <= at_most)

        wait_until(ok, timeout_s, 0.05)
        return seen

    def probe(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The sidecar's Python-level state (bench/sidecar_probe.py writes it on SIGUSR1)."""
        before = self.probe_out.stat().st_mtime_ns if self.probe_out.exists() else 0
        os.kill(self.sidecar_pid, signal.SIGUSR1)
        if not wait_until(lambda: self.probe_out.exists() and self.probe_out.stat().st_mtime_ns != before, timeout_s,
                          0.05):
            raise TimeoutError("the sidecar wrote no probe snapshot")
        return json.loads(self.probe_out.read_text())


def http1_aborts(t: Target, n: int) -> float:
    """`n` HTTP/1 requests whose client leaves after the headers; returns the most the sidecar held at once."""
    head = (f"POST {PATH} HTTP/1.1\r\nhost: {t.host}:{t.port}\r\ncontent-type: application/json\r\n"
            f"content-length: {BODY_LENGTH}\r\n\r\n").encode()
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection((t.host, t.port), timeout=5)
            s.sendall(head)
            socks.append(s)
        return t.wait_open_streams(at_least=n)
    finally:
        for s in socks:
            s.close()


def http2_cancels(t: Target, n: int) -> float:
    """`n` HTTP/2 streams on one connection, each cancelled (RST_STREAM) after its headers; returns the most the
    sidecar held at once."""
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    with socket.create_connection((t.host, t.port), timeout=5) as s:
        conn.initiate_connection()
        ids = []
        for _ in range(n):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [(":method", "POST"), (":path", PATH), (":scheme", "http"),
                                    (":authority", f"{t.host}:{t.port}"), ("content-type", "application/json"),
                                    ("content-length", str(BODY_LENGTH))])
            ids.append(sid)
        s.sendall(conn.data_to_send())
        s.settimeout(0.05)
        held = 0.0

        def all_held() -> bool:
            nonlocal held
            try:  # keep the connection's flow-control and settings exchange going
                data = s.recv(65536)
                if data:
                    conn.receive_data(data)
                    s.sendall(conn.data_to_send())
            except TimeoutError:
                pass
            held = t.open_streams()
            return held >= n

        wait_until(all_held, 15.0, 0.0)
        for sid in ids:
            conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        s.sendall(conn.data_to_send())
        t.wait_open_streams(at_most=0)  # cancelled streams, not a closed connection, end them
        conn.close_connection()
        s.sendall(conn.data_to_send())
    return held


def one_round(t: Target, per_round: int, batch: int) -> dict[str, Any]:
    t0 = time.monotonic()
    held_h1, held_h2 = [], []
    for size in batches(per_round, batch):
        held_h1.append(http1_aborts(t, size))
    for size in batches(per_round, batch):
        held_h2.append(http2_cancels(t, size))
    left = t.wait_open_streams(at_most=0)
    state = t.probe()
    gateways = state.pop("gateways")
    return {"seconds": round(time.monotonic() - t0, 1), "sidecar_rss_mb": round(rss_bytes(t.sidecar_pid) / 2**20, 2),
            "open_streams_after": left, "min_held_http1": min(held_h1), "min_held_http2": min(held_h2),
            "gateway_state": gateways[0] if len(gateways) == 1 else gateways, **state}


def verdict(rounds: list[dict[str, Any]], warmup: int, max_mb_per_round: float,
            max_object_growth: int) -> dict[str, Any]:
    after = rounds[warmup:]
    rss = [r["sidecar_rss_mb"] for r in after]
    steps = [b - a for a, b in zip(rss, rss[1:])]
    late = steps[len(steps) // 2:] or [0.0]
    states_empty = all(not any(v for k, v in r["gateway_state"].items()) and r["open_streams_after"] == 0
                       for r in rounds)
    objects = after[-1]["gc_objects"] - after[0]["gc_objects"]
    tasks = after[-1]["asyncio_tasks"] - after[0]["asyncio_tasks"]
    out = {"rss_after_warmup_mb": rss[0], "rss_end_mb": rss[-1], "rss_steps_mb": [round(x, 2) for x in steps],
           "late_mean_mb_per_round": round(statistics.mean(late), 3),
           "gc_object_growth": objects, "asyncio_task_growth": tasks,
           "checks": {"state": states_empty,
                      "objects": objects <= max_object_growth and tasks <= 0,
                      "memory": statistics.mean(late) <= max_mb_per_round}}
    out["passed"] = all(out["checks"].values())
    return out


def run(rounds: int, per_round: int, batch: int, run_dir: Path, tracemalloc: bool = False,
        log: Callable[..., None] = print) -> list[dict[str, Any]]:
    probe_out = run_dir / "sidecar-probe.json"

    def wrap(argv: list[str]) -> list[str]:  # [python, -m, extproc.cli, serve, ...] -> the probe's entry point
        return [argv[0], *(["-X", "tracemalloc=1"] if tracemalloc else []), "-m", "bench.sidecar_probe",
                str(probe_out), *argv[3:]]

    stack = Stack(with_free_ports(policy_from_dict(abort_policy())), run_dir=run_dir, sidecar_wrapper=wrap)
    stack.start()
    try:
        t = Target(stack, probe_out)
        out = [{"round": 0, "sidecar_rss_mb": round(rss_bytes(t.sidecar_pid) / 2**20, 2), **_start_state(t)}]
        log(f"start: sidecar RSS {out[0]['sidecar_rss_mb']} MB")
        for i in range(1, rounds + 1):
            r = {"round": i, **one_round(t, per_round, batch)}
            out.append(r)
            log(f"round {i}: {per_round} HTTP/1 aborts + {per_round} HTTP/2 cancels in {r['seconds']} s; sidecar "
                f"RSS {r['sidecar_rss_mb']} MB; state {r['gateway_state']}; tasks {r['asyncio_tasks']}, "
                f"gc objects {r['gc_objects']}" + (f", traced {r['tracemalloc_bytes'] / 2**20:.2f} MB"
                                                   if "tracemalloc_bytes" in r else ""))
        return out
    finally:
        stack.stop()


def _start_state(t: Target) -> dict[str, Any]:
    state = t.probe()
    gateways = state.pop("gateways")
    return {"gateway_state": gateways[0] if len(gateways) == 1 else gateways, "open_streams_after": 0, **state}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.abort_soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=2000, help="HTTP/1 aborts and HTTP/2 cancels, each, per round")
    p.add_argument("--batch", type=int, default=200, help="requests held at once (HTTP/2: streams per connection)")
    p.add_argument("--warmup", type=int, default=3, help="rounds before the memory verdict starts")
    p.add_argument("--max-mb-per-round", type=float, default=0.1)
    p.add_argument("--max-object-growth", type=int, default=2000)
    p.add_argument("--tracemalloc", action="store_true", help="run the sidecar with -X tracemalloc (slower)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not (2 <= args.rounds <= 100 and 1 <= args.per_round <= 50000 and 1 <= args.batch <= 250
            and 0 <= args.warmup < args.rounds - 1):
        p.error("need 2 <= rounds <= 100, 1 <= per-round <= 50000, 1 <= batch <= 250, 0 <= warmup < rounds - 1")
    commit = git_commit()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sluice-aborts-") as tmp:
        rounds = run(args.rounds, args.per_round, args.batch, Path(tmp), args.tracemalloc)
    # round 0 (before any abort) is the start; the warm-up counts aborting rounds
    report = {"commit": commit,
              "command": " ".join(["python", "-m", "bench.abort_soak", *(argv if argv is not None else sys.argv[1:])]),
              "config": vars(args) | {"json": str(args.json) if args.json else None},
              "run_s": round(time.monotonic() - t0, 1), "rounds": rounds,
              "verdict": verdict(rounds[1:], args.warmup, args.max_mb_per_round, args.max_object_growth)}
    v = report["verdict"]
    print(f"aborts ({commit}): {args.rounds} rounds x ({args.per_round} HTTP/1 aborts + {args.per_round} HTTP/2 "
          f"cancels); sidecar RSS {rounds[0]['sidecar_rss_mb']} MB at start, {v['rss_after_warmup_mb']} MB after "
          f"{args.warmup} warm-up rounds, {v['rss_end_mb']} MB at the end; late growth "
          f"{v['late_mean_mb_per_round']} MB/round; gc objects {v['gc_object_growth']:+d}, tasks "
          f"{v['asyncio_task_growth']:+d}; checks " + ", ".join(f"{k} {'ok' if ok else 'FAILED'}"
                                                                 for k, ok in v["checks"].items()))
    write_report(args.json, report)
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
