"""Which replica, if any, may take this request now: the saturation filter and the score (P3, P7, P9).

A replica fits a request when, with the request added, it stays within every limit:
  KV      used + footprint <= capacity x weight x (1 - margin)   used = max(scraped + placed since, reserved)
  queue   the engine's own waiting queue <= max_waiting (the replicas never protect themselves)
  running requests on it (this sidecar's, plus the other sidecars' when they share through Redis) <
          max_concurrency x weight
  prefill predicted prefill backlog + prompt <= prefill rate x TTFT limit x weight (an idle replica always
          takes one prompt, however long); the limit is the policy's TTFT target, or DEADLINE_SHARE (75%) of
          the client's time left (its own timeout header) when that is less: work the client will have
          abandoned is not sent (P4, P5)
  lane    dedicated replicas, and at most max_replica_share of the replicas prefilling the lane at once (P3)
  fresh   its metrics are recent; a serving (healthy or recovering) replica whose metrics are stale but that was
          scraped before is placed cautiously, at STALE_WEIGHT x its weight in every limit and the score (a busy
          vLLM answers /metrics in seconds now and then; the sidecar's own accounting still holds), any other
          replica with stale metrics counts as saturated
Among fitting replicas the lowest score wins:
  score = predicted TTFT / TTFT target + kv_weight x KV fraction after placing + waiting_weight x engine waiting
          + 1 for each larger confined lane (max_replica_share < 1, e.g. long) with a request in flight there
            (short requests avoid long prefills, P3; unconfined lanes mix freely, which keeps KV balanced, P7)
          + 4 x (1 - health weight) (degraded and slow-starting replicas are the last choice, P6/P8)
The pin list is the winner and the runner-up (Envoy tries them in order, one per attempt).

A confined lane's share counts replicas *prefilling* its prompts (predicted from the prefill backlog), not
replicas holding one: short requests are hurt by a long prefill, not by a long context decoding (P3). While the
share is taken, a request of the lane waits in the sidecar's queue instead of stacking behind a replica's long
prefill (the engine would prefill them one after another anyway), and once a prefill ends it goes to the best
replica by score. Stacking made the same half of the pool hold every long context: KV spread 0.29 in P7 against
0.12 now (P7).

Tenants get the same kind of share (P1f): while more than one tenant is active (a request seen within the last
TENANT_ACTIVE_S), the dominant tenant may be prefilling on at most max(1, tenant_prefill_share x routable
replicas) at once.
The fair queue already puts a quiet tenant's request first, but a replica prefills in arrival order: if every
replica is busy with the flooding tenant's prompts, the quiet one's prompt shares the step with one of them and
its TTFT doubles. The share keeps replicas free of the dominant tenant's prefill. Only the tenant sending more
than DOMINANT_SHARE of the recent requests is held, a tenant alone never is; at its share it may still queue
behind its own prefills (its replicas stay busy), and its other requests wait in the fair queue (not shed).
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

from extproc.admission.policy import AdmissionPolicy
from extproc.request import LLMRequest
from extproc.routing.pool import EJECTED, HEALTHY, RECOVERING, Pool, Replica

LANE_PENALTY = 1.0  # score added per larger lane busy on a replica (= a full TTFT target of predicted wait)
WEIGHT_PENALTY = 4.0  # score added at weight 0 (health: degraded / slow start), proportionally above
TENANT_ACTIVE_S = 2.0  # a tenant with a request seen this recently counts as active for the tenant share
DOMINANT_SHARE = 0.5  # a tenant sending more than this share of the recent requests may be held at its share
MAX_TRACKED_TENANTS = 10_000  # decayed arrival counts kept; beyond it, tenants idle for TENANT_ACTIVE_S go
DEADLINE_SHARE = 0.75  # of the client's time left, the most a predicted first token (or answer) may take: the
                       # prediction counts prefill only, and decode steps sharing the engine lengthen it (P5)
MAX_TENANT_ENTRIES = 64  # per replica, tenant prefill entries before ended ones are pruned
STALE_WEIGHT = 0.5  # a serving replica whose metrics are stale takes this share of its weight (issue 16)

# Why a replica did not fit (counted per replica: "saturation by reason").
NOT_ROUTABLE, STALE, KV_FULL, QUEUE_FULL, CONCURRENCY, PREFILL, LANE, TENANT = (
    "not_routable", "stale", "kv_full", "engine_queue", "concurrency", "prefill_backlog", "lane", "tenant_share")


class Placer:
    """Per pool. Pure bookkeeping and arithmetic: no I/O, no awaits."""

    def __init__(self, pool: Pool, policy: AdmissionPolicy,
                 is_fresh: Callable[[Replica, float], bool] | None = None) -> None:
        self.pool = pool
        self.policy = policy
        self.is_fresh = is_fresh
        self.allow_probe: Callable[[Replica, float], bool] | None = None  # health: one probe to an ejected one
        self.rate = policy.prefill_tokens_per_s
        self._lane_sets = [frozenset(lane.replicas) for lane in policy.lanes]
        self._lane_caps: list[int] = []
        self.on_replicas_changed()
        # Larger lanes confined to a share of the replicas (long prompts): smaller requests avoid their replicas.
        confined = [i for i, lane in enumerate(policy.lanes) if lane.max_replica_share < 1 or lane.replicas]
        self._confined_above = [[i for i in confined if i > lane] for lane in range(len(policy.lanes))]
        self.last_reasons: dict[str, int] = {}
        self.tenant_share = policy.tenant_prefill_share
        # The two most recent tenants seen (O(1) "is another tenant active?"): the latest tenant and when it was
        # seen, and when any other tenant was last seen.
        self._last_tenant = ""
        self._last_at = self._other_at = float("-inf")
        # Arrivals per tenant and in total, decayed with time constant TENANT_ACTIVE_S: (count, as of).
        self._tenant_rate: dict[str, tuple[float, float]] = {}
        self._total = (0.0, 0.0)

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
        # Per lane: how many replicas may prefill it at once (0 = not confined).
        self._lane_caps = [self._lane_replica_cap(lane.max_replica_share) for lane in self.policy.lanes]

    # ---- estimates -------------------------------------------------------------------------------------
    def backlog(self, r: Replica, now: float) -> float:
        if r.prefill_backlog <= 0:
            return 0.0
        left = r.prefill_backlog - self.rate * (now - r.prefill_at)
        return left if left > 0 else 0.0

    def predicted_ttft_s(self, r: Replica, prompt_tokens: int, now: float) -> float:
        return (self.backlog(r, now) + prompt_tokens) / self.rate

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

    def max_footprint(self) -> float:
        """The largest footprint any replica could ever hold (for "can never fit")."""
        caps = [r.kv_capacity_tokens for r in self.pool.replicas if r.kv_capacity_tokens]
        return max(caps) * (1 - self.policy.kv_margin) if caps else float("inf")

    # ---- the filter ------------------------------------------------------------------------------------
    def why_not(self, r: Replica, req: LLMRequest, lane: int, now: float, ttft_limit_s: float) -> str | None:
        """Why `r` cannot take `req` now (None: it fits). `ttft_limit_s`: the predicted TTFT allowed
        (`ttft_limit_s()`)."""
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
        if r.inflight_requests + r.shared_requests >= max(1, int(pol.max_concurrency_per_replica * w)):
            return CONCURRENCY
        if r.engine.waiting > pol.max_waiting_per_replica:
            return QUEUE_FULL
        cap = r.kv_capacity_tokens
        if cap and r.kv_used_tokens() + req.total_tokens > cap * w * (1 - pol.kv_margin):
            return KV_FULL
        backlog = self.backlog(r, now)
        if backlog > 0 and backlog + req.prompt_tokens > self.rate * ttft_limit_s * w:
            return PREFILL
        return None

    def ttft_limit_s(self, req: LLMRequest, now: float) -> float:
        """The predicted TTFT a replica may offer this request: the policy's target, and less when the client's own
        timeout is nearer (a first token after the client gave up is ghost load, and its retry doubles it: P4,
        P5). A non-streaming client waits for the whole answer, so its expected decode time comes off."""
        limit = self.policy.ttft_target_s
        left = req.time_left_s(now)
        if left is not None:
            left = DEADLINE_SHARE * left - self.answer_decode_s(req)
            if left < limit:
                limit = left
        return limit

    def answer_decode_s(self, req: LLMRequest) -> float:
        """Decode time a non-streaming client waits for before its answer (a streaming one: 0)."""
        return 0.0 if req.stream else req.max_output_tokens * self.policy.decode_s_per_token

    def _lane_replica_cap(self, share: float) -> int:
        if share >= 1:
            return 0  # not confined
        return max(1, int(share * len(self.pool.replicas)))

    def lane_full(self, lane: int, now: float) -> bool:
        """A confined lane already has its share of replicas prefilling its prompts (P3): a request of it waits."""
        cap = self._lane_caps[lane]
        if not cap:
            return False
        prefilling = 0
        for r in self.pool.replicas:
            if r.lane_prefill_until[lane] > now:
                prefilling += 1
        return prefilling >= cap

    def note_tenant(self, tenant: str, now: float) -> None:
        """A request of `tenant` arrived: decayed arrival counts (tenant and total) say who dominates, and the
        two most recent tenants say whether more than one is active."""
        if self.tenant_share >= 1:
            return
        if tenant != self._last_tenant:
            self._other_at = self._last_at
            self._last_tenant = tenant
        self._last_at = now
        self._total = (self._decayed(self._total, now) + 1.0, now)
        seen = self._tenant_rate.get(tenant)
        if seen is None and len(self._tenant_rate) >= MAX_TRACKED_TENANTS:
            self._tenant_rate = {t: v for t, v in self._tenant_rate.items() if now - v[1] < TENANT_ACTIVE_S}
        self._tenant_rate[tenant] = ((self._decayed(seen, now) if seen else 0.0) + 1.0, now)

    @staticmethod
    def _decayed(v: tuple[float, float], now: float) -> float:
        return v[0] * math.exp((v[1] - now) / TENANT_ACTIVE_S)

    def tenant_full(self, tenant: str, now: float) -> bool:
        """The tenant sends most of the recent requests while another tenant is active, and is prefilling on its
        share of the replicas (or more): it may take no other replica, so replicas stay free of its prefill for
        the others (P1f). A quieter tenant is never held, nor a tenant alone."""
        return self._tenant_over(tenant, now) >= 0

    def _tenant_over(self, tenant: str, now: float) -> int:
        """Replicas the tenant is prefilling on beyond its share: 0 at it, negative within it or when not limited."""
        if self.tenant_share >= 1:
            return -1
        other = self._other_at if tenant == self._last_tenant else self._last_at
        if other < now - TENANT_ACTIVE_S:
            return -1  # alone: never limited
        seen = self._tenant_rate.get(tenant)
        if seen is None or self._decayed(seen, now) <= DOMINANT_SHARE * self._decayed(self._total, now):
            return -1  # not the dominant tenant
        prefilling = routable = 0
        for r in self.pool.replicas:
            if r.routable:
                routable += 1
                if r.tenant_prefill_until.get(tenant, 0.0) > now:
                    prefilling += 1
        return prefilling - max(1, int(self.tenant_share * routable + 1e-9))

    def score(self, r: Replica, req: LLMRequest, now: float, lane: int = 0) -> float:
        pol = self.policy
        s = self.predicted_ttft_s(r, req.prompt_tokens, now) / pol.ttft_target_s
        # P3: a replica working on a larger lane's request (a long prefill, whose real duration the linear
        # backlog estimate may understate) is the last choice for smaller requests.
        for bigger in self._confined_above[lane]:
            if r.lane_inflight[bigger]:
                s += LANE_PENALTY
        w = self.weight(r, now)
        if w < 1.0:
            # P8: a degraded, recovering or stale replica takes work only when the healthy ones are fuller.
            s += WEIGHT_PENALTY * (1.0 - w)
        cap = r.kv_capacity_tokens
        if cap:
            s += pol.score_kv_weight * (r.kv_used_tokens() + req.total_tokens) / cap
        else:
            busy = r.inflight_requests + r.shared_requests
            s += pol.score_kv_weight * busy / pol.max_concurrency_per_replica
        return s + pol.score_waiting_weight * r.engine.waiting

    def choose(self, req: LLMRequest, lane: int, now: float) -> list[Replica] | None:
        """The pin list [best, runner-up] among fitting replicas, or None when nothing fits now. A request with a
        subset (the gateway's hint in EPP mode, `req.subset`) considers only the replicas it allows."""
        best = second = None
        best_s = second_s = 0.0
        affinity = self._affinity(req) if self.policy.affinity_slack > 0 else None
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
        ttft_limit = self.ttft_limit_s(req, now)
        subset = req.subset
        for r in self.pool.replicas:
            if subset is not None and not subset.allows(r.address):
                continue  # the gateway's subset hint (EPP mode): not a candidate at all
            if tenant is not None and r.tenant_prefill_until.get(tenant, 0.0) <= now:
                reasons[TENANT] = reasons.get(TENANT, 0) + 1
                continue
            why = self.why_not(r, req, lane, now, ttft_limit)
            if why is not None:
                reasons[why] = reasons.get(why, 0) + 1
                continue
            s = self.score(r, req, now, lane)
            if r is affinity:
                s /= 1 + self.policy.affinity_slack
            if best is None or s < best_s:
                second, second_s, best, best_s = best, best_s, r, s
            elif second is None or s < second_s:
                second, second_s = r, s
        if best is None:
            return None
        return [best] if second is None else [best, second]

    def _affinity(self, req: LLMRequest) -> Replica | None:
        """Rendezvous hash of the prompt prefix: the same system prompt prefers the same replica (its prefix
        cache is warm) while that replica's score stays within affinity_slack of the best."""
        if not req.prefix_key:
            return None
        key = req.prefix_key.to_bytes(4, "little")
        return max(self.pool.replicas, key=lambda r: zlib.crc32(r.address.encode(), zlib.crc32(key)))

    # ---- accounting ------------------------------------------------------------------------------------
    def commit(self, r: Replica, req: LLMRequest, lane: int, now: float) -> None:
        r.place(req.total_tokens, req.prompt_tokens)
        r.prefill_backlog = self.backlog(r, now) + req.prompt_tokens
        r.prefill_at = now
        r.lane_prefill_until[lane] = now + r.prefill_backlog / self.rate  # prompts ahead of it prefill first
        r.lane_inflight[lane] += 1
        if self.tenant_share < 1:
            until = r.tenant_prefill_until
            if len(until) >= MAX_TENANT_ENTRIES and req.tenant not in until:
                for t in [t for t, end in until.items() if end <= now]:
                    del until[t]
            until[req.tenant] = r.lane_prefill_until[lane]

    def release(self, r: Replica, req: LLMRequest, lane: int, epoch: int) -> None:
        r.release(req.total_tokens, req.prompt_tokens, epoch)
        r.lane_inflight[lane] -= 1
        if r.lane_inflight[lane] == 0:
            r.lane_prefill_until[lane] = 0.0  # ended (or cancelled) before its predicted prefill end

    def move(self, r: Replica, to: Replica, req: LLMRequest, lane: int, epoch: int) -> int:
        """The request was served by `to`, not by `r` where it was placed (the gateway walked down the pin list):
        its accounting follows it. Returns its epoch on `to`."""
        self.release(r, req, lane, epoch)
        to.place(req.total_tokens, req.prompt_tokens)
        to.lane_inflight[lane] += 1
        return to.scrape_epoch
