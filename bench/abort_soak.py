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
import threading
import time
from pathlib import Path
from typing import Any, Callable

import h2.config
import h2.connection
import h2.errors
import h2.exceptions

from bench.procstat import rss_bytes
from bench.soak import batches, git_commit, scrape, total, wait_until, write_report
from extproc.config import policy_from_dict
from extproc.restarts import RecyclePolicy, Recycler
from extproc.supervisor import Stack, with_free_ports

MODEL = "sim-model"
PATH = "/v1/chat/completions"
BODY_LENGTH = 96  # announced in Content-Length, never sent


def abort_policy(recycle_rss_mb: int | None = None) -> dict[str, Any]:
    """The bench's stack; `recycle_rss_mb` (the --recycle-rss-mb option, to see recycling within a short run) sets
    sidecar.recycle_rss_mb, else the policy's default stands."""
    policy: dict[str, Any] = {"pools": [{"model": MODEL, "replicas": ["127.0.0.1:1"]}],
                              "simulator": {"enabled": True, "preset": "tiny-cpu", "time_scale": 50.0},
                              "gateway": {"envoy_log_level": "error"},
                              "tenants": {"max_streams_per_tenant": 0}}
    if recycle_rss_mb is not None:
        policy["sidecar"] = {"recycle_rss_mb": recycle_rss_mb}
    return policy


class Supervision:
    """What `sluice up` does to the stack's sidecar between its own checks: `Recycler.tend` every 0.2 s, in a
    thread, until stopped (bounded by `max_s`)."""

    def __init__(self, stack: Stack, log: Callable[..., None], max_s: float = 6 * 3600) -> None:
        sc = stack.policy.sidecar
        self.recycler = Recycler(RecyclePolicy(limit_mb=sc.recycle_rss_mb, check_s=sc.recycle_check_s),
                                 stack.child_env(), lambda line: log(f"supervisor: {line}"))
        self.stack, self.max_s = stack, max_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        while not self.stopped.wait(0.2) and time.monotonic() < deadline:
            self.recycler.tend(self.stack.children)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)
        self.recycler.stop()


class Target:
    """The stack under test: where to connect, and what the sidecar holds."""

    def __init__(self, stack: Stack, probe_out: Path) -> None:
        self.stack = stack
        self.host, self.port = stack.policy.gateway.host, stack.policy.gateway.port
        self.probe_out = probe_out

    @property
    def sidecar_pid(self) -> int:
        """The sidecar worker serving now (a recycle replaces it)."""
        proc = self.stack.child("sidecar[0]").proc
        assert proc is not None
        return proc.pid

    def open_streams(self) -> float:
        """The serving worker's open ext_proc streams; NaN (no wait is satisfied) while no worker answers on the
        metrics port (a recycled worker's replacement takes it over within a fraction of a second)."""
        try:
            return total(scrape(self.stack.metrics_url), "sluice_open_streams")
        except OSError:
            return float("nan")

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
        for _ in range(3):  # a worker that is handing over may leave before it answers: ask the one serving now
            before = self.probe_out.stat().st_mtime_ns if self.probe_out.exists() else 0
            try:
                os.kill(self.sidecar_pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            if wait_until(lambda: self.probe_out.exists() and self.probe_out.stat().st_mtime_ns != before,
                          timeout_s, 0.05):
                return json.loads(self.probe_out.read_text())
        raise TimeoutError("the sidecar wrote no probe snapshot")


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
            try:
                conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            except h2.exceptions.StreamClosedError:
                pass  # already answered: held past a recycled worker's grace, Envoy's 503 ended it
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
    return {"seconds": round(time.monotonic() - t0, 1), "sidecar_pid": t.sidecar_pid,
            "sidecar_rss_mb": round(rss_bytes(t.sidecar_pid) / 2**20, 2),
            "open_streams_after": left, "min_held_http1": min(held_h1), "min_held_http2": min(held_h2),
            "gateway_state": gateways[0] if len(gateways) == 1 else gateways, **state}


def verdict(rounds: list[dict[str, Any]], warmup: int, max_mb_per_round: float,
            max_object_growth: int, recycle_rss_mb: float = 0.0, max_mb_over_limit: float = 5.0) -> dict[str, Any]:
    """With recycling on (`recycle_rss_mb` > 0) memory is bounded when a worker was replaced and no round ended more
    than `max_mb_over_limit` above the limit (the check runs every recycle_check_s, so a worker may pass the limit
    by what it grows in that time); without it, when the late growth per round tends to 0."""
    after = rounds[warmup:]
    rss = [r["sidecar_rss_mb"] for r in after]
    steps = [b - a for a, b in zip(rss, rss[1:])]
    late = steps[len(steps) // 2:] or [0.0]
    states_empty = all(not any(v for k, v in r["gateway_state"].items()) and r["open_streams_after"] == 0
                       for r in rounds)
    pids = [r["sidecar_pid"] for r in rounds]
    recycles = sum(1 for a, b in zip(pids, pids[1:]) if a != b)
    # objects and tasks are compared within one process, after its own warm-up (a replacement's first rounds count
    # tasks and objects a fresh worker creates on its first traffic)
    same = [r for r in after if r["sidecar_pid"] == after[-1]["sidecar_pid"]]
    same = same[min(warmup, max(0, len(same) - 2)):] if same[0] is not after[0] else same
    objects = same[-1]["gc_objects"] - same[0]["gc_objects"]
    tasks = same[-1]["asyncio_tasks"] - same[0]["asyncio_tasks"]
    bounded = (recycles >= 1 and max(rss) <= recycle_rss_mb + max_mb_over_limit if recycle_rss_mb > 0
               else statistics.mean(late) <= max_mb_per_round)
    out = {"rss_after_warmup_mb": rss[0], "rss_end_mb": rss[-1], "rss_steps_mb": [round(x, 2) for x in steps],
           "late_mean_mb_per_round": round(statistics.mean(late), 3),
           "rss_max_mb": max(rss), "rss_min_mb": min(rss), "workers_replaced": recycles,
           "recycle_rss_mb": recycle_rss_mb,
           "gc_object_growth": objects, "asyncio_task_growth": tasks,
           "checks": {"state": states_empty,
                      "objects": objects <= max_object_growth and tasks <= 0,
                      "memory": bounded}}
    out["passed"] = all(out["checks"].values())
    return out


def run(rounds: int, per_round: int, batch: int, run_dir: Path, tracemalloc: bool = False,
        log: Callable[..., None] = print, recycle_rss_mb: int | None = None) -> list[dict[str, Any]]:
    probe_out = run_dir / "sidecar-probe.json"

    def wrap(argv: list[str]) -> list[str]:  # [python, -m, extproc.cli, serve, ...] -> the probe's entry point
        return [argv[0], *(["-X", "tracemalloc=1"] if tracemalloc else []), "-m", "bench.sidecar_probe",
                str(probe_out), *argv[3:]]

    stack = Stack(with_free_ports(policy_from_dict(abort_policy(recycle_rss_mb))), run_dir=run_dir,
                  sidecar_wrapper=wrap)
    stack.start()
    supervision = Supervision(stack, log)
    try:
        t = Target(stack, probe_out)
        out = [{"round": 0, "sidecar_pid": t.sidecar_pid, "sidecar_rss_mb": round(rss_bytes(t.sidecar_pid) / 2**20, 2),
                **_start_state(t)}]
        log(f"start: sidecar RSS {out[0]['sidecar_rss_mb']} MB")
        for i in range(1, rounds + 1):
            r = {"round": i, **one_round(t, per_round, batch)}
            out.append(r)
            log(f"round {i}: {per_round} HTTP/1 aborts + {per_round} HTTP/2 cancels in {r['seconds']} s; sidecar "
                f"pid {r['sidecar_pid']} RSS {r['sidecar_rss_mb']} MB; state {r['gateway_state']}; "
                f"tasks {r['asyncio_tasks']}, "
                f"gc objects {r['gc_objects']}" + (f", traced {r['tracemalloc_bytes'] / 2**20:.2f} MB"
                                                   if "tracemalloc_bytes" in r else ""))
        return out
    finally:
        supervision.stop()
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
    p.add_argument("--recycle-rss-mb", type=int, default=None,
                   help="set sidecar.recycle_rss_mb for this run (default: the policy's), to see workers recycled "
                        "within a short run; the bench supervises the sidecar as `sluice up` does either way")
    p.add_argument("--max-mb-over-limit", type=float, default=5.0,
                   help="with recycling: how far above the limit a round may end")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not (2 <= args.rounds <= 100 and 1 <= args.per_round <= 50000 and 1 <= args.batch <= 250
            and 0 <= args.warmup < args.rounds - 1):
        p.error("need 2 <= rounds <= 100, 1 <= per-round <= 50000, 1 <= batch <= 250, 0 <= warmup < rounds - 1")
    commit = git_commit()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sluice-aborts-") as tmp:
        rounds = run(args.rounds, args.per_round, args.batch, Path(tmp), args.tracemalloc,
                     recycle_rss_mb=args.recycle_rss_mb)
    limit = policy_from_dict(abort_policy(args.recycle_rss_mb)).sidecar.recycle_rss_mb
    # round 0 (before any abort) is the start; the warm-up counts aborting rounds
    report = {"commit": commit,
              "command": " ".join(["python", "-m", "bench.abort_soak", *(argv if argv is not None else sys.argv[1:])]),
              "config": vars(args) | {"json": str(args.json) if args.json else None},
              "run_s": round(time.monotonic() - t0, 1), "rounds": rounds,
              "verdict": verdict(rounds[1:], args.warmup, args.max_mb_per_round, args.max_object_growth,
                                 limit if args.recycle_rss_mb is not None else 0.0, args.max_mb_over_limit)}
    v = report["verdict"]
    print(f"aborts ({commit}): {args.rounds} rounds x ({args.per_round} HTTP/1 aborts + {args.per_round} HTTP/2 "
          f"cancels); sidecar RSS {rounds[0]['sidecar_rss_mb']} MB at start, {v['rss_after_warmup_mb']} MB after "
          f"{args.warmup} warm-up rounds, {v['rss_end_mb']} MB at the end; late growth "
          f"{v['late_mean_mb_per_round']} MB/round; max {v['rss_max_mb']} MB, {v['workers_replaced']} worker(s) "
          f"replaced (recycle limit {limit} MB); gc objects {v['gc_object_growth']:+d}, tasks "
          f"{v['asyncio_task_growth']:+d}; checks " + ", ".join(f"{k} {'ok' if ok else 'FAILED'}"
                                                                 for k, ok in v["checks"].items()))
    write_report(args.json, report)
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
