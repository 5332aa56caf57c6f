"""How long the replicas take per output token, learned from their own inter-token latency (P5).

Deadline-aware placement gives a non-streaming request's answer `max_tokens x decode time per token` of the
client's time (placement.py `answer_decode_s`), and a slow consumer is one that reads far slower than its
replica generates (streaming.py). A fixed `admission.decode_s_per_token` is wrong for most engines: 0.02 s was
about 3x too slow for the simulated tiny-cpu engine (5-7 ms per token measured in P5), so requests that would
have been answered in time were refused.

The measurement: each replica's mean inter-token latency over the last second (`History.recent_s`: the engine's
`vllm:inter_token_latency_seconds` histogram, delta of its sum / delta of its count, routing/scrape.py), weighted
by the intervals each holds, over the healthy replicas at full weight (a sick replica's slowness is
health's business):

    decode_s_per_token = sum(itl_r x n_r) / sum(n_r)        while sum(n_r) >= MIN_INTERVALS

It is the pool's current speed at its current batch sizes, so it follows load; when the window holds too few
tokens (an idle pool) the last measurement stands, and before any the configured value does. It stays within
a factor BOUND of the configured value, so a bogus histogram cannot make every deadline look easy or impossible.

A measurement older than STALE_S is not `current`: deadlines then plan with the fastest speed within the bounds
(placement.py `answer_decode_s`). Refusals decode nothing, so a speed measured while the engines were slow would
otherwise refuse every later request, and nothing would ever measure it again: real P5 measured ~50 ms per token
while both engines ran at a third of their speed, and refused 32 of the 36 requests after they had recovered.
The measurement covers the last second, not the scrape's 10 s window, for the same reason: the window kept the
slowdown's intervals for 10 s after it ended, renewed as a measurement at every scrape (real P5 after P4: 37 ms
per token read from engines running nothing, 36 of 36 requests refused after the slowdown).
"""

from __future__ import annotations

from extproc.routing.pool import HEALTHY, Replica

MIN_INTERVALS = 20.0  # inter-token intervals the pool's windows must hold together to be a measurement
BOUND = 10.0          # the learned value stays within [configured / BOUND, configured x BOUND]
STALE_S = 2.0         # a measurement with no newer one for this long no longer decides deadlines


class DecodeTime:
    """Per pool. `update` after every scrape round; `value` is the decode time per token to plan with."""

    __slots__ = ("prior", "value", "learned", "measured_at")

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.value = prior
        self.learned = False
        self.measured_at = float("-inf")

    def current(self, now: float) -> bool:
        """The engines showed their speed within the last STALE_S."""
        return self.learned and now - self.measured_at <= STALE_S

    def update(self, replicas: list[Replica], now: float = 0.0) -> float:
        """Take the new scrapes' inter-token latency; return the pool's decode seconds per token."""
        total_s = total_n = 0.0
        for r in replicas:
            if r.state != HEALTHY or r.weight < 1.0:
                continue
            e = r.engine
            n = getattr(e, "itl_count_recent", 0.0)
            itl = getattr(e, "itl_s", 0.0)
            if n > 0 and itl > 0:
                total_s += itl * n
                total_n += n
        if total_n >= MIN_INTERVALS:
            mean = total_s / total_n
            self.value = min(self.prior * BOUND, max(self.prior / BOUND, mean))
            self.learned = True
            self.measured_at = now
        return self.value
