"""A pool's token throughput, for P10's capacity-at-cost report (budgets/prompt_shift.py: how many requests per
second the pool serves at an app's old and new cost per request).

    capacity = sum over routable replicas of (its busy prompt rate, else the policy's prefill rate)

A replica's busy prompt rate is the prompt-token rate (over the scrape window) its engine showed the last time
it was busy, recorded at each scrape (`Replica.on_scrape`); reading the capacity changes nothing. The last busy
rate, not the peak: prefill per token slows as prompts grow, and the report is about the prompts now being sent.
Prefill dominates a long prompt's cost (and completions are mostly unobserved), hence prompt tokens.
"""

from __future__ import annotations

from extproc.routing.pool import Pool


def tokens_per_s(pool: Pool, default_rate: float) -> float:
    """The pool's prompt tokens per second, in the engines' own tokens."""
    return sum(r.busy_prompt_tps or default_rate for r in pool.replicas if r.routable)
