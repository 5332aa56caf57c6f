"""Which replica, if any, may take this request now: the saturation filter and the score (P3, P7, P9).

A replica fits a request when, with the request added, it stays within every limit:
  KV      used + footprint <= capacity x weight x (1 - margin)   used = max(scraped + placed since, reserved)
  queue   the engine's own waiting queue <= max_waiting (the replicas never protect themselves)
  running this sidecar's requests on it < max_concurrency x weight
  prefill predicted prefill backlog + prompt <= prefill rate x TTFT target x weight (an idle replica always
          takes one prompt, however long)
  lane    dedicated replicas, and at most max_replica_share of the replicas busy with the lane (P3)
  fresh   its metrics are recent (stale metrics count as saturated)
Among fitting replicas the lowest score wins:
  score = predicted TTFT / TTFT target + kv_weight x KV fraction after placing + waiting_weight x engine waiting
          + 1 for each larger confined lane (max_replica_share < 1, e.g. long) with a request in flight there
            (short requests avoid long prefills, P3; unconfined lanes mix freely, which keeps KV balanced, P7)
          + 4 x (1 - health weight) (degraded and slow-starting replicas are the last choice, P6/P8)
The pin list is the winner and the runner-up (Envoy tries them in order, one per attempt).
"""

from __future__ import annotations

import zlib
from typing import Callable

from extproc.admission.policy import AdmissionPolicy
from extproc.request import LLMRequest
from extproc.routing.pool import EJECTED, Pool, Replica

LANE_PENALTY = 1.0  # score added per larger lane busy on a replica (= a full TTFT target of predicted wait)
WEIGHT_PENALTY = 4.0  # score added at weight 0 (health: degraded / slow start), proportionally above

# Why a replica did not fit (counted per replica: "saturation by reason").
NOT_ROUTABLE, STALE, KV_FULL, QUEUE_FULL, CONCURRENCY, PREFILL, LANE = (
    "not_routable", "stale", "kv_full", "engine_queue", "concurrency", "prefill_backlog", "lane")


class Placer:
    """Per pool. Pure bookkeeping and arithmetic: no I/O, no awaits."""

    def __init__(self, pool: Pool, policy: AdmissionPolicy,
                 is_fresh: Callable[[Replica, float], bool] | None = None) -> None:
        self.pool = pool
        self.policy = policy
        self.is_fresh = is_fresh
        self.allow_probe: Callable[[Replica, float], bool] | None = None  # health: one probe to an ejected one
        self.rate = policy.prefill_tokens_per_s
        n_lanes = len(policy.lanes)
        for r in pool.replicas:
            if not r.kv_capacity_tokens and policy.kv_capacity_tokens:
                r.kv_capacity_tokens = policy.kv_capacity_tokens
            if len(r.lane_inflight) != n_lanes:  # a reload keeps the counts of requests still in flight
                r.lane_inflight = [0] * n_lanes
        # Replicas with at least one request of the lane in flight. Kept on the Pool, so the placer of a reload and
        # the one that placed requests still in flight count the same releases.
        # Recounted from the pool's current replicas (a reload may have removed some).
        pool.lane_busy[:] = [sum(1 for r in pool.replicas if r.lane_inflight[i] > 0) for i in range(n_lanes)]
        self.lane_busy = pool.lane_busy
        self._lane_sets = [frozenset(lane.replicas) for lane in policy.lanes]
        # Larger lanes confined to a share of the replicas (long prompts): smaller requests avoid their replicas.
        confined = [i for i, lane in enumerate(policy.lanes) if lane.max_replica_share < 1 or lane.replicas]
        self._confined_above = [[i for i in confined if i > lane] for lane in range(n_lanes)]
        self.last_reasons: dict[str, int] = {}

    # ---- estimates -------------------------------------------------------------------------------------
    def backlog(self, r: Replica, now: float) -> float:
        if r.prefill_backlog <= 0:
            return 0.0
        left = r.prefill_backlog - self.rate * (now - r.prefill_at)
        return left if left > 0 else 0.0

    def predicted_ttft_s(self, r: Replica, prompt_tokens: int, now: float) -> float:
        return (self.backlog(r, now) + prompt_tokens) / self.rate

    def max_footprint(self) -> float:
        """The largest footprint any replica could ever hold (for "can never fit")."""
        caps = [r.kv_capacity_tokens for r in self.pool.replicas if r.kv_capacity_tokens]
        return max(caps) * (1 - self.policy.kv_margin) if caps else float("inf")

    # ---- the filter ------------------------------------------------------------------------------------
    def why_not(self, r: Replica, req: LLMRequest, lane: int, now: float) -> str | None:
        pol = self.policy
        if not r.routable:
            if not (r.state == EJECTED and not r.draining and r.inflight_requests == 0
                    and self.allow_probe is not None and self.allow_probe(r, now)):
                return NOT_ROUTABLE
            return None  # a probe: one request tells health whether the replica is back
        if self.is_fresh is not None and not self.is_fresh(r, now):
            return STALE
        w = r.weight or 0.1
        lane_set = self._lane_sets[lane]
        if lane_set and r.address not in lane_set:
            return LANE
        if r.lane_inflight[lane] == 0 and self.lane_busy[lane] >= self._lane_replica_cap(lane):
            return LANE
        if r.inflight_requests >= max(1, int(pol.max_concurrency_per_replica * w)):
            return CONCURRENCY
        if r.engine.waiting > pol.max_waiting_per_replica:
            return QUEUE_FULL
        cap = r.kv_capacity_tokens
        if cap and r.kv_used_tokens() + req.total_tokens > cap * w * (1 - pol.kv_margin):
            return KV_FULL
        backlog = self.backlog(r, now)
        if backlog > 0 and backlog + req.prompt_tokens > self.rate * pol.ttft_target_s * w:
            return PREFILL
        return None

    def _lane_replica_cap(self, lane: int) -> int:
        share = self.policy.lanes[lane].max_replica_share
        if share >= 1:
            return 1 << 30  # not confined
        return max(1, int(share * len(self.pool.replicas)))

    def score(self, r: Replica, req: LLMRequest, now: float, lane: int = 0) -> float:
        pol = self.policy
        s = self.predicted_ttft_s(r, req.prompt_tokens, now) / pol.ttft_target_s
        # P3: a replica working on a larger lane's request (a long prefill, whose real duration the linear
        # backlog estimate may understate) is the last choice for smaller requests.
        for bigger in self._confined_above[lane]:
            if r.lane_inflight[bigger]:
                s += LANE_PENALTY
        if r.weight < 1.0:
            # P8: a degraded or recovering replica takes work only when the healthy ones are fuller.
            s += WEIGHT_PENALTY * (1.0 - r.weight)
        cap = r.kv_capacity_tokens
        if cap:
            s += pol.score_kv_weight * (r.kv_used_tokens() + req.total_tokens) / cap
        else:
            s += pol.score_kv_weight * r.inflight_requests / pol.max_concurrency_per_replica
        return s + pol.score_waiting_weight * r.engine.waiting

    def choose(self, req: LLMRequest, lane: int, now: float) -> list[Replica] | None:
        """The pin list [best, runner-up] among fitting replicas, or None when nothing fits now."""
        best = second = None
        best_s = second_s = 0.0
        affinity = self._affinity(req) if self.policy.affinity_slack > 0 else None
        reasons = self.last_reasons
        reasons.clear()
        for r in self.pool.replicas:
            why = self.why_not(r, req, lane, now)
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
        if r.lane_inflight[lane] == 0:
            self.lane_busy[lane] += 1
        r.lane_inflight[lane] += 1

    def release(self, r: Replica, req: LLMRequest, lane: int, epoch: int) -> None:
        r.release(req.total_tokens, req.prompt_tokens, epoch)
        r.lane_inflight[lane] -= 1
        if r.lane_inflight[lane] == 0 and self.lane_busy[lane] > 0:
            self.lane_busy[lane] -= 1
