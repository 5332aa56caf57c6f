"""Every Prometheus metric of the routing package (scraper and health), default registry, names prefixed `sluice_`.

Series (labels):
  sluice_replica_state{pool,replica,state}        1 for the replica's current health state, 0 for the other three
                                                  (state = healthy | degraded | ejected | recovering): one series
                                                  per state so `sum by (state)` counts replicas per state and an
                                                  alert can match `state="ejected"` without a code table.
  sluice_replica_weight{pool,replica}             share of normal capacity the replica may take (slow start: 0.1,
                                                  0.3, 0.5, 1.0; degraded: 0.25; ejected: 0).
  sluice_replica_kv_usage{pool,replica}           scraped KV-cache usage, 0..1.
  sluice_replica_running{pool,replica}            scraped requests running in the engine.
  sluice_replica_waiting{pool,replica}            scraped requests waiting in the engine's own queue.
  sluice_replica_ttft_p95_seconds{pool,replica}   p95 time to first token over the scrape window (bucket deltas).
  sluice_replica_generation_tokens_per_second{pool,replica}  generated tokens/s over the scrape window.
  sluice_replica_scrape_age_seconds{pool,replica} seconds since the last successful scrape (computed when
                                                  Prometheus reads it; since the scraper first saw the replica
                                                  when no scrape ever succeeded).
  sluice_replica_health_transitions_total{pool,replica,from,to,reason}  health state changes; reason is a short
                                                  code (ttft_p95, tps_collapse, error_rate, unreachable, restarted,
                                                  reachable, signals_ok, slow_start_done, pool_fallback,
                                                  fallback_released).
  sluice_scrape_duration_seconds{pool}            wall time of one replica scrape (request + parse), successful
                                                  scrapes only.
  sluice_scrape_failures_total{pool,replica}      failed scrapes (refused, timeout, non-200, unparsable).
  sluice_pool_all_degraded{pool}                  1 while no replica of the pool is healthy or recovering (the pool
                                                  then serves from the best degraded one).

  sluice_shared_load_degraded                     1 while the shared in-flight view (Redis) is unreachable: placement
                                                  then sees only this sidecar's own placements (shared_load.py).
  sluice_shared_load_peers                        other sidecars whose in-flight report is fresh.
  sluice_shared_load_sync_failures_total          failed publish-and-read round trips to Redis.

Label children are resolved once per replica (`replica_metrics`) and cached; nothing here formats strings per
scrape.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import Counter, Gauge, Histogram

from extproc.routing.pool import DEGRADED, EJECTED, HEALTHY, RECOVERING, EngineState

STATES = (HEALTHY, DEGRADED, EJECTED, RECOVERING)

REPLICA_STATE = Gauge(
    "sluice_replica_state",
    "1 for the replica's current health state (healthy, degraded, ejected, recovering), 0 for the others.",
    ["pool", "replica", "state"],
)


def _per_replica(name: str, documentation: str) -> Gauge:
    return Gauge(name, documentation, ["pool", "replica"])


REPLICA_WEIGHT = _per_replica(
    "sluice_replica_weight",
    "Share of normal capacity the replica may take (slow start 0.1..1.0, degraded 0.25, ejected 0).")
REPLICA_KV_USAGE = _per_replica("sluice_replica_kv_usage", "Scraped KV-cache usage of the replica, 0..1.")
REPLICA_RUNNING = _per_replica("sluice_replica_running", "Scraped requests running in the replica's engine.")
REPLICA_WAITING = _per_replica("sluice_replica_waiting", "Scraped requests waiting in the replica's own queue.")
REPLICA_TTFT_P95 = _per_replica(
    "sluice_replica_ttft_p95_seconds",
    "p95 time to first token over the scrape window, from the engine's histogram bucket deltas (0 = no samples).")
REPLICA_GEN_TPS = _per_replica(
    "sluice_replica_generation_tokens_per_second",
    "Generated tokens per second over the scrape window, from the engine's counter deltas.")
REPLICA_SCRAPE_AGE = _per_replica("sluice_replica_scrape_age_seconds",
                                  "Seconds since the last successful scrape of the replica's /metrics.")
HEALTH_TRANSITIONS = Counter(
    "sluice_replica_health_transitions_total",
    "Health state changes of a replica, by previous state, new state and reason code.",
    ["pool", "replica", "from", "to", "reason"],
)
SCRAPE_DURATION = Histogram(
    "sluice_scrape_duration_seconds",
    "Wall time of one successful replica /metrics scrape (HTTP request and parsing).",
    ["pool"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
SCRAPE_FAILURES = Counter(
    "sluice_scrape_failures_total",
    "Failed replica scrapes (connection refused, timeout, non-200 status, page without engine metrics).",
    ["pool", "replica"],
)
SCRAPE_TIMEOUTS = Counter(
    "sluice_scrape_timeouts_total",
    "Failed replica scrapes that timed out (counted in sluice_scrape_failures_total too): a busy engine answers "
    "late, a dead one not at all; health tells them apart by the requests the replica still answers.",
    ["pool", "replica"],
)
POOL_ALL_DEGRADED = Gauge(
    "sluice_pool_all_degraded",
    "1 while no replica of the pool is healthy or recovering: the pool serves from its best degraded replica.",
    ["pool"],
)


class ReplicaMetrics:
    """The cached label children of one replica."""

    __slots__ = ("pool", "replica", "_state", "_current", "weight", "kv", "running", "waiting", "ttft", "tps",
                 "age", "failures", "timeouts", "duration", "_transitions")

    def __init__(self, pool: str, replica: str) -> None:
        self.pool, self.replica = pool, replica
        self._state = {s: REPLICA_STATE.labels(pool, replica, s) for s in STATES}
        self._current: str | None = None
        self.weight = REPLICA_WEIGHT.labels(pool, replica)
        self.kv = REPLICA_KV_USAGE.labels(pool, replica)
        self.running = REPLICA_RUNNING.labels(pool, replica)
        self.waiting = REPLICA_WAITING.labels(pool, replica)
        self.ttft = REPLICA_TTFT_P95.labels(pool, replica)
        self.tps = REPLICA_GEN_TPS.labels(pool, replica)
        self.age = REPLICA_SCRAPE_AGE.labels(pool, replica)
        self.failures = SCRAPE_FAILURES.labels(pool, replica)
        self.timeouts = SCRAPE_TIMEOUTS.labels(pool, replica)
        self.duration = SCRAPE_DURATION.labels(pool)
        self._transitions: dict[tuple[str, str, str], Counter] = {}

    def engine(self, st: EngineState, seconds: float) -> None:
        """After a successful scrape."""
        self.kv.set(st.kv_usage)
        self.running.set(st.running)
        self.waiting.set(st.waiting)
        self.ttft.set(st.ttft_p95_s)
        self.tps.set(st.generation_tps)
        self.duration.observe(seconds)

    def age_from(self, scraped_at: Callable[[], float], first_seen: float) -> None:
        """Make the age gauge compute `now - scraped_at()` whenever Prometheus reads it."""

        def age() -> float:
            at = scraped_at()
            return time.monotonic() - (at if at > 0 else first_seen)

        self.age.set_function(age)

    def state(self, state: str, weight: float) -> None:
        if state != self._current:
            if self._current is not None:
                self._state[self._current].set(0)
            else:
                for g in self._state.values():
                    g.set(0)
            self._state[state].set(1)
            self._current = state
        self.weight.set(weight)

    def transition(self, from_state: str, to_state: str, reason: str) -> None:
        key = (from_state, to_state, reason)
        child = self._transitions.get(key)
        if child is None:
            child = self._transitions[key] = HEALTH_TRANSITIONS.labels(self.pool, self.replica, *key)
        child.inc()


SHARED_LOAD_DEGRADED = Gauge("sluice_shared_load_degraded",
                             "1 while the shared in-flight view (Redis) is unreachable and only own placements count.")
SHARED_LOAD_PEERS = Gauge("sluice_shared_load_peers", "Other sidecars whose in-flight report is fresh.")
SHARED_LOAD_SYNC_FAILURES = Counter("sluice_shared_load_sync_failures_total",
                                    "Failed publish-and-read round trips of the shared in-flight view.")

_CACHE: dict[tuple[str, str], ReplicaMetrics] = {}
_POOL_CACHE: dict[str, Gauge] = {}


def replica_metrics(pool: str, replica: str) -> ReplicaMetrics:
    """The (cached) metric children of one replica."""
    m = _CACHE.get((pool, replica))
    if m is None:
        m = _CACHE[(pool, replica)] = ReplicaMetrics(pool, replica)
    return m


def pool_all_degraded(pool: str) -> Gauge:
    g = _POOL_CACHE.get(pool)
    if g is None:
        g = _POOL_CACHE[pool] = POOL_ALL_DEGRADED.labels(pool)
    return g


def forget_replica(pool: str, replica: str) -> None:
    """Drop a replica's series (it left the pool), so removed replicas do not linger in /metrics."""
    m = _CACHE.pop((pool, replica), None)
    if m is None:
        return
    for gauge in (REPLICA_WEIGHT, REPLICA_KV_USAGE, REPLICA_RUNNING, REPLICA_WAITING, REPLICA_TTFT_P95,
                  REPLICA_GEN_TPS, REPLICA_SCRAPE_AGE, SCRAPE_FAILURES, SCRAPE_TIMEOUTS):
        try:
            gauge.remove(pool, replica)
        except KeyError:
            pass
    for s in STATES:
        try:
            REPLICA_STATE.remove(pool, replica, s)
        except KeyError:
            pass
    for key in m._transitions:
        try:
            HEALTH_TRANSITIONS.remove(pool, replica, *key)
        except KeyError:
            pass
