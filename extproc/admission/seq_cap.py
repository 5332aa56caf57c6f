"""How many requests each engine runs at once (vLLM's `max_num_seqs`), learned from what it shows (P12).

A fixed per-replica concurrency limit is wrong for most engines: 64 held P12's replicas, which run 4,096
sequences each, to 128 streams while the baselines kept 800-1,000 flowing. vLLM does not export
`max_num_seqs` (`vllm:cache_config_info` carries the KV cache's configuration only), but an engine at its cap
shows it: requests wait while the running count sits at the same value, with KV to spare (with KV full, or a
step's token budget spent on other prefills, requests wait at varying running counts).

    cap = N   once CONFIRM consecutive scrapes showed waiting > 0, running == N, KV usage < KV_FREE
    cap = 0   (unknown) again when the engine runs more than N: it was not the cap (an engine restarted with
              another configuration, or waits that had another cause)

The placer (placement.py `_over_concurrency`) uses it: with the cap known, a replica is full when running +
waiting + placed since the scrape reaches cap x health weight + max_waiting_per_replica (requests beyond it
would wait in the engine, where they cannot move to another replica); unknown, placements may at most double
what the engine showed at its last scrape (plus PROBE_BASE), per scrape interval, so the cap shows within a few
scrapes before a burst can pile hundreds of requests into one engine's queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.routing.pool import Replica

CONFIRM = 3      # consecutive saturated scrapes at the same running count that make it the cap
KV_FREE = 0.8    # KV usage under which waiting requests are waiting for a sequence slot, not for blocks


@dataclass(slots=True)
class _Seen:
    at: float = 0.0       # scraped_at of the last scrape taken
    candidate: int = 0    # running count of the current run of saturated scrapes
    hits: int = 0         # how many consecutive saturated scrapes showed it


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
            if r.max_num_seqs and e.running > r.max_num_seqs:
                r.max_num_seqs = 0  # ran more than the learned cap: it was not the cap
            if e.waiting > 0 and e.running > 0 and e.kv_usage < KV_FREE:
                if e.running == s.candidate:
                    s.hits += 1
                else:
                    s.candidate, s.hits = e.running, 1
                if s.hits >= CONFIRM and e.running >= r.max_num_seqs:
                    r.max_num_seqs = e.running
            else:
                s.hits = 0
