"""The `admission:` section of the policy file.

Admission is metered in tokens, not requests (P2): every request's footprint is its estimated prompt plus expected
output tokens, reserved on the replica's KV cache for as long as it runs. Lanes by prompt size keep long prompts
from stalling short ones (P3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from extproc.request import PRIORITIES


@dataclass
class LanePolicy:
    """One size class of requests, by estimated prompt tokens."""

    name: str
    max_prompt_tokens: int            # this lane takes prompts up to this size (the last lane: everything above)
    max_queue: int = 1000             # requests waiting in this lane; beyond it new ones are shed (429)
    max_concurrency: int = 0          # requests of this lane in flight across the pool; 0 = no lane limit
    max_inflight_tokens: int = 0      # token footprint of this lane in flight across the pool; 0 = no limit
    max_replica_share: float = 1.0    # share of the pool's replicas that may run this lane's requests at once
    replicas: list[str] = field(default_factory=list)  # dedicated replicas ("ip:port"); empty = any replica


def default_lanes() -> list[LanePolicy]:
    return [
        LanePolicy("short", 1024),
        LanePolicy("normal", 8192),
        # Long prompts may occupy at most half the replicas at once, so short ones always find a replica
        # that is not busy with a long prefill (P3).
        LanePolicy("long", 1 << 30, max_queue=200, max_replica_share=0.5),
    ]


@dataclass
class AdmissionPolicy:
    enabled: bool = True                  # false: no queue, no limits, just pick the least-loaded replica
    lanes: list[LanePolicy] = field(default_factory=default_lanes)
    kv_margin: float = 0.1                # keep this share of each replica's KV cache free (P9: no preemption)
    kv_capacity_tokens: int = 0           # per replica, when the engine does not export vllm:cache_config_info
    max_concurrency_per_replica: int = 64  # requests this sidecar keeps in flight on one replica
    max_waiting_per_replica: int = 2      # dispatch only while the engine's own waiting queue is at most this
    prefill_tokens_per_s: float = 10000.0  # replica prefill speed, for predicted TTFT: the start value, then
                                           # learned from saturated engines (admission/prefill_rate.py)
    calibrate_prompt_tokens: bool = True  # scale prompt estimates by the engines' counted / our estimated
                                          # prompt tokens (admission/token_calibration.py)
    ttft_target_s: float = 2.0            # keep each replica's predicted prefill backlog under this
    decode_s_per_token: float = 0.02      # for deadline checks: expected time per output token
    max_wait_s: float = 0.0               # longest queue wait; 0 = sidecar.max_queue_wait_ms
    tenant_weights: dict[str, float] = field(default_factory=dict)  # fair-share weights (default 1)
    tenant_prefill_share: float = 1.0     # while several tenants are active, the one sending most requests may
                                          # prefill on at most this share of the replicas at once (at least 1);
                                          # 1 = no limit; 0.5 keeps a quiet tenant's TTFT near its solo value
                                          # under a flood, at the flood's throughput (P1f)
    priorities: list[str] = field(default_factory=lambda: list(PRIORITIES))  # highest first
    affinity_slack: float = 0.0           # prefer the prompt-prefix replica if its score is within this share
    score_kv_weight: float = 1.0          # score = predicted TTFT / target + kv_weight * KV fraction after
    score_waiting_weight: float = 0.5     #         + waiting_weight * engine waiting

    def lane_for(self, prompt_tokens: int) -> int:
        for i, lane in enumerate(self.lanes):
            if prompt_tokens <= lane.max_prompt_tokens:
                return i
        return len(self.lanes) - 1


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"admission.{message}")


def admission_policy_from_dict(data: dict[str, Any], default_max_wait_s: float) -> AdmissionPolicy:
    """Validate the `admission:` mapping; every error names the field."""
    data = dict(data or {})
    known = {f.name for f in dataclasses.fields(AdmissionPolicy)}
    unknown = sorted(set(data) - known)
    _check(not unknown, f"unknown field(s): {', '.join(unknown)}")
    lanes_raw = data.pop("lanes", None)
    policy = AdmissionPolicy(**data)
    if lanes_raw is not None:
        _check(isinstance(lanes_raw, list) and lanes_raw, "lanes must be a non-empty list")
        lane_fields = {f.name for f in dataclasses.fields(LanePolicy)}
        lanes = []
        for i, raw in enumerate(lanes_raw):
            _check(isinstance(raw, dict), f"lanes[{i}] must be a mapping")
            bad = sorted(set(raw) - lane_fields)
            _check(not bad, f"lanes[{i}]: unknown field(s) {', '.join(bad)}")
            _check("name" in raw and "max_prompt_tokens" in raw, f"lanes[{i}] needs name and max_prompt_tokens")
            lanes.append(LanePolicy(**raw))
        policy.lanes = lanes
    bounds = [lane.max_prompt_tokens for lane in policy.lanes]
    _check(bounds == sorted(bounds) and len(set(bounds)) == len(bounds),
           "lanes must be ordered by increasing max_prompt_tokens")
    for lane in policy.lanes:
        _check(lane.max_queue >= 0, f"lanes[{lane.name}].max_queue must be >= 0")
        _check(0 < lane.max_replica_share <= 1, f"lanes[{lane.name}].max_replica_share must be in (0, 1]")
    _check(0 <= policy.kv_margin < 1, "kv_margin must be in [0, 1)")
    _check(policy.max_concurrency_per_replica > 0, "max_concurrency_per_replica must be > 0")
    _check(policy.prefill_tokens_per_s > 0, "prefill_tokens_per_s must be > 0")
    _check(policy.ttft_target_s > 0, "ttft_target_s must be > 0")
    _check(all(w > 0 for w in policy.tenant_weights.values()), "tenant_weights must be > 0")
    _check(0 < policy.tenant_prefill_share <= 1, "tenant_prefill_share must be in (0, 1]")
    _check(set(policy.priorities) == set(PRIORITIES), f"priorities must be an ordering of {list(PRIORITIES)}")
    if policy.max_wait_s <= 0:
        policy.max_wait_s = default_max_wait_s
    return policy
