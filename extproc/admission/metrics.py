"""Admission metrics: queue depth and wait per lane and priority, admitted and shed by reason, saturation.

Label children are resolved once per pool (PoolMetrics) so the hot path only calls inc/dec/observe.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

QUEUE_DEPTH = Gauge("sluice_queue_depth", "Requests waiting in the sidecar's queue.", ["pool", "lane", "priority"])
QUEUE_WAIT = Histogram(
    "sluice_queue_wait_seconds", "How long dispatched requests waited in the queue.", ["pool", "lane"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
QUEUE_WAIT_OVER_ESTIMATE = Histogram(
    "sluice_queue_wait_over_estimate",
    "A queued request's wait (until dispatched, or shed at the end of its wait) over the queue-wait estimate it "
    "was queued with (requests ahead / the lane's drain rate). A request is queued only while estimate x 1.4 "
    "(the scheduler's WAIT_SAFETY) fits its wait budget: the share above 1.4 waited longer than that margin "
    "allowed for.", ["pool", "lane"],
    buckets=(0.25, 0.5, 0.75, 1.0, 1.4, 2, 3, 5, 10))
ADMITTED = Counter("sluice_admitted_total", "Requests dispatched to a replica, by lane and whether they queued.",
                   ["pool", "lane", "queued"])
SHED = Counter("sluice_shed_total",
               "Requests answered without reaching a replica, by lane and reason (queue_full, deadline, "
               "wait_exceeds_deadline, kv_committed, deadline_unmeetable, never_fits, evicted).",
               ["pool", "lane", "reason"])
LATE = Counter("sluice_queue_late_total",
               "Queued requests whose wait budget (from the TTFT target) ended without a replica for them, kept "
               "waiting behind every on-time request to be served late (admission.late_wait_of_target).",
               ["pool", "lane"])
SATURATION = Counter("sluice_replica_saturated_total",
                     "Placement attempts that found replicas full, by reason (kv_full, kv_share, engine_queue, "
                     "concurrency, prefill_backlog, lane, tenant_share, stale, not_routable).", ["pool", "reason"])
PREFILL_RATE = Gauge("sluice_prefill_tokens_per_second",
                     "Prefill speed per replica admission assumes (learned from saturated engines).", ["pool"])
ESTIMATE_FACTOR = Gauge("sluice_prompt_estimate_factor",
                        "Factor applied to prompt token estimates, learned from the engines' prompt-token counters.",
                        ["pool"])
LANE_INFLIGHT = Gauge("sluice_lane_inflight_requests", "Requests in flight per lane.", ["pool", "lane"])


class PoolMetrics:
    def __init__(self, pool: str, lanes: list[str], priorities: list[str]) -> None:
        self.pool = pool
        self.lanes = lanes
        self._depth = [[QUEUE_DEPTH.labels(pool, lane, p) for p in priorities] for lane in lanes]
        self._wait = [QUEUE_WAIT.labels(pool, lane) for lane in lanes]
        self._over_estimate = [QUEUE_WAIT_OVER_ESTIMATE.labels(pool, lane) for lane in lanes]
        self._admitted = [(ADMITTED.labels(pool, lane, "false"), ADMITTED.labels(pool, lane, "true"))
                          for lane in lanes]
        self._inflight = [LANE_INFLIGHT.labels(pool, lane) for lane in lanes]
        self._late = [LATE.labels(pool, lane) for lane in lanes]
        self._shed: dict[tuple[int, str], object] = {}
        self._sat: dict[str, object] = {}
        self._rate = PREFILL_RATE.labels(pool)
        self._factor = ESTIMATE_FACTOR.labels(pool)

    def queued(self, lane: int, prio: int, delta: int) -> None:
        self._depth[lane][prio].inc(delta)

    def admitted(self, lane: int, queued: bool, waited_s: float = 0.0) -> None:
        self._admitted[lane][queued].inc()
        self._inflight[lane].inc()
        if queued:
            self._wait[lane].observe(waited_s)

    def waited_over_estimate(self, lane: int, waited_s: float, estimate_s: float) -> None:
        """A queued request left the queue after `waited_s`; it was queued with `estimate_s` of wait (0: it had
        no estimate, nothing is reported)."""
        if estimate_s > 0:
            self._over_estimate[lane].observe(waited_s / estimate_s)

    def late(self, lane: int) -> None:
        self._late[lane].inc()

    def released(self, lane: int) -> None:
        self._inflight[lane].dec()

    def shed(self, lane: int, reason: str) -> None:
        child = self._shed.get((lane, reason))
        if child is None:
            child = self._shed[(lane, reason)] = SHED.labels(self.pool, self.lanes[lane], reason)
        child.inc()  # type: ignore[attr-defined]

    def prefill_rate(self, rate: float) -> None:
        self._rate.set(rate)

    def estimate_factor(self, factor: float) -> None:
        self._factor.set(factor)

    def saturated(self, reasons: dict[str, int]) -> None:
        for reason, n in reasons.items():
            child = self._sat.get(reason)
            if child is None:
                child = self._sat[reason] = SATURATION.labels(self.pool, reason)
            child.inc(n)  # type: ignore[attr-defined]
