"""The `routing:` section of the policy file: scraping and health. Every field is documented where it is defined.

`RoutingPolicy.from_dict(d)` takes the parsed mapping under `routing:` (`None` / `{}` = all defaults), rejects
unknown fields and wrong types with a `ValueError` naming the dotted field (`routing.health.min_samples`), and
fills defaults. `score:` is passed through untouched (the placement code parses it).

```yaml
routing:
  scrape_interval_s: 0.2        # how often every replica's /metrics is read
  scrape_timeout_s: 1.0         # one scrape's deadline (a slow replica never delays the others)
  stale_after_s: null           # null = 5 x scrape_interval_s; older metrics count as saturated/unknown
  window_s: 10.0                # windowed TTFT p95, tokens/s, preemptions are computed over this many seconds
  health:
    enabled: true
    ttft_p95_degraded_s: 15.0
    min_samples: 10
    tps_floor_per_request: 2.0
    tps_min_busy: 1.0
    tps_min_span_s: 3.0
    error_rate_degraded: 0.2
    error_min_samples: 10
    error_window_s: 10.0
    scrape_failures_degraded: 2
    scrape_failures_ejected: 5
    degraded_weight: 0.25
    eject_after_s: 20.0
    recover_after_s: 10.0
    ejected_min_s: 10.0
    probe_interval_s: 5.0
    probe_min_samples: 1
    slow_start_steps: [0.1, 0.3, 0.5, 1.0]
    slow_start_step_s: 5.0
    slow_start_healthy_factor: 0.8
    relapse_factor: 1.0
    fallback_weight: 0.1
  score: {}                     # passed through to the placement code as is
```
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """When a replica is healthy, degraded, ejected or recovering (see health.py for the state machine).

    Fields:
      enabled: false freezes every replica in its current state (weight untouched): health from business
        signals off.
      ttft_p95_degraded_s: windowed p95 time to first token above this -> DEGRADED (PROBLEMS.md P8: 15 s).
      min_samples: first tokens the window must hold before its p95 may degrade a HEALTHY replica (a p95 of 2
        samples says nothing).
      tps_floor_per_request: generated tokens/s per running request (window mean of running) below this while
        requests are in the engine -> DEGRADED ("TPS fell from 50 to 3", or a hang: 0).
      tps_min_busy: the window's mean requests in the engine (running + waiting) needed before the TPS floor
        is judged (an idle or nearly idle replica generates nothing and is fine).
      tps_min_span_s: seconds of scrape history the window must span before the TPS floor is judged (right after
        start or a restart the rate is noise).
      error_rate_degraded: share of failed + timed-out requests (Envoy access log outcomes; cancelled ones are
        the client's doing and not counted) over `error_window_s` above this -> DEGRADED.
      error_min_samples: finished requests the error window must hold before the rate is judged.
      error_window_s: the error-rate window, seconds.
      scrape_failures_degraded: consecutive failed scrapes that make a replica DEGRADED ("unreachable").
      scrape_failures_ejected: consecutive failed scrapes that EJECT it. Once it answers again it enters
        RECOVERING (slow start, P6).
      degraded_weight: `Replica.weight` while DEGRADED.
      eject_after_s: a DEGRADED replica whose signals are still bad this long after it was degraded is EJECTED.
      recover_after_s: a DEGRADED replica whose signals stayed good this long returns to HEALTHY.
      ejected_min_s: least time in EJECTED (for business signals) before good signals may start RECOVERING.
        A replica ejected as unreachable recovers as soon as it answers a scrape.
      probe_interval_s: an EJECTED (reachable) replica gets at most one probe request per this many seconds
        (`HealthTracker.allow_probe`).
      probe_min_samples: first tokens (and finished requests) enough to judge an EJECTED or RECOVERING replica,
        whose traffic is deliberately small.
      slow_start_steps: weights of RECOVERING, strictly increasing in (0, 1]; the replica starts at the first
        and advances one step per `slow_start_step_s`; past the last step (or on reaching 1.0) it is HEALTHY.
      slow_start_step_s: seconds of healthy TTFT needed per step (the timer restarts when TTFT is not healthy).
      slow_start_healthy_factor: during slow start TTFT is healthy when p95 <= this x ttft_p95_degraded_s
        (or too few samples to say); between that and the relapse bar the step is held.
      relapse_factor: a RECOVERING replica whose p95 TTFT exceeds relapse_factor x ttft_p95_degraded_s (or that
        collapses in TPS, errors or stops answering) falls back to EJECTED.
      fallback_weight: weight given to the best ejected replica when every replica of the pool is degraded or
        ejected (never zero capacity while a replica still answers).
    """

    enabled: bool = True
    ttft_p95_degraded_s: float = 15.0
    min_samples: int = 10
    tps_floor_per_request: float = 2.0
    tps_min_busy: float = 1.0
    tps_min_span_s: float = 3.0
    error_rate_degraded: float = 0.2
    error_min_samples: int = 10
    error_window_s: float = 10.0
    scrape_failures_degraded: int = 2
    scrape_failures_ejected: int = 5
    degraded_weight: float = 0.25
    eject_after_s: float = 20.0
    recover_after_s: float = 10.0
    ejected_min_s: float = 10.0
    probe_interval_s: float = 5.0
    probe_min_samples: int = 1
    slow_start_steps: tuple[float, ...] = (0.1, 0.3, 0.5, 1.0)
    slow_start_step_s: float = 5.0
    slow_start_healthy_factor: float = 0.8
    relapse_factor: float = 1.0
    fallback_weight: float = 0.1

    @classmethod
    def from_dict(cls, d: Any, path: str = "routing.health") -> "HealthPolicy":
        kw = _fields(cls, d, path)
        if "slow_start_steps" in kw:
            steps = kw["slow_start_steps"]
            if not isinstance(steps, (list, tuple)) or not steps:
                raise ValueError(f"{path}.slow_start_steps must be a non-empty list of weights")
            kw["slow_start_steps"] = tuple(_number(v, f"{path}.slow_start_steps[{i}]") for i, v in enumerate(steps))
        p = cls(**kw)
        p._validate(path)
        return p

    def _validate(self, path: str) -> None:
        _positive(self, path, "ttft_p95_degraded_s", "tps_min_busy", "error_window_s", "eject_after_s",
                  "recover_after_s", "probe_interval_s", "slow_start_step_s", "slow_start_healthy_factor",
                  "relapse_factor")
        _non_negative(self, path, "tps_floor_per_request", "tps_min_span_s", "ejected_min_s")
        for name in ("min_samples", "error_min_samples", "probe_min_samples", "scrape_failures_degraded"):
            if getattr(self, name) < 1:
                raise ValueError(f"{path}.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.scrape_failures_ejected < self.scrape_failures_degraded:
            raise ValueError(f"{path}.scrape_failures_ejected must be >= scrape_failures_degraded")
        if not 0.0 < self.error_rate_degraded <= 1.0:
            raise ValueError(f"{path}.error_rate_degraded must be in (0, 1], got {self.error_rate_degraded!r}")
        for name in ("degraded_weight", "fallback_weight"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{path}.{name} must be in (0, 1], got {getattr(self, name)!r}")
        prev = 0.0
        for i, w in enumerate(self.slow_start_steps):
            if not prev < w <= 1.0:
                raise ValueError(f"{path}.slow_start_steps[{i}] must be in (0, 1] and above the previous step, "
                                 f"got {w!r}")
            prev = w


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """Scraping and health of the replicas.

    Fields:
      scrape_interval_s: seconds between two scrapes of every replica's /metrics (all replicas concurrently).
      scrape_timeout_s: deadline of one replica's scrape; a timeout counts as a failed scrape. A replica that is
        slow to answer never delays the others' rounds.
      stale_after_s: metrics older than this count as unknown: the replica is treated as saturated
        (`Scraper.is_fresh`). Default (null) 5 x scrape_interval_s.
      window_s: counters and histograms are differenced over this many seconds: p95 TTFT, tokens/s, preemptions.
      health: see HealthPolicy.
      score: the placement scorer's settings, passed through untouched.
    """

    scrape_interval_s: float = 0.2
    scrape_timeout_s: float = 1.0
    stale_after_s: float | None = None
    window_s: float = 10.0
    health: HealthPolicy = field(default_factory=HealthPolicy)
    score: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stale_after_s is None:
            object.__setattr__(self, "stale_after_s", 5.0 * self.scrape_interval_s)

    @classmethod
    def from_dict(cls, d: Any, path: str = "routing") -> "RoutingPolicy":
        kw = _fields(cls, d, path, nested=("health", "score"))
        if "health" in kw:
            kw["health"] = HealthPolicy.from_dict(kw["health"], f"{path}.health")
        if "score" in kw:
            score = kw["score"]
            if score is None:
                score = {}
            if not isinstance(score, dict):
                raise ValueError(f"{path}.score must be a mapping, got {type(score).__name__}")
            kw["score"] = dict(score)
        p = cls(**kw)
        p._validate(path)
        return p

    def _validate(self, path: str) -> None:
        _positive(self, path, "scrape_interval_s", "scrape_timeout_s", "stale_after_s", "window_s")
        if self.stale_after_s < self.scrape_interval_s:  # type: ignore[operator]
            raise ValueError(f"{path}.stale_after_s must be >= scrape_interval_s")
        if self.window_s < 2 * self.scrape_interval_s:
            raise ValueError(f"{path}.window_s must be at least 2 x scrape_interval_s")


# ---- helpers -------------------------------------------------------------------------------------------------

def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where} must be a number, got {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"{where} must be finite, got {v!r}")
    return float(v)


def _fields(cls: type, d: Any, path: str, nested: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check a mapping against a flat dataclass: unknown keys and scalar types, named by dotted path."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ValueError(f"{path} must be a mapping, got {type(d).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in d.items():
        f = known.get(key)
        if f is None:
            raise ValueError(f"{path}.{key}: unknown field (known: {', '.join(sorted(known))})")
        where = f"{path}.{key}"
        default = f.default if f.default is not dataclasses.MISSING else None
        if key in nested or key == "slow_start_steps":
            out[key] = value
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{where} must be true or false, got {value!r}")
            out[key] = value
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where} must be an integer, got {value!r}")
            out[key] = value
        elif isinstance(default, float) or (default is None and key.endswith("_s")):
            if value is None and default is None:
                out[key] = None
            else:
                out[key] = _number(value, where)
        else:  # pragma: no cover - every field is one of the above
            out[key] = value
    return out


def _positive(obj: Any, path: str, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not v > 0:
            raise ValueError(f"{path}.{name} must be > 0, got {v!r}")


def _non_negative(obj: Any, path: str, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if v < 0:
            raise ValueError(f"{path}.{name} must be >= 0, got {v!r}")
