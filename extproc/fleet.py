"""The pools the sidecar routes to and, per pool, the parts that decide for it: the health tracker (replica states
from business signals, P6/P8), the placer (which replica fits and scores best, P3/P7/P9) and the scheduler (the
lanes' queues, P1/P2). Their background events arrive here: a scrape round, an access-log outcome, capacity
that came back, replicas found or lost by discovery, the other gateways' load in flight.

Replicas found by discovery (extproc/discovery: DNS names, an InferencePool's pods) join and leave live:
    added    joins in slow start (RECOVERING at the first `slow_start_steps` weight), except in a source's first
             report, which is the starting set; an address being retired is taken back the same way
    removed  retired: no new requests, the ones in flight finish; it leaves the pool (health state and metric
             series forgotten) once nothing is in flight on it, checked after every scrape round and release

One Fleet per sidecar process, for its whole life: a policy reload rebuilds the parts in place (`rebuild`, called
by extproc/reload.py), so the listeners registered with the scraper and the access log stay valid.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from extproc.accesslog import CANCELLED, TIMEOUT, client_deadline_passed
from extproc.admission.placement import Placer
from extproc.admission.scheduler import Scheduler
from extproc.config import Policy
from extproc import metrics as m
from extproc.routing import metrics as rm
from extproc.routing.capacity import requests_per_s
from extproc.routing.health import HealthTracker
from extproc.routing.pool import Pool, Replica
from extproc.routing.scrape import Scraper

if TYPE_CHECKING:
    from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry

    from extproc.discovery import EndpointDiff
    from extproc.routing.shared_load import View
    from extproc.routing.turns import Turns

FreshTest = Callable[[Replica, float], bool]


class Fleet:
    def __init__(self, policy: Policy) -> None:
        self.is_fresh: FreshTest | None = None  # set when a scraper runs: stale metrics count as saturated
        self.scraper: Scraper | None = None
        self.health: dict[str, HealthTracker] = {}
        self.schedulers: dict[str, Scheduler] = {}
        self.on_removed: list[Callable[[Replica], object]] = []  # called for each replica that left its pool
        self.turns: Turns | None = None  # several gateways sharing the pools: whose the last places are
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
        placer.turns = self.turns
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
        """After every scrape: retired replicas with nothing in flight leave, health re-evaluates each replica
        (weights, states), then queued requests that now fit are dispatched."""
        self.sweep_retired()
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
            if outcome == TIMEOUT and client_deadline_passed(entry, self.policy.gateway.request_timeout_s):
                outcome = CANCELLED  # the client's own deadline: its doing, like hanging up
            self.health[pool.model].on_outcome(f"{sock.address}:{sock.port_value}", outcome, answered=answered)

    def kick_all(self) -> None:
        """Capacity may have changed (scrape, health, an operator's undrain): dispatch what now fits."""
        for sched in self.schedulers.values():
            if sched.queued_total():
                sched.kick()

    # ---- replicas found and lost by discovery --------------------------------------------------------------
    def apply_endpoint_diff(self, diff: EndpointDiff) -> None:
        """A discovery report for one pool (see the module docstring). A source's first report (`initial`) is
        the pool's whole set: replicas it does not list are retired."""
        pool = self.pools.get(diff.pool)
        if pool is None:
            return  # the pool was removed by a reload since
        health = self.health[pool.model]
        for address in diff.added:
            r, joined = pool.add_replica(address)
            if joined and not diff.initial:
                health.start_slow(r)
            elif joined:
                health.register(r)
        gone = set(diff.removed)
        if diff.initial:
            gone |= {r.address for r in pool.replicas} - set(diff.added)
        for address in sorted(gone):
            pool.retire_replica(address)
        self.placers[pool.model].on_replicas_changed()
        self.sweep_retired(pool)
        self.kick_all()

    def sweep_retired(self, pool: Pool | None = None) -> None:
        """Retired replicas with nothing in flight leave their pool (all pools when `pool` is None)."""
        for p in (self.pools.values() if pool is None else (pool,)):
            gone = p.sweep_retired()
            if not gone:
                continue
            health = self.health[p.model]
            for r in gone:
                health.forget(r.address)
                for listener in self.on_removed:
                    listener(r)
                rm.forget_replica(p.model, r.address)
                for gauge in (m.INFLIGHT_REQUESTS, m.INFLIGHT_TOKENS, m.REPLICA_DRAINING):
                    try:
                        gauge.remove(p.model, r.address)
                    except KeyError:
                        pass
            self.placers[p.model].on_replicas_changed()

    def endpoints(self, model: str) -> list[str]:
        """The pool's replicas Envoy should know (EDS): every one not retired."""
        pool = self.pools.get(model)
        return [] if pool is None else [r.address for r in pool.replicas if not r.retired]

    # ---- the other gateways' load (several sidecars sharing through Redis) ---------------------------------
    def local_view(self) -> dict[str, dict[str, tuple[int, int, int, int]]]:
        """This sidecar's requests in flight, published to the others: pool -> replica -> (tokens, requests,
        output still to decode, expected output within tokens)."""
        now = time.monotonic()
        view = {}
        for p in self.pools.values():
            placer = self.placers.get(p.model)
            view[p.model] = {r.address: (r.inflight_tokens, r.inflight_requests,
                                         int(placer.own_growth(r, now)) if placer is not None else 0,
                                         r.inflight_tokens - r.inflight_prompt_tokens)
                             for r in p.replicas}
        return view

    def share_turns(self, turns: Turns) -> None:
        """Place as one of several gateways: each placer fills its share of a replica's headroom between two shared
        views (routing/turns.py)."""
        self.turns = turns
        for placer in self.placers.values():
            placer.turns = turns

    def on_shared_view(self, view: View) -> None:
        """The other sidecars' requests in flight per replica (an empty view: Redis lost, own load only)."""
        for pool in self.pools.values():
            others = view.get(pool.model, {})
            for r in pool.replicas:
                load = others.get(r.address)
                if load is None:
                    r.note_shared(0, 0)
                else:
                    r.note_shared(load.tokens, load.requests, load.growth, load.output)

    def capacity_rps(self, model: str, prompt: float) -> float:
        """Requests/s a pool sustains at `prompt` estimated prompt tokens per request (routing/capacity.py); 0 for
        an unknown pool."""
        pool = self.pools.get(model)
        return 0.0 if pool is None else requests_per_s(pool, prompt, self.admission.prefill_tokens_per_s)
