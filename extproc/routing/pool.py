"""Replicas of one model and the sidecar's own accounting of what it placed on each.

The in-flight numbers here are exact for this sidecar (incremented at dispatch, decremented in the stream's
`finally`), so they are the part of a replica's load the sidecar can trust between scrapes (P7).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.config import PoolConfig


@dataclass(slots=True, eq=False)
class Replica:
    """One serving endpoint. `address` is the exact "ip:port" Envoy knows the host by (override_host)."""

    address: str
    pool: str
    inflight_requests: int = 0
    inflight_tokens: int = 0
    served_total: int = 0
    errors_total: int = 0
    draining: bool = False

    def place(self, tokens: int) -> None:
        self.inflight_requests += 1
        self.inflight_tokens += tokens

    def release(self, tokens: int) -> None:
        self.inflight_requests -= 1
        self.inflight_tokens -= tokens
        self.served_total += 1


@dataclass(eq=False)
class Pool:
    """The replicas serving one model."""

    model: str
    cluster: str
    replicas: list[Replica] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg: PoolConfig) -> "Pool":
        return cls(model=cfg.model, cluster=cfg.cluster,
                   replicas=[Replica(address=a, pool=cfg.model) for a in cfg.replicas])

    def candidates(self) -> list[Replica]:
        return [r for r in self.replicas if not r.draining]

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

    @property
    def inflight_requests(self) -> int:
        return sum(r.inflight_requests for r in self.replicas)

    @property
    def inflight_tokens(self) -> int:
        return sum(r.inflight_tokens for r in self.replicas)
