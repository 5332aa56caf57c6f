"""Replica health from business signals, not /health (P6, P8): a state machine per replica.

                 bad signal                      still bad eject_after_s after degrading
    HEALTHY ─────────────────► DEGRADED ───────────────────────────────────────► EJECTED
       ▲   ◄─────────────────  (weight 0.25)   signals good recover_after_s       (weight 0; one probe per
       │                          │                                                probe_interval_s)
       │                          │ unreachable, then answers again / restarted      │  ▲
       │                          ▼                                                  │  │ relapse: TTFT over
       └──── past the last ── RECOVERING ◄──── answers again (was unreachable), ────┘  │ relapse bar, TPS,
             step             (slow start:      restarted, or ejected_min_s with       │ errors, unreachable
                              0.1 -> 0.25 ->    good signals                            │
                              0.5 -> 1.0,  ─────────────────────────────────────────────┘
                              by its TTFT)

    HEALTHY -> RECOVERING when the engine restarted (a counter went down): a cold replica ramps up too.
    Any state -> EJECTED after `scrape_failures_ejected` consecutive failed scrapes (unreachable).

Signals (first that fires is the reason code). "The others" are the pool's other HEALTHY replicas unless said: a busy pool
slows every replica together, and only a replica worse than its peers is sick (issue 16: busy engines were read
as dead).
  unreachable   consecutive failed scrapes that say the replica is not there >= scrape_failures_degraded
                (EJECTED at scrape_failures_ejected). A refused or reset connection, an HTTP error or an
                unreadable page always counts; a timeout counts only once the replica has shown no sign of life
                for unresponsive_after_s: no successful scrape and no request answered (Envoy's access log: a
                completed request, or a cancelled one that had its first byte). A busy vLLM answers /metrics in
                seconds now and then while it serves at full speed: slow to report is not dead, and its stale
                metrics only make placement cautious (admission/placement.py).
  ttft_p95      windowed p95 TTFT > the TTFT bar, with >= min_samples first tokens in the window:
                    bar = min(ttft_p95_degraded_s, max(SLO, degraded_vs_pool x median p95 of the others))
                (only ttft_p95_degraded_s when no other replica has min_samples first tokens, or no SLO is known;
                SLO = admission.ttft_target_s), unless the replica keeps pace: it completed >= 1 / degraded_vs_pool
                of the median of its serving peers' completions over the last tps_min_span_s (Envoy's access log;
                the peers' median >= error_min_samples), or it processed >= 1 / degraded_vs_pool of their median
                tokens/s (prompt + generated, the engines' counters). Saturated engines' TTFTs spread widely while
                they all complete requests, and a replica given a long prompt shows its prefill as a TTFT while
                completing fewer requests at the same token rate; a sick one falls behind in both.
  tps_collapse  generated tokens/s per running request (window mean) < tps_floor_per_request, while the window's
                mean requests in the engine >= tps_min_busy, requests are in the engine now, the window spans
                >= tps_min_span_s, and the access log shows no request answered by it within that span (vLLM
                refreshes its counters in lumps seconds apart: a flat counter alone may be a late lump; a hung
                engine answers nothing), unless the replica keeps pace with its peers as for ttft_p95
                (`keeps_pace`). Long prompts slow every replica's decode together (each step prefills a chunk
                and decodes one token per request: P10's prompt change), and so do hundreds of streams on
                equally loaded replicas (P12): a replica that processes as many tokens as its peers is busy,
                not hung. A hung one processes none; alone in its pool it has no peers and the floor decides.
  error_rate    (failed + timeout) / finished requests from Envoy's access log over error_window_s >
                error_rate_degraded + the pooled rate of the other serving (not ejected) replicas, with
                >= error_min_samples (cancelled: the client's doing, not counted, and so is a timeout at the
                client's own deadline, the route timeout the sidecar set from it, which under load ended requests
                on every replica of P4 and P5 at once; timeouts that hit every replica alike are the load's, not
                one replica's, even while a peer is degraded)
EJECTED and RECOVERING replicas carry little traffic, so they are judged with `probe_min_samples`; RECOVERING
relapses at relapse_factor x the TTFT bar. Slow start follows the replica's own first tokens (P6): once per
slow_start_step_s it goes one step up when the p95 TTFT of that step's first tokens is within
slow_start_healthy_factor x max(SLO, median p95 of the others) (or it had too few to say), and one step down
when it is not. A healthy-again replica is at full weight after len(slow_start_steps) - 1 steps; one that
queues backs off instead of being ejected.

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

    def completed_since(self, since: float) -> int:
        """Requests finished without error in the whole seconds from `since` on."""
        return sum(n - e for sec, n, e in self.buckets if sec >= since)


class _Track:
    """What the tracker remembers about one replica beyond `Replica.state`."""

    __slots__ = ("code", "good_since", "step", "step_since", "last_probe", "fallback", "engine_seen", "outcomes",
                 "metrics", "served_at")

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
        self.served_at = float("-inf")  # the access log's last request answered by it


class HealthTracker:
    """The health state machine of every replica of one pool. `slo_ttft_s` is the user's TTFT target
    (admission.ttft_target_s): a replica is judged against it and against its peers; None: against
    ttft_p95_degraded_s alone."""

    def __init__(self, pool: Pool, policy: HealthPolicy, slo_ttft_s: float | None = None) -> None:
        self.pool = pool
        self.policy = policy
        self.slo_ttft_s = slo_ttft_s
        self.all_degraded = False
        self._tracks: dict[str, _Track] = {}
        # per round: each replica's reference among the others (median p95 TTFT; pooled error rate)
        self._ref_ttft: dict[str, float] = {}
        self._ref_errors: dict[str, float] = {}
        self._ref_pace: dict[str, float] = {}
        self._ref_token_pace: dict[str, float] = {}
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

    def on_outcome(self, replica_address: str, outcome: str, now: float | None = None,
                   answered: bool = False) -> None:
        """One finished request from Envoy's access log: completed, cancelled, timeout or failed. `answered`: the
        replica had sent its first byte (a cancelled request the replica was serving: it is alive)."""
        error: bool | None
        if outcome == COMPLETED:
            error = False
        elif outcome == FAILED or outcome == TIMEOUT:
            error = True
        elif outcome == CANCELLED and answered:
            error = None  # the client left: not an outcome of the replica's, but it was serving
        else:  # cancelled before any answer, or unknown: says nothing about the replica
            return
        tr = self._tracks.get(replica_address)
        if tr is None:
            r = self.pool.by_address(replica_address)
            if r is None:
                return
            tr = self._track(r)
        now = time.monotonic() if now is None else now
        if error is not True:
            tr.served_at = now
        if error is not None:
            tr.outcomes.add(now, error)

    def allow_probe(self, replica: Replica, now: float | None = None) -> bool:
        """May one probe request go to this EJECTED replica now? At most one per `probe_interval_s`; True
        consumes the slot. Never for a replica that does not answer scrapes, is draining, or is not ejected."""
        if replica.state != EJECTED or replica.draining:
            return False
        now = time.monotonic() if now is None else now
        tr = self._track(replica)
        if self._unanswered(replica, tr, now) >= self.policy.scrape_failures_degraded:
            return False
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
        self._references(now)
        for r in replicas:
            self._evaluate(r, self._track(r), now)
        self._ensure_capacity(now)

    # ---- the pool as reference ------------------------------------------------------------------------------
    def _references(self, now: float) -> None:
        """Each replica's reference among the others, for this round: the median windowed p95 TTFT of the other
        HEALTHY replicas with >= min_samples first tokens; the pooled error rate of the other serving (not
        ejected) replicas when they finished >= error_min_samples requests; the median of the requests the other
        serving replicas completed over the last tps_min_span_s (its pace). Absent: no reference."""
        p = self.policy
        active = [r for r in self.pool.replicas if not r.draining]
        healthy = [r for r in active if r.state == HEALTHY]
        serving = [r for r in active if r.state != EJECTED]
        ttfts = sorted(r.engine.ttft_p95_s for r in healthy if r.engine.ttft_count_window >= p.min_samples)
        counts = {r.address: self._track(r).outcomes.counts(now) for r in serving}
        since = now - p.tps_min_span_s
        paces = {r.address: float(self._track(r).outcomes.completed_since(since)) for r in serving}
        ordered_paces = sorted(paces.values())
        token_paces = {r.address: _token_pace(r) for r in serving}
        ordered_token_paces = sorted(token_paces.values())
        total = sum(c[0] for c in counts.values())
        errors = sum(c[1] for c in counts.values())
        self._ref_ttft.clear()
        self._ref_errors.clear()
        self._ref_pace.clear()
        self._ref_token_pace.clear()
        for r in self.pool.replicas:
            healthy_own = r.state == HEALTHY and not r.draining and r.engine.ttft_count_window >= p.min_samples
            ref = _median_without(ttfts, r.engine.ttft_p95_s if healthy_own else None)
            if ref is not None:
                self._ref_ttft[r.address] = ref
            n, e = counts.get(r.address, (0, 0))
            if total - n >= p.error_min_samples:
                self._ref_errors[r.address] = (errors - e) / (total - n)
            pace = _median_without(ordered_paces, paces.get(r.address))
            if pace is not None:
                self._ref_pace[r.address] = pace
            token_pace = _median_without(ordered_token_paces, token_paces.get(r.address))
            if token_pace:
                self._ref_token_pace[r.address] = token_pace

    def keeps_pace(self, r: Replica, now: float) -> bool:
        """Does `r` keep >= 1 / degraded_vs_pool of its peers' median pace, in requests completed over the last
        tps_min_span_s (>= error_min_samples of theirs) or in tokens processed per second (prompt + generated,
        its engine's counters over the scrape window)? Then a high TTFT is its load, not a sick replica: two
        saturated real engines' p95 TTFT differed by 5x while they completed 307 and 351 requests (issue 16),
        and a replica given a long prompt shows that prompt's prefill as a TTFT and completes fewer requests
        while its peers take the short ones (lanes keep short prompts off a long prefill, P3), at the same
        token rate. A sick replica falls behind in both: it processes less of whatever it was given."""
        p = self.policy
        ref = self._ref_pace.get(r.address)
        if ref is not None and ref >= p.error_min_samples:
            if self._track(r).outcomes.completed_since(now - p.tps_min_span_s) * p.degraded_vs_pool >= ref:
                return True
        ref_tokens = self._ref_token_pace.get(r.address)
        return ref_tokens is not None and _token_pace(r) * p.degraded_vs_pool >= ref_tokens

    def ttft_bar(self, r: Replica) -> float:
        """The p95 TTFT above which `r` is sick: ttft_p95_degraded_s, or less when its peers are much faster
        (see the module docstring)."""
        p = self.policy
        ref = self._ref_ttft.get(r.address)
        if ref is None or self.slo_ttft_s is None:
            return p.ttft_p95_degraded_s
        return min(p.ttft_p95_degraded_s, max(self.slo_ttft_s, p.degraded_vs_pool * ref))

    def _ramp_bar(self, r: Replica) -> float:
        """Slow start goes up while the step's p95 TTFT is within this: the SLO, or the pool's median when the
        whole pool is slower (ttft_p95_degraded_s without an SLO)."""
        target = self.policy.ttft_p95_degraded_s if self.slo_ttft_s is None else self.slo_ttft_s
        ref = self._ref_ttft.get(r.address)
        return target if ref is None else max(target, ref)

    def _unanswered(self, r: Replica, tr: _Track, now: float) -> int:
        """Consecutive failed scrapes that say the replica is not there: all of them but the timeouts, and the
        timeouts too once it showed no sign of life (a successful scrape, a request answered) for
        unresponsive_after_s."""
        e = r.engine
        fails = e.scrape_failures
        timeouts = getattr(e, "scrape_timeouts", 0)
        if timeouts and now - max(e.scraped_at, tr.served_at) < self.policy.unresponsive_after_s:
            return fails - timeouts
        return fails

    # ---- evaluation -----------------------------------------------------------------------------------------
    def _assess(self, r: Replica, tr: _Track, now: float, min_samples: int, min_finished: int,
                ttft_limit: float, pace: bool = False) -> tuple[str, str] | None:
        """The first business signal that is bad, as (reason code, detail), or None. `pace`: a high TTFT counts
        only when the replica also falls behind its peers' completions (`keeps_pace`)."""
        p = self.policy
        e = r.engine
        if (e.ttft_count_window >= min_samples and e.ttft_p95_s > ttft_limit
                and (e.ttft_p95_s > p.ttft_p95_degraded_s or not (pace and self.keeps_pace(r, now)))):
            ref = self._ref_ttft.get(r.address)
            peers = f"; the others' median {ref:.3g}s" if ref is not None else ""
            return TTFT, (f"p95 TTFT {e.ttft_p95_s:.3g}s > {ttft_limit:.3g}s over "
                          f"{e.ttft_count_window:.0f} first tokens{peers}")
        span = getattr(e, "window_span_s", None)
        run_avg = getattr(e, "running_avg", None)
        if run_avg is None:
            run_avg = float(e.running)
        wait_avg = getattr(e, "waiting_avg", None)
        if wait_avg is None:
            wait_avg = float(e.waiting)
        if ((span is None or span >= p.tps_min_span_s) and run_avg + wait_avg >= p.tps_min_busy
                and e.running + e.waiting > 0 and tr.served_at < now - (span or p.tps_min_span_s)):
            per_request = e.generation_tps / max(run_avg, 1.0)
            if per_request < p.tps_floor_per_request and not (pace and self.keeps_pace(r, now)):
                return TPS, (f"{per_request:.3g} generated tokens/s per running request < "
                             f"{p.tps_floor_per_request:g} ({run_avg:.1f} running, {wait_avg:.1f} waiting), "
                             f"no request answered")
        total, errors = tr.outcomes.counts(now)
        ref = self._ref_errors.get(r.address, 0.0)
        if total >= min_finished and errors > (p.error_rate_degraded + ref) * total:
            peers = f" + the others' {ref:.0%}" if ref else ""
            return ERRORS, (f"{errors}/{total} requests failed or timed out > "
                            f"{p.error_rate_degraded:.0%}{peers}")
        return None

    def _assess_normal(self, r: Replica, tr: _Track, now: float) -> tuple[str, str] | None:
        p = self.policy
        return self._assess(r, tr, now, p.min_samples, p.error_min_samples, self.ttft_bar(r), pace=True)

    def _evaluate(self, r: Replica, tr: _Track, now: float) -> None:
        p = self.policy
        e = r.engine
        restarted = False
        if e is not tr.engine_seen:
            tr.engine_seen = e
            restarted = bool(getattr(e, "restarted", False))
        fails = self._unanswered(r, tr, now)
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
                bad = self._assess(r, tr, now, p.probe_min_samples, p.probe_min_samples, self.ttft_bar(r))
                if bad is not None:
                    tr.good_since = None
                elif now - r.state_since >= p.ejected_min_s:
                    self._move(r, tr, RECOVERING, SIGNALS_OK,
                               f"signals good after {now - r.state_since:.0f}s ejected", now)

        elif state == RECOVERING:
            if unreachable:
                self._move(r, tr, EJECTED, UNREACHABLE, unreachable_detail, now)
                return
            bad = self._assess(r, tr, now, p.probe_min_samples, p.probe_min_samples,
                               self.ttft_bar(r) * p.relapse_factor)
            if bad is not None:
                self._move(r, tr, EJECTED, bad[0], f"relapse during slow start: {bad[1]}", now)
                return
            if now - tr.step_since < p.slow_start_step_s:
                return
            count = getattr(e, "ttft_count_recent", None)
            p95 = getattr(e, "ttft_p95_recent_s", 0.0)
            if count is None:  # a plain EngineState: the window's
                count, p95 = e.ttft_count_window, e.ttft_p95_s
            bar = p.slow_start_healthy_factor * self._ramp_bar(r)
            if count >= p.probe_min_samples and p95 > bar:
                self._back_off(r, tr, now, f"p95 TTFT {p95:.3g}s > {bar:.3g}s over its last step")
            else:
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

    def _back_off(self, r: Replica, tr: _Track, now: float, why: str) -> None:
        """One slow-start step down (not below the first): the replica queues at its share; the timer restarts."""
        tr.step_since = now
        if tr.step == 0:
            return
        tr.step -= 1
        r.weight = self.policy.slow_start_steps[tr.step]
        steps = len(self.policy.slow_start_steps)
        r.state_reason = f"slow start step {tr.step + 1}/{steps}: weight {r.weight:g} (back off: {why})"
        tr.metrics.state(r.state, r.weight)
        log.info("replica %s/%s slow start backs off to weight %g: %s", r.pool, r.address, r.weight, why)

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
                cands = [r for r in active
                         if self._unanswered(r, self._track(r), now) < p.scrape_failures_degraded]
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


def _token_pace(r: Replica) -> float:
    """Tokens/s the replica's engine processed over the scrape window: prompt tokens prefilled + tokens generated."""
    return r.engine.prompt_tps + r.engine.generation_tps


def _median_without(values: list[float], own: float | None) -> float | None:
    """The median of sorted `values` with one occurrence of `own` left out (None: nothing left)."""
    n = len(values) - (own is not None)
    if n <= 0:
        return None
    if own is None:
        rest = values
    else:
        i = values.index(own)
        rest = values[:i] + values[i + 1:]
    mid = n // 2
    return rest[mid] if n % 2 else (rest[mid - 1] + rest[mid]) / 2
