"""When a request may enter: dispatch at once if a replica fits it, else hold it in its lane's queue until one
does, and shed early and clearly when waiting cannot help (P1, P2, P3, P9).

    submit ─► never fits? ─► 400 context_length_exceeded
           ─► deadline already unmeetable? ─► 429 x-should-retry: false
           ─► no replica routable at all (outage)? ─► 503 pool_unavailable, retry-after 1 s
           ─► nobody ahead and a replica fits ─► dispatched now
           ─► KV keeps it off every replica (behind the waiters ahead) until after its wait budget ─► 429
              kv_committed at once, x-should-retry: false, retry-after = when KV frees
           ─► no replica's prefill room left behind the queue ahead, or the queue's expected wait past the wait
              budget (and past its late wait, for a request whose own prefill misses the SLO) ─► 429 at once,
              retry-after (it would only have expired in the queue)
           ─► lane queue full ─► evict a lower-priority waiter, or shed 429 (503 if the pool is down)
           ─► queued ─► dispatched by `kick` (on every release, scrape, health change, and a short timer)
                     └► deadline passes ─► a prefill of at most REFILL_S, or one that misses the SLO by itself,
                                           waits on as LATE, behind every on-time request, until its late limit
                                           (`serve_late`), placed only behind at most REFILL_S of prefill
                                        └► late limit passes ─► 429 (503 if the pool is down), retry-after
                                                                from the drain rate

All of it is synchronous bookkeeping on the event loop; the only await is the held request's own future.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass

from extproc.admission import metrics as am
from extproc.admission.decode_time import DecodeTime
from extproc.admission.kv_growth import Growth
from extproc.admission.placement import (CONCURRENCY, KV_FULL, KV_SHARE, LANE, PREFILL, QUEUE_FULL, REFILL_S, TENANT,
                                         Placer)
from extproc.admission.policy import AdmissionPolicy, LanePolicy
from extproc.admission.prefill_rate import PrefillRate
from extproc.admission.queue import FairQueue, VirtualClock, Waiter, work_ahead
from extproc.admission.seq_cap import SeqCap
from extproc.admission.token_calibration import TokenCalibration
from extproc.request import PRIORITIES, LLMRequest
from extproc.routing.pool import Pool, Replica


# Queue only what is expected to start well within its wait budget: the drain-rate estimate is noisy, and a
# request shed on arrival (milliseconds) is better for the client than one shed after a futile wait (P1).
WAIT_SAFETY = 1.4
# While no replica is routable (an outage), nothing is queued: each request is refused at once with this
# retry-after, so a client's retry lands soon after the pool is back instead of the request waiting out the
# outage in the queue and reaching a recovered replica too late for its SLO (P6).
POOL_DOWN_RETRY_S = 1.0
# A queue's next request that waits for KV alone (every replica's KV is committed past what it needs) lets
# requests behind it go first when they will have ended before that KV frees: they take nothing it waits for
# (EASY backfilling). At most this many are looked at per kick, so a kick stays cheap with a long queue.
BACKFILL_SCAN = 16
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 0.2, 60.0  # the retry-after a shed request is given, bounded
BUSY_MIN_RELEASES, BUSY_MIN_S = 4, 0.5  # releases and seconds of a saturated lane before its pace is trusted
# The queue's priority level below every request priority: waiters whose SLO wait ended, served late (`serve_late`).
LATE = len(PRIORITIES)


class Shed(Exception):
    """Reply now instead of queueing or forwarding."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None,
                 should_retry: bool | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.retry_after_s, self.should_retry = retry_after_s, should_retry


@dataclass(slots=True)
class Placement:
    """What a dispatched request holds until its stream ends."""

    replica: Replica
    pins: list[Replica]
    lane: int
    epoch: int = -1  # the replica's scrape epoch when placed
    owner: "Scheduler | None" = None  # who to release to (survives a policy reload that replaces schedulers)
    at: float = 0.0  # dispatch time (service-time estimate for the drain rate)
    growth: Growth | None = None  # its expected output still to decode on the replica (kv_growth.py)
    answered: bool = False  # the replica's response headers came (`Replica.answered`: its engine counts it)

    def on_answer(self, req: LLMRequest) -> None:
        """The replica answered: it leaves the replica's awaiting counters (once; admission off, `owner` None, it
        leaves them when released)."""
        if not self.answered and self.owner is not None:
            self.answered = True
            self.replica.answered(req.total_tokens, req.prompt_tokens, req.prefix_held)


class DrainRate:
    """Releases per second over the last few seconds, for retry-after and early shedding. A window of
    timestamps (bounded), not an EWMA: right after a quiet period an EWMA starting from zero would
    underestimate the rate and shed requests that would have been served in time."""

    __slots__ = ("times", "window_s")

    def __init__(self, window_s: float = 5.0, max_events: int = 4096) -> None:
        self.times: deque[float] = deque(maxlen=max_events)
        self.window_s = window_s

    def tick(self, now: float) -> None:
        self.times.append(now)

    def current(self, now: float) -> float:
        times = self.times
        horizon = now - self.window_s
        while times and times[0] < horizon:
            times.popleft()
        if len(times) < 2:
            return 0.0
        span = max(now - times[0], times[-1] - times[0], 1e-3)
        return (len(times) - 1) / span


class BusyPace:
    """Releases per second while the lane had waiters: the pool's pace when it is the bottleneck. Each release is
    kept with the start of the busy period it fell in, and the rate is counted from the start of the oldest such
    period still in the window, so a busy period's first releases are not timed from the first of them (the
    requests placed together at a flood's start end together) and idle gaps between periods only lower it.
    Fewer than BUSY_MIN_RELEASES releases or BUSY_MIN_S seconds say nothing (0)."""

    __slots__ = ("events", "window_s")

    def __init__(self, window_s: float = 5.0, max_events: int = 4096) -> None:
        self.events: deque[tuple[float, float]] = deque(maxlen=max_events)  # (released at, busy since)
        self.window_s = window_s

    def tick(self, now: float, busy_since: float) -> None:
        self.events.append((now, busy_since))

    def current(self, now: float) -> float:
        events = self.events
        horizon = now - self.window_s
        while events and events[0][0] < horizon:
            events.popleft()
        if len(events) < BUSY_MIN_RELEASES:
            return 0.0
        span = now - max(horizon, events[0][1])
        return len(events) / span if span >= BUSY_MIN_S else 0.0


class Scheduler:
    """One per pool."""

    def __init__(self, pool: Pool, policy: AdmissionPolicy, placer: Placer) -> None:
        self.pool = pool
        self.policy = policy
        self.placer = placer
        n = len(policy.lanes)
        # The pace each lane's queue drains at is measured per meter: the lanes that share the whole pool (no
        # replica share, no dedicated replicas, no lane limit) share meter n, and one virtual clock (kick serves
        # them in one fair order); each other lane has its own.
        self.meter = [n if self._shares_pool(lane) else i for i, lane in enumerate(policy.lanes)]
        pooled = VirtualClock()
        self.queues = [FairQueue(LATE + 1, policy.tenant_weights, pooled if self.meter[i] == n else None)
                       for i in range(n)]
        self.lane_requests = [0] * n
        self.lane_tokens = [0] * n
        self.drain = [DrainRate() for _ in range(n + 1)]  # releases per second, per meter
        self.busy_pace = [BusyPace() for _ in range(n + 1)]  # releases while its lanes had waiters (drain_rate)
        self.busy_since = [0.0] * (n + 1)  # when its lanes' queues last went from empty to waiting
        self.service_s = [0.0] * n  # EWMA of dispatch-to-release time, per lane
        # per lane: when KV is predicted to free for its next request, while that request waits for KV alone
        # (set by each kick, 0 otherwise): a request that ends before then may go first (`_backfill`)
        self.kv_held_until = [0.0] * n
        self.prio_index = {name: i for i, name in enumerate(policy.priorities)}
        self._timer: asyncio.TimerHandle | None = None
        self.prefill = PrefillRate(policy.prefill_tokens_per_s, long_lane=max(1, n - 1), work=placer.prefill_work)
        self.decode = DecodeTime(policy.decode_s_per_token)
        self.seq_cap = SeqCap()
        self.calibration = TokenCalibration(policy.calibrate_prompt_tokens)
        self.m = am.PoolMetrics(pool.model, [lane.name for lane in policy.lanes], [*policy.priorities, "late"])
        self.m.estimate_factor(self.calibration.factor)

    @staticmethod
    def _shares_pool(lane: LanePolicy) -> bool:
        """The lane's requests may take any replica, limited only by the replicas: its queue drains at the
        pool's pace, after the queues of the lanes before it (`kick` serves lanes in order)."""
        return lane.max_replica_share >= 1 and not lane.replicas and not lane.max_concurrency \
            and not lane.max_inflight_tokens

    def _metered_waiting(self, lane: int) -> int:
        """Requests waiting in the lanes that share `lane`'s meter."""
        m = self.meter[lane]
        return sum(q.size for i, q in enumerate(self.queues) if self.meter[i] == m)

    def _work_ahead(self, lane: int, tenant: str, priority: int, footprints: bool = False) -> tuple[int, int]:
        """Waiters (and their prompt tokens, or footprints) a new request of `tenant` in `lane` would wait behind: in
        fair order in its lane, and with it the other lanes sharing the pool (one fair order across them: `kick`)."""
        n = len(self.queues)
        if self.meter[lane] != n:
            return work_ahead([self.queues[lane]], tenant, priority, footprints)
        return work_ahead([q for i, q in enumerate(self.queues) if self.meter[i] == n], tenant, priority, footprints)

    def _waiting_at_or_above(self, lane: int, priority: int) -> bool:
        """Something of this priority or higher waits where a new request of `lane` would queue behind it (its
        lane, and the other lanes sharing the pool with it): it may not be placed before them."""
        m = self.meter[lane]
        return any(q.has_waiting_at_or_above(priority) for i, q in enumerate(self.queues)
                   if i == lane or (m == len(self.queues) and self.meter[i] == m))

    def _lifetime_s(self, req: LLMRequest, prefill_s: float | None = None) -> float:
        """About how long `req` would hold KV once placed: its prefill at the pool's speed (`prefill_s` when the
        caller has it), then its expected output's decode."""
        if prefill_s is None:
            prefill_s = self.placer.lane_prefill_s(req)
        return prefill_s + req.expected_output_tokens * self.placer.decode_s

    def _backfills(self, lane: int, priority: int, req: LLMRequest, now: float, prefill_s: float) -> bool:
        """Every queue `req` would wait behind (`_waiting_at_or_above`) is held by a request waiting for KV that
        frees only after `req` would have ended: `req` may go first (`_backfill`)."""
        m, n = self.meter[lane], len(self.queues)
        ends = now + self._lifetime_s(req, prefill_s)
        return all(self.kv_held_until[i] >= ends for i, q in enumerate(self.queues)
                   if (i == lane or (m == n and self.meter[i] == m)) and q.has_waiting_at_or_above(priority))

    def on_scrape(self, now: float) -> None:
        """After a scrape round: the placer's prefill speed, decode time per token, engines' sequence caps and
        prefix-cache confidence follow what the engines showed, and prompt estimates follow what they counted."""
        replicas = self.pool.replicas
        factor = self.calibration.update(replicas, now)
        self.m.estimate_factor(factor)
        rate = self.prefill.update(replicas, now)
        self.placer.rate = rate
        self.m.prefill_rate(rate)
        self.placer.decode_s = self.decode.update(replicas, now)
        self.placer.decode_measured = self.decode.current(now)
        self.seq_cap.update(replicas)
        if self.placer.prefix is not None:
            self.placer.prefix.on_scrape(replicas)
        if self.queued_total() and self.pool_down():  # the pool just went down: nobody waits out the outage
            for lane, w in self._take_queued():
                self.m.shed(lane, "pool_down")
                w.future.set_exception(self._pool_unavailable(""))

    def calibrate(self, req: LLMRequest) -> None:
        """Put the request's prompt estimate in the engines' units, before anything is decided from it."""
        req.prompt_tokens = self.calibration.apply(req.prompt_tokens)
        req.prompt_units = self.calibration.epoch

    # ---- submit ----------------------------------------------------------------------------------------
    def submit(self, req: LLMRequest, now: float) -> Placement | Waiter:
        """Dispatch now (Placement), or queue (Waiter whose future resolves to a Placement). Raises Shed."""
        pol = self.policy
        prefill_s = self.placer.lane_prefill_s(req)
        lane = pol.lane_for(prefill_s)
        if self.placer.surely_too_large(req):
            self.m.shed(lane, "never_fits")
            raise Shed(400, "context_length_exceeded",
                       f"this request needs about {req.total_tokens} tokens of KV cache (prompt "
                       f"{req.prompt_tokens} + output {req.expected_output_tokens}); no replica of {req.model} "
                       f"can hold more than {int(self.placer.max_footprint())}. Shorten the prompt or max_tokens.",
                       should_retry=False)
        wait_budget = self._wait_budget(req, now, prefill_s)
        if wait_budget <= 0:
            self.m.shed(lane, "deadline_unmeetable")
            raise Shed(429, "deadline_unmeetable",
                       "the gateway cannot start this request before the client's own timeout",
                       retry_after_s=self.retry_after(lane, now), should_retry=False)
        if self.pool_down():
            self.m.shed(lane, "pool_down")
            raise self._pool_unavailable("")
        prio = self.prio_index.get(req.priority, 0)
        queue = self.queues[lane]
        self.placer.note_tenant(req.tenant, now, req.prompt_tokens)
        self.placer.note_lane(lane, now)
        if not self._waiting_at_or_above(lane, prio) or self._backfills(lane, prio, req, now, prefill_s):
            placed = self._try_place(req, lane, now)
            if placed is not None:
                self.m.admitted(lane, queued=False)
                return placed
        ahead, ahead_tokens = self._work_ahead(lane, req.tenant, prio)
        ahead_kv = self._work_ahead(lane, req.tenant, prio, footprints=True)[1] if ahead else 0
        late_budget = self._late_budget(req, now, prefill_s, wait_budget)
        may_wait = wait_budget + late_budget if self._slo_lost(prefill_s) else wait_budget
        kv_s = self.placer.kv_free_s(req, now, ahead, ahead_kv)
        if kv_s is not None and kv_s > may_wait:
            # Every replica's KV (after the waiters ahead of it take theirs) is committed to requests in flight that
            # end later than this one may wait: neither the queue nor the SDK's prompt retry can start it within
            # the SLO. Say so now, with when KV frees (PG).
            self.m.shed(lane, "kv_committed")
            raise self._kv_committed(req, kv_s, may_wait)
        short_s = self._prefill_room_short_s(req, now, wait_budget, ahead, ahead_tokens)
        if short_s > 0:
            # No replica will have room for its prefill within the SLO once the queue ahead is placed, and that
            # room only shrinks while it waits: it would expire in the queue. Say so now (P1).
            self.m.shed(lane, "wait_exceeds_deadline")
            raise Shed(429, "queue_wait_exceeds_deadline",
                       f"the replicas of {req.model} cannot start this request within the {pol.ttft_target_s:g}s "
                       f"TTFT target behind the {ahead} queued ahead of it; retry later",
                       retry_after_s=self._clamp_retry_after(short_s), should_retry=True)
        expected = self._expected_wait(lane, now, ahead)
        if expected is not None and expected * WAIT_SAFETY > may_wait:
            # Waiting cannot help: say so now (P1: shed early, in milliseconds, not after a futile wait).
            self.m.shed(lane, "wait_exceeds_deadline")
            too_long = req.client_timeout_s is not None and expected > req.client_timeout_s
            raise Shed(429, "queue_wait_exceeds_deadline",
                       f"about {expected:.1f}s of queue ahead on {req.model} ({expected * WAIT_SAFETY:.1f}s with "
                       f"the estimate's margin), more than this request may wait ({may_wait:.1f}s); retry later",
                       retry_after_s=self._clamp_retry_after(expected),
                       should_retry=not too_long)
        if len(queue) >= pol.lanes[lane].max_queue:
            victim = queue.lowest_priority_newest(below=prio)
            if victim is None:
                self.m.shed(lane, "queue_full")
                raise self._overload(lane, now, "queue_full",
                                     f"the {pol.lanes[lane].name} queue of {req.model} is full")
            queue.remove(victim)
            self.m.shed(lane, "evicted")
            victim.future.set_exception(self._overload(lane, now, "evicted",
                                                       "displaced by higher-priority traffic"))
        waiter = Waiter(req=req, lane=lane, priority=prio, tenant=req.tenant, deadline=now + wait_budget,
                        enqueued=now, expected_wait=expected or 0.0,
                        future=asyncio.get_running_loop().create_future())
        waiter.late_until = waiter.deadline + late_budget
        if not self._metered_waiting(lane):
            self.busy_since[self.meter[lane]] = now
        queue.push(waiter)
        self.m.queued(lane, prio, +1)
        # The fair order may put it first, or pass over a tenant held at its prefill share (a quiet tenant behind
        # a flood's held backlog): try now, not at the next timer tick (P1f).
        self.kick(now)
        if waiter.future.done() and waiter.future.exception() is None:
            return waiter.future.result()  # dispatched by that kick: no need to hold the request
        self._arm_timer()
        return waiter

    def _wait_budget(self, req: LLMRequest, now: float, prefill: float | None = None) -> float:
        """How long this request may wait here for a start within the SLO: the policy's max wait, by default the
        SLO (ttft_target_s) minus its own predicted prefill (at most half the SLO) and REFILL_S, so a request that
        could not get its first token within the SLO is told at once to retry later (P1f); and never so long that
        the client's own deadline passes before it could get its first token (stream) or its whole answer
        (non-stream). Work dispatched just before the client gives up is ghost load (P4). `prefill`: its predicted
        prefill where its prefix is cached best (None: all of it computed). A queued request may then wait on,
        served late (`_late_budget`, `serve_late`)."""
        pol = self.policy
        if prefill is None:
            prefill = self.placer.prefill_s(req.prompt_tokens)
        if pol.max_wait_s > 0:
            budget = pol.max_wait_s
        else:
            # Dispatched from the queue, it may land behind REFILL_S of prefill. A prompt whose prefill alone takes
            # most of the SLO cannot meet it by waiting less: it may wait half of it, and is served when a replica
            # frees (its lane keeps it off the others' way).
            target = pol.ttft_target_s
            budget = max(REFILL_S, target - REFILL_S - min(prefill, 0.5 * target))
        left = req.time_left_s(now)
        if left is not None:
            budget = min(budget, 0.9 * left - prefill - self.placer.answer_decode_s(req))
        return budget

    def _late_budget(self, req: LLMRequest, now: float, prefill: float, wait_budget: float) -> float:
        """How much longer than its wait budget a queued request may wait, served late (`serve_late`):

            late = late_wait_of_target x max(ttft_target_s, prefill), at most 0.9 x the client's time left - prefill
                   - answer decode - wait_budget (as `_wait_budget` bounds the wait: nothing dispatched after the
                   client gave up), never below 0

        A prompt whose own prefill is longer than the target is told its first token comes later in proportion: a
        user who sends it waits for its prefill anyway."""
        late = self.policy.late_wait_of_target * max(self.policy.ttft_target_s, prefill)
        left = req.time_left_s(now)
        if left is not None:
            late = min(late, 0.9 * left - prefill - self.placer.answer_decode_s(req) - wait_budget)
        return max(0.0, late)

    def _prefill_room_short_s(self, req: LLMRequest, now: float, wait_budget: float, ahead: int,
                              ahead_tokens: int) -> float:
        """How many seconds of prefill the fullest-placed replicas are short of starting this request within the
        TTFT target, once the `ahead` queued requests (`ahead_tokens` prompt tokens) are placed; <= 0: it may.

        A queued request fits replica r when backlog_r(t) + prompt <= rate x (target - waited) x w_r. The backlog
        drains at `rate` exactly as fast as the wait grows, and each placement on r adds to it, so the room
        room_r = rate x target x w_r - backlog_r only shrinks while the request waits; what it has on arrival is
        all it will get before its wait budget ends (then it is shed with 429 queue_timeout, after a futile wait).
        The requests ahead are placed first, each on the replica with the most room (the scorer's lowest predicted
        TTFT) while it fits; the request may wait only if some replica still has room for its prompt afterwards:
            short = prompt - max_r room_r (after the ahead ones), in seconds of prefill at `rate`
        This holds while the wait budget ends before the TTFT limit's floor (own prefill + REFILL_S) takes over,
        i.e. budget <= target - prefill - REFILL_S, which the default budget is (the floor would let a long prompt
        in behind REFILL_S of backlog later; an explicit max_wait_s may reach it too): otherwise 0."""
        placer = self.placer
        rate = placer.rate
        target = self.policy.ttft_target_s
        prompt = placer.prefill_work(req.prompt_tokens)
        if wait_budget > target - prompt / rate - REFILL_S + 1e-9:
            return 0.0
        rooms = [rate * target * placer.weight(r, now) - placer.backlog(r, now)
                 for r in self.pool.replicas if placer.usable(r, now)]
        if not rooms:
            return 0.0  # nothing routable: the pool-down path answers
        each = placer.prefill_work(ahead_tokens / ahead) if ahead else 0.0  # the mean prompt ahead's work
        for _ in range(ahead):
            i = max(range(len(rooms)), key=rooms.__getitem__)
            if rooms[i] < each:
                break  # the rest of the queue ahead cannot start in time either: it expires, taking no room
            rooms[i] -= each
        return (prompt - max(rooms)) / rate

    def drain_rate(self, lane: int, now: float) -> float:
        """How fast the lane's queue drains: the measured release rate over the last seconds (extrapolating from
        requests in flight / service time promised waits that did not happen under a burst, measured in P1);
        before any release is seen, requests in flight / mean service time.

        A release rate is what the pool served, not what it can serve: over a window that began before a flood
        (P1f) or a burst (P1) it counts the quiet seconds' arrivals, and underestimated the pool's pace for the
        window's length (5 s), shedding a quiet tenant's requests the fair queue would have started at once. So
        the releases seen while the lane had waiters (the pool saturated) count on their own as well, from
        BUSY_MIN_RELEASES of them and BUSY_MIN_S on (`BusyPace`): rate = max(all releases' rate, busy pace)."""
        m = self.meter[lane]
        rate = max(self.drain[m].current(now), self.busy_pace[m].current(now))
        if rate <= 0 and self.service_s[lane] > 0 and self.lane_requests[lane]:
            rate = self.lane_requests[lane] / self.service_s[lane]
        return rate

    def _expected_wait(self, lane: int, now: float, ahead: int) -> float | None:
        """The requests this one would wait behind (fair order, `_work_ahead`) / drain rate of its meter;
        None when there is no queue or no rate known yet."""
        if not ahead:
            return None
        rate = self.drain_rate(lane, now)
        if rate <= 0:
            return None
        return (ahead + 1) / rate

    def _lane_allows(self, lane: int, req: LLMRequest) -> bool:
        lp = self.policy.lanes[lane]
        if lp.max_concurrency and self.lane_requests[lane] >= lp.max_concurrency:
            return False
        if lp.max_inflight_tokens and self.lane_tokens[lane] + req.total_tokens > lp.max_inflight_tokens:
            return self.lane_requests[lane] == 0  # one oversized request may run alone
        return True

    def _try_place(self, req: LLMRequest, lane: int, now: float, waited: float = 0.0) -> Placement | None:
        if not self._lane_allows(lane, req):
            self.placer.last_reasons.clear()
            self.placer.last_reasons[LANE] = 1  # the lane's own limits, not the replicas
            return None
        pins = self.placer.choose(req, lane, now, waited)
        if pins is None:
            self.m.saturated(self.placer.last_reasons)
            return None
        primary = pins[0]
        growth = self.placer.commit(primary, req, lane, now)
        self.lane_requests[lane] += 1
        self.lane_tokens[lane] += req.total_tokens
        return Placement(primary, pins, lane, primary.scrape_epoch, self, now, growth)

    # ---- dispatch from the queues ---------------------------------------------------------------------
    def kick(self, now: float | None = None) -> int:
        """Dispatch every queued request that fits now: the lanes that share the pool together, in one fair
        order across them (`_kick_lanes`), then each other lane. Returns how many were dispatched."""
        now = time.monotonic() if now is None else now
        n = len(self.queues)
        dispatched = self._kick_lanes([lane for lane in range(n) if self.meter[lane] == n], now)
        for lane in range(n):
            if self.meter[lane] != n:
                dispatched += self._kick_lanes([lane], now)
        return dispatched

    def _kick_lanes(self, lanes: list[int], now: float) -> int:
        """Dispatch from `lanes` while their next requests fit. The next one is, of each lane's next in fair
        order, the one of the highest priority, then of the tenant least ahead of its lane's virtual clock
        (`FairQueue.lag`), then the oldest: a request's lane can change with the learned prefill speed (1,000
        tokens at the short/normal edge), and serving the lanes one after the other put a quiet tenant's request
        behind every flood request of the lane before it (P1f), or let later arrivals of that lane take the prefill
        room an earlier waiter was admitted for (P1: it expired). A lane whose next request does not fit is done
        for this kick (the pool is full for it); a tenant held at its prefill share is passed over in its lane."""
        held: dict[int, set[str]] = {}  # per lane, tenants at their prefill share: the next tenant may go
        open_lanes = [lane for lane in lanes if self.queues[lane].size]
        for lane in lanes:
            self.kv_held_until[lane] = 0.0
        dispatched = 0
        while open_lanes:
            best: tuple[int, float, float] | None = None
            pick: tuple[int, Waiter] | None = None
            for lane in list(open_lanes):
                queue = self.queues[lane]
                w = queue.peek(held.get(lane))
                while w is not None and w.future.done():  # cancelled or expired but not yet removed
                    queue.remove(w)
                    self.m.queued(lane, w.priority, -1)
                    w = queue.peek(held.get(lane))
                if w is None:
                    open_lanes.remove(lane)
                    continue
                key = (w.priority, queue.lag(w.tenant), w.enqueued)
                if best is None or key < best:
                    best, pick = key, (lane, w)
            if pick is None:
                break
            lane, w = pick
            placed = self._try_place(w.req, lane, now, now - w.enqueued)
            if placed is None:
                if self.placer.last_reasons.get(TENANT):
                    held.setdefault(lane, set()).add(w.tenant)
                else:
                    open_lanes.remove(lane)  # the pool is full for this lane: only a backfill may pass its head
                    dispatched += self._backfill(lane, w, now)
                continue
            self._dispatch(lane, w, placed, now)
            dispatched += 1
        return dispatched

    def _dispatch(self, lane: int, w: Waiter, placed: Placement, now: float) -> None:
        """`w` leaves its queue, placed: its tenant is charged in the fair order, its client's wait ends."""
        self.queues[lane].pop(w)
        self.m.queued(lane, w.priority, -1)
        self.m.admitted(lane, queued=True, waited_s=now - w.enqueued)
        self.m.waited_over_estimate(lane, now - w.enqueued, w.expected_wait)
        w.future.set_result(placed)

    def _backfill(self, lane: int, head: Waiter, now: float) -> int:
        """`head` did not fit. If KV alone kept it off every replica (EASY backfilling):

            held_until = now + kv_free_s(head)          (when KV is predicted to free for it)
            w behind it may go now  iff  now + lifetime(w) <= held_until  and  w fits now

        With other gateways placing in the pool, a head that fits some replica's KV beyond this gateway's share
        (KV_SHARE) waits for its turn there: held_until = now + min(kv_free_s, turn_wait_s) (routing/turns.py).

        `lifetime` = prefill at the pool's speed + expected output x decode s per token: what goes first has
        ended, by prediction, before the head could start, so it takes none of the KV the head waits for (PG: a
        burst of long generations committed the pool's KV and held every short chat behind it). Returns how many
        were dispatched; `held_until` is kept for new arrivals (`_backfills`)."""
        reasons = self.placer.last_reasons
        share = reasons.get(KV_SHARE)
        if not (reasons.get(KV_FULL) or share) or any(reasons.get(k) for k in (CONCURRENCY, PREFILL, QUEUE_FULL,
                                                                                  LANE)):
            return 0
        kv_s = self.placer.kv_free_s(head.req, now)
        if kv_s is None and not share:
            return 0
        if share:  # the KV fits it somewhere and the turn there will come (routing/turns.py)
            kv_s = min(kv_s if kv_s is not None else math.inf, self.placer.turn_wait_s())
        until = self.kv_held_until[lane] = now + kv_s
        dispatched = 0
        for w in self.queues[lane].behind(head, BACKFILL_SCAN):
            if w.future.done() or now + self._lifetime_s(w.req) > until:
                continue
            placed = self._try_place(w.req, lane, now, now - w.enqueued)
            if placed is not None:
                self._dispatch(lane, w, placed, now)
                dispatched += 1
        return dispatched

    def _arm_timer(self) -> None:
        """While anything waits, re-check every 50 ms: prefill backlog estimates decay with time alone."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(0.05, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.kick()
        if any(q.size for q in self.queues):
            self._arm_timer()

    # ---- leaving the queue without dispatch ------------------------------------------------------------
    def abandon(self, w: Waiter) -> None:
        """The client left (or the waiter's own wait ended): drop it from the queue at once."""
        if self.queues[w.lane].remove(w):
            self.m.queued(w.lane, w.priority, -1)

    def _slo_lost(self, prefill_s: float) -> bool:
        """Does a request of `prefill_s` predicted prefill (where its prefix is cached best) miss the SLO by its
        size alone, on an idle replica (prefill + REFILL_S > ttft_target_s)? No wait can save its SLO, and a
        refusal loses its call."""
        return prefill_s + REFILL_S > self.policy.ttft_target_s

    def _late_allowed(self, prefill_s: float) -> bool:
        """May a request of `prefill_s` predicted prefill be served late? It takes at most REFILL_S, or its SLO is
        lost by its size."""
        return prefill_s <= REFILL_S or self._slo_lost(prefill_s)

    def serve_late(self, w: Waiter, now: float) -> bool:
        """Its wait budget ended in the queue: keep it waiting, served late, until `w.late_until`, at priority LATE,
        behind every request that can still meet the SLO (`kick` serves priorities in order, and new arrivals do
        not count it ahead of them: `work_ahead`), when its own prefill (where its prefix is cached best) takes
        at most REFILL_S, or misses the SLO by itself (`_slo_lost`). It is placed where at most REFILL_S of
        prefill is ahead of it (`Placer.ttft_limit_s` after a wait): late work takes a replica's idle moment, and
        a request after it waits behind at most the late one's prefill and shares a decode step with it (P1: about
        5 % fewer requests within the SLO in three of four seeds, docs/benchmarks.md). Its SLO is lost either way;
        its call need not be: a refusal after a futile wait was P1's only slow one (the shed latency bar), and its
        SDK retry comes later still, or is refused by the retry budget. A prompt in between (its prefill longer
        than REFILL_S, yet within the SLO's reach) is refused instead: served late it holds a replica for a prefill
        on-time requests would wait behind, and a retry of it may still meet the SLO. One that misses the SLO by
        itself cannot, and a refusal only loses it and, for a shared prefix, the cache it would warm for the
        requests after it (PX's cold prompts, docs/benchmarks.md). False (answer it now: `expired`) when its late
        limit has passed, its prefill is in between, it was dispatched or left meanwhile, no replica is usable, or
        KV keeps it off every replica past the limit."""
        if w.future.done() or now >= w.late_until or not self.pool_up(now):
            return False
        if not self._late_allowed(self.placer.lane_prefill_s(w.req)):
            return False
        kv_s = self.placer.kv_free_s(w.req, now)
        if kv_s is not None and kv_s > w.late_until - now:
            return False
        queue = self.queues[w.lane]
        if w.priority == LATE or not queue.remove(w):
            return False
        self.m.queued(w.lane, w.priority, -1)
        w.priority, w.deadline = LATE, w.late_until
        queue.push(w)
        self.m.queued(w.lane, LATE, +1)
        self.m.late(w.lane)
        self._arm_timer()
        return True

    def expired(self, w: Waiter, now: float) -> Shed:
        """Its wait budget ended in the queue: 429 queue_timeout, retryable after the queue's drain time; or, when
        KV keeps it off every replica for longer than the shortest retry-after (MIN_RETRY_AFTER_S), 429
        kv_committed, final, retry-after = when KV frees (`submit`'s rule with no wait left)."""
        self.abandon(w)
        self.m.waited_over_estimate(w.lane, now - w.enqueued, w.expected_wait)
        kv_s = self.placer.kv_free_s(w.req, now) if self.pool_up(now) else None
        if kv_s is not None and kv_s > MIN_RETRY_AFTER_S:
            self.m.shed(w.lane, "kv_committed")
            return self._kv_committed(w.req, kv_s, 0.0)
        self.m.shed(w.lane, "deadline")
        return self._overload(w.lane, now, "queue_timeout",
                              f"waited {now - w.enqueued:.1f}s for capacity on {self.pool.model}")

    def _overload(self, lane: int, now: float, code: str, message: str) -> Shed:
        if not self.pool_up(now):
            return self._pool_unavailable(message)
        return Shed(429, code, message + "; retry later", retry_after_s=self.retry_after(lane, now),
                    should_retry=True)

    def _kv_committed(self, req: LLMRequest, kv_s: float, wait_s: float) -> Shed:
        """429 kv_committed: KV frees in `kv_s`, later than the `wait_s` it may still wait; x-should-retry false
        (retrying at the SDK's pace cannot start it within the SLO), retry-after = `kv_s` (0.2 .. 60 s)."""
        return Shed(429, "kv_committed",
                    f"the KV cache of every replica of {req.model} is committed to requests in flight for about "
                    f"{kv_s:.1f}s, more than this request may wait ({wait_s:.1f}s); retry after that",
                    retry_after_s=self._clamp_retry_after(kv_s), should_retry=False)

    def _pool_unavailable(self, message: str) -> Shed:
        return Shed(503, "pool_unavailable", f"no replica of {self.pool.model} is available"
                    + (f"; {message}" if message else "; retry shortly"),
                    retry_after_s=POOL_DOWN_RETRY_S, should_retry=True)

    def pool_up(self, now: float) -> bool:
        """Some replica could take a request now (placement's view: routable and with usable metrics)."""
        return any(self.placer.usable(r, now) for r in self.pool.replicas)

    def pool_down(self) -> bool:
        """No replica may take traffic at all (health: every one ejected or unreachable, or drained): waiting
        cannot help."""
        return not any(r.routable for r in self.pool.replicas)

    def retry_after(self, lane: int, now: float) -> float:
        """How long until the queue ahead would drain at the recent dispatch rate (0.2 s .. 60 s): the waiters of
        every lane on `lane`'s meter, since they drain at that meter's rate (`drain_rate`), divided by it."""
        rate = self.drain_rate(lane, now)
        ahead = self._metered_waiting(lane) + 1
        if rate <= 0:
            return 1.0
        return self._clamp_retry_after(ahead / rate)

    @staticmethod
    def _clamp_retry_after(seconds: float) -> float:
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, seconds))

    # ---- end of a dispatched request -------------------------------------------------------------------
    def release(self, placement: Placement, req: LLMRequest) -> None:
        now = time.monotonic()
        self.placer.release(placement.replica, req, placement.lane, placement.epoch, placement.growth,
                            placement.answered, now)
        placement.growth = None
        lane = placement.lane
        m = self.meter[lane]
        self.drain[m].tick(now)
        if self._metered_waiting(lane):
            self.busy_pace[m].tick(now, self.busy_since[m])
        if placement.at:
            took = now - placement.at
            self.service_s[lane] = took if not self.service_s[lane] else 0.9 * self.service_s[lane] + 0.1 * took
        self.lane_requests[placement.lane] -= 1
        self.lane_tokens[placement.lane] -= req.total_tokens
        self.m.released(placement.lane)
        if any(q.size for q in self.queues):
            self.kick()

    def queued_total(self) -> int:
        return sum(q.size for q in self.queues)

    # ---- a policy reload replaced this pool's scheduler -----------------------------------------------------
    def take_over(self, old: Scheduler) -> None:
        """Continue what `old` (the scheduler a reload replaced) was doing: its waiters keep their place (same
        lane, same deadline) in this one's queues, and what the engines counted still calibrates the prompt
        estimates. Requests `old` placed release to it (`Placement.owner`)."""
        if self.policy.calibrate_prompt_tokens:
            self.calibration = old.calibration
            self.calibration.enabled = True
            self.m.estimate_factor(self.calibration.factor)
        self.placer.growth = old.placer.growth  # the output its requests in flight still decode (released to old)
        if self.placer.prefix is not None and old.placer.prefix is not None:
            self.placer.prefix = old.placer.prefix  # where prefixes were placed, and the engines' confirmation
        for lane, w in old._take_queued():
            self.queues[lane].push(w)
            self.m.queued(lane, w.priority, +1)
        if self.queued_total():
            self._arm_timer()
            self.kick()

    def shed_queued(self, shed: Shed) -> None:
        """The pool is gone: every waiter gets `shed` as its answer."""
        for _lane, w in self._take_queued():
            w.future.set_exception(shed)

    def _take_queued(self) -> list[tuple[int, Waiter]]:
        """Empty the queues; the waiters still waiting, with their lane."""
        out = []
        for lane, queue in enumerate(self.queues):
            while queue.size:
                w = queue.peek()
                assert w is not None
                queue.pop(w)
                self.m.queued(lane, w.priority, -1)
                if not w.future.done():
                    out.append((lane, w))
        return out

