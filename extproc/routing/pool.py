"""Replicas of one model: what the sidecar knows about each (scraped engine state, its own placements, health)
and the pool-level view admission reads.

Four sources meet in `Replica`:
- the scraper (`scrape.py`) writes the engine's own numbers (KV usage, running, waiting, TTFT...) every
  100-250 ms;
- this sidecar's accounting (`place` / `release`) is exact and immediate, so between scrapes the sidecar adds
  its own placements to the last scraped state (P7, P9);
- the other sidecars' requests in flight, when several gateways share them through Redis (`shared_load.py`,
  copied here by `note_shared`);
- the health tracker (`health.py`) sets `state` and `weight` from business signals (P6, P8).

A pool's replica set changes at run time when replicas are found by name (extproc/discovery): `add_replica`,
`retire_replica` (no new requests; the ones in flight finish) and `sweep_retired` (gone once nothing is in
flight on it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from extproc.config import PoolConfig
from extproc.routing.saturation import SaturatedRate

# Health states (see health.py for the transitions).
HEALTHY, DEGRADED, EJECTED, RECOVERING = "healthy", "degraded", "ejected", "recovering"


@dataclass(slots=True, eq=False)
class EngineState:
    """The replica's own numbers from its last scrape (vLLM / SGLang names mapped in scrape.py)."""

    scraped_at: float = 0.0             # time.monotonic() of the last successful scrape; 0 = never
    kv_usage: float = 0.0               # 0..1 fraction of KV blocks in use
    running: int = 0
    waiting: int = 0
    preemptions_total: float = 0.0
    kv_capacity_tokens: int = 0         # from vllm:cache_config_info (blocks x block size), 0 = unknown
    kv_block_tokens: int = 0            # its block_size: prefixes are shared in whole blocks; 0 = unknown
    ttft_p95_s: float = 0.0             # over the recent window (histogram bucket deltas)
    ttft_count_window: float = 0.0      # how many first tokens that window held
    generation_tps: float = 0.0         # tokens/s generated over the recent window
    prompt_tps: float = 0.0             # prompt tokens/s processed over the recent window
    errors_total: float = 0.0           # scraped failures (finished_reason=error/abort), if exported
    scrape_failures: int = 0           # consecutive failed scrapes
    scrape_timeouts: int = 0           # of those, the ones that timed out (busy or dead: health.py tells which)
    window_span_s: float = 0.0          # how much history the windowed values cover
    running_avg: float = 0.0            # mean running requests over the window
    waiting_avg: float = 0.0            # mean waiting requests over the window
    preemptions_window: float = 0.0     # preemptions within the window (P9)
    prefix_hit_rate: float = 0.0        # prefix-cache hit share within the window
    restarted: bool = False             # counters went down: the engine restarted (recovery -> slow start)


@dataclass(slots=True, eq=False)
class Replica:
    """One serving endpoint. `address` is the exact "ip:port" Envoy knows the host by (override_host)."""

    address: str
    pool: str
    kv_capacity_tokens: int = 0         # policy value or scraped; 0 = unknown (KV headroom not enforced)
    kv_block_tokens: int = 0            # scraped KV block size; 0 = unknown (a prefix is shared to the token,
                                        # as SGLang's radix cache does)
    max_num_seqs: int = 0               # the engine's cap on requests it runs at once, learned by admission
                                        # (admission/seq_cap.py); 0 = not known
    # this sidecar's own accounting, exact
    inflight_requests: int = 0
    inflight_tokens: int = 0            # footprints (prompt + expected output) of this sidecar's requests in flight
    inflight_prompt_tokens: int = 0
    placed_prompt_total: int = 0        # estimated prompt tokens ever placed here ...
    placed_requests_total: int = 0      # ... in this many requests (token calibration)
    placed_since_scrape_tokens: int = 0
    placed_since_scrape_prompt_tokens: int = 0
    placed_since_scrape_requests: int = 0
    # this sidecar's requests placed here that the engine has not answered yet (no response headers): an engine's
    # API server takes them in (parse, template, tokenize) before its scheduler counts them, so a scrape can miss
    # them; see `on_scrape`
    awaiting_requests: int = 0
    awaiting_tokens: int = 0
    awaiting_prompt_tokens: int = 0
    unseen_requests: int = 0            # of those, the ones the last scrape could not have counted (`on_scrape`),
    unseen_tokens: int = 0              # with their footprints and prompts (an average awaiting request's each),
    unseen_prompt_tokens: int = 0       # counted in the since-scrape counters until they end or the next scrape
    placed_in_epoch_requests: int = 0   # placements since the scrape, finished ones included ...
    placed_last_epoch_requests: int = 0  # ... and recently: the last interval's, or half the value before it if
                                         # more (the unknown-cap probe, placement.py `_over_concurrency`)
    scrape_epoch: int = 0               # increments as each scrape is sent: a placement's epoch tells whether a
                                        # scrape could have seen it
    counted_epoch: int = 0              # the epoch the last successful scrape was sent in: placements of this epoch
                                        # or later are in the since-scrape counters
    scrape_asked_at: float = 0.0        # time.monotonic() when the engine's page in force was asked for (its
                                        # placements before it are the ones the page can count)
    scrape_asking_since: float = 0.0    # ... and when the scrape in flight was
    scrape_in_flight: bool = False      # a scrape was sent and has not been read yet ...
    sent_since_requests: int = 0        # ... and this sidecar's requests placed here since it was sent, in flight,
    sent_since_tokens: int = 0          # with their footprints and prompts: the page cannot have counted them all,
    sent_since_prompt_tokens: int = 0   # and they are new placements, not requests the engine is slow to count
    inflight_prefill_new: float = 0.0   # uncached prompt tokens of this sidecar's requests in flight, and their
    inflight_prefill_work: float = 0.0  # prefill work (placement.py `prefill_work`): work per token computed here
    placed_work_total: float = 0.0      # prefill work ever placed here by this sidecar (a request's `work_mark`)
    prefill_backlog: float = 0.0        # prefill work placed (placement.py `prefill_work`) and not yet prefilled ...
    prefill_at: float = 0.0             # ... as of this time.monotonic(); decays at the prefill rate
    lane_inflight: list[int] = field(default_factory=list)  # this sidecar's requests in flight, per lane
    # per lane: time.monotonic() until which the prompts of that lane placed here are predicted to be prefilling
    lane_prefill_until: list[float] = field(default_factory=list)
    # per tenant: time.monotonic() until which its prompts placed here are predicted to be prefilling (fair share
    # of prefill across tenants; pruned of ended entries by the placer)
    tenant_prefill_until: dict[str, float] = field(default_factory=dict)
    served_total: int = 0
    errors_total: int = 0
    busy_prompt_tps: float = 0.0        # prompt tokens/s its engine showed the last time it was busy (capacity.py:
                                        # the offered load, a lower bound until `saturated` has measured)
    saturated: SaturatedRate = field(default_factory=SaturatedRate)  # prefill throughput with a queue (saturation.py)
    # engine state and health
    engine: EngineState = field(default_factory=EngineState)
    state: str = HEALTHY
    weight: float = 1.0                 # share of normal capacity this replica may take (slow start)
    draining: bool = False              # operator drain: no new traffic
    retired: bool = False               # gone from discovery: draining until its requests in flight finish, then
                                        # removed from the pool (`Pool.sweep_retired`)
    # the other sidecars' requests in flight here (several gateways sharing through Redis; 0 without)
    shared_tokens: int = 0
    shared_requests: int = 0
    shared_at_scrape: int = 0           # others' in-flight tokens when this replica was last scraped
    shared_prompt_tokens: int = 0       # the prompts within shared_tokens (their footprints less expected output)
    shared_prompt_at_scrape: int = 0    # ... when this replica was last scraped
    shared_growth: float = 0.0          # output the others' requests here are still expected to decode
                                        # (admission/kv_growth.py), as of the latest shared view
    placed_since_view_tokens: int = 0   # footprints this sidecar placed here since that view (turns.py: its share
                                        # of the headroom the view left)
    state_since: float = field(default_factory=time.monotonic)
    state_reason: str = "start"

    def place(self, tokens: int, prompt_tokens: int = 0, shared: int = 0) -> None:
        """`shared`: tokens of its prompt that requests in flight here already hold in the engine's KV (a common
        prefix, whose blocks the engine shares): it adds only the rest to what the engine holds."""
        self.inflight_requests += 1
        self.inflight_tokens += tokens
        self.inflight_prompt_tokens += prompt_tokens
        self.placed_prompt_total += prompt_tokens
        self.placed_requests_total += 1
        self.placed_since_scrape_tokens += tokens - shared
        self.placed_since_scrape_prompt_tokens += prompt_tokens - shared
        self.placed_since_scrape_requests += 1
        self.placed_since_view_tokens += tokens - shared
        self.placed_in_epoch_requests += 1
        self.awaiting_requests += 1
        self.awaiting_tokens += tokens - shared
        self.awaiting_prompt_tokens += prompt_tokens - shared
        if self.scrape_in_flight:
            self.sent_since_requests += 1
            self.sent_since_tokens += tokens - shared
            self.sent_since_prompt_tokens += prompt_tokens - shared

    def answered(self, tokens: int, prompt_tokens: int = 0, shared: int = 0) -> None:
        """The engine answered (response headers) a request placed here: its own numbers count it from now on."""
        self.awaiting_requests -= 1
        self.awaiting_tokens -= tokens - shared
        self.awaiting_prompt_tokens -= prompt_tokens - shared

    def release(self, tokens: int, prompt_tokens: int = 0, epoch: int = -1, shared: int = 0,
                answered: bool = False) -> None:
        """`epoch` is the scrape epoch at placement: a request placed and finished between two scrapes was never
        seen by the engine's numbers, so it leaves the since-scrape counters too (`shared` as placed). `answered`:
        `answered` was called for it (else it leaves the awaiting counters here)."""
        if not answered:
            self.answered(tokens, prompt_tokens, shared)
        self.inflight_requests -= 1
        self.inflight_tokens -= tokens
        self.inflight_prompt_tokens -= prompt_tokens
        self.served_total += 1
        if epoch >= self.counted_epoch:
            self.placed_since_scrape_tokens -= tokens - shared
            self.placed_since_scrape_prompt_tokens -= prompt_tokens - shared
            self.placed_since_scrape_requests -= 1
        elif self.unseen_requests > 0:
            self._drop_one_unseen()
        if self.scrape_in_flight and epoch == self.scrape_epoch and self.sent_since_requests > 0:
            self.sent_since_requests -= 1
            self.sent_since_tokens -= tokens - shared
            self.sent_since_prompt_tokens -= prompt_tokens - shared

    def _drop_one_unseen(self) -> None:
        """A request placed before the last scrape ended while that scrape's carried (unseen) ones still count:
        one of them leaves the since-scrape counters. Either it was one of them, or the engine's stale numbers
        still count it; both ways running + waiting + carried stays the number of requests still here. Without
        this, a request that ended after the engine stopped showing it and before its release reached the sidecar
        (the access log's flush) stayed counted until the next scrape."""
        tokens = self.unseen_tokens // self.unseen_requests
        prompt = self.unseen_prompt_tokens // self.unseen_requests
        self.unseen_requests -= 1
        self.unseen_tokens -= tokens
        self.unseen_prompt_tokens -= prompt
        self.placed_since_scrape_requests -= 1
        self.placed_since_scrape_tokens -= tokens
        self.placed_since_scrape_prompt_tokens -= prompt

    def scrape_sent(self) -> None:
        """The scraper sent a request for the engine's page: placements from now on are in a new epoch, and
        counted as sent since it (`on_scrape`)."""
        self.scrape_epoch += 1
        self.scrape_in_flight = True
        self.scrape_asking_since = time.monotonic()
        self.sent_since_requests = self.sent_since_tokens = self.sent_since_prompt_tokens = 0

    def on_scrape(self, engine: EngineState) -> None:
        """A fresh scrape includes what the engine had taken in before it: the since-scrape counters restart from
        the requests it could not have counted yet, the ones it has not answered (`awaiting_*`) as far as the
        engine shows fewer requests than are in flight here, plus the ones placed while the scrape was on its way
        (`sent_since_*`, as placed since it):

            carried = min(awaiting - sent since, max(0, own in flight - sent since + the other sidecars'
                                                          - (running + waiting)))

        A real vLLM's API server parses, templates and tokenizes a request before its scheduler counts it (tens of
        milliseconds, more while the engine's core is busy), so a scrape in between showed it nowhere: restarting
        from 0 forgot it, and the replica looked emptier by every such request (issue 16: a third of the scrapes
        of a real engine missed 1-5 requests in flight, up to 8 under load; P3 stacked short prompts on it, P7
        placed 24 on an engine running 7). An engine that counts a request on arrival (the simulator) shows them
        all, except the ones that ended there and whose release has not reached the sidecar yet: those leave the
        carry as requests placed before the scrape end (`_drop_one_unseen`). The minimum keeps a request the engine
        counts (a non-streaming one has no response headers until it ends) from being counted twice. The sidecar
        sees response headers only for the streams it observes (streaming.sample_rate, metered tenants): for the
        others `awaiting` is every request in flight, and the carry is the count the engine does not show.
        The carried requests count as queued at the engine (`engine_queue`); the ones placed while the scrape was on
        its way do not: a page read 50 ms after it was asked for (a busy engine, a loaded machine) made every
        placement of those 50 ms look like a request the engine was slow to take in, and the replica was avoided
        until the next scrape (a burst of equal requests on idle replicas placed 2, 5 and 5)."""
        self.engine = engine
        self.scrape_asked_at = self.scrape_asking_since if self.scrape_in_flight else engine.scraped_at
        if not self.scrape_in_flight:  # read without `scrape_sent` (the scraper always sends first)
            self.scrape_epoch += 1
            self.sent_since_requests = self.sent_since_tokens = self.sent_since_prompt_tokens = 0
        self.scrape_in_flight = False
        self.counted_epoch = self.scrape_epoch
        sent = self.sent_since_requests
        before = self.awaiting_requests - sent
        hidden = self.inflight_requests - sent + self.shared_requests - engine.running - engine.waiting
        carried = self.unseen_requests = min(before, hidden) if hidden > 0 and before > 0 else 0
        if carried > 0:
            self.unseen_tokens = (self.awaiting_tokens - self.sent_since_tokens) * carried // before
            prompts = self.awaiting_prompt_tokens - self.sent_since_prompt_tokens
            self.unseen_prompt_tokens = prompts * carried // before
        else:
            self.unseen_tokens = self.unseen_prompt_tokens = 0
        self.placed_since_scrape_requests = carried + sent
        self.placed_since_scrape_tokens = self.unseen_tokens + self.sent_since_tokens
        self.placed_since_scrape_prompt_tokens = self.unseen_prompt_tokens + self.sent_since_prompt_tokens
        self.placed_last_epoch_requests = max(self.placed_in_epoch_requests, self.placed_last_epoch_requests // 2)
        self.placed_in_epoch_requests = 0
        self.shared_at_scrape = self.shared_tokens
        self.shared_prompt_at_scrape = self.shared_prompt_tokens
        if engine.kv_capacity_tokens:
            self.kv_capacity_tokens = engine.kv_capacity_tokens
        if engine.kv_block_tokens:
            self.kv_block_tokens = engine.kv_block_tokens
        if engine.running + engine.waiting > 0 and engine.prompt_tps > 0:
            self.busy_prompt_tps = engine.prompt_tps
        self.saturated.observe(engine)

    @property
    def routable(self) -> bool:
        """May take new traffic at all (probes for ejected replicas are decided by health.py)."""
        return not self.draining and self.state != EJECTED and self.weight > 0

    def note_shared(self, tokens: int, requests: int, growth: float = 0.0, output: int = 0) -> None:
        """The other sidecars' requests in flight here, as of the latest shared view: `tokens` their footprints,
        `output` the expected output within them (a report without it: 0, all of `tokens` counts as prompt)."""
        self.shared_tokens = tokens
        self.shared_prompt_tokens = tokens - output
        self.shared_requests = requests
        self.shared_growth = growth
        self.placed_since_view_tokens = 0

    def waiting_estimate(self) -> int:
        return self.engine.waiting + self.placed_since_scrape_requests

    def engine_queue(self) -> int:
        """Requests queued at the engine as of its last scrape: its waiting ones and the ones it had not counted
        yet (still in its API server)."""
        return self.engine.waiting + self.unseen_requests


@dataclass(eq=False)
class Pool:
    """The replicas serving one model."""

    model: str
    cluster: str
    replicas: list[Replica] = field(default_factory=list)
    metrics_style: str = "vllm"

    @classmethod
    def from_config(cls, cfg: PoolConfig) -> "Pool":
        """The pool's fixed addresses; replicas by name join when discovery first reports them."""
        return cls(model=cfg.model, cluster=cfg.cluster, metrics_style=cfg.metrics_style,
                   replicas=[Replica(address=a, pool=cfg.model) for a in cfg.addresses])

    # ---- membership (discovery) ----------------------------------------------------------------------------
    def add_replica(self, address: str) -> tuple[Replica, bool]:
        """The replica at `address`, added if new. (replica, True) when it is new or was retiring (re-added
        before its drain ended: the retirement is cancelled); the caller decides its health (slow start)."""
        r = self.by_address(address)
        if r is None:
            r = Replica(address=address, pool=self.model)
            self.replicas.append(r)
            return r, True
        if r.retired:
            r.retired = r.draining = False
            return r, True
        return r, False

    def retire_replica(self, address: str) -> Replica | None:
        """No new requests to `address`; its requests in flight finish, then `sweep_retired` removes it."""
        r = self.by_address(address)
        if r is not None:
            r.retired = r.draining = True
        return r

    def sweep_retired(self) -> list[Replica]:
        """Remove the retired replicas with nothing in flight; returns them (the caller forgets their health
        state and metric series)."""
        gone = [r for r in self.replicas if r.retired and r.inflight_requests == 0]
        if gone:
            self.replicas = [r for r in self.replicas if r not in gone]
        return gone

    def candidates(self) -> list[Replica]:
        return [r for r in self.replicas if r.routable]

    def pick(self, tokens: int) -> list[Replica]:
        """Least in-flight tokens first (ties: fewer requests), then the runner-up as the retry fallback.

        The list is the pin list Envoy's override_host tries in order, one entry per attempt."""
        live = self.candidates()
        if not live:
            return []
        if len(live) == 1:
            return live
        best = second = None
        best_key = second_key = None
        for r in live:
            key = (r.inflight_tokens, r.inflight_requests)
            if best_key is None or key < best_key:
                second, second_key = best, best_key
                best, best_key = r, key
            elif second_key is None or key < second_key:
                second, second_key = r, key
        return [best, second]  # type: ignore[list-item]

    def by_address(self, address: str) -> Replica | None:
        for r in self.replicas:
            if r.address == address:
                return r
        return None

    @property
    def inflight_requests(self) -> int:
        return sum(r.inflight_requests for r in self.replicas)

    @property
    def inflight_tokens(self) -> int:
        return sum(r.inflight_tokens for r in self.replicas)
