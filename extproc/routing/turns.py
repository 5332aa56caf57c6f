"""The last places on a replica when several gateways share a pool: each sidecar fills only its share of the
headroom its shared view left, and the places that do not divide go to one sidecar at a time
(`routing.shared_load.take_turns`, off by default: the cost is below).

Why: a sidecar sees the others' requests in flight as of its last shared view (shared_load.py), up to
`interval_s` plus a round trip old. Until the next view every sidecar sees the same headroom on a replica and each
may fill all of it: with room for one more long generation, two gateways placed one each (PG: every preemption was
on a replica running ten long generations where the KV held nine, and nine was the admission line). So between
two views:

    headroom   H = KV limit - (committed - own footprints placed here since this sidecar's last view)
    fits       own footprints placed here since the view + the request's footprint F <= max(allowance, free)
    allowance  H / N                                          not this sidecar's turn on the replica
               H - (N - 1) x floor(H / (N x F)) x F           its turn: H less the others' whole places
    free       KV margin / (N - 1)                            what the margin holds if every other sidecar
                                                              placed as much meanwhile
    N          the sidecars with requests in flight in the pool (their reports), this one included

With equal requests the allowances add up to H: room for one long generation goes to the turn's holder alone,
room for four among three gateways is 1 + 1 + 2. A short request fits in `free` (a 332-token chat beside three
gateways' 550 each of an 11,000-token replica's 10 % margin), so it is not held back by the turn; what the others
place under `free` between two views stays within the margin. Sidecars without requests in flight in the pool are
left out of N: a lone active gateway fills the pool at the full rate.

The turn of replica r in period e (TURN_INTERVALS x interval_s, counted on Redis' clock, which every sidecar
reads at each round trip) is the sidecar at index (e + rank of r) mod N of the active ids, sorted (rank: r's place
among the pool's addresses, sorted): in each period each sidecar holds the turn on some replicas when
N <= replicas. A new holder uses its turn only once its view was read TURN_WAIT_INTERVALS x interval_s after the
period began: the previous holder's last placements were published by then (each sidecar publishes once per
interval), so the new holder does not take a last place the previous one took just before the period ended.
A place that frees up waits at most one period (0.4 s at the default interval) for a holder with a request.

The cost (PG at `fb4a061`, six seeds, docs/benchmarks.md "PG's race closed by taking turns"): 5 preemptions
against 34, and 13 % less SLO goodput with a higher TTFT p95, as more of the burst is refused. The overshoot it
removes was serving requests: a preempted generation there recomputes a 400-token prompt and still meets its SLO.
Where a preemption recomputes a long context, the trade may go the other way; no scenario measures that yet.

Bounds: views of different ages differ by what was placed in between, so the shares are not exact: they limit what
a stale view can overcommit to a share of the headroom (plus the KV margin) instead of all of it. Own footprints
count in full (prompt + expected output), an upper bound of what they add to `committed`; ones that ended since
the view count up to what is still in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

TURN_INTERVALS = 4          # a turn lasts this many shared-view intervals ...
TURN_WAIT_INTERVALS = 1.5   # ... and its holder uses it once its view is this many intervals into the turn


@dataclass(slots=True)
class Turns:
    """Whose turn it is on each replica, as of this sidecar's latest shared view (updated by shared_load.py after
    every round trip; plain arithmetic on the hot path)."""

    sidecar_id: str
    interval_s: float = 0.1
    active: dict[str, tuple[str, ...]] = field(default_factory=dict)  # pool -> active sidecar ids, this one's
                                                                       # included, sorted
    view_ms: float = 0.0        # Redis' clock when the latest view was read (ms)
    view_mono: float = 0.0      # time.monotonic() when it arrived

    def update(self, redis_ms: float, active: dict[str, set[str]], mono: float | None = None) -> None:
        """A new view, read at `redis_ms` on Redis' clock: `active` the other sidecars with requests in flight,
        per pool."""
        self.view_ms = redis_ms
        self.view_mono = time.monotonic() if mono is None else mono
        self.active = {pool: tuple(sorted(ids | {self.sidecar_id})) for pool, ids in active.items() if ids}

    def clear(self) -> None:
        """No shared view (Redis lost): this sidecar places alone, as without one."""
        self.active = {}

    def gateways(self, pool: str) -> int:
        """N: the sidecars placing in `pool`, this one included (1 without a shared view)."""
        ids = self.active.get(pool)
        return len(ids) if ids else 1

    def holds_turn(self, pool: str, rank: int, mono: float) -> bool:
        """Whether this sidecar may take the places that do not divide on the replica of `rank` (its place among
        the pool's addresses, sorted), at time.monotonic() `mono`."""
        ids = self.active.get(pool)
        if not ids:
            return True
        period_ms = TURN_INTERVALS * self.interval_s * 1000.0
        now_ms = self.view_ms + (mono - self.view_mono) * 1000.0
        period = int(now_ms // period_ms)
        if self.view_ms < period * period_ms + TURN_WAIT_INTERVALS * self.interval_s * 1000.0:
            return False  # the view may not show the previous holder's last placements yet
        return ids[(period + rank) % len(ids)] == self.sidecar_id

    def turn_wait_s(self, pool: str) -> float:
        """The longest wait for this sidecar's turn on one replica: N periods, plus the wait into the last."""
        n = self.gateways(pool)
        return 0.0 if n <= 1 else (n * TURN_INTERVALS + TURN_WAIT_INTERVALS) * self.interval_s

    def allowance(self, pool: str, rank: int, headroom: float, footprint: float, mono: float,
                  margin: float = 0.0) -> float:
        """How much of `headroom` (KV tokens) this sidecar may fill on the replica of `rank` until its next view,
        `margin` the replica's KV margin (formula above: max(allowance, free))."""
        n = self.gateways(pool)
        if n <= 1:
            return headroom
        free = margin / (n - 1)
        if not self.holds_turn(pool, rank, mono):
            return max(headroom / n, free)
        whole = int(headroom // (n * footprint)) if footprint > 0 else 0
        return max(headroom - (n - 1) * whole * footprint, free)
