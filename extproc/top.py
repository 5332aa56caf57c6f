"""`sluice top`: a live terminal view of the running sidecar(s), refreshed in place like `top`.

    sluice top [--admin ADDR] [--config FILE] [--interval 1.0] [--pool MODEL] [--once] [--no-color]

Per pool: requests and tokens in flight, queued, admitted/s, shed/s (and the shed share); per replica: health
state, weight, drain flag, KV usage (bar), running / waiting in the engine, this sidecar's in-flight requests,
p95 TTFT, generated tokens/s, scrape age; per lane: queue depth and in flight. Rates are differences between two
frames (the first frame shows totals only). Plain ANSI escapes: the cursor goes home, every line clears its
remnant, the screen below the frame is cleared. `--once` prints one plain frame (scripts, tests). Ctrl-C quits.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from extproc.admin import admin_pb2 as pb
from extproc.admin.client import AdminClient, AdminError
from extproc.opscli import add_common, addresses, fmt_seconds, fmt_ttft
from extproc.config import PolicyError

HOME, CLEAR, CLEAR_EOL, CLEAR_BELOW = "\x1b[H", "\x1b[2J", "\x1b[K", "\x1b[J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
COLORS = {"healthy": "\x1b[32m", "recovering": "\x1b[36m", "degraded": "\x1b[33m", "ejected": "\x1b[31m"}
BOLD, RESET = "\x1b[1m", "\x1b[0m"
BAR = 10


@dataclass
class Rates:
    """Previous totals per (sidecar, pool), to turn counters into per-second rates between frames."""

    prev: dict[tuple[str, str], tuple[float, float, float]] = field(default_factory=dict)

    def update(self, key: tuple[str, str], now: float, admitted: float, shed: float) -> tuple[float, float] | None:
        last = self.prev.get(key)
        self.prev[key] = (now, admitted, shed)
        if last is None or now <= last[0]:
            return None
        dt = now - last[0]
        return max(0.0, admitted - last[1]) / dt, max(0.0, shed - last[2]) / dt


def kv_bar(fraction: float, width: int = BAR) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def pool_lines(pool: pb.PoolStatus, rates: tuple[float, float] | None) -> list[tuple[str, str | None]]:
    """(plain line, state to colour or None)."""
    shed_total = sum(pool.shed_total.values())
    if rates is None:
        flow = f"admitted {pool.admitted_total:.0f}  shed {shed_total:.0f} (totals)"
    else:
        adm, shed = rates
        share = shed / (adm + shed) * 100 if adm + shed > 0 else 0.0
        flow = f"admitted {adm:.1f}/s  shed {shed:.1f}/s ({share:.0f}%)"
    lines: list[tuple[str, str | None]] = [
        (f"pool {pool.model}  in flight {pool.inflight_requests} req / {pool.inflight_tokens} tok  "
         f"queued {pool.queued}  {flow}" + ("  ALL DEGRADED" if pool.all_degraded else ""), None),
        (f"  {'REPLICA':<22} {'STATE':<10} {'W':>4} {'DRN':>3} {'KV':<{BAR + 2}} {'KV%':>5} {'RUN':>4} {'WAIT':>4} "
         f"{'INFL':>4} {'TTFT95':>7} {'TOK/S':>6} {'AGE':>6}", None),
    ]
    for r in pool.replicas:
        lines.append((f"  {r.address:<22} {r.state:<10} {r.weight:>4.2f} {'D' if r.draining else '-':>3} "
                      f"{kv_bar(r.kv_usage)} {r.kv_usage * 100:>5.1f} {r.running:>4} {r.waiting:>4} "
                      f"{r.inflight_requests:>4} {fmt_ttft(r):>7} {r.generation_tps:>6.0f} "
                      f"{fmt_seconds(r.scrape_age_s):>6}", r.state))
    lines.append((f"  {'LANE':<10} {'QUEUED':>6} {'MAX':>6} {'INFL':>5} {'TOKENS':>9}", None))
    for lane in pool.lanes:
        lines.append((f"  {lane.name:<10} {lane.queued:>6} {lane.max_queue:>6} {lane.inflight_requests:>5} "
                      f"{lane.inflight_tokens:>9}", None))
    if pool.shed_total:
        lines.append(("  shed by reason: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(pool.shed_total.items())),
                      None))
    return lines


def render_frame(snapshots: list[tuple[str, pb.StatusResponse | str]], rates: Rates, now: float,
                 interval: float, width: int = 0, color: bool = False) -> str:
    """One frame. `snapshots`: (admin address, StatusResponse or an error message)."""
    out: list[tuple[str, str | None]] = []
    clock = time.strftime("%H:%M:%S")
    out.append((f"sluice top  {clock}  refresh {interval:g}s  (Ctrl-C quits)", None))
    for addr, st in snapshots:
        if isinstance(st, str):
            out.append((f"sidecar {addr}: UNREACHABLE: {st}", "ejected"))
            continue
        out.append((f"sidecar {addr}  pid {st.pid}  up {fmt_seconds(st.uptime_s)}"
                    + ("  DRAINING" if st.draining else "")
                    + ("" if not st.HasField("last_reload") or st.last_reload.ok
                       else f"  LAST RELOAD REJECTED: {st.last_reload.error}"), None))
        for pool in st.pools:
            r = rates.update((addr, pool.model), now, pool.admitted_total, sum(pool.shed_total.values()))
            out.extend(pool_lines(pool, r))
    lines = []
    for text, state in out:
        if width > 0:
            text = text[:width]
        if color:
            if state in COLORS and f" {state} " in text:
                text = text.replace(f" {state} ", f" {COLORS[state]}{state}{RESET} ", 1)
            elif state in COLORS:
                text = COLORS[state] + text + RESET
            elif text.startswith(("pool ", "sluice top")):
                text = BOLD + text + RESET
        lines.append(text)
    return "\n".join(lines)


def snapshot(clients: list[AdminClient], pool: str) -> list[tuple[str, pb.StatusResponse | str]]:
    out: list[tuple[str, pb.StatusResponse | str]] = []
    for c in clients:
        try:
            out.append((c.address, c.status(pool)))
        except AdminError as exc:
            out.append((c.address, exc.message))
    return out


def run(addrs: list[str], interval: float = 1.0, once: bool = False, pool: str = "", timeout: float = 2.0,
        iterations: int | None = None, out: TextIO | None = None, color: bool | None = None) -> int:
    """Draw frames until Ctrl-C (or `iterations` frames). Returns 1 when no sidecar answered the last frame."""
    out = out or sys.stdout
    tty = out.isatty() if hasattr(out, "isatty") else False
    color = tty and not once if color is None else color
    clients = [AdminClient(a, timeout) for a in addrs]
    rates = Rates()
    last: list[tuple[str, pb.StatusResponse | str]] = []
    try:
        if once:
            last = snapshot(clients, pool)
            out.write(render_frame(last, rates, time.monotonic(), interval, color=color) + "\n")
            out.flush()
        else:
            out.write(HIDE_CURSOR + CLEAR)
            n = 0
            try:
                while iterations is None or n < iterations:
                    last = snapshot(clients, pool)
                    width = shutil.get_terminal_size((120, 40)).columns if tty else 0
                    frame = render_frame(last, rates, time.monotonic(), interval, width, color)
                    out.write(HOME + frame.replace("\n", CLEAR_EOL + "\n") + CLEAR_EOL + "\n" + CLEAR_BELOW)
                    out.flush()
                    n += 1
                    if iterations is None or n < iterations:
                        time.sleep(interval)
            except KeyboardInterrupt:
                pass
            finally:
                out.write(SHOW_CURSOR)
                out.flush()
    finally:
        for c in clients:
            c.close()
    return 0 if any(not isinstance(st, str) for _, st in last) else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_common(argparse.ArgumentParser(prog="sluice top", description=__doc__.split("\n\n")[0]))
    parser.add_argument("--interval", "-n", type=float, default=1.0, help="seconds between frames (default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--pool", default="", help="only this pool (model name)")
    parser.add_argument("--no-color", action="store_true", help="no colours")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.interval <= 0:
        print("sluice top: --interval must be > 0", file=sys.stderr)
        return 2
    try:
        addrs = addresses(args)
    except PolicyError as exc:
        print(f"sluice top: invalid policy: {exc}", file=sys.stderr)
        return 2
    return run(addrs, args.interval, args.once, args.pool, min(args.timeout, max(args.interval, 0.5)),
               color=False if args.no_color else None)


if __name__ == "__main__":
    sys.exit(main())
