"""Replica health from business signals, not /health (P6, P8): a state machine per replica.

                 bad signal                      still bad eject_after_s after degrading
    HEALTHY ─────────────────► DEGRADED ───────────────────────────────────────► EJECTED
       ▲   ◄─────────────────  (weight 0.25)   signals good recover_after_s       (weight 0; one probe per
       │                          │                                                probe_interval_s)
       │                          │ unreachable, then answers again / restarted      │  ▲
       │                          ▼                                                  │  │ relapse: TTFT over
       └──── past the last ── RECOVERING ◄──── answers again (was unreachable), ────┘  │ relapse bar, TPS,
             step             (slow start:      restarted, or ejected_min_s with       │ errors, unreachable
                              0.1 -> 0.3 ->     good signals                            │
                              0.5 -> 1.0)  ─────────────────────────────────────────────┘

    HEALTHY -> RECOVERING when the engine restarted (a counter went down): a cold replica ramps up too.
    Any state -> EJECTED after `scrape_failures_ejected` consecutive failed scrapes (unreachable).

Signals (first that fires is the reason code):
  unreachable   consecutive failed scrapes >= scrape_failures_degraded (EJECTED at scrape_failures_ejected)
  ttft_p95      windowed p95 TTFT > ttft_p95_degraded_s, with >= min_samples first tokens in the window
  tps_collapse  generated tokens/s per running request (window mean) < tps_floor_per_request, while the window's
                mean requests in the engine >= tps_min_busy, requests are in the engine now, and the window spans
                >= tps_min_span_s (a hung engine: 0; a half-dead one: 50 -> 3)
  error_rate    (failed + timeout) / finished requests from Envoy's access log over error_window_s >
                error_rate_degraded, with >= error_min_samples (cancelled: the client's doing, not counted)
EJECTED and RECOVERING replicas carry little traffic, so they are judged with `probe_min_samples`; RECOVERING
relapses at relapse_factor x the TTFT bar and advances one slow-start step per slow_start_step_s only while p95
TTFT <= slow_start_healthy_factor x the bar (or too few samples to say).

Never zero capacity: when no replica of the pool is HEALTHY or RECOVERING the pool is "all degraded"
(`sluice_pool_all_degraded` = 1, one log line per change). Degraded replicas keep serving at their reduced
weight and the last routable one is never escalated; when every replica is EJECTED the best reachable one
(lowest p95 TTFT, replicas with TTFT samples first) is made DEGRADED at `fallback_weight` (reason
pool_fallback). A replica that does not answer scrapes is never chosen: it cannot serve anyway. Once another
replica is healthy or recovering again the fallback is released (EJECTED again if its signals are still bad);
a fallback whose own signals turn good goes to RECOVERING (slow start), not straight to HEALTHY.

Pure logic: no I/O, no clock of its own (every entry point takes `now`, time.monotonic() when omitted).
Every transition sets `replica.state`, `weight`, `state_since`, `state_reason`, counts
`sluice_replica_health_transitions_total{pool,replica,from,to,reason}` and logs one line.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from extproc.routing import metrics as rm
from extproc.routing.policy import HealthPolicy
from extproc.routing.pool import DEGRADED, EJECTED, HEALTHY, RECOVERING, Pool, Replica

log = logging.getLogger("sluice.routing.health")

# Outcomes from Envoy's access log (same strings as extproc.accesslog).
COMPLETED, CANCELLED, TIMEOUT, FAILED = "completed", "cancelled", "timeout", "failed"

# Reason codes (the `reason` label of the transitions counter).
TTFT = "ttft_p95"
TPS = "tps_collapse"
ERRORS = "error_rate"
UNREACHABLE = "unreachable"
RESTARTED = "restarted"
REACHABLE = "reachable"
SIGNALS_OK = "signals_ok"
SLOW_START_DONE = "slow_start_done"
POOL_FALLBACK = "pool_fallback"
FALLBACK_RELEASED = "fallback_released"
DISCOVERED = "discovered"

_SERVING = (HEALTHY, RECOVERING)


class _Outcomes:
    """Finished requests of one replica in one-second buckets over a window (bounded: one entry per second)."""

    __slots__ = ("window_s", "buckets")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.buckets: deque[list[int]] = deque()  # [second, finished, errors]

    def add(self, now: float, error: bool) -> None:
        sec = int(now)
        b = self.buckets
        if b and b[-1][0] == sec:
            b[-1][1] += 1
            b[-1][2] += error
        else:
            b.append([sec, 1, int(error)])
            self._prune(now)

    def _prune(self, now: float) -> None:
        oldest = now - self.window_s
        b = self.buckets
        while b and b[0][0] + 1 <= oldest:
            b.popleft()

    def clear(self) -> None:
        self.buckets.clear()

    def counts(self, now: float) -> tuple[int, int]:
        self._prune(now)
        total = errors = 0
        for _, n, e in self.buckets:
            total += n
            errors += e
        return total, errors


class _Track:
    """What the tracker remembers about one replica beyond `Replica.state`."""

    __slots__ = ("code", "good_since", "step", "step_since", "last_probe", "fallback", "engine_seen", "outcomes",
                 "metrics")

    def __init__(self, r: Replica, policy: HealthPolicy) -> None:
        self.code = r.state_reason.split(":", 1)[0] or "start"
        self.good_since: float | None = None
        self.step = 0
        self.step_since = r.state_since
        self.last_probe = float("-inf")
        self.fallback = False
        self.engine_seen: object = None
        self.outcomes = _Outcomes(policy.error_window_s)
        self.metrics = rm.replica_metrics(r.pool, r.address)


class HealthTracker:
    """The health state machine of every replica of one pool."""

    def __init__(self, pool: Pool, policy: HealthPolicy) -> None:
        self.pool = pool
        self.policy = policy
        self.all_degraded = False
        self._tracks: dict[str, _Track] = {}
        self._all_gauge = rm.pool_all_degraded(pool.model)
        self._all_gauge.set(0)
        for r in pool.replicas:
            self._track(r)

    # ---- entry points ---------------------------------------------------------------------------------------
    def on_scrape_round(self, now: float | None = None) -> None:
        """Evaluate every replica after a scrape round (register as a `Scraper.listeners` callback)."""
        self._evaluate_all(time.monotonic() if now is None else now)

    def tick(self, now: float | None = None) -> None:
        """Evaluate time-based transitions (slow-start steps, recovery timers) without a new scrape."""
        self._evaluate_all(time.monotonic() if now is None else now)

    def on_outcome(self, replica_address: str, outcome: str, now: float | None = None) -> None:
        """One finished request from Envoy's access log: completed, cancelled, timeout or failed."""
        if outcome == COMPLETED:
            error = False
        elif outcome == FAILED or outcome == TIMEOUT:
            error = True
        else:  # cancelled (the client left) or unknown: says nothing about the replica
            return
        tr = self._tracks.get(replica_address)
        if tr is None:
            r = self.pool.by_address(replica_address)
            if r is None:
                return
            tr = self._track(r)
        tr.outcomes.add(time.monotonic() if now is None else now, error)

    def allow_probe(self, replica: Replica, now: float | None = None) -> bool:
        """May one probe request go to this EJECTED replica now? At most one per `probe_interval_s`; True
        consumes the slot. Never for a replica that does not answer scrapes, is draining, or is not ejected."""
        if replica.state != EJECTED or replica.draining:
            return False
        if replica.engine.scrape_failures >= self.policy.scrape_failures_degraded:
            return False
        now = time.monotonic() if now is None else now
        tr = self._track(replica)
        if now - tr.last_probe < self.policy.probe_interval_s:
            return False
        tr.last_probe = now
        return True

    def error_counts(self, replica: Replica, now: float | None = None) -> tuple[int, int]:
        """(finished, failed + timed out) requests of the replica within the error window."""
        return self._track(replica).outcomes.counts(time.monotonic() if now is None else now)

    def status(self) -> list[dict[str, Any]]:
        """A plain snapshot for admin views."""
        return [{"replica": r.address, "state": r.state, "weight": r.weight, "since": r.state_since,
                 "reason": r.state_reason, "fallback": self._track(r).fallback} for r in self.pool.replicas]

    # ---- evaluation -----------------------------------------------------------------------------------------
    def _track(self, r: Replica) -> _Track:
        tr = self._tracks.get(r.address)
        if tr is None:
            tr = self._tracks[r.address] = _Track(r, self.policy)
            tr.metrics.state(r.state, r.weight)
        return tr

    def _evaluate_all(self, now: float) -> None:
        if not self.policy.enabled:
            return
        replicas = self.pool.replicas
        if len(self._tracks) > len(replicas):  # replicas left the pool: forget them
            live = {r.address for r in replicas}
            self._tracks = {a: t for a, t in self._tracks.items() if a in live}
        for r in replicas:
            self._evaluate(r, self._track(r), now)
        self._ensure_capacity(now)

    def _assess(self, r: Replica, tr: _Track, now: float, min_samples: int, min_finished: int,
                ttft_limit: float) -> tuple[str, str] | None:
        """The first business signal that is bad, as (reason code, detail), or None."""
        p = self.policy
        e = r.engine
        if e.ttft_count_window >= min_samples and e.ttft_p95_s > ttft_limit:
            return TTFT, (f"p95 TTFT {e.ttft_p95_s:.3g}s > {ttft_limit:.3g}s over "
                          f"{e.ttft_count_window:.0f} first tokens")
        span = getattr(e, "window_span_s", None)
        run_avg = getattr(e, "running_avg", None)
        if run_avg is None:
            run_avg = float(e.running)
        wait_avg = getattr(e, "waiting_avg", None)
        if wait_avg is None:
            wait_avg = float(e.waiting)
        if ((span is None or span >= p.tps_min_span_s) and run_avg + wait_avg >= p.tps_min_busy
                and e.running + e.waiting > 0):
            per_request = e.generation_tps / max(run_avg, 1.0)
            if per_request < p.tps_floor_per_request:
                return TPS, (f"{per_request:.3g} generated tokens/s per running request < "
                             f"{p.tps_floor_per_request:g} ({run_avg:.1f} running, {wait_avg:.1f} waiting)")
        total, errors = tr.outcomes.counts(now)
        if total >= min_finished and errors > p.error_rate_degraded * total:
            return ERRORS, f"{errors}/{total} requests failed or timed out > {p.error_rate_degraded:.0%}"
        return None

    def _assess_normal(self, r: Replica, tr: _Track, now: float) -> tuple[str, str] | None:
        p = self.policy
        return self._assess(r, tr, now, p.min_samples, p.error_min_samples, p.ttft_p95_degraded_s)

    def _evaluate(self, r: Replica, tr: _Track, now: float) -> None:
        p = self.policy
        e = r.engine
        restarted = False
        if e is not tr.engine_seen:
            tr.engine_seen = e
            restarted = bool(getattr(e, "restarted", False))
        fails = e.scrape_failures
        unreachable = fails >= p.scrape_failures_degraded
        unreachable_detail = f"{fails} consecutive failed scrapes"
        state = r.state

        if state == HEALTHY:
            if fails >= p.scrape_failures_ejected:
                self._move(r, tr, EJECTED, UNREACHABLE, unreachable_detail, now)
            elif unreachable:
                self._move(r, tr, DEGRADED, UNREACHABLE, unreachable_detail, now)
            elif restarted:
                self._move(r, tr, RECOVERING, RESTARTED, "engine counters restarted", now)
            else:
                bad = self._assess_normal(r, tr, now)
                if bad is not None:
                    self._move(r, tr, DEGRADED, bad[0], bad[1], now)

        elif state == DEGRADED:
            if fails >= p.scrape_failures_ejected:
                self._move(r, tr, EJECTED, UNREACHABLE, unreachable_detail, now)
            elif unreachable:
                tr.good_since = None
                self._note_unreachable(r, tr, unreachable_detail)
            elif tr.code == UNREACHABLE or restarted:
                self._move(r, tr, RECOVERING, RESTARTED if restarted else REACHABLE,
                           "answers scrapes again", now)
            else:
                bad = self._assess_normal(r, tr, now)
                if bad is not None:
                    tr.good_since = None
                    if not tr.fallback and now - r.state_since >= p.eject_after_s:
                        if self._others_routable(r):
                            self._move(r, tr, EJECTED, bad[0],
                                       f"{bad[1]} (degraded for {now - r.state_since:.0f}s)", now)
                        else:
                            tr.fallback = True  # the last replica still serving: hold it (never zero capacity)
                            r.state_reason = f"{bad[0]}: {bad[1]} (kept: last routable replica of the pool)"
                else:
                    if tr.good_since is None:
                        tr.good_since = now
                    if now - tr.good_since >= p.recover_after_s:
                        # a fallback replica was ejected before: it ramps up through slow start (P6)
                        to = RECOVERING if tr.code == POOL_FALLBACK else HEALTHY
                        self._move(r, tr, to, SIGNALS_OK, f"signals good for {p.recover_after_s:g}s", now)

        elif state == EJECTED:
            if unreachable:
                tr.good_since = None
                self._note_unreachable(r, tr, unreachable_detail)
            elif tr.code == UNREACHABLE or restarted:
                self._move(r, tr, RECOVERING, RESTARTED if restarted else REACHABLE,
                           "answers scrapes again", now)
            else:
                bad = self._assess(r, tr, now, p.probe_min_samples, p.probe_min_samples, p.ttft_p95_degraded_s)
                if bad is not None:
                    tr.good_since = None
                elif now - r.state_since >= p.ejected_min_s:
                    self._move(r, tr, RECOVERING, SIGNALS_OK,
                               f"signals good after {now - r.state_since:.0f}s ejected", now)

        elif state == RECOVERING:
            if unreachable:
                self._move(r, tr, EJECTED, UNREACHABLE, unreachable_detail, now)
                return
            limit = p.ttft_p95_degraded_s
            bad = self._assess(r, tr, now, p.probe_min_samples, p.probe_min_samples, limit * p.relapse_factor)
            if bad is not None:
                self._move(r, tr, EJECTED, bad[0], f"relapse during slow start: {bad[1]}", now)
                return
            healthy = (e.ttft_count_window < p.probe_min_samples
                       or e.ttft_p95_s <= limit * p.slow_start_healthy_factor)
            if not healthy:
                tr.step_since = now  # hold the step; the timer restarts
            elif now - tr.step_since >= p.slow_start_step_s:
                self._advance(r, tr, now)

    def _note_unreachable(self, r: Replica, tr: _Track, detail: str) -> None:
        """A degraded or ejected replica that stops answering: remember it, so answering again means slow start."""
        if tr.code != UNREACHABLE:
            tr.code = UNREACHABLE
            r.state_reason = f"{UNREACHABLE}: {detail}"

    def _advance(self, r: Replica, tr: _Track, now: float) -> None:
        steps = self.policy.slow_start_steps
        tr.step += 1
        if tr.step >= len(steps) or steps[tr.step] >= 1.0:
            self._move(r, tr, HEALTHY, SLOW_START_DONE, "slow start complete", now)
            return
        r.weight = steps[tr.step]
        tr.step_since = now
        r.state_reason = f"slow start step {tr.step + 1}/{len(steps)}: weight {r.weight:g}"
        tr.metrics.state(r.state, r.weight)
        log.info("replica %s/%s slow start: weight %g", r.pool, r.address, r.weight)

    def _others_routable(self, r: Replica) -> bool:
        return any(o is not r and not o.draining and o.state != EJECTED for o in self.pool.replicas)

    def _weight_for(self, state: str, code: str) -> float:
        p = self.policy
        if state == HEALTHY:
            return 1.0
        if state == DEGRADED:
            return p.fallback_weight if code == POOL_FALLBACK else p.degraded_weight
        if state == RECOVERING:
            return p.slow_start_steps[0]
        return 0.0

    def begin_slow_start(self, r: Replica, reason: str, detail: str = "", now: float | None = None) -> None:
        """Put a replica at the first slow-start step (RECOVERING), e.g. when an operator undrains it: its step
        timer restarts, and the transition is counted and logged like any other."""
        self._move(r, self._track(r), RECOVERING, reason, detail, time.monotonic() if now is None else now)

    def start_slow(self, r: Replica, reason: str = DISCOVERED, now: float | None = None) -> None:
        """A replica that joins the pool while it serves (discovery found it): RECOVERING at the first slow-start
        step, like one back from ejection (P6). It had no state before, so no transition is counted; its ramp
        shows in sluice_replica_weight and ends with recovering -> healthy (slow_start_done). With health off
        (nothing would ever advance the ramp) it joins HEALTHY at full weight."""
        if not self.policy.enabled:
            return
        now = time.monotonic() if now is None else now
        tr = self._track(r)
        r.state, r.weight = RECOVERING, self.policy.slow_start_steps[0]
        r.state_since, r.state_reason = now, f"{reason}: slow start at weight {r.weight:g}"
        tr.code, tr.good_since, tr.step, tr.step_since, tr.fallback = reason, None, 0, now, False
        tr.metrics.state(r.state, r.weight)
        log.info("replica %s/%s joined the pool (%s): slow start at weight %g", r.pool, r.address, reason, r.weight)

    def register(self, r: Replica) -> None:
        """A replica that joined the pool as part of its starting set: its state and weight series appear now."""
        self._track(r)

    def forget(self, address: str) -> None:
        """The replica left the pool: drop what the tracker remembers of it."""
        self._tracks.pop(address, None)

    def _move(self, r: Replica, tr: _Track, to: str, code: str, detail: str, now: float) -> None:
        frm = r.state
        r.state = to
        r.weight = self._weight_for(to, code)
        r.state_since = now
        r.state_reason = f"{code}: {detail}" if detail else code
        tr.code = code
        tr.good_since = None
        tr.step = 0
        tr.step_since = now
        tr.fallback = code == POOL_FALLBACK
        if code in (REACHABLE, RESTARTED):
            # Back after an outage: the failures in the error window are the outage's (already acted on by the
            # ejection). Judged on them, slow start relapsed at once and the replica sat out ejected_min_s (P6).
            tr.outcomes.clear()
        tr.metrics.state(to, r.weight)
        tr.metrics.transition(frm, to, code)
        level = logging.WARNING if to in (DEGRADED, EJECTED) else logging.INFO
        log.log(level, "replica %s/%s %s -> %s (weight %g): %s", r.pool, r.address, frm, to, r.weight,
                r.state_reason)

    def _ensure_capacity(self, now: float) -> None:
        p = self.policy
        active = [r for r in self.pool.replicas if not r.draining]
        all_bad = bool(active) and not any(r.state in _SERVING for r in active)
        if all_bad:
            if not any(r.state == DEGRADED for r in active):
                cands = [r for r in active if r.engine.scrape_failures < p.scrape_failures_degraded]
                if cands:
                    best = min(cands, key=lambda r: (r.engine.ttft_count_window <= 0, r.engine.ttft_p95_s,
                                                     r.engine.scrape_failures))
                    e = best.engine
                    ttft = f"p95 TTFT {e.ttft_p95_s:.3g}s" if e.ttft_count_window > 0 else "no recent TTFT samples"
                    self._move(best, self._track(best), DEGRADED, POOL_FALLBACK,
                               f"every replica is degraded or ejected; serving from the best ({ttft})", now)
        else:
            for r in active:
                tr = self._track(r)
                if not tr.fallback:
                    continue
                tr.fallback = False
                if r.state == DEGRADED:
                    bad = self._assess_normal(r, tr, now)
                    if bad is not None:
                        self._move(r, tr, EJECTED, FALLBACK_RELEASED, f"the pool has capacity again; {bad[1]}", now)
        if all_bad != self.all_degraded:
            self.all_degraded = all_bad
            self._all_gauge.set(1 if all_bad else 0)
            if all_bad:
                serving = [r.address for r in active if r.state == DEGRADED]
                log.warning("pool %s: every replica is degraded or ejected; serving from %s", self.pool.model,
                            ", ".join(serving) or "nothing (no replica answers)")
            else:
                log.info("pool %s: a replica is healthy or recovering again", self.pool.model)
