"""How many requests each engine runs at once (vLLM's `max_num_seqs`), learned from what it shows (P12).

A fixed per-replica concurrency limit is wrong for most engines: 64 held P12's replicas, which run 4,096
sequences each, to 128 streams while the baselines kept 800-1,000 flowing. vLLM does not export
`max_num_seqs` (`vllm:cache_config_info` carries the KV cache's configuration only), but an engine at its cap
shows it: requests wait while the running count sits at the same value, with KV to spare, and each request that
finishes is replaced by a waiting one, so requests keep starting (first tokens keep coming) at that same count.

A scrape is saturated at N when it shows waiting > 0, running == N, KV usage < KV_FREE and, with the KV
capacity known, free KV ((1 - usage) x capacity) of at least the mean prompt this sidecar placed there (a
waiting request that does not fit waits for blocks, not for a slot). It is evidence when, in addition, the
engine started requests since the last evidence (`first_tokens_total` rose; every scrape counts when the engine
does not export it):

    cap = N   once CONFIRM saturated scrapes at the same N were evidence, with no unsaturated scrape between
              them, and N is at least the peak running count seen since the engine (re)started
    cap = 0   (unknown) again when the engine runs more than N: it was not the cap (an engine restarted with
              another configuration, or waits that had another cause)

Why the progress rule: a long chunked prefill holds the engine in one step for up to a second (a 2,048-token
chunk over a 4,000-token prefix: 0.9 s on tiny-cpu), while the page is scraped every 100-250 ms. Scrapes within
one step show the same running count with requests waiting for the step's token budget, not for a slot; read
as evidence, they taught PX's replicas caps of 3-10 against a real 64. Why the peak rule: an engine never runs
more than its cap, so a count below what it already ran is not one.
An engine full of streams that do not end (no request starts) teaches no cap: its waiting count then stops
placement there (placement.py's engine-queue limit, max_waiting_per_replica), as for any replica.

The placer (placement.py `_over_concurrency`) uses it: with the cap known, a replica is full when running +
waiting + placed since the scrape reaches cap x health weight + max_waiting_per_replica (requests beyond it
would wait in the engine, where they cannot move to another replica); unknown, placements may at most double
what the engine showed at its last scrape (plus PROBE_BASE), per scrape interval, so the cap shows within a few
scrapes before a burst can pile hundreds of requests into one engine's queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.routing.pool import EngineState, Replica

CONFIRM = 3      # saturated scrapes at the same running count, each after requests started, that make it the cap
KV_FREE = 0.8    # KV usage under which waiting requests are waiting for a sequence slot, not for blocks


@dataclass(slots=True)
class _Seen:
    at: float = 0.0       # scraped_at of the last scrape taken
    candidate: int = 0    # running count of the current run of saturated scrapes
    hits: int = 0         # how many of them were evidence (requests started since the previous one)
    firsts: float = -1.0  # first_tokens_total at the last evidence (-1: none yet)
    peak: int = 0         # the highest running count seen since the engine (re)started


def kv_room(r: Replica, e: EngineState) -> bool:
    """Whether a waiting request fits in the free KV: usage < KV_FREE and, with the capacity known,
    (1 - usage) x capacity >= the mean prompt placed on `r` (placed_prompt_total / placed_requests_total)."""
    if e.kv_usage >= KV_FREE:
        return False
    cap = e.kv_capacity_tokens or r.kv_capacity_tokens
    if cap <= 0 or r.placed_requests_total <= 0:
        return True
    return (1.0 - e.kv_usage) * cap >= r.placed_prompt_total / r.placed_requests_total


class SeqCap:
    """Per pool. `update` after every scrape round writes each replica's `max_num_seqs` (0: not known)."""

    def __init__(self) -> None:
        self.seen: dict[str, _Seen] = {}

    def update(self, replicas: list[Replica]) -> None:
        for r in replicas:
            s = self.seen.get(r.address)
            if s is None:
                s = self.seen[r.address] = _Seen()
            e = r.engine
            if e.scraped_at <= s.at:
                continue
            s.at = e.scraped_at
            self._observe(r, s, e)

    @staticmethod
    def _observe(r: Replica, s: _Seen, e: EngineState) -> None:
        """One new scrape of `r` (see the module docstring for the rule)."""
        if getattr(e, "restarted", False):
            s.peak, s.hits, s.firsts = 0, 0, -1.0
        if r.max_num_seqs and e.running > r.max_num_seqs:
            r.max_num_seqs = 0  # ran more than the learned cap: it was not the cap
        s.peak = max(s.peak, e.running)
        if not (e.waiting > 0 and e.running > 0 and kv_room(r, e)):
            s.hits = 0
            return
        firsts = float(getattr(e, "first_tokens_total", -1.0))
        if e.running != s.candidate:
            s.candidate, s.hits, s.firsts = e.running, 0, -1.0
        if firsts >= 0 and s.firsts >= 0 and firsts <= s.firsts:
            return  # nothing started since the last evidence: the same engine step, or one as stuck
        s.hits += 1
        s.firsts = firsts
        if s.hits >= CONFIRM and e.running >= s.peak and e.running >= r.max_num_seqs:
            r.max_num_seqs = e.running
