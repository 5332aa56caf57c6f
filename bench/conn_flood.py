"""`python -m bench.conn_flood [--connections 10000] [--json FILE]`: silent connections against a full gateway
(issue #19, finding 2).

One client opens `--connections` raw TCP connections to the gateway's listener and sends nothing on them, against
a gateway whose `max_downstream_connections` equals that number, so the flood alone can hold every slot. Then a
normal client (the openai SDK, a new connection per try) asks for a chat completion. What is measured:

  flood        how long the connects took, and how many Envoy held once it had accepted them all (the client
               starts only then)
  client       the normal client's latency from its first try to its answer, and how many tries were refused;
               the bar: served within `gateway.request_headers_timeout_s`; `refused_at_accept` is Envoy's count
               of connections it closed at accept for the limit (the client's refused tries, and no silent one)
  closed       when Envoy had closed every silent connection (the bar: by the headers timeout after the last connect,
               plus a small margin)
  Envoy RSS    (VmRSS from /proc) before the flood, at its peak, and after every silent connection is closed; the
               bar: back within 10% of where it started, within a bounded settle time (`--settle-s`; "after" is the
               first reading within the bar, or the last one). tcmalloc returns free pages above its soft limit
               (extproc/xds.py `render_bootstrap`) and its per-CPU caches give back the freed small objects
               (`envoy_environment`)

The test process and Envoy (which inherits it) need one file descriptor per connection: RLIMIT_NOFILE is raised for
this process before the stack starts, and it is an error (never a skip) if it cannot be. Every loop here is bounded
in count and time; the processes are started and stopped by PID through extproc.supervisor.Stack.
"""

from __future__ import annotations

import argparse
import errno
import json
import re
import resource
import select
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from bench.procstat import rss_bytes
from bench.soak import batches, git_commit, wait_until, write_report
from extproc.config import policy_from_dict
from extproc.supervisor import Stack, with_free_ports

MODEL = "sim-model"
FD_HEADROOM = 1024  # descriptors beyond the flood: the stack's own sockets, pipes, logs, Python's imports
RSS_TOLERANCE = 0.10


def raise_fd_limit(need: int) -> int:
    """Make RLIMIT_NOFILE at least `need` for this process (children started later inherit it); returns the soft
    limit now in force. Raises the hard limit too when it is lower (possible as root, as CI runs). A limit that
    cannot be raised is an error with the reason: the flood cannot be measured without its descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return soft
    new_hard = hard if hard == resource.RLIM_INFINITY or hard >= need else need
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, new_hard))
    except (ValueError, OSError) as exc:
        raise RuntimeError(f"RLIMIT_NOFILE is {soft}/{hard} and could not be raised to {need} ({exc}); run as root "
                           f"or raise the hard limit (ulimit -Hn {need}) before starting") from exc
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def flood_policy(connections: int, headers_timeout_s: float) -> dict[str, Any]:
    return {"pools": [{"model": MODEL, "replicas": ["127.0.0.1:1"]}],
            "simulator": {"enabled": True, "preset": "tiny-cpu", "time_scale": 50.0},
            "gateway": {"envoy_log_level": "error", "max_downstream_connections": connections,
                        "request_headers_timeout_s": headers_timeout_s}}


def open_silent(host: str, port: int, n: int, batch: int = 500, timeout_s: float = 30.0) -> list[socket.socket]:
    """`n` connected TCP sockets that send nothing. Non-blocking connects, `batch` at a time, each batch waited on
    with epoll until every socket is writable (connected) or the overall `timeout_s` passes; a connect that failed
    raises. The caller closes the sockets."""
    deadline = time.monotonic() + timeout_s
    socks: list[socket.socket] = []
    ep = select.epoll()
    try:
        for size in batches(n, batch):
            pending: dict[int, socket.socket] = {}
            for _ in range(size):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                socks.append(s)
                rc = s.connect_ex((host, port))
                if rc not in (0, errno.EINPROGRESS):
                    raise OSError(rc, f"connect #{len(socks)}: {errno.errorcode.get(rc, rc)}")
                pending[s.fileno()] = s
                ep.register(s.fileno(), select.EPOLLOUT)
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(pending)} connects still pending after {timeout_s} s "
                                       f"({len(socks) - len(pending)} of {n} made)")
                for fd, _ev in ep.poll(min(left, 1.0)):
                    s = pending.pop(fd)
                    ep.unregister(fd)
                    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, f"connect: {errno.errorcode.get(err, err)} after {len(socks)} sockets")
        return socks
    except BaseException:
        for s in socks:
            s.close()
        raise
    finally:
        ep.close()


def closed_by_peer(socks: list[socket.socket], deadline: float) -> tuple[int, float]:
    """Wait until the peer has closed every socket in `socks` (EOF or reset) or `deadline` (monotonic) passes.
    Returns (how many are still open, monotonic time the last one was seen closed)."""
    ep = select.epoll()
    open_fds = {s.fileno(): s for s in socks}
    last = time.monotonic()
    try:
        for fd in open_fds:
            ep.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ev in ep.poll(min(left, 0.5)):
                s = open_fds.get(fd)
                if s is None:
                    continue
                try:
                    data = s.recv(1)
                except BlockingIOError:
                    continue
                except OSError:  # reset
                    data = b""
                if data == b"":
                    ep.unregister(fd)
                    del open_fds[fd]
                    last = time.monotonic()
        return len(open_fds), last
    finally:
        ep.close()


def still_open_now(socks: list[socket.socket]) -> int:
    """How many of `socks` the peer has not closed, right now (no waiting)."""
    return closed_by_peer(socks, time.monotonic() + 0.05)[0] if socks else 0


def listener_stat(stack: Stack, name: str) -> int:
    """One of Envoy's counters or gauges for the gateway listener (`listener.<host>_<port>.<name>`), from its admin."""
    gw = stack.policy.gateway
    stat = f"listener.{gw.host}_{gw.port}.{name}"
    with urllib.request.urlopen(f"{stack.admin_url}/stats?filter=^{re.escape(stat)}$", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            key, _, value = line.partition(": ")
            if key == stat:
                return int(value)
    raise KeyError(stat)


def serve_one(base_url: str, deadline_s: float, pause_s: float = 0.05) -> dict[str, Any]:
    """A normal client: one chat completion through the openai SDK, a new connection per try (max_retries=0; a
    refused connection is tried again after `pause_s`, until `deadline_s` has passed). Returns its latency from the
    first try, how many tries were refused, and whether it was answered."""
    import openai

    t0 = time.monotonic()
    refused = 0
    last_error = ""
    while time.monotonic() - t0 < deadline_s:
        with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=5.0) as client:
            try:
                out = client.chat.completions.create(model=MODEL, max_tokens=2,
                                                     messages=[{"role": "user", "content": "hello"}])
                return {"served": True, "latency_s": round(time.monotonic() - t0, 3), "refused_tries": refused,
                        "tokens": out.usage.completion_tokens if out.usage else None}
            except openai.APIConnectionError as exc:
                refused += 1
                last_error = type(exc.__cause__ or exc).__name__
        time.sleep(pause_s)  # pacing the retries of a client that was refused at accept
    return {"served": False, "latency_s": round(time.monotonic() - t0, 3), "refused_tries": refused,
            "last_error": last_error}


def settle_rss(pid: int, target_bytes: float, timeout_s: float,
               poll: Callable[[Callable[[], bool], float], Any]) -> tuple[int, float]:
    """Wait (with `poll(pred, timeout)`, e.g. tests.waiting.wait_for) until `pid`'s RSS is at most `target_bytes`;
    returns (the last RSS read, seconds waited)."""
    t0 = time.monotonic()
    last = rss_bytes(pid)

    def settled() -> bool:
        nonlocal last
        last = rss_bytes(pid)
        return last <= target_bytes

    poll(settled, timeout_s)
    return last, round(time.monotonic() - t0, 2)


def flood(stack: Stack, connections: int, *, settle_s: float = 60.0,
          poll: Callable[[Callable[[], bool], float], Any] = wait_until,
          log: Callable[..., None] = print) -> dict[str, Any]:
    """Run the flood against a started `stack` (see the module docstring) and return what was measured."""
    gw = stack.policy.gateway
    envoy = stack.child("envoy").proc.pid
    timeout_s = gw.request_headers_timeout_s
    warm = serve_one(stack.base_url, 10.0)  # a first request: Envoy's per-worker state exists before the baseline
    rss_before = rss_bytes(envoy)
    t0 = time.monotonic()
    silent = open_silent(gw.host, gw.port, connections)
    connected_s = time.monotonic() - t0
    try:
        # The kernel completes the handshakes before Envoy accepts them: wait until Envoy holds every silent connection
        # (in its listener filter, waiting for a request line), so the client starts against a full gateway.
        poll(lambda: listener_stat(stack, "downstream_pre_cx_active") >= connections, timeout_s)
        held = min(still_open_now(silent), listener_stat(stack, "downstream_pre_cx_active"))
        rss_peak = rss_bytes(envoy)
        log(f"flood: {connections} connects in {connected_s:.2f} s, {held} held; Envoy RSS "
            f"{rss_before / 2**20:.1f} -> {rss_peak / 2**20:.1f} MB")
        client = serve_one(stack.base_url, timeout_s + 5.0)
        rss_peak = max(rss_peak, rss_bytes(envoy))
        left, last_closed = closed_by_peer(silent, t0 + connected_s + timeout_s + 5.0)
        rss_peak = max(rss_peak, rss_bytes(envoy))
        refused_at_accept = listener_stat(stack, "downstream_global_cx_overflow")
    finally:
        for s in silent:
            s.close()
    rss_after, settle_waited = settle_rss(envoy, rss_before * (1 + RSS_TOLERANCE), settle_s, poll)
    return {
        "connections": connections,
        "max_downstream_connections": gw.max_downstream_connections,
        "request_headers_timeout_s": timeout_s,
        "warm_up_served": warm["served"],
        "connect_s": round(connected_s, 2),
        "held_after_connect": held,
        "client": client,
        "refused_at_accept": refused_at_accept,
        "still_open_at_deadline": left,
        "all_closed_after_s": round(last_closed - t0, 2),
        "envoy_rss_mb": {"before": round(rss_before / 2**20, 2), "peak": round(rss_peak / 2**20, 2),
                         "after": round(rss_after / 2**20, 2),
                         "after_vs_before_pct": round(100.0 * (rss_after - rss_before) / rss_before, 2),
                         "settle_wait_s": settle_waited},
    }


def run(connections: int, headers_timeout_s: float, run_dir: Path, settle_s: float = 60.0,
        log: Callable[..., None] = print) -> dict[str, Any]:
    raise_fd_limit(connections + FD_HEADROOM)
    stack = Stack(with_free_ports(policy_from_dict(flood_policy(connections, headers_timeout_s))), run_dir=run_dir)
    stack.start()
    try:
        return flood(stack, connections, settle_s=settle_s, log=log)
    finally:
        stack.stop()


def verdict(report: dict[str, Any]) -> dict[str, bool]:
    timeout_s = report["request_headers_timeout_s"]
    return {"client_served_within_headers_timeout": report["client"]["served"]
            and report["client"]["latency_s"] < timeout_s,
            "silent_closed": report["still_open_at_deadline"] == 0,
            "envoy_rss_back_within_10pct": report["envoy_rss_mb"]["after_vs_before_pct"] <= 100 * RSS_TOLERANCE}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.conn_flood", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=10000, help="silent connections = max_downstream_connections")
    p.add_argument("--headers-timeout-s", type=float, default=5.0, help="gateway.request_headers_timeout_s")
    p.add_argument("--settle-s", type=float, default=60.0, help="longest wait for Envoy's RSS to come back")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not 1 <= args.connections <= 60000:
        p.error("--connections must be in 1..60000")
    commit = git_commit()
    with tempfile.TemporaryDirectory(prefix="sluice-flood-") as tmp:
        t0 = time.monotonic()
        report = run(args.connections, args.headers_timeout_s, Path(tmp), args.settle_s)
        report["run_s"] = round(time.monotonic() - t0, 1)
    report["commit"] = commit
    report["command"] = " ".join(["python", "-m", "bench.conn_flood", *(argv if argv is not None else sys.argv[1:])])
    report["checks"] = verdict(report)
    report["passed"] = all(report["checks"].values())
    print(json.dumps(report, indent=1))
    write_report(args.json, report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
