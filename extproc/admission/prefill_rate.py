"""How fast the replicas really prefill, learned from their own counters (P1).

The placer's prefill-backlog gate admits prompt tokens at `prefill_tokens_per_s` per replica. A fixed value is
wrong for most prompt mixes: prefill cost per token grows with the prompt (attention), so one speed is
pessimistic for short prompts and optimistic for long ones. Too pessimistic, and the gate starves the replicas
during a burst while the sidecar sheds work they could have done in time (measured in P1: the pool took 22 of
its ~70 requests/s). This module measures the speed instead.

A measurement is the engine's prompt-token counter, less its prefix-cache hits (tokens found cached are not
computed, and the placer charges only the uncached part of a prompt), in prefill work (placement.py `prefill_work`:
each token weighted by its position in the context, as attention costs), over one scrape interval that began with a
non-empty engine waiting queue, so the engine was prefilling as fast as it could. If the queue was still non-empty
at the end, the interval's rate is the engine's speed (averaged in); if it had drained, the rate is only a lower
bound (it can raise the estimate, never lower it). Lower bounds matter: the gate itself keeps the engines' queues
short, so with a pessimistic speed an engine is saturated only for a moment at the start of a burst, and that
moment must be enough to open the gate. An interval without any engine queue says only how much work was sent; but
if the engine kept up with nearly the speed the gate assumes and still queued nothing, the gate is what limits it:
the estimate is probed upwards (x PROBE per scrape) until a queue forms and a real measurement takes over.
Completed prompts are counted in one lump, so no single scrape may raise a replica's estimate by more than MAX_STEP
(a long prompt finishing inside a short interval is not a speed).

A second lower bound needs no queue at all: vLLM records, for each request it finishes, the seconds from its first
scheduling to its first token (`vllm:request_prefill_time_seconds`) and the prompt tokens it computed
(`vllm:request_prefill_kv_computed_tokens`, cache hits excluded). Over the requests finished in one scrape interval:

    finished speed = n x prefill_work(computed / n) / prefill seconds

(n requests, their computed tokens and prefill seconds: the deltas of the histograms' _count and _sum). Each request
had at most the whole engine for its prefill (it shared it with the other requests' prefills and decodes), so its
own work over its own prefill time is at most the engine's speed; the work of the mean prompt is at most the mean
work (prefill work is convex in the prompt) and charging the computed tokens from position 0 is at most their cost
after a cached prefix. At light load (the real engines in P7 and PX never queue) this is the only measurement there
is: without it the gate stayed at the configured 10,000 work/s, where the bound reads 15,000-25,000 on the real
engines (PX, docs/benchmarks.md). It can raise the estimate (or hold a saturated measurement above it), never lower
it; MAX_STEP applies.

Speed per token falls as prompts grow (attention is quadratic), so a speed learned on short prompts would let long ones
in too fast (measured in P2: learned on 2,000-token prompts, applied to 25,000-token ones). So the speed is measured in
work, not tokens: the tokens computed in the interval x the work per uncached token of this sidecar's requests in flight
on the replica (`inflight_prefill_work / inflight_prefill_new`), and the placer charges each prompt its own work. A
measurement speaks for the largest lane in flight on the replica during its interval (at the scrape that opened it or
the one that closed it: a finished request's prefill time is read after it left). While the replica runs a request of a
larger lane than its latest measurement's (a long prompt among short ones), the latest speed each replica that paces the
pool (below), itself included, showed with that lane or a larger one in flight stands, if slower, and the configured
speed when none did. Each replica keeps its latest measurement per lane for this: a later one among smaller prompts
replaces its speed, not what it showed with a long prompt in flight (when only the latest counted, the real engines'
PX went back to the configured 10,000 work/s for 1-2 s at a time, against the 22,000-35,000 they had shown, and the
gate shed cold prompts they would have served in time; docs/benchmarks.md, "A lane keeps its measured speed").
Nothing is measured from the prompt counter while a request of the last lane (the long prompts) was in flight
in the interval: its prompt is counted in one lump when its prefill ends, seconds later, and would read as a burst of
speed (measured in P2). The placer uses one speed for the pool, so the pool's is the slowest healthy replica's: the
cautious choice when one replica holds a long prompt and the others do not (that is its lane rule, above). A replica
whose learned speed is under 1 / OUTLIER of the median of its healthy peers' is left out of that minimum: it is sick,
not slow because of its prompts, and health takes it out (P8). Each replica keeps an EWMA of its measurements that
relaxes back to the configured speed when no new one comes (the prompt mix may have changed), and it stays within a
factor of the configured value so a bogus counter cannot open or close the gate entirely. Only HEALTHY and RECOVERING
replicas are measured (a sick one's speed is health's business) and only HEALTHY ones at full weight set the pool's
speed; when none is (every replica back from an outage at once, P6) the recovering ones' speeds do. A replica keeps what
it learned through an outage: the engine that comes back runs on the same hardware, and forgetting it put the gate back
at the configured 10,000 tokens/s against ~25,000 real while the backlog of the outage waited (P6: 2,350 prefill_backlog
refusals with the replicas' KV near 5 %); slow start (health.py) backs off if it comes back slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from extproc.routing.pool import HEALTHY, RECOVERING, Replica

MIN_SPAN_S = 0.05     # shorter scrape intervals are too noisy to measure a rate over
ALPHA = 0.5           # weight of a new measurement: a burst lasts about a second, the estimate must follow it
RELAX_S = 30.0        # time constant back to the configured speed without new measurements
BOUND = 4.0           # the learned speed stays within [configured / BOUND, configured x BOUND]
PROBE = 1.15          # upward probe per scrape while the engine keeps up with the gate without a queue
KEEP_UP = 0.8         # ... "keeps up": it prefilled at least this share of the assumed speed
MAX_STEP = 1.5        # no scrape raises an estimate by more than this factor
OUTLIER = 3.0         # a healthy replica learned this many times slower than the median of its peers does not
                      # pace the pool (the factor by which health judges a replica's TTFT against its peers)
T = TypeVar("T")  # what `_without_outliers` carries along with each rate


@dataclass(slots=True)
class _Seen:
    """One replica: its previous scrape and its learned speed."""

    at: float = 0.0            # scraped_at of the previous scrape
    total: float = -1.0        # prompt tokens counter then (-1: none)
    hits: float = -1.0         # prefix-cache hits counter then (-1: none)
    waiting: int = 0           # engine waiting queue then
    rate: float = 0.0          # learned prefill work/s (0: never measured)
    measured_at: float = 0.0
    lane: int = -1             # largest lane with a request in flight on the replica when measured
    by_lane: dict[int, tuple[float, float]] = field(default_factory=dict)  # per such lane, its latest measurement
                                                                            # (rate, measured_at)
    top: int = -1              # largest lane in flight on it at the previous scrape
    prefill_s: float = -1.0    # the engine's finished requests then: their prefill seconds (-1: not exported),
    prefilled: float = -1.0    # their number ...
    computed: float = -1.0     # ... and the prompt tokens they computed


class PrefillRate:
    """Per pool. `update` after every scrape round; `current` is the speed the placer should use."""

    def __init__(self, prior: float, long_lane: int = 1 << 30,
                 work: Callable[[float], float] | None = None) -> None:
        self.prior = prior
        self.long_lane = long_lane  # no counter measurement while a request of this lane (or above) is in flight
        self.work = work or float   # prefill work of a cold prompt of n tokens (placement.py `prefill_work`)
        self.seen: dict[str, _Seen] = {}
        self._pacers: list[_Seen] = []  # the replicas that pace the pool at the latest update (`_speed_of_lane`)

    def update(self, replicas: list[Replica], now: float) -> float:
        """Take the new scrapes' measurements; return the pool's prefill speed (work per second) now: the slowest
        `_speed` of the pacing replicas, the HEALTHY ones at full weight less the outliers (`_without_outliers`),
        else the RECOVERING ones, else the configured speed."""
        healthy: list[tuple[float, tuple[_Seen, Replica]]] = []
        recovering: list[tuple[float, tuple[_Seen, Replica]]] = []
        for r in replicas:
            s = self.seen.get(r.address)
            if s is None:
                s = self.seen[r.address] = _Seen()
            self._observe(s, r, learn=r.state == HEALTHY or r.state == RECOVERING)
            if r.state == HEALTHY and r.weight >= 1.0:
                healthy.append((self._relaxed(s, now), (s, r)))
            elif r.state == RECOVERING:
                recovering.append((0.0, (s, r)))
        pacers = [seen for _, seen in _without_outliers(healthy) or recovering]
        self._pacers = [s for s, _ in pacers]
        return min((self._speed(s, r, now) for s, r in pacers), default=self.prior)

    def _speed(self, s: _Seen, r: Replica, now: float) -> float:
        if not _lane_unseen(s, r):
            return self._relaxed(s, now)
        return min(self._relaxed(s, now), self._speed_of_lane(_top_lane(r), now))

    def _speed_of_lane(self, lane: int, now: float) -> float:
        """The slowest speed of the pacing replicas (`update`) measured while a request of `lane` or larger was in
        flight (the pool's replicas run on like hardware: the placer paces them with one speed); the configured one
        when none was. A replica that left the pool, fell sick or is slow-starting paces no lane: its speed is
        health's business, as in the pool's own pace."""
        measured = [self._lane_rate(p, lane, now) for p in self._pacers]
        known = [rate for rate in measured if rate > 0]
        return min(known) if known else self.prior

    def _lane_rate(self, s: _Seen, lane: int, now: float) -> float:
        """The replica's latest speed measured while a request of `lane` or larger was in flight, relaxed as its
        own (0: none). Kept per lane: a later measurement among smaller prompts replaces the replica's speed, not
        what it showed with a long prompt in flight."""
        seen = [v for k, v in s.by_lane.items() if k >= lane]
        if not seen:
            return 0.0
        rate, at = max(seen, key=lambda v: v[1])
        return self._relax(rate, at, now)

    def _observe(self, s: _Seen, r: Replica, learn: bool = True) -> None:
        e = r.engine
        at = e.scraped_at
        if at <= s.at:
            return  # no new scrape of this replica
        total = getattr(e, "prompt_tokens_total", -1.0)
        hits = getattr(e, "prefix_hits_total", -1.0)
        span = at - s.at
        delta = total - s.total
        if hits >= s.hits >= 0:
            delta -= hits - s.hits  # tokens found in the prefix cache were not computed
        old = self._relaxed(s, at)
        top = _top_lane(r)
        lane = max(top, s.top)  # the largest lane in flight during the interval, as far as the scrapes saw
        new = 0.0
        if (learn and s.total >= 0 and total >= 0 and span >= MIN_SPAN_S and delta > 0
                and lane < self.long_lane):
            meas = delta / span * _work_per_token(r)
            if s.waiting > 0 and e.waiting > 0:  # saturated all along: the engine's speed
                new = (1 - ALPHA) * old + ALPHA * meas
            elif s.waiting > 0:  # drained within the interval: a lower bound
                new = max(old, meas)
            elif e.waiting == 0 and meas >= KEEP_UP * old:  # kept up with the gate, no queue: probe
                new = old * PROBE
        prefill_s = getattr(e, "prefill_seconds_total", -1.0)
        prefilled = getattr(e, "prefilled_requests_total", -1.0)
        computed = getattr(e, "prefill_computed_total", -1.0)
        low = self._finished_speed(s, prefill_s, prefilled, computed) if learn else 0.0
        if low > (new or old):  # the finished requests' speed is a lower bound of the engine's
            new = low
        if new > 0:
            s.rate, s.measured_at = min(new, old * MAX_STEP), at
            s.lane = lane
            s.by_lane[lane] = (s.rate, at)
        s.at, s.total, s.waiting, s.hits, s.top = at, total, e.waiting, hits, top
        s.prefill_s, s.prefilled, s.computed = prefill_s, prefilled, computed

    def _finished_speed(self, s: _Seen, prefill_s: float, prefilled: float, computed: float) -> float:
        """n x prefill_work(computed / n) / prefill seconds over the requests the engine finished since the
        previous scrape (the engine's totals now against `s`'s; 0: none, not exported, or a counter went down)."""
        seconds, n, new = prefill_s - s.prefill_s, prefilled - s.prefilled, computed - s.computed
        if min(s.prefill_s, s.prefilled, s.computed) < 0 or seconds <= 0 or n <= 0 or new <= 0:
            return 0.0
        return n * self.work(new / n) / seconds

    def _relaxed(self, s: _Seen, now: float) -> float:
        if s.rate <= 0:
            return self.prior
        return self._relax(s.rate, s.measured_at, now)

    def _relax(self, rate: float, measured_at: float, now: float) -> float:
        """A measured speed relaxed back to the configured one with time (RELAX_S), within BOUND of it."""
        keep = math.exp(-max(0.0, now - measured_at) / RELAX_S)
        rate = self.prior + (rate - self.prior) * keep
        return min(self.prior * BOUND, max(self.prior / BOUND, rate))



def _without_outliers(rates: list[tuple[float, T]]) -> list[tuple[float, T]]:
    """(learned rate, replica) of the healthy replicas, less those whose learned rate is under 1 / OUTLIER of the
    median of the others': a replica that prefills several times slower than its peers is sick (health degrades it
    within seconds), not the pool's pace. Pacing the pool by it throttled every replica's gate to the sick one's
    speed until then (P8: one engine 20x slower)."""
    if len(rates) < 2:
        return rates
    kept = []
    for i, (rate, item) in enumerate(rates):
        others = sorted(r for j, (r, _) in enumerate(rates) if j != i)
        mid = len(others) // 2
        median = others[mid] if len(others) % 2 else 0.5 * (others[mid - 1] + others[mid])
        if rate * OUTLIER >= median:
            kept.append((rate, item))
    return kept


def _lane_unseen(s: _Seen, r: Replica) -> bool:
    """The replica runs a request of a larger lane than any it ran when its speed was measured: that speed says
    nothing about it (prompt size is in the work unit already; a new lane is a mix never measured)."""
    return s.rate > 0 and _top_lane(r) > s.lane


def _work_per_token(r: Replica) -> float:
    """Prefill work per uncached prompt token of this sidecar's requests in flight on the replica (1: none)."""
    return r.inflight_prefill_work / r.inflight_prefill_new if r.inflight_prefill_new > 0 else 1.0


def _top_lane(r: Replica) -> int:
    for lane in range(len(r.lane_inflight) - 1, -1, -1):
        if r.lane_inflight[lane] > 0:
            return lane
    return -1
