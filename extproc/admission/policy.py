"""The `admission:` section of the policy file.

Admission is metered in tokens, not requests (P2): every request's footprint is its estimated prompt plus expected
output tokens, reserved on the replica's KV cache for as long as it runs. Lanes by prompt size keep long prompts
from stalling short ones (P3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.request import PRIORITIES
from extproc.schema import positive, require, share


@dataclass
class LanePolicy:
    """One size class of requests, by estimated prompt tokens."""

    name: str                         # the lane's name (metrics label `lane`)
    max_prompt_tokens: int            # this lane takes prompts up to this size (the last lane: everything above)
    max_queue: int = 1000             # requests waiting in this lane; beyond it new ones are shed (429)
    max_concurrency: int = 0          # requests of this lane in flight across the pool; 0 = no lane limit
    max_inflight_tokens: int = 0      # token footprint of this lane in flight across the pool; 0 = no limit
    max_replica_share: float = 1.0    # share of the pool's replicas that may run this lane's requests at once
    replicas: list[str] = field(default_factory=list)  # dedicated replicas ("ip:port"); empty = any replica

    def validate(self, path: str) -> None:
        require(self.max_queue >= 0, f"{path}.max_queue", "must be >= 0")
        share(self, path, "max_replica_share")


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
    """When a request may enter and on which replica: lanes, the fair queue, the fit test and the score."""

    enabled: bool = True                  # false: no queue, no limits, just pick the least-loaded replica
    lanes: list[LanePolicy] = field(default_factory=default_lanes)  # size classes, by increasing max_prompt_tokens
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
    score_kv_weight: float = 1.0          # score term: this x the replica's KV fraction after placing
    score_waiting_weight: float = 0.5     # score term: this x the engine's waiting requests

    def lane_for(self, prompt_tokens: int) -> int:
        for i, lane in enumerate(self.lanes):
            if prompt_tokens <= lane.max_prompt_tokens:
                return i
        return len(self.lanes) - 1

    def validate(self, path: str) -> None:
        require(bool(self.lanes), f"{path}.lanes", "must be a non-empty list")
        bounds = [lane.max_prompt_tokens for lane in self.lanes]
        require(bounds == sorted(bounds) and len(set(bounds)) == len(bounds), f"{path}.lanes",
                "must be ordered by increasing max_prompt_tokens")
        require(0 <= self.kv_margin < 1, f"{path}.kv_margin", "must be in [0, 1)")
        positive(self, path, "max_concurrency_per_replica", "prefill_tokens_per_s", "ttft_target_s")
        require(all(w > 0 for w in self.tenant_weights.values()), f"{path}.tenant_weights", "must be > 0")
        share(self, path, "tenant_prefill_share")
        require(set(self.priorities) == set(PRIORITIES), f"{path}.priorities",
                f"must be an ordering of {list(PRIORITIES)}")
