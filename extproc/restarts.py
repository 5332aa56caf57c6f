"""`sluice up` restarts a sidecar that died, with backoff and a limit, while Envoy keeps running.

Envoy holds the client connections and streams: a stream already forwarded to its replica keeps flowing without
the sidecar (the cheap response mode needs no answer from it), and a new request gets Envoy's fail-closed 503
(OpenAI-style JSON, `retry-after`) until the sidecar answers again. So a dead sidecar is restarted, never the stack.

Backoff: the n-th restart of one child within `window_s` (n = 1, 2, ...) waits
    delay(n) = min(max_backoff_s, backoff_s * 2 ** (n - 1))
after the exit is seen. A child that died `max_restarts` times within `window_s` is not restarted again: the
restarter reports it (`gave_up`) and `sluice up` stops the stack and exits 1, because a crash loop is a fault to
fix, not one to hide.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from extproc.supervisor import Child


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_s: float = 0.5       # the first restart's delay; each later one within the window doubles it
    max_backoff_s: float = 8.0   # the longest delay
    max_restarts: int = 5        # restarts of one child within window_s before giving up
    window_s: float = 300.0      # the window over which restarts are counted

    def delay(self, n: int) -> float:
        """Seconds before the n-th restart (n >= 1) within the window."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (n - 1))


@dataclass
class Restarter:
    """Tends the children `sluice up` may restart; `tend(child)` once per supervision tick for each dead one."""

    policy: RestartPolicy
    env: dict[str, str]
    report: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    restarts: dict[str, list[float]] = field(default_factory=dict)  # child name -> monotonic restart times
    due: dict[str, float] = field(default_factory=dict)             # child name -> when its pending restart runs

    def total(self) -> int:
        """Restarts done so far, every child."""
        return sum(len(times) for times in self.restarts.values())

    def tend(self, child: Child) -> bool:
        """Schedule or run the restart of a dead child; False once it exhausted its restarts (give up)."""
        now = self.clock()
        p = self.policy
        recent = [t for t in self.restarts.get(child.name, []) if now - t < p.window_s]
        self.restarts[child.name] = recent
        due = self.due.get(child.name)
        if due is None:
            code = child.proc.returncode if child.proc is not None else None
            if len(recent) >= p.max_restarts:
                self.report(f"{child.name} exited (code {code}) after {len(recent)} restarts within "
                            f"{p.window_s:g} s (limit {p.max_restarts}): not restarting it; log {child.log_path}")
                return False
            delay = p.delay(len(recent) + 1)
            self.due[child.name] = now + delay
            self.report(f"{child.name} exited (code {code}); restart {len(recent) + 1} of {p.max_restarts} within "
                        f"{p.window_s:g} s in {delay:g} s; log {child.log_path}")
            return True
        if now >= due:
            del self.due[child.name]
            child.start(self.env)
            recent.append(now)
            self.report(f"{child.name} restarted (pid {child.proc.pid if child.proc else '?'}); "
                        f"{self.total()} restart(s) since start")
        return True


# ---- recycling a worker whose memory grew ------------------------------------------------------------------------
# grpc.aio leaks about 110-165 bytes of native memory per ext_proc stream that Envoy cancels (grpc/grpc#43360, open,
# no fixed grpcio release): RSS grows with every abandoned request and nothing in Python can free it. `sluice up`
# bounds it by replacing a worker whose RSS passed `sidecar.recycle_rss_mb`, with no request lost:
#   1. start a replacement with the same argv plus `--take-over READY_FILE`: it listens on the same gRPC port
#      (SO_REUSEPORT) and writes READY_FILE once it serves ext_proc;
#   2. once READY_FILE exists, SIGUSR2 to the old worker: it closes its listener and sends Envoy a GOAWAY, so new
#      streams go to the replacement, answers the streams it holds, then exits (extproc/server.py `_hand_over`);
#      the replacement takes the metrics and admin ports once the old one frees them;
#   3. the replacement takes the old one's place in the stack; a recycle is counted apart from crash restarts.


@dataclass(frozen=True, slots=True)
class RecyclePolicy:
    limit_mb: float = 0.0          # recycle a worker whose RSS is above this (MB = 2**20 bytes); 0 = never
    check_s: float = 10.0          # seconds between two RSS reads of one worker (off the request path)
    ready_timeout_s: float = 60.0  # a replacement not serving within this is stopped (and retried later)
    leave_timeout_s: float = 30.0  # a leaving worker still alive after this is killed (its drain takes <= 10 s)
    max_backoff_s: float = 3600.0  # after n failed replacements the next try waits min(this, check_s * 2**n)


def should_recycle(rss_mb: float, first_mb: float, limit_mb: float) -> bool:
    """Recycle when the limit is set and passed, unless the worker was already over it when it was fresh (`first_mb`:
    its RSS when it was first seen serving, before it took traffic; a replacement would be over it too, so
    replacing it would only loop).
        rss_mb > limit_mb > 0 and first_mb <= limit_mb"""
    return limit_mb > 0 and rss_mb > limit_mb and first_mb <= limit_mb


def read_rss_mb(pid: int) -> float | None:
    """A process's resident set (VmRSS in /proc/PID/status) in MB; None when it cannot be read (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


TAKE_OVER = "--take-over"


def replacement_of(child: Child) -> tuple[Child, Path]:
    """A Child that takes `child`'s place: the same argv (plus `--take-over READY_FILE`), log and readiness URL."""
    ready = child.log_path.with_suffix(".ready")
    argv = list(child.argv)
    if TAKE_OVER in argv:
        argv[argv.index(TAKE_OVER) + 1] = str(ready)
    else:
        argv += [TAKE_OVER, str(ready)]
    return Child(child.name, argv, child.log_path, child.ready_url, env=dict(child.env)), ready


@dataclass
class Handover:
    """One recycle in progress: `new` starting (until `ready` exists), then `old` leaving."""

    old: Child
    new: Child
    ready: Path
    rss_mb: float
    started: float
    signalled: float | None = None


@dataclass
class Recycler:
    """Replaces sidecar workers whose RSS passed the limit; `tend(children)` once per supervision tick (it reads
    RSS only every `check_s` per worker)."""

    policy: RecyclePolicy
    env: dict[str, str]
    report: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    rss_of: Callable[[int], float | None] = read_rss_mb
    recycles: int = 0
    next_check: dict[str, float] = field(default_factory=dict)   # child name -> when to read its RSS next
    first_mb: dict[int, float] = field(default_factory=dict)     # pid -> its RSS when first seen serving
    warned: set[int] = field(default_factory=set)                # pids reported as over the limit when fresh
    failures: dict[str, int] = field(default_factory=dict)       # child name -> failed replacements in a row
    starting: dict[str, Handover] = field(default_factory=dict)  # child name -> replacement not yet serving
    leaving: list[Handover] = field(default_factory=list)        # replaced workers not yet exited

    def tend(self, children: list[Child]) -> None:
        """Check RSS when due, advance each handover, reap the workers that left."""
        if self.policy.limit_mb <= 0:
            return
        now = self.clock()
        for i, child in enumerate(children):
            if not child.name.startswith("sidecar"):
                continue
            if child.name in self.starting:
                self._advance(children, i, self.starting[child.name], now)
                continue
            if child.alive() and child.proc is not None and child.proc.pid not in self.first_mb:
                self._note_fresh(child)
            if child.alive() and now >= self.next_check.setdefault(child.name, now + self.policy.check_s):
                self.next_check[child.name] = now + self.policy.check_s
                self._check(child, now)
        self._reap(now)

    def _note_fresh(self, child: Child) -> None:
        """A worker's RSS when first seen serving (sluice up's first tick after start-up, or a replacement as it
        takes over): what any fresh worker holds."""
        assert child.proc is not None
        rss = self.rss_of(child.proc.pid)
        if rss is not None:
            self.first_mb[child.proc.pid] = rss

    def _check(self, child: Child, now: float) -> None:
        assert child.proc is not None
        pid = child.proc.pid
        rss = self.rss_of(pid)
        if rss is None:
            return
        first = self.first_mb.setdefault(pid, rss)
        limit = self.policy.limit_mb
        if rss > limit and first > limit and pid not in self.warned:
            self.warned.add(pid)
            self.report(f"{child.name} (pid {pid}) held {first:.1f} MB when fresh, over sidecar.recycle_rss_mb "
                        f"{limit:g}: a replacement would be too, so it is not recycled")
        if not should_recycle(rss, first, limit):
            return
        new, ready = replacement_of(child)
        ready.unlink(missing_ok=True)
        new.start(self.env)
        self.starting[child.name] = Handover(child, new, ready, rss, now)
        self.report(f"{child.name} (pid {pid}) RSS {rss:.1f} MB over sidecar.recycle_rss_mb {limit:g}: "
                    f"starting its replacement (pid {new.proc.pid if new.proc else '?'})")

    def _advance(self, children: list[Child], i: int, h: Handover, now: float) -> None:
        """A replacement that serves takes the old worker's place; one that died or is late is given up on."""
        name = h.old.name
        if h.ready.exists() and h.new.alive() or not h.old.alive() and h.new.alive():
            del self.starting[name]
            self.failures.pop(name, None)
            if h.old.alive() and h.old.proc is not None:
                h.old.proc.send_signal(signal.SIGUSR2)
            h.signalled = now
            children[i] = h.new
            self._note_fresh(h.new)
            self.leaving.append(h)
            self.recycles += 1
            self.next_check[name] = now + self.policy.check_s
            self.report(f"{name} recycled at RSS {h.rss_mb:.1f} MB (limit {self.policy.limit_mb:g} MB): pid "
                        f"{h.old.proc.pid if h.old.proc else '?'} -> {h.new.proc.pid if h.new.proc else '?'} "
                        f"serving after {now - h.started:.2f} s; {self.recycles} recycle(s) since start")
            return
        if h.new.alive() and now - h.started < self.policy.ready_timeout_s:
            return
        del self.starting[name]
        h.new.stop()
        n = self.failures[name] = self.failures.get(name, 0) + 1
        wait = min(self.policy.max_backoff_s, self.policy.check_s * 2 ** n)
        self.next_check[name] = now + wait
        code = h.new.proc.returncode if h.new.proc else None
        why = (f"exited (code {code})" if code is not None and now - h.started < self.policy.ready_timeout_s
               else f"did not serve within {self.policy.ready_timeout_s:g} s")
        self.report(f"{name}: its replacement {why}; the worker stays, next try in {wait:g} s; log "
                    f"{h.new.log_path}:\n{h.new.log_tail()}")

    def _reap(self, now: float) -> None:
        """Workers that handed over exit after their streams end; one still alive past leave_timeout_s is killed."""
        for h in list(self.leaving):
            pid = h.old.proc.pid if h.old.proc else "?"
            if not h.old.alive():
                code = h.old.proc.returncode if h.old.proc else None
                self.report(f"{h.old.name} pid {pid} left {now - (h.signalled or now):.2f} s after handing over "
                            f"(exit code {code})")
                self.leaving.remove(h)
            elif now - (h.signalled or now) > self.policy.leave_timeout_s and h.old.proc is not None:
                h.old.proc.kill()
                self.report(f"{h.old.name} pid {pid} still alive {self.policy.leave_timeout_s:g} s after handing "
                            f"over: killed")

    def stop(self) -> None:
        """Stop replacements still starting and workers still leaving (the stack stops its own children)."""
        for h in self.starting.values():
            h.new.stop()
        self.starting.clear()
        for h in self.leaving:
            h.old.stop()
        self.leaving.clear()
