"""The `admission:` section of the policy file.

Admission is metered in tokens, not requests (P2): every request's footprint is its estimated prompt plus expected
output tokens, counted on the replica's KV cache until the engine's own numbers show what it holds. Lanes by
predicted prefill time, relative to the TTFT target, keep long prefills from stalling short requests (P3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.request import PRIORITIES
from extproc.schema import positive, require, share


@dataclass
class LanePolicy:
    """One size class of requests, by predicted prefill time relative to the TTFT target."""

    name: str                         # the lane's name (metrics label `lane`)
    max_prefill_of_target: float      # this lane takes prompts whose predicted prefill time (uncached prompt
                                      # tokens / the pool's learned prefill speed) is at most this x
                                      # admission.ttft_target_s (the last lane: everything above). In seconds,
                                      # not tokens, so the same lanes hold on any engine speed: what delays a
                                      # short request is the prefill time of what runs ahead of it (P3)
    max_queue: int = 1000             # requests waiting in this lane; beyond it new ones are shed (429)
    max_concurrency: int = 0          # requests of this lane in flight across the pool; 0 = no lane limit
    max_inflight_tokens: int = 0      # token footprint of this lane in flight across the pool; 0 = no limit
    max_replica_share: float = 1.0    # share of the pool's replicas that may run this lane's requests at once
    replicas: list[str] = field(default_factory=list)  # dedicated replicas ("ip:port"); empty = any replica

    def validate(self, path: str) -> None:
        require(self.max_queue >= 0, f"{path}.max_queue", "must be >= 0")
        positive(self, path, "max_prefill_of_target")
        share(self, path, "max_replica_share")


def default_lanes() -> list[LanePolicy]:
    return [
        LanePolicy("short", 0.1),
        LanePolicy("normal", 0.5),
        # A prompt whose prefill alone takes more than half the TTFT target would cost a short request queued
        # behind it at least half its budget: long prompts may be prefilling on at most half the replicas at
        # once, so short ones always find a replica that is not busy with a long prefill (P3).
        LanePolicy("long", 1e6, max_queue=200, max_replica_share=0.5),
    ]


@dataclass
class AdmissionPolicy:
    """When a request may enter and on which replica: lanes, the fair queue, the fit test and the score."""

    enabled: bool = True                  # false: no queue, no limits, just pick the least-loaded replica
    lanes: list[LanePolicy] = field(default_factory=default_lanes)  # size classes, by increasing
                                                                     # max_prefill_of_target
    kv_margin: float = 0.1                # keep this share of each replica's KV cache free for the growth of
                                          # the requests running (P9: no preemption); a request too large for
                                          # the rest runs alone on an idle replica
    kv_capacity_tokens: int = 0           # per replica, when the engine does not export vllm:cache_config_info
    max_concurrency_per_replica: int = 0  # requests this sidecar keeps in flight on one replica; 0 = derived from
                                          # the engine: its learned max_num_seqs (admission/seq_cap.py; 64 for a
                                          # replica without metrics). A fixed 64 held P12's 4,096-sequence engines
                                          # to 128 streams; a stream generating on an engine with free sequence
                                          # slots costs no other request anything
    max_waiting_per_replica: int = 2      # dispatch only while the engine's own waiting queue is at most this
    prefill_tokens_per_s: float = 10000.0  # replica prefill speed, for predicted TTFT: the start value, then
                                           # learned from the engines: saturated intervals, and at light load
                                           # their finished requests' prefill times (admission/prefill_rate.py)
    prefill_knee_tokens: float = 1024.0   # the context length at which a prompt token's attention costs as much
                                          # as the rest of its prefill: per-token prefill time grows as
                                          # 1 + context / knee (placement.py `prefill_work`). A property of the
                                          # engine and model: the tiny CPU models measured here fit 120-375 (cost
                                          # model) or ~1,200 from their speeds, each request's fixed costs included
                                          # (9,000 tokens/s at 500-token prompts, 3,500 at 5,000); an 8B model on
                                          # an H100 ~20,000, where this default overstates long prompts' prefill.
                                          # `sluice sim calibrate --against URL` prints your engine's. 0 = prefill
                                          # time linear in the prompt
    calibrate_prompt_tokens: bool = True  # scale prompt estimates by the engines' counted / our estimated
                                          # prompt tokens (admission/token_calibration.py)
    ttft_target_s: float = 2.0            # keep each replica's predicted prefill backlog under this
    decode_s_per_token: float = 0.02      # for deadline checks: expected time per output token; the start value,
                                          # then learned from the engines' inter-token latency
                                          # (admission/decode_time.py: 0.02 was 3x too slow in P5)
    max_wait_s: float = 0.0               # longest queue wait; 0 = derived from the SLO: ttft_target_s minus the
                                          # request's own predicted prefill (at most sidecar.max_queue_wait_ms).
                                          # A request that cannot get its first token within the SLO is shed at
                                          # once with retry-after, which clients honour, instead of waiting 30 s
                                          # and missing it anyway (P1f)
    late_wait_of_target: float = 2.0      # a queued request whose wait above ended without a replica for it, and
                                          # whose own prefill takes at most REFILL_S (0.1 s) or alone misses the
                                          # target, waits on, behind every request that can still meet the SLO, up
                                          # to this x ttft_target_s more (x its own prefill when that is longer;
                                          # never past the client's own deadline), and is served late by a replica
                                          # with at most REFILL_S of prefill ahead, rather than refused (429
                                          # queue_timeout after a futile wait: P1's slow refusals; PX's cold
                                          # prompts). Its SLO is lost either way, and the SDK's retry of a refusal
                                          # comes later still, or is refused by the retry budget. 0 = refuse at
                                          # the end of the wait above
    tenant_weights: dict[str, float] = field(default_factory=dict)  # fair-share weights (default 1)
    tenant_prefill_share: float = 1.0     # while several tenants are active, the one sending most requests may
                                          # prefill on at most this share of the replicas at once (at least 1);
                                          # 1 = no limit; 0.5 keeps a quiet tenant's TTFT near its solo value
                                          # under a flood, at the flood's throughput (P1f)
    tenant_backlog_share: float = 0.0     # while several tenants are active, the one sending most prompt tokens is
                                          # placed on a replica only behind at most this x ttft_target_s of
                                          # predicted prefill; 0: only where the predicted prefill has drained,
                                          # one of its prompts at a time per replica, its others waiting in the
                                          # fair queue, where the other tenants' requests go first. The engine
                                          # prefills in arrival order, so a quiet tenant's prompt waits behind
                                          # whatever the flood already placed there: at 0.25 (of P1f's 0.5 s
                                          # target) about two of its prompts, the quiet tenant's TTFT p95 3.6-5.2x
                                          # its solo value; at 0, 2.0-2.4x, for 8% of the flood's completions
                                          # (sluice only, quick runs). A tenant alone is never held. 1 = off
    priorities: list[str] = field(default_factory=lambda: list(PRIORITIES))  # highest first
    prefix_affinity: bool = True          # place a request where its prompt's prefix is cached, as confirmed by
                                          # the engines' prefix-cache hit counters, and keep a prefix on the
                                          # replica it went to last unless another scores better by more than
                                          # half a TTFT target x the prompt's cached share (in proportion less for
                                          # a prefix under a tenth of the KV): a move computes the prefix again
                                          # and evicts another there (admission/prefix_affinity.py `home_term`)
    score_kv_weight: float = 1.0          # score term: this x the replica's KV fraction after placing
    score_waiting_weight: float = 0.5     # score term: this x the engine's waiting requests
    score_inflight_weight: float = 1.0    # score term: this x the replica's requests in flight (with the new one)
                                          # / its max sequences (at least 64): each sequence costs a decode slot
                                          # however little KV it holds, so equal requests spread over equal replicas

    def lane_for(self, prefill_s: float) -> int:
        """The first lane whose bound holds a prompt of `prefill_s` predicted seconds of prefill."""
        of_target = prefill_s / self.ttft_target_s
        for i, lane in enumerate(self.lanes):
            if of_target <= lane.max_prefill_of_target:
                return i
        return len(self.lanes) - 1

    def validate(self, path: str) -> None:
        require(bool(self.lanes), f"{path}.lanes", "must be a non-empty list")
        bounds = [lane.max_prefill_of_target for lane in self.lanes]
        require(bounds == sorted(bounds) and len(set(bounds)) == len(bounds), f"{path}.lanes",
                "must be ordered by increasing max_prefill_of_target")
        require(0 <= self.kv_margin < 1, f"{path}.kv_margin", "must be in [0, 1)")
        positive(self, path, "prefill_tokens_per_s", "ttft_target_s", "decode_s_per_token")
        require(self.prefill_knee_tokens >= 0, f"{path}.prefill_knee_tokens", "must be >= 0")
        require(self.late_wait_of_target >= 0, f"{path}.late_wait_of_target", "must be >= 0")
        require(self.max_concurrency_per_replica >= 0, f"{path}.max_concurrency_per_replica", "must be >= 0")
        require(self.score_inflight_weight >= 0, f"{path}.score_inflight_weight", "must be >= 0")
        require(all(w > 0 for w in self.tenant_weights.values()), f"{path}.tenant_weights", "must be > 0")
        share(self, path, "tenant_prefill_share")
        require(0 <= self.tenant_backlog_share <= 1, f"{path}.tenant_backlog_share",
                f"must be in [0, 1], got {self.tenant_backlog_share!r}")
        require(set(self.priorities) == set(PRIORITIES), f"{path}.priorities",
                f"must be an ordering of {list(PRIORITIES)}")
