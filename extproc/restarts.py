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

import time
from dataclasses import dataclass, field
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
