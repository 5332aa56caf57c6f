"""Which replica, if any, may take this request now: the saturation filter and the score (P3, P7, P9, P12, P13).

A replica fits a request when, with the request added, it stays within every limit:
  KV      committed + footprint <= capacity x weight x (1 - margin), where committed is what the engine holds
          now (its scraped KV usage, plus the prompts placed since that scrape, plus the engine's waiting requests,
          not in its KV yet, plus what its running requests decoded since the scrape) plus the output its
          requests in flight, this sidecar's and the others' sharing through Redis, are still expected to decode
          while the new request would run, this sidecar's freeing theirs at their predicted ends: the highest
          point of that curve (`kv_committed` with `frees`, kv_growth.py: no preemption when gateways place long
          generations, PG / P9). Not a lifetime reservation: a stream whose client reads slowly holds nothing in
          an engine that finished it (P13)
  queue   the engine's own waiting queue, with the requests it has not counted yet (`Replica.engine_queue`),
          <= max_waiting (the replicas never protect themselves)
  running the engine's running + waiting + placed since the scrape < its sequence cap x weight + max_waiting,
          the cap learned from the engine (seq_cap.py); unknown, at most double per scrape interval what the
          engine showed or what the replica recently took (`_over_concurrency`, P12). An explicit
          max_concurrency_per_replica caps this sidecar's requests plus the other sidecars' when they share
          through Redis
  prefill predicted prefill backlog + prefill work <= prefill rate x TTFT limit x weight (an idle replica always
          takes one prompt, however long); the limit is the policy's TTFT target, or DEADLINE_SHARE (75%) of
          the client's time left (its own timeout header) when that is less: work the client will have
          abandoned is not sent (P4, P5)
  lane    dedicated replicas, and at most max_replica_share of the replicas prefilling the lane at once (P3)
  tenant  while several tenants are active, the dominant one queues behind at most tenant_backlog_share x
          ttft_target_s of prefill per replica (default 0: only where its predicted prefill has drained), and,
          with tenant_prefill_share < 1, prefills on at most that share of the replicas
  fresh   its metrics are recent; a serving (healthy or recovering) replica whose metrics are stale but that was
          scraped before is placed cautiously, at STALE_WEIGHT x its weight in every limit and the score (a busy
          vLLM answers /metrics in seconds now and then; the sidecar's own accounting still holds), any other
          replica with stale metrics counts as saturated
Among fitting replicas the lowest score wins:
  score = (prefill backlog + prefill work) / prefill rate / TTFT target
          + kv_weight x KV fraction after placing + waiting_weight x engine queue (waiting + not counted yet)
          + inflight_weight x (requests in flight there + 1) / max sequences
          + 1 for each larger confined lane (max_replica_share < 1, e.g. long) with a request in flight there
            (short requests avoid long prefills, P3; unconfined lanes mix freely, which keeps KV balanced, P7)
          + 4 x (1 - health weight) (degraded and slow-starting replicas are the last choice, P6/P8)
          - the home term on the home of the prompt's prefix (where its longest level was placed last):
            HOME_STAY (0.5) x cached / prompt for a prefix of at least a tenth of the KV (prefix_affinity.py): a move
            computes the prefix again elsewhere and evicts as much of other prefixes there (PX)
where the prefill work is the cost of the prompt's uncached tokens, each weighted by its position in the context
(`prefill_work`: attention makes a long prompt's tokens slower than a short one's), and the uncached tokens are
prompt - confidence x cached tokens of its prefix there (prefix_affinity.py, in whole KV blocks: a prompt shorter
than a block shares none): the prefix term, which makes requests that share a prefix go where it is cached while
that replica has headroom. The prefill backlog is the work placed and not yet prefilled, drained at the rate.

The in-flight term counts this sidecar's requests on the replica and the others' (shared through Redis) against its
max sequences (max_concurrency_per_replica, else the engine's learned max_num_seqs, at least UNSCRAPED_CONCURRENCY:
`_sequence_scale`): every sequence takes a decode slot and lengthens each engine step, however little KV it holds.
The KV term alone lets a replica running a short request score almost as an idle one (once scraped, it holds one
block), and a prefix its requests hold makes the next copy cheaper there still, so identical short prompts (a health
probe, a templated one-liner) gathered on one replica while another was idle. With it, equal requests spread over
equal replicas, and a cached prefix stays where it is while its saving (its prefill time over the TTFT target)
outweighs the replica's extra sequences: a 4,000-token prefix at 10,000 tokens/s and a 2 s target is worth 0.2, a
dozen sequences of a 64-sequence engine, before it spills (PX).

The pin list is the winner and the runner-up (Envoy tries them in order, one per attempt).

A confined lane's share counts replicas *prefilling* its prompts (predicted from the prefill backlog), not
replicas holding one: short requests are hurt by a long prefill, not by a long context decoding (P3). While the
share is taken, a request of the lane waits in the sidecar's queue instead of stacking behind a replica's long
prefill (the engine would prefill them one after another anyway), and once a prefill ends it goes to the best
replica by score. Stacking made the same half of the pool hold every long context: KV spread 0.29 in P7 against
0.12 now (P7).

Tenants (P1f): a tenant is dominant while it sent more than DOMINANT_SHARE of the recent prompt tokens
(decayed over TENANT_ACTIVE_S) and another tenant is active. The fair queue already puts a quiet tenant's request
first, but a replica prefills in arrival order: a quiet prompt placed behind the flood's queued prompts waits for
all of them. The backlog share keeps each replica's queue of the dominant tenant's prefill short: its prompt may
be placed only behind at most tenant_backlog_share x the TTFT target of predicted prefill (always on a replica
whose backlog has drained). By default (0) that is one prompt at a time per replica: each replica stays busy with
the flood, its other requests wait in the fair queue instead of the engine, and a quiet prompt waits behind at most
the one flood prompt its replica is prefilling (P1f measured: at 0.25 of a 0.5 s target, the flood kept about two
prompts ahead of every quiet one). The replica share (off by default) goes further: it keeps whole replicas free of
the dominant tenant's prefill, at the cost of the flood's throughput when the others do not use them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from extproc.admission.decode_time import BOUND as DECODE_BOUND
from extproc.admission.kv_growth import Growth, KvGrowth
from extproc.admission.policy import AdmissionPolicy
from extproc.admission.prefix_affinity import PrefixAffinity, home_term
from extproc.request import LLMRequest
from extproc.routing.pool import EJECTED, HEALTHY, RECOVERING, Pool, Replica

if TYPE_CHECKING:
    from extproc.routing.turns import Turns

NONE_CACHED: dict[Replica, float] = {}  # no prefix state: nothing cached or held anywhere (never written)


@dataclass(slots=True, eq=False)
class PrefixLookup:
    """One request's prefix-cache lookup: the tokens of its prompt cached per replica and its prefix's home (both
    valid while the prefix state keeps its version) and, once `Placer.choose` asked, the prompt tokens that
    requests in flight hold there (for `commit`)."""

    req: LLMRequest
    prefix: PrefixAffinity
    version: int
    cached: dict[Replica, float]
    home: Replica | None = None
    held: dict[Replica, float] | None = None

LANE_PENALTY = 1.0  # score added per larger lane busy on a replica (= a full TTFT target of predicted wait)
WEIGHT_PENALTY = 4.0  # score added at weight 0 (health: degraded / slow start), proportionally above
LANE_ACTIVE_S = 2.0  # a lane with a request this recent is protected by the confinement of larger lanes
TENANT_ACTIVE_S = 2.0  # a tenant with a request seen this recently counts as active for the tenant share
DOMINANT_SHARE = 0.5  # a tenant sending more than this share of the recent prompt tokens may be held
MAX_TRACKED_TENANTS = 10_000  # decayed arrival counts kept; beyond it, tenants idle for TENANT_ACTIVE_S go
DEADLINE_SHARE = 0.75  # of the client's time left, the most a predicted first token (or answer) may take: the
                       # prediction counts prefill only, and decode steps sharing the engine lengthen it (P5)
MAX_TENANT_ENTRIES = 64  # per replica, tenant prefill entries before ended ones are pruned
PROMPT_ESTIMATE_ERROR = 2.0  # how much larger than the truth a prompt's estimate may be (`surely_too_large`)
STALE_WEIGHT = 0.5  # a serving replica whose metrics are stale takes this share of its weight (issue 16)
UNSCRAPED_CONCURRENCY = 64  # requests in flight on a replica whose engine exports no metrics (nothing to learn from)
PROBE_BASE = 8  # while an engine's sequence cap is unknown, placements per scrape interval beyond doubling it
ROOM_STEPS = 64  # waiters ahead placed one by one on the replica with the most KV room (`_room_behind`); more: a level
PRIOR_PROMPT_TOKENS = 1024.0  # the cold prompt whose prefill work is its token count (`prefill_work`)
REFILL_S = 0.1  # a queued request may always be placed behind this much predicted prefill (two kicks of the
                # scheduler's timer): the replica never runs dry between dispatches

# Why a replica did not fit (counted per replica: "saturation by reason").
NOT_ROUTABLE, STALE, KV_FULL, KV_SHARE, QUEUE_FULL, CONCURRENCY, PREFILL, LANE, TENANT = (
    "not_routable", "stale", "kv_full", "kv_share", "engine_queue", "concurrency", "prefill_backlog", "lane",
    "tenant_share")
# KV_SHARE: the KV fits, but not within this gateway's share of it until its next shared view (routing/turns.py)


class Placer:
    """Per pool. Pure bookkeeping and arithmetic: no I/O, no awaits."""

    def __init__(self, pool: Pool, policy: AdmissionPolicy,
                 is_fresh: Callable[[Replica, float], bool] | None = None) -> None:
        self.pool = pool
        self.policy = policy
        self.is_fresh = is_fresh
        self.allow_probe: Callable[[Replica, float], bool] | None = None  # health: one probe to an ejected one
        self.turns: Turns | None = None  # several gateways: the share of a replica's headroom this one may fill
        self.rate = policy.prefill_tokens_per_s  # the pool's prefill speed (prefill_rate.py, after each scrape)
        self.decode_s = policy.decode_s_per_token  # seconds per output token (decode_time.py, after each scrape)
        self.decode_measured = False  # decode_s comes from the engines, not the configured start value
        self.prefix = PrefixAffinity() if policy.prefix_affinity else None
        self._lane_sets = [frozenset(lane.replicas) for lane in policy.lanes]
        self._lane_seen: list[float] = []  # per lane, when its latest request arrived (`note_lane`)
        self._lane_caps: list[int] = []
        # Per replica, the output this sidecar's requests there are still expected to decode (kv_growth.py).
        self.growth: dict[Replica, KvGrowth] = {}
        # Per replica, (scraped at, what this sidecar's requests should hold that the scrape did not show).
        self._unshown: dict[Replica, tuple[float, float]] = {}
        self.on_replicas_changed()
        # Larger lanes confined to a share of the replicas (long prompts): smaller requests avoid their replicas.
        confined = [i for i, lane in enumerate(policy.lanes) if lane.max_replica_share < 1 or lane.replicas]
        self._confined_above = [[i for i in confined if i > lane] for lane in range(len(policy.lanes))]
        self.last_reasons: dict[str, int] = {}
        self.tenant_share = policy.tenant_prefill_share
        self.backlog_share = policy.tenant_backlog_share
        self._tenants_tracked = self.tenant_share < 1 or self.backlog_share < 1
        # The two most recent tenants seen (O(1) "is another tenant active?"): the latest tenant and when it was
        # seen, and when any other tenant was last seen.
        self._last_tenant = ""
        self._last_at = self._other_at = float("-inf")
        # Prompt tokens per tenant and in total, decayed with time constant TENANT_ACTIVE_S: (tokens, as of).
        self._tenant_rate: dict[str, tuple[float, float]] = {}
        self._total = (0.0, 0.0)
        # The last request's prefix-cache lookup: the lane, `choose` and the `commit` that follows share it.
        self._lookup: PrefixLookup | None = None

    def on_replicas_changed(self) -> None:
        """The pool's replica set changed (built, reloaded, or discovery added / removed one): new replicas get the
        policy's KV capacity default and per-lane counters, and each confined lane's replica cap follows the
        pool's size."""
        n_lanes = len(self.policy.lanes)
        for r in self.pool.replicas:
            if not r.kv_capacity_tokens and self.policy.kv_capacity_tokens:
                r.kv_capacity_tokens = self.policy.kv_capacity_tokens
            if len(r.lane_inflight) != n_lanes:  # a reload keeps the counts of requests still in flight
                r.lane_inflight = [0] * n_lanes
            if len(r.lane_prefill_until) != n_lanes:
                r.lane_prefill_until = [0.0] * n_lanes
        if len(self.growth) > len(self.pool.replicas):
            self.growth = {r: g for r, g in self.growth.items() if r in self.pool.replicas}
            self._unshown = {r: v for r, v in self._unshown.items() if r in self.pool.replicas}
        # Per lane: how many replicas may prefill it at once (0 = not confined).
        self._lane_caps = [self._lane_replica_cap(lane.max_replica_share) for lane in self.policy.lanes]
        if len(self._lane_seen) != n_lanes:
            self._lane_seen = [-math.inf] * n_lanes
        # Each replica's place among the pool's addresses, sorted: the same on every gateway (turns.py).
        self._rank = {r: i for i, r in enumerate(sorted(self.pool.replicas, key=lambda r: r.address))}

    # ---- estimates -------------------------------------------------------------------------------------
    def backlog(self, r: Replica, now: float) -> float:
        if r.prefill_backlog <= 0:
            return 0.0
        left = r.prefill_backlog - self.rate * (now - r.prefill_at)
        return left if left > 0 else 0.0

    def predicted_ttft_s(self, r: Replica, work: float, now: float) -> float:
        """Seconds until a prompt of `work` (`prefill_work`) placed on `r` now has its first token."""
        return (self.backlog(r, now) + work) / self.rate

    def weight(self, r: Replica, now: float) -> float:
        """The share of a routable replica's capacity placement may use now: its health weight, x STALE_WEIGHT
        while its metrics are stale; 0 when it may not be used (stale and never scraped, or stale while not
        serving: a degraded replica that stopped answering is not placed on blind)."""
        w = r.weight or 0.1
        if self.is_fresh is None or self.is_fresh(r, now):
            return w
        if r.engine.scraped_at > 0 and (r.state == HEALTHY or r.state == RECOVERING):
            return w * STALE_WEIGHT
        return 0.0

    def usable(self, r: Replica, now: float) -> bool:
        """Routable, and its metrics allow placing on it (see `weight`)."""
        return r.routable and self.weight(r, now) > 0

    def prefill_work(self, prompt_tokens: float, cached: float = 0.0) -> float:
        """What computing a prompt costs, in the unit of the prefill speed `rate` and the backlog: a prompt's tokens
        attend to every token before them, so a token's prefill time grows with its position (attention is
        quadratic in the context). Per token, 1 + position / knee; over the uncached tokens (`cached` of them
        found in the prefix cache), counted so that a cold prompt of P = PRIOR_PROMPT_TOKENS is worth P:

            work = (prompt - cached) x (2 knee + prompt + cached) / (2 knee + P)

        (the mean position of the computed tokens is (prompt + cached) / 2; knee = prefill_knee_tokens, 0: work =
        prompt - cached). The speed is then measured in work per second (prefill_rate.py), so the configured
        prefill_tokens_per_s is the speed of P-token prompts. A real vLLM-CPU engine prefilled 500-token prompts
        at about 9,000 tokens/s and 5,000-token ones at 3,500 (knee ~1,000). Charged as plain tokens at one
        speed, a 6,500-token prompt read as drained from its replica's backlog after 0.7 s of its 2 s prefill, and
        short prompts placed there then waited 1.3 s for it, while eight short prompts read as 0.45 s of backlog
        on the other replica (their real prefill was half that) and kept the next ones off it (P3). A cached
        follow-up turn computes few tokens, but each attends to the whole conversation before it (PX)."""
        new = prompt_tokens - cached
        if new <= 0:
            return 0.0
        knee2 = 2.0 * self.policy.prefill_knee_tokens
        if knee2 <= 0:
            return new
        return new * (knee2 + prompt_tokens + cached) / (knee2 + PRIOR_PROMPT_TOKENS)

    def prefill_s(self, prompt_tokens: float, cached: float = 0.0) -> float:
        """Predicted prefill time of a prompt on an idle replica (its lane): `prefill_work` / rate."""
        return self.prefill_work(prompt_tokens, cached) / self.rate

    def lane_prefill_s(self, req: LLMRequest) -> float:
        """The predicted prefill time that decides the request's lane: on the replica that holds most of its
        prefix cached (all of it computed when none does)."""
        if self.prefix is None:
            return self.prefill_s(req.prompt_tokens)
        cached = self.cached_tokens(req)
        return self.prefill_s(req.prompt_tokens, max(cached.values()) if cached else 0.0)

    def cached_tokens(self, req: LLMRequest) -> dict[Replica, float]:
        """`PrefixAffinity.cached_tokens`, computed once per request while the prefix state stays the same: the
        lane (`lane_prefill_s`) and the placement that follows it at once (`choose`) ask the same question."""
        lookup = self._lookup_for(req)
        return lookup.cached if lookup is not None else {}

    def _lookup_for(self, req: LLMRequest) -> PrefixLookup | None:
        """The request's lookup, made anew when it is another request's or the prefix state has changed since."""
        prefix = self.prefix
        if prefix is None:
            return None
        lookup = self._lookup
        if lookup is None or lookup.req is not req or lookup.prefix is not prefix or lookup.version != prefix.version:
            cached = prefix.cached_tokens(req)
            home = prefix.home(req) if cached else None
            lookup = self._lookup = PrefixLookup(req, prefix, prefix.version, cached, home)
        return lookup

    def kv_held(self, r: Replica, now: float) -> float:
        """KV tokens the replica's engine holds now, as far as this sidecar can tell:

            scraped usage x capacity                  what the engine reported it holds
          + footprints placed since that scrape       prompt + expected output each: not in the report yet
          + engine waiting x mean footprint here      queued in the engine, not yet in its KV
          + running x (now - scraped at) / decode s   what its running requests decoded since

          + the other sidecars' growth since the scrape   (shared through Redis: shared now - shared at scrape)

        Without engine numbers (never scraped, or metrics_style none), the reservations in flight (a full
        footprint per request, this sidecar's and the others'). What is still to be decoded is `kv_committed`'s."""
        if not r.engine.scraped_at:
            return float(r.inflight_tokens + r.shared_tokens)
        return self._since_scrape(r, now, r.placed_since_scrape_tokens, r.inflight_tokens,
                                  r.shared_tokens - r.shared_at_scrape)

    def _since_scrape(self, r: Replica, now: float, placed: float, inflight: float, others_since: float,
                      unshown: float = 0.0) -> float:
        """The engine's scraped KV usage plus, since that scrape: `placed` tokens this sidecar placed, the others'
        `others_since` (footprints or prompts, as `placed`), its waiting requests at `inflight` / this sidecar's
        requests in flight each, or `unshown` when more (what this sidecar's requests placed before the scrape should
        hold and it did not show: queued in the engine, prefilling or behind, kv_growth.py), and what its running
        requests decoded."""
        e = r.engine
        held = e.kv_usage * r.kv_capacity_tokens + placed
        if others_since > 0:
            held += others_since
        waiting = e.waiting * inflight / r.inflight_requests if e.waiting and r.inflight_requests else 0.0
        held += waiting if waiting > unshown else unshown
        if e.running and now > e.scraped_at:
            held += e.running * (now - e.scraped_at) / self.decode_s
        return held

    def own_growth(self, r: Replica, now: float) -> float:
        """Output tokens this sidecar's requests on `r` are still expected to decode (kv_growth.py)."""
        g = self.growth.get(r)
        return g.remaining(now) if g is not None else 0.0

    def kv_committed(self, r: Replica, now: float, horizon_s: float | None = None, frees: bool = False,
                     joining: Growth | None = None) -> float:
        """KV tokens the replica's engine will hold, at most, within the next `horizon_s` seconds (None: before its
        requests in flight end): what it holds now plus the output they decode meanwhile (the admission check,
        and with no horizon the score's KV term):

            scraped usage x capacity                   what the engine reported it holds
          + prompts placed since that scrape           (their outputs are in the growth below)
          + the other sidecars' prompts placed since the scrape  (shared through Redis; their outputs are in
                                                       the others' growth below, counted once)
          + max(engine waiting x mean prompt here,     queued in the engine, not yet in its KV, or, when
                unshown)                               more, what this sidecar's requests placed before the scrape
                                                       should hold by the ledger and it did not show (a long
                                                       prompt prefilling chunk by chunk, an engine behind the
                                                       prediction: kv_growth.py `unshown`)
          + running x (now - scraped at) / decode s    what its running requests decoded since
          + own growth within the horizon              sum over this sidecar's requests here of the output they
                                                       decode before now + horizon (kv_growth.py `within`)
          + the others' growth within the horizon      min(their published growth, their requests x horizon /
                                                       decode s)  (they publish a total, not its timing)

        Requests ending within the horizon free their KV before it ends, which this leaves out (an upper bound),
        unless `frees`: then this sidecar's requests free what they hold at their predicted ends, and the own growth
        term is its peak over the horizon (kv_growth.py `peak_within`), the most the engine holds at any moment,
        with `joining`'s output (the request being placed, `kv_peak`) decoding beside them.
        A request placed now needs the KV for its own lifetime only (`lifetime_s`): growth after it ends cannot
        preempt it, and placing it does not add to it. So the engine's KV fits what its requests will grow into
        while the new one runs, not only what they hold now (no preemption when several gateways place long
        generations, PG / P9), while a short request is not held back by the far future of long ones, and a
        request whose decode is predicted to have ended counts only what the scrape shows (a slow reader's
        finished stream holds nothing, P13). Without engine numbers: the reservations in flight, as `kv_held`."""
        if not r.engine.scraped_at:
            return float(r.inflight_tokens + r.shared_tokens)
        own = self.growth.get(r)
        held = self._since_scrape(r, now, r.placed_since_scrape_prompt_tokens, r.inflight_prompt_tokens,
                                  r.shared_prompt_tokens - r.shared_prompt_at_scrape, self._unshown_kv(r, own))
        if horizon_s is None:
            return held + (own.remaining(now) if own is not None else 0.0) + r.shared_growth
        others = r.shared_requests * horizon_s / self.decode_s
        if frees:
            ledger = own if own is not None else KvGrowth()  # none of this sidecar's here: the joining one alone
            mine = ledger.peak_within(now, horizon_s, joining)
        else:
            mine = own.within(now, horizon_s) if own is not None else 0.0
        return held + mine + min(r.shared_growth, others)

    def _unshown_kv(self, r: Replica, own: KvGrowth | None) -> float:
        """What this sidecar's requests on `r` are expected to hold and `r`'s last scrape did not show: still to
        come (kv_growth.py `unshown`), read once per scrape."""
        if own is None:
            return 0.0
        at = r.engine.scraped_at
        seen = self._unshown.get(r)
        if seen is None or seen[0] != at:
            # Placed before the page was asked for; the ones it could not count yet (carried) are in `placed`.
            shown = r.engine.kv_usage * r.kv_capacity_tokens + r.unseen_prompt_tokens
            seen = self._unshown[r] = (at, own.unshown(r.scrape_asked_at, shown))
        return seen[1]

    def lifetime_s(self, r: Replica, req: LLMRequest, now: float, work: float) -> float:
        """How long `req` would hold KV on `r`: its predicted TTFT there (`work`: its prefill work there), then its
        expected output's decode."""
        return self.predicted_ttft_s(r, work, now) + req.expected_output_tokens * self.decode_s

    def kv_fits(self, r: Replica, req: LLMRequest, now: float, limit: float, work: float,
                held: float = 0.0) -> bool:
        """Whether `req` fits `r`'s KV now (`kv_refusal` is None)."""
        return self.kv_refusal(r, req, now, limit, work, held) is None

    def kv_refusal(self, r: Replica, req: LLMRequest, now: float, limit: float, work: float,
                   held: float = 0.0) -> str | None:
        """Why `req`'s footprint (less `held`, the tokens of its prefix that requests in flight on `r` already
        hold) does not fit within `limit` at every moment of its lifetime: its prompt from now on, its output as it
        decodes, beside what `r` holds then (`kv_peak`; the whole future with its whole footprint first: O(1), and
        enough whenever the replica is not near full): KV_FULL, KV_SHARE (it fits, beyond this gateway's share:
        `_refusal`), or None."""
        footprint = req.total_tokens - held
        why = self._refusal(r, self.kv_committed(r, now), limit, footprint, now)
        if why is None:
            return None
        return self._refusal(r, self.kv_peak(r, req, now, work), limit, footprint, now)

    def kv_peak(self, r: Replica, req: LLMRequest, now: float, work: float) -> float:
        """What `req`'s footprint must fit beside on `r` (`work`: its prefill work there):

            kv_peak = max over its lifetime of (what r holds, its requests' ends freeing theirs, + req's output
                      decoded by then) - req's expected output
                    = kv_committed(now, lifetime, frees, joining = req) - expected output

        so that kv_peak + footprint is the highest point of r's KV with req placed (its prompt held from now on).
        Between what r holds at req's end and kv_committed(now, lifetime) without the ends."""
        if not r.engine.scraped_at:
            return self.kv_committed(r, now)  # the reservations in flight: every footprint in full
        lifetime = self.lifetime_s(r, req, now, work)
        out = req.expected_output_tokens
        joining = Growth(now + self.predicted_ttft_s(r, work, now), out, self.decode_s)
        return self.kv_committed(r, now, lifetime, frees=True, joining=joining) - out

    def _refusal(self, r: Replica, committed: float, limit: float, footprint: float, now: float) -> str | None:
        """`footprint` fits within `limit` beside `committed` (else KV_FULL), and, with other gateways placing in
        the pool, within this sidecar's share of the headroom its last shared view left (else KV_SHARE;
        routing/turns.py):

            own footprints placed since the view + footprint
                <= allowance(limit - (committed - those footprints), KV margin)
        """
        if committed + footprint > limit:
            return KV_FULL
        turns = self.turns
        if turns is None or turns.gateways(self.pool.model) <= 1:
            return None
        mine = min(r.placed_since_view_tokens, r.inflight_tokens)
        allowance = turns.allowance(self.pool.model, self._rank.get(r, 0), limit - (committed - mine), footprint,
                                    now, r.kv_capacity_tokens * self.policy.kv_margin)
        return None if mine + footprint <= allowance else KV_SHARE

    def turn_wait_s(self) -> float:
        """The longest a request fitting a replica's KV waits for this gateway's turn on it (0: no other gateway
        places in the pool)."""
        turns = self.turns
        return 0.0 if turns is None else turns.turn_wait_s(self.pool.model)

    def kv_free_s(self, req: LLMRequest, now: float, ahead: int = 0, ahead_tokens: float = 0.0) -> float | None:
        """Seconds until some usable replica's KV could hold `req` behind the `ahead` requests queued before it
        (`ahead_tokens`: their footprints), when KV keeps it off every usable replica; None when it fits some
        replica by KV after them, or nothing is usable. The KV a replica holds for requests this sidecar does not
        know (another gateway's, without the shared view) may free at any moment: it counts as freed now, so only
        what the known requests hold can make the wait long.

        With limit_r = `kv_limit(r, req, w)` (capacity x w x (1 - kv_margin), or the request's footprint above it):
            peak room_r = limit_r - kv_peak_r                              (`kv_fits`' room)
                          less the footprints ahead, each on the replica with the most room left
                          (>= footprint on some r: None)
            room_r      = the same without the ends (they are freed_r's, below)
            deficit_r   = footprint - room_r
            unknown_r   = max(0, committed(now, inf) - own footprints in flight - the others' published ones)
            freed_r(t)  = unknown_r
                        + own footprints whose predicted end <= now + t   (own requests past it: at t = 0)
                        + the others' published footprints once t >= their mean remaining decode
                          (published growth / their requests x decode s)
            free_r      = the least t with freed_r(t) >= deficit_r          (inf: nothing known frees enough)
        Returns min_r free_r."""
        limits: dict[Replica, float] = {}
        for r in self.pool.replicas:
            if not self.usable(r, now):
                continue
            cap = r.kv_capacity_tokens
            if not cap or not r.engine.scraped_at:
                return None
            limits[r] = self.kv_limit(r, req, self.weight(r, now))
        if not limits:
            return None
        footprint = float(req.total_tokens)
        # The whole future first (O(1) per replica, less room than within the lifetime): room enough -> None.
        fast = {r: lim - self.kv_committed(r, now) for r, lim in limits.items()}
        if max(self._room_behind(ahead, ahead_tokens, fast).values()) >= footprint:
            return None
        work = self.prefill_work(req.prompt_tokens)
        peak_rooms = self._room_behind(ahead, ahead_tokens, {
            r: lim - self.kv_peak(r, req, now, work) for r, lim in limits.items()})
        if max(peak_rooms.values()) >= footprint:
            return None
        # The wait: from the room its lifetime leaves without the ends, which `_kv_freed_after` then adds one by one.
        rooms = self._room_behind(ahead, ahead_tokens, {
            r: lim - self.kv_committed(r, now, self.lifetime_s(r, req, now, work)) for r, lim in limits.items()})
        return min(self._kv_freed_after(r, now, footprint - room) for r, room in rooms.items())

    @staticmethod
    def _room_behind(ahead: int, ahead_tokens: float, rooms: dict[Replica, float]) -> dict[Replica, float]:
        """Each replica's KV room left once the `ahead` waiters (`ahead_tokens` of footprints, each the mean) took
        theirs, each on the replica with the most room left. Beyond ROOM_STEPS waiters, as a level: every room
        above L lowered to L, with sum over them of (room - L) = ahead_tokens."""
        if ahead > ROOM_STEPS:
            vals = sorted(rooms.values(), reverse=True)
            acc = level = 0.0
            for k, v in enumerate(vals, 1):
                acc += v
                level = (acc - ahead_tokens) / k
                if k == len(vals) or level >= vals[k]:
                    break
            return {r: min(room, level) for r, room in rooms.items()}
        left = dict(rooms)
        each = ahead_tokens / ahead if ahead else 0.0
        for _ in range(ahead):
            most = max(left, key=left.__getitem__)
            left[most] -= each
        return left

    def _kv_freed_after(self, r: Replica, now: float, deficit: float) -> float:
        """`kv_free_s`'s free_r: the least t at which `deficit` KV tokens on `r` are free, counting the KV of requests
        this sidecar does not know as freed now and each known request's footprint from its predicted end on
        (inf when all of them together do not free enough)."""
        ends = self.growth[r].ends(now) if r in self.growth else []
        known = r.inflight_tokens + r.shared_tokens
        freed = max(0.0, self.kv_committed(r, now) - known)  # held for requests it does not know
        freed += max(0.0, r.inflight_tokens - sum(tokens for _, tokens in ends))  # own ones past their predicted end
        if freed >= deficit:
            return 0.0
        events = [(end - now, tokens) for end, tokens in ends]
        if r.shared_requests:
            events.append((r.shared_growth / r.shared_requests * self.decode_s, float(r.shared_tokens)))
            events.sort()
        for t, tokens in events:
            freed += tokens
            if freed >= deficit:
                return max(0.0, t)
        return math.inf

    def max_footprint(self) -> float:
        """The largest KV cache of a replica: a request surely larger can never run (`surely_too_large`)."""
        caps = [r.kv_capacity_tokens for r in self.pool.replicas if r.kv_capacity_tokens]
        return max(caps) if caps else float("inf")

    def surely_too_large(self, req: LLMRequest) -> bool:
        """`req` cannot run on any replica even if its prompt is PROMPT_ESTIMATE_ERROR times smaller than estimated:

            prompt / PROMPT_ESTIMATE_ERROR + max_tokens x n > the largest replica's KV cache

        Only then is it refused (400, final). The prompt's size is an estimate from its bytes until the engines'
        counts calibrate it (token_calibration.py): about 1.5x high on 6-byte words. Refused on the estimate alone,
        requests the engine serves were turned away (real vLLM P9 on a KV cache of 28 blocks, 3,584 tokens: every
        request of 3,000 prompt tokens and 240 output). A request between this and the KV cache runs alone on an
        idle replica (`kv_limit`), where the engine, which counts exactly, serves it or refuses it itself."""
        return req.prompt_tokens / PROMPT_ESTIMATE_ERROR + req.expected_output_tokens > self.max_footprint()

    def kv_limit(self, r: Replica, req: LLMRequest, w: float) -> float:
        """The KV `req` may fill on `r` (`w`: its weight now), what it holds already included:

            limit = max(capacity x w x (1 - kv_margin), footprint)

        The margin keeps room for the growth of the requests running beside a new one (P9: no preemption). A
        request whose own footprint is above the margin line (or above the whole cache, by its estimate) has
        nothing to share that room with on an idle replica, so its limit is its footprint: it fits where nothing
        else is committed (`kv_fits`' room is then 0), and waits for that otherwise."""
        return max(r.kv_capacity_tokens * w * (1 - self.policy.kv_margin), float(req.total_tokens))

    # ---- the filter ------------------------------------------------------------------------------------
    def why_not(self, r: Replica, req: LLMRequest, lane: int, now: float, ttft_limit_s: float,
                work: float | None = None, held: float = 0.0) -> str | None:
        """Why `r` cannot take `req` now (None: it fits). `ttft_limit_s`: the predicted TTFT allowed
        (`ttft_limit_s()`); `work`: its prompt's prefill work on `r` (`prefill_work`; default: none of it cached);
        `held`: the tokens of its prompt that requests in flight on `r` already hold in KV (a shared prefix)."""
        pol = self.policy
        if not r.routable:
            if not (r.state == EJECTED and not r.draining and r.inflight_requests == 0
                    and self.allow_probe is not None and self.allow_probe(r, now)):
                return NOT_ROUTABLE
            return None  # a probe: one request tells health whether the replica is back
        w = self.weight(r, now)
        if w <= 0:
            return STALE
        lane_set = self._lane_sets[lane]
        if lane_set and r.address not in lane_set:
            return LANE
        if self._over_concurrency(r, w):
            return CONCURRENCY
        if r.engine_queue() > pol.max_waiting_per_replica:
            return QUEUE_FULL
        if work is None:
            work = self.prefill_work(req.prompt_tokens)
        if r.kv_capacity_tokens:
            why = self.kv_refusal(r, req, now, self.kv_limit(r, req, w), work, held)
            if why is not None:
                return why
        backlog = self.backlog(r, now)
        if backlog > 0:
            if backlog + work > self.rate * ttft_limit_s * w:
                return PREFILL
        return None

    def _over_concurrency(self, r: Replica, w: float) -> bool:
        """The replica runs as many requests as it may take (P12). An explicit max_concurrency_per_replica caps
        this sidecar's requests on it. Otherwise the engine's own count decides: with its sequence cap learned
        (seq_cap.py), running + waiting + placed since the scrape must stay under cap x weight + max_waiting
        (beyond it a request waits in the engine, where it cannot move to another replica); with the cap
        unknown, the placements of one scrape interval may at most double:

            placed since the scrape < max(PROBE_BASE, seen x weight, 2 x recent)
            recent = max(placed in the interval before, recent before it / 2)

        `seen` (running + waiting) doubles what long requests hold; `recent` doubles what short ones pass, which
        are over before any scrape sees them (without it, a fast engine's ~3 requests in sight held it to
        PROBE_BASE per interval, ~40 requests/s). `recent` halves per interval rather than dropping to what one
        interval placed, so an interval in which the engine's queue was full (the queue limit refused it) does
        not restart the doubling from PROBE_BASE. The engine's own queue stays bounded by the queue limit. A
        replica without metrics: UNSCRAPED_CONCURRENCY of this sidecar's requests."""
        fixed = self.policy.max_concurrency_per_replica
        if fixed:
            return r.inflight_requests + r.shared_requests >= max(1, int(fixed * w))
        e = r.engine
        if not e.scraped_at:
            return r.inflight_requests + r.shared_requests >= max(1, int(UNSCRAPED_CONCURRENCY * w))
        seen = e.running + e.waiting
        if r.max_num_seqs:
            return seen + r.placed_since_scrape_requests >= max(1, int(r.max_num_seqs * w)) + \
                self.policy.max_waiting_per_replica
        return r.placed_since_scrape_requests >= max(PROBE_BASE, int(seen * w), 2 * r.placed_last_epoch_requests)

    def _sequence_scale(self, r: Replica) -> int:
        """What the score's in-flight term counts a replica's requests against: the explicit
        max_concurrency_per_replica, else the engine's learned max_num_seqs, but never less than
        UNSCRAPED_CONCURRENCY. A cap is learned from a few saturated scrapes, and a long prefill filling a step's token
        budget looks the same for a while (PX learned caps of 1 to 5 on 64-sequence engines, dropped again seconds
        later): as a gate that costs a scrape interval, as a divisor it made each request outweigh a cached prefix."""
        return self.policy.max_concurrency_per_replica or max(r.max_num_seqs, UNSCRAPED_CONCURRENCY)

    def _concurrency_bound(self, r: Replica) -> int:
        """Requests the replica may run: the explicit limit, else its engine's learned cap, else the default."""
        return self.policy.max_concurrency_per_replica or r.max_num_seqs or UNSCRAPED_CONCURRENCY

    def ttft_limit_s(self, req: LLMRequest, now: float, waited: float = 0.0) -> float:
        """The predicted TTFT a replica may offer this request: what is left of the policy's target after the
        `waited` seconds it spent in the sidecar's queue (never less than its own prefill + REFILL_S), so its first
        token still comes within the SLO: under a sustained overload the engines' queues stay short and the wait
        happens here, where it is fair and can be shed with retry-after (P1f). Less again when the client's own
        timeout is nearer (a first token after the client gave up is ghost load, and its retry doubles it: P4,
        P5). A non-streaming client waits for the whole answer, so its expected decode time comes off."""
        limit = self.policy.ttft_target_s
        if waited > 0:
            limit = max(limit - waited, self.prefill_s(req.prompt_tokens) + REFILL_S)
        left = req.time_left_s(now)
        if left is not None:
            left = DEADLINE_SHARE * left - self.answer_decode_s(req)
            if left < limit:
                limit = left
        return limit

    def answer_decode_s(self, req: LLMRequest) -> float:
        """Decode time a non-streaming client waits for before its answer (a streaming one: 0):

            max_tokens x decode seconds per token      while the engines show it (decode_time.py `current`),
            max_tokens x start value / BOUND           before, or once no window confirmed it for STALE_S:
                                                       the fastest speed the measurement may take

        Before any measurement the configured start value is a guess, and a deadline judged on it cannot correct
        itself: a request refused decodes nothing, so nothing is learned. On engines 5x faster than the start
        value (0.02 s per token), a client allowing 0.75 s for 48 tokens was refused at once, and so was every
        other (real P5: 137 of 137 requests, deadline_unmeetable). Until the first answers teach the real speed
        (within a scrape), only what no engine within the bounds could answer in time is refused."""
        if req.stream:
            return 0.0
        per_token = self.decode_s if self.decode_measured else self.policy.decode_s_per_token / DECODE_BOUND
        return req.max_output_tokens * per_token

    def _lane_replica_cap(self, share: float) -> int:
        if share >= 1:
            return 0  # not confined
        return max(1, int(share * len(self.pool.replicas)))

    def note_lane(self, lane: int, now: float) -> None:
        """A request of `lane` arrived (the confinement of larger lanes protects lanes seen recently)."""
        self._lane_seen[lane] = now

    def lane_full(self, lane: int, now: float) -> bool:
        """A confined lane already has its share of replicas prefilling its prompts (P3): a request of it waits.

        The confinement keeps replicas free of long prefills for the smaller lanes' requests; it holds only while
        a smaller lane had a request within LANE_ACTIVE_S. When every request is of this lane (cold prompts of a
        prefix-heavy pool, PX), holding half the replicas idle for requests that do not come halved the pool."""
        cap = self._lane_caps[lane]
        if not cap:
            return False
        since = now - LANE_ACTIVE_S
        if not any(seen > since for seen in self._lane_seen[:lane]):
            return False
        prefilling = 0
        for r in self.pool.replicas:
            if r.lane_prefill_until[lane] > now:
                prefilling += 1
        return prefilling >= cap

    # ---- tenants (P1f) ---------------------------------------------------------------------------------------
    def note_tenant(self, tenant: str, now: float, tokens: float = 1.0) -> None:
        """A request of `tenant` with `tokens` prompt tokens arrived: decayed token counts (tenant and total) say
        who dominates, and the two most recent tenants say whether more than one is active."""
        if not self._tenants_tracked:
            return
        if tenant != self._last_tenant:
            self._other_at = self._last_at
            self._last_tenant = tenant
        self._last_at = now
        self._total = (self._decayed(self._total, now) + tokens, now)
        seen = self._tenant_rate.get(tenant)
        if seen is None and len(self._tenant_rate) >= MAX_TRACKED_TENANTS:
            self._tenant_rate = {t: v for t, v in self._tenant_rate.items() if now - v[1] < TENANT_ACTIVE_S}
        self._tenant_rate[tenant] = ((self._decayed(seen, now) if seen else 0.0) + tokens, now)

    @staticmethod
    def _decayed(v: tuple[float, float], now: float) -> float:
        return v[0] * math.exp((v[1] - now) / TENANT_ACTIVE_S)

    def _dominant(self, tenant: str, now: float) -> bool:
        """Another tenant is active and this one sent more than DOMINANT_SHARE of the recent prompt tokens."""
        if not self._tenants_tracked:
            return False
        other = self._other_at if tenant == self._last_tenant else self._last_at
        if other < now - TENANT_ACTIVE_S:
            return False  # alone: never limited
        seen = self._tenant_rate.get(tenant)
        return seen is not None and self._decayed(seen, now) > DOMINANT_SHARE * self._decayed(self._total, now)

    def tenant_full(self, tenant: str, now: float) -> bool:
        """The tenant is held at its replica share (tenant_prefill_share): it may take no other replica, so
        replicas stay free of its prefill for the others (P1f). A quieter tenant is never held, nor one alone."""
        return self._tenant_over(tenant, now) >= 0

    def _tenant_over(self, tenant: str, now: float) -> int:
        """Replicas the tenant is prefilling on beyond its share: 0 at it, negative within it or when not limited."""
        if self.tenant_share >= 1 or not self._dominant(tenant, now):
            return -1
        prefilling = routable = 0
        for r in self.pool.replicas:
            if r.routable:
                routable += 1
                if r.tenant_prefill_until.get(tenant, 0.0) > now:
                    prefilling += 1
        return prefilling - max(1, int(self.tenant_share * routable + 1e-9))

    def _tenant_backlog_s(self, tenant: str, now: float) -> float | None:
        """The prefill backlog (seconds) a dominant tenant's prompt may queue behind on a replica; None: no limit."""
        if self.backlog_share >= 1 or not self._dominant(tenant, now):
            return None
        return self.backlog_share * self.policy.ttft_target_s

    # ---- the score and the picker --------------------------------------------------------------------------
    def score(self, r: Replica, req: LLMRequest, now: float, lane: int = 0, work: float | None = None,
              held: float = 0.0) -> float:
        pol = self.policy
        if work is None:
            work = self.prefill_work(req.prompt_tokens)
        s = self.predicted_ttft_s(r, work, now) / pol.ttft_target_s
        # P3: a replica working on a larger lane's request (a long prefill, whose real duration the predicted
        # backlog may still understate) is the last choice for smaller requests.
        for bigger in self._confined_above[lane]:
            if r.lane_inflight[bigger]:
                s += LANE_PENALTY
        w = self.weight(r, now)
        if w < 1.0:
            # P8: a degraded, recovering or stale replica takes work only when the healthy ones are fuller.
            s += WEIGHT_PENALTY * (1.0 - w)
        cap = r.kv_capacity_tokens
        if cap:
            s += pol.score_kv_weight * (self.kv_committed(r, now) + req.total_tokens - held) / cap
        else:
            s += pol.score_kv_weight * (r.inflight_requests + r.shared_requests) / self._concurrency_bound(r)
        s += pol.score_inflight_weight * (r.inflight_requests + r.shared_requests + 1) / self._sequence_scale(r)
        return s + pol.score_waiting_weight * self.queue_ahead(r)

    def queue_ahead(self, r: Replica) -> int:
        """Requests a new one would queue behind at r's engine, for the score:

            waiting beyond room + unseen        room = free sequence slots (concurrency bound - running) when the
                                                waiting prompts fit in the KV left above kv_margin, else 0

        A request the page caught waiting while the engine had a slot and KV for it starts at the engine's next step:
        a step's delay, which the predicted TTFT already counts. Scored as a full queue place, it made the replica
        the last choice for a whole scrape interval while the others took a burst (12 equal requests on 3 idle
        replicas: 2, 3 and 7). The carried requests (`unseen`: still in the engine's API server) count in full."""
        e = r.engine
        waiting = e.waiting
        if waiting:
            cap = r.kv_capacity_tokens
            prompts = waiting * r.inflight_prompt_tokens / r.inflight_requests if r.inflight_requests else 0.0
            if not cap or e.kv_usage + prompts / cap <= 1.0 - self.policy.kv_margin:
                waiting = max(0, waiting - max(0, self._concurrency_bound(r) - e.running))
        return waiting + r.unseen_requests

    def choose(self, req: LLMRequest, lane: int, now: float, waited: float = 0.0) -> list[Replica] | None:
        """The pin list [best, runner-up] among fitting replicas, or None when nothing fits now (`waited`: seconds
        the request has been queued). A request with a subset (the gateway's hint in EPP mode, `req.subset`)
        considers only the replicas it allows."""
        best = second = None
        best_s = second_s = 0.0
        reasons = self.last_reasons
        reasons.clear()
        if self.lane_full(lane, now):
            reasons[LANE] = len(self.pool.replicas)
            return None
        # At its share, a dominant tenant may still queue behind its own prefills (keeps its replicas busy), but
        # takes no other replica; beyond it (it spread before it dominated), it waits until enough prefills end.
        over = self._tenant_over(req.tenant, now)
        if over > 0:
            reasons[TENANT] = len(self.pool.replicas)
            return None
        tenant = req.tenant if over == 0 else None
        held_s = self._tenant_backlog_s(req.tenant, now)
        ttft_limit = self.ttft_limit_s(req, now, waited)
        lookup = self._lookup_for(req)
        cached = held = NONE_CACHED
        home = None
        if lookup is not None:
            # what requests in flight hold changes with every placement and end: asked at each choice
            lookup.held = held = lookup.prefix.held_tokens(req)
            cached, home = lookup.cached, lookup.home
        subset = req.subset
        for r in self.pool.replicas:
            if subset is not None and not subset.allows(r.address):
                continue  # the gateway's subset hint (EPP mode): not a candidate at all
            if tenant is not None and r.tenant_prefill_until.get(tenant, 0.0) <= now:
                reasons[TENANT] = reasons.get(TENANT, 0) + 1
                continue
            if held_s is not None and self.backlog(r, now) > self.rate * held_s * (r.weight or 0.1):
                reasons[TENANT] = reasons.get(TENANT, 0) + 1
                continue
            work = self.prefill_work(req.prompt_tokens, cached.get(r, 0.0))
            shared = held.get(r, 0.0)
            why = self.why_not(r, req, lane, now, ttft_limit, work, shared)
            if why is not None:
                reasons[why] = reasons.get(why, 0) + 1
                continue
            s = self.score(r, req, now, lane, work, shared)
            if r is home:
                s -= home_term(cached.get(r, 0.0), req.prompt_tokens, r.kv_capacity_tokens)  # prefix_affinity.py
            if best is None or s < best_s:
                second, second_s, best, best_s = best, best_s, r, s
            elif second is None or s < second_s:
                second, second_s = r, s
        if best is None:
            return None
        return [best] if second is None else [best, second]

    # ---- accounting ------------------------------------------------------------------------------------
    def commit(self, r: Replica, req: LLMRequest, lane: int, now: float) -> Growth:
        """`req` goes to `r`: charge its uncached prompt to the replica's prefill backlog, its expected output to
        the replica's KV growth from its predicted first token on (returned: `release` takes it), and remember its
        prefix there (prefix_affinity.py)."""
        lookup, self._lookup = self._lookup, None
        cached = held = 0.0
        if lookup is not None and lookup.req is req and lookup.held is not None:  # `choose` looked it up
            cached, held = lookup.cached.get(r, 0.0), lookup.held.get(r, 0.0)
        req.prefix_held = int(min(held, req.prompt_tokens))
        r.place(req.total_tokens, req.prompt_tokens, req.prefix_held)
        req.prefill_new = req.prompt_tokens - cached
        req.prefill_work = self.prefill_work(req.prompt_tokens, cached)
        r.inflight_prefill_new += req.prefill_new
        r.inflight_prefill_work += req.prefill_work
        r.prefill_backlog = self.backlog(r, now) + req.prefill_work
        r.placed_work_total += req.prefill_work
        req.work_mark = r.placed_work_total
        r.prefill_at = now
        r.lane_prefill_until[lane] = now + r.prefill_backlog / self.rate  # prompts ahead of it prefill first
        r.lane_inflight[lane] += 1
        if self.tenant_share < 1:
            until = r.tenant_prefill_until
            if len(until) >= MAX_TENANT_ENTRIES and req.tenant not in until:
                for t in [t for t, end in until.items() if end <= now]:
                    del until[t]
            until[req.tenant] = r.lane_prefill_until[lane]
        if self.prefix is not None and req.prefix_chain:
            self.prefix.record(r, req, self.prefix.predicted_tokens(r, req), now)
        return self._ledger(r).add(r.lane_prefill_until[lane], req.expected_output_tokens, self.decode_s,
                                   req.total_tokens, req.prompt_tokens - req.prefix_held, now)

    def _ledger(self, r: Replica) -> KvGrowth:
        g = self.growth.get(r)
        if g is None:
            g = self.growth[r] = KvGrowth()
        return g

    def release(self, r: Replica, req: LLMRequest, lane: int, epoch: int, growth: Growth | None = None,
                answered: bool = False, now: float | None = None) -> None:
        """`req` ended on `r` (at `now`: its prefill is over, and with it every prompt placed before it)."""
        if now is not None:
            self._prefilled(r, req, now)
        if growth is not None:
            self._ledger(r).remove(growth)
        r.release(req.total_tokens, req.prompt_tokens, epoch, req.prefix_held, answered)
        r.inflight_prefill_new -= req.prefill_new
        r.inflight_prefill_work -= req.prefill_work
        if r.inflight_requests <= 0:
            r.inflight_prefill_new = r.inflight_prefill_work = 0.0  # no float residue on an idle replica
        if self.prefix is not None and req.prefix_chain:
            self.prefix.release(r, req)
        r.lane_inflight[lane] -= 1
        if r.lane_inflight[lane] == 0:
            r.lane_prefill_until[lane] = 0.0  # ended (or cancelled) before its predicted prefill end

    def _prefilled(self, r: Replica, req: LLMRequest, now: float) -> None:
        """A request placed on `r` ended: the engine prefills in arrival order, so what is left of the replica's
        backlog is at most the work placed after it:

            backlog = min(backlog, placed_work_total - work_mark)

        The backlog drains at the learned speed, a prediction; an end is a fact. Without it an overestimate (a
        prompt estimate 1.5x the engine's count, or a speed not yet learned because the gate never let a queue form)
        kept a replica that had finished everything looking busy for seconds (PX: both engines idle, 0.8-1.8 s of
        backlog predicted, the cold prompts that warm the cache shed). A request that ended before its first token
        (the client left) takes the same cut: the engine aborted its prefill."""
        if req.work_mark < 0:
            return
        after = r.placed_work_total - req.work_mark
        if self.backlog(r, now) > after:
            r.prefill_backlog = after
            r.prefill_at = now

    def move(self, r: Replica, to: Replica, req: LLMRequest, lane: int, epoch: int,
             growth: Growth | None = None, answered: bool = False) -> tuple[int, Growth | None]:
        """The request was served by `to`, not by `r` where it was placed (the gateway walked down the pin list):
        its accounting follows it, its KV growth with its predicted end. Returns its epoch and growth on `to`."""
        self.release(r, req, lane, epoch, growth, answered)
        req.prefix_held = 0  # what `to`'s requests in flight hold of its prefix is not known
        req.work_mark = -1.0  # nor where it stands in `to`'s order
        to.place(req.total_tokens, req.prompt_tokens)
        to.inflight_prefill_new += req.prefill_new
        to.inflight_prefill_work += req.prefill_work
        if answered:
            to.answered(req.total_tokens, req.prompt_tokens)
        if self.prefix is not None and req.prefix_chain:
            self.prefix.hold(to, req)
        to.lane_inflight[lane] += 1
        if growth is not None:
            growth = self._ledger(to).add(growth.first, growth.out, 1.0 / growth.per_s, growth.tokens)
        return to.scrape_epoch, growth
