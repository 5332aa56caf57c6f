"""The pools the sidecar routes to and, per pool, the parts that decide for it: the health tracker (replica states
from business signals, P6/P8), the placer (which replica fits and scores best, P3/P7/P9) and the scheduler (the
lanes' queues, P1/P2). Their background events arrive here: a scrape round, an access-log outcome, capacity
that came back.

One Fleet per sidecar process, for its whole life: a policy reload rebuilds the parts in place (`rebuild`, called
by extproc/reload.py), so the listeners registered with the scraper and the access log stay valid.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from extproc.admission.placement import Placer
from extproc.admission.scheduler import Scheduler
from extproc.config import Policy
from extproc.routing.capacity import tokens_per_s
from extproc.routing.health import HealthTracker
from extproc.routing.pool import Pool, Replica
from extproc.routing.scrape import Scraper

if TYPE_CHECKING:
    from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry

FreshTest = Callable[[Replica, float], bool]


class Fleet:
    def __init__(self, policy: Policy) -> None:
        self.is_fresh: FreshTest | None = None  # set when a scraper runs: stale metrics count as saturated
        self.scraper: Scraper | None = None
        self.health: dict[str, HealthTracker] = {}
        self.schedulers: dict[str, Scheduler] = {}
        self.rebuild(policy, {p.model: Pool.from_config(p) for p in policy.pools})

    def rebuild(self, policy: Policy, pools: dict[str, Pool]) -> dict[str, Scheduler]:
        """Build every part for `pools` under `policy`; a pool that stays keeps its health tracker (and its
        replicas their live state). Returns the schedulers it replaced, whose queues the caller hands over."""
        old = self.schedulers
        self.policy = policy
        self.admission = policy.admission
        self.routing = policy.routing
        self.pools = pools
        self.health = {name: self.health[name] if name in self.health and self.health[name].pool is pool
                       else HealthTracker(pool, self.routing.health) for name, pool in pools.items()}
        for tracker in self.health.values():
            tracker.policy = self.routing.health
            tracker.slo_ttft_s = self.admission.ttft_target_s  # replicas are judged against the user's SLO
        self.placers = {name: self._placer(pool) for name, pool in pools.items()}
        self.schedulers = {name: Scheduler(pool, self.admission, self.placers[name]) for name, pool in pools.items()}
        self.by_cluster = {pool.cluster: pool for pool in pools.values()}
        if self.scraper is not None:
            self.scraper.pools[:] = self._scraped()
        return old

    def _placer(self, pool: Pool) -> Placer:
        placer = Placer(pool, self.admission, self.is_fresh)
        if self.routing.health.enabled:
            placer.allow_probe = self.health[pool.model].allow_probe
        return placer

    def _scraped(self) -> list[Pool]:
        """Pools whose replicas export metrics (metrics_style "none": OpenAI-compatible servers without /metrics;
        only the sidecar's own accounting is used for them)."""
        return [p for p in self.pools.values() if p.metrics_style != "none"]

    def make_scraper(self) -> Scraper | None:
        """The scraper of every replica's engine metrics (every routing.scrape_interval_s), wired to health and the
        queues; None when no pool exports metrics. The caller starts and stops it."""
        scraped = self._scraped()
        if not scraped:
            return None
        scraper = Scraper(scraped, self.routing)
        scraper.listeners.append(self.on_scrape_round)
        unscraped = {p.model for p in self.pools.values() if p.metrics_style == "none"}
        if unscraped:
            self.set_freshness(lambda r, now: r.pool in unscraped or scraper.is_fresh(r, now))
        else:
            self.set_freshness(scraper.is_fresh)
        self.scraper = scraper
        return scraper

    def set_freshness(self, is_fresh: FreshTest) -> None:
        """With a scraper running, replicas whose metrics are stale count as saturated."""
        self.is_fresh = is_fresh
        for placer in self.placers.values():
            placer.is_fresh = is_fresh

    # ---- events --------------------------------------------------------------------------------------------
    def on_scrape_round(self) -> None:
        """After every scrape: health re-evaluates each replica (weights, states), then queued requests that
        now fit are dispatched."""
        if self.routing.health.enabled:
            now = time.monotonic()
            for tracker in self.health.values():
                tracker.on_scrape_round(now)
        now = time.monotonic()
        for sched in self.schedulers.values():
            sched.on_scrape(now)
        self.kick_all()

    def on_outcome(self, outcome: str, entry: HTTPAccessLogEntry) -> None:
        """Envoy's access log says how each forwarded request ended on which replica: errors feed health."""
        pool = self.by_cluster.get(entry.common_properties.upstream_cluster)
        if pool is None or not self.routing.health.enabled:
            return
        common = entry.common_properties
        sock = common.upstream_remote_address.socket_address
        if sock.address:
            # a first byte from the replica says it was serving, even when the client left (busy is not dead)
            answered = common.HasField("time_to_first_upstream_rx_byte")
            self.health[pool.model].on_outcome(f"{sock.address}:{sock.port_value}", outcome, answered=answered)

    def kick_all(self) -> None:
        """Capacity may have changed (scrape, health, an operator's undrain): dispatch what now fits."""
        for sched in self.schedulers.values():
            if sched.queued_total():
                sched.kick()

    def capacity_tokens_per_s(self, model: str) -> float:
        """A pool's prompt-token throughput (routing/capacity.py), in the engines' tokens; 0 for an unknown pool."""
        pool = self.pools.get(model)
        return 0.0 if pool is None else tokens_per_s(pool, self.admission.prefill_tokens_per_s)
