"""The `routing:` section of the policy file: scraping and health of the replicas."""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.schema import non_negative, positive, require, share


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """When a replica is healthy, degraded, ejected or recovering (see health.py for the state machine)."""

    enabled: bool = True              # false freezes every replica in its current state (weight untouched): health
                                      # from business signals off
    ttft_p95_degraded_s: float = 15.0  # windowed p95 time to first token above this -> DEGRADED, whatever the
                                       # other replicas do (PROBLEMS.md P8: 15 s); the only TTFT bar of a replica
                                       # without peers to compare with
    degraded_vs_pool: float = 3.0     # a replica is also DEGRADED when its p95 TTFT is above this x the median
                                      # p95 of the pool's other healthy replicas AND above admission.ttft_target_s
                                      # (the SLO): a busy pool slows every replica together, a sick one stands out
    min_samples: int = 10             # first tokens the window must hold before its p95 may degrade a HEALTHY
                                      # replica (a p95 of 2 samples says nothing)
    tps_floor_per_request: float = 2.0  # generated tokens/s per running request (window mean of running) below
                                        # this while requests are in the engine -> DEGRADED ("TPS fell from 50 to
                                        # 3", or a hang: 0), unless it processes tokens at its peers' pace (long
                                        # prompts or many streams slow every replica's decode together)
    tps_min_busy: float = 1.0         # the window's mean requests in the engine (running + waiting) needed before
                                      # the TPS floor is judged (an idle or nearly idle replica generates nothing
                                      # and is fine)
    tps_min_span_s: float = 3.0       # seconds of scrape history the window must span before the TPS floor is
                                      # judged (right after start or a restart the rate is noise)
    error_rate_degraded: float = 0.2  # share of failed + timed-out requests (Envoy access log outcomes; cancelled
                                      # ones, and ones timed out at the client's own deadline, are the client's
                                      # doing and not counted) over `error_window_s` above this + the pool's other
                                      # healthy replicas' share -> DEGRADED
    error_min_samples: int = 10       # finished requests the error window must hold before the rate is judged
    error_window_s: float = 10.0      # the error-rate window, seconds
    scrape_failures_degraded: int = 2  # consecutive failed scrapes that make a replica DEGRADED ("unreachable")
    scrape_failures_ejected: int = 5  # consecutive failed scrapes that EJECT it. Once it answers again it enters
                                      # RECOVERING (slow start, P6)
    unresponsive_after_s: float = 5.0  # scrapes that time out count as failed only once the replica has also
                                       # shown no sign of life this long: no successful scrape and no request
                                       # answered in Envoy's access log (a busy vLLM answers /metrics in seconds
                                       # now and then; refused or reset connections count at once)
    degraded_weight: float = 0.25     # `Replica.weight` while DEGRADED
    eject_after_s: float = 20.0       # a DEGRADED replica whose signals are still bad this long after it was
                                      # degraded is EJECTED
    recover_after_s: float = 10.0     # a DEGRADED replica whose signals stayed good this long returns to HEALTHY
    ejected_min_s: float = 10.0       # least time in EJECTED (for business signals) before good signals may start
                                      # RECOVERING. A replica ejected as unreachable recovers as soon as it answers
                                      # a scrape
    probe_interval_s: float = 5.0     # an EJECTED (reachable) replica gets at most one probe request per this many
                                      # seconds (`HealthTracker.allow_probe`)
    probe_min_samples: int = 1        # first tokens (and finished requests) enough to judge an EJECTED or
                                      # RECOVERING replica, whose traffic is deliberately small
    slow_start_steps: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)  # weights of RECOVERING, strictly increasing
                                      # in (0, 1]; the replica starts at the first and moves one step per
                                      # `slow_start_step_s`, up or down by its TTFT; past the last step (or on
                                      # reaching 1.0) it is HEALTHY
    slow_start_step_s: float = 1.0    # how often slow start moves a step: up when the p95 TTFT of the first tokens
                                      # of the last step_s is healthy (or there were none), down when not
    slow_start_healthy_factor: float = 1.0  # during slow start TTFT is healthy when its p95 over the last step is
                                            # <= this x max(admission.ttft_target_s, the median p95 of the pool's
                                            # healthy replicas)
    relapse_factor: float = 1.0       # a RECOVERING replica whose p95 TTFT exceeds relapse_factor x the TTFT bar
                                      # of a healthy one (or that collapses in TPS, errors or stops answering)
                                      # falls back to EJECTED
    fallback_weight: float = 0.1      # weight given to the best ejected replica when every replica of the pool is
                                      # degraded or ejected (never zero capacity while a replica still answers)

    def validate(self, path: str) -> None:
        positive(self, path, "ttft_p95_degraded_s", "tps_min_busy", "error_window_s", "eject_after_s",
                 "recover_after_s", "probe_interval_s", "slow_start_step_s", "slow_start_healthy_factor",
                 "relapse_factor", "degraded_vs_pool", "unresponsive_after_s")
        non_negative(self, path, "tps_floor_per_request", "tps_min_span_s", "ejected_min_s")
        for name in ("min_samples", "error_min_samples", "probe_min_samples", "scrape_failures_degraded"):
            require(getattr(self, name) >= 1, f"{path}.{name}", f"must be >= 1, got {getattr(self, name)!r}")
        require(self.scrape_failures_ejected >= self.scrape_failures_degraded, f"{path}.scrape_failures_ejected",
                "must be >= scrape_failures_degraded")
        share(self, path, "error_rate_degraded", "degraded_weight", "fallback_weight")
        require(bool(self.slow_start_steps), f"{path}.slow_start_steps", "must be a non-empty list of weights")
        prev = 0.0
        for i, w in enumerate(self.slow_start_steps):
            require(prev < w <= 1.0, f"{path}.slow_start_steps[{i}]",
                    f"must be in (0, 1] and above the previous step, got {w!r}")
            prev = w


@dataclass(frozen=True, slots=True)
class SharedLoadPolicy:
    """Several gateways as one (shared_load.py): with `budgets.store.kind: redis`, each sidecar publishes its
    requests in flight per replica and placement adds the other sidecars' fresh share to the scraped state."""

    enabled: bool = True              # share in-flight load through the budgets' Redis (only with
                                      # budgets.store.kind: redis; memory store: nothing to share with)
    interval_s: float = 0.1           # seconds between two publish-and-read round trips to Redis (never per
                                      # request); shorter than the scrape interval, or the view adds little. The
                                      # view's age is the window in which two gateways can both take a replica's
                                      # last place: in PG, 0.02 preempted 7 times over six seeds against 27, at 5 %
                                      # less SLO goodput and 14 % more sidecar CPU (docs/benchmarks.md)
    stale_after_s: float = 1.0        # another sidecar's report older than this is ignored (it stopped, or lost
                                      # Redis): its load is then seen through scrapes only
    max_backoff_s: float = 5.0        # longest wait between attempts while Redis is unreachable
    take_turns: bool = False          # between two views each sidecar fills only its share of a replica's KV
                                      # headroom, the last places in turn (routing/turns.py): no two gateways take
                                      # the same last place. In PG (six seeds) 5 preemptions against 34, at 13 %
                                      # less SLO goodput and a higher TTFT p95 (docs/benchmarks.md): for pools
                                      # where a preemption costs more than a refusal (long prompts recomputed).
                                      # Read at start

    def validate(self, path: str) -> None:
        positive(self, path, "interval_s", "stale_after_s", "max_backoff_s")
        require(self.interval_s < self.stale_after_s, f"{path}.interval_s", "must be < stale_after_s")
        require(self.max_backoff_s >= self.interval_s, f"{path}.max_backoff_s", "must be >= interval_s")


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """Scraping and health of the replicas."""

    scrape_interval_s: float = 0.2    # seconds between two scrapes of every replica's /metrics (all replicas
                                      # concurrently)
    scrape_timeout_s: float = 1.0     # deadline of one replica's scrape; a timeout counts as a failed scrape. A
                                      # replica that is slow to answer never delays the others' rounds
    stale_after_s: float | None = None  # metrics older than this count as unknown: the replica is treated as
                                        # saturated (`Scraper.is_fresh`). Default (null) 5 x scrape_interval_s
    window_s: float = 10.0            # counters and histograms are differenced over this many seconds: p95 TTFT,
                                      # tokens/s, preemptions
    health: HealthPolicy = field(default_factory=HealthPolicy)  # when a replica is healthy, degraded, ejected or
                                                                 # recovering
    shared_load: SharedLoadPolicy = field(default_factory=SharedLoadPolicy)  # several gateways in front of one
                                                                              # pool see each other's requests in
                                                                              # flight (Redis)

    def __post_init__(self) -> None:
        if self.stale_after_s is None:
            object.__setattr__(self, "stale_after_s", 5.0 * self.scrape_interval_s)

    def validate(self, path: str) -> None:
        positive(self, path, "scrape_interval_s", "scrape_timeout_s", "stale_after_s", "window_s")
        require(self.stale_after_s >= self.scrape_interval_s, f"{path}.stale_after_s",  # type: ignore[operator]
                "must be >= scrape_interval_s")
        require(self.window_s >= 2 * self.scrape_interval_s, f"{path}.window_s",
                "must be at least 2 x scrape_interval_s")
