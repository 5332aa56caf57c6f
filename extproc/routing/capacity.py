"""What a pool sustains at saturation, for P10's capacity-at-cost report (budgets/prompt_shift.py: how many
requests per second the pool serves at an app's prompt size).

    an app's capacity (requests/s) = sum over routable replicas of rate / the app's mean (calibrated) prompt

A replica's `rate` is its engine's prefill throughput while it had a queue (saturation.py `SaturatedRate`), in
the engine's prompt tokens: the units of the app's prompt it divides, an estimate calibrated against the engines'
own counts (admission/token_calibration.py). Until the engine has been seen saturated, the rate it showed while
busy stands in (`Replica.busy_prompt_tps`: the offered load, a lower bound), else the policy's prefill rate.
The decode that rode along with the prefills while measuring is in the rate; reading the capacity changes nothing.

What it does not see: an engine whose KV cache is overcommitted preempts and recomputes prefills. P10's tiny-cpu
replica, saturated with 400 queued 5,504-token prompts of 48-token outputs, prefills 0.699 requests/s when its KV
has room (0.694 with 8x the KV) but sustains 0.586 with its 512 blocks (30 preemptions per 40 requests; the
simulator's cost model, bench/capacity.py): the estimate is the prefill-bound rate, up to ~19 % above that.
"""

from __future__ import annotations

from extproc.routing.pool import Pool


def requests_per_s(pool: Pool, prompt: float, default_rate: float) -> float:
    """The pool's requests/s at `prompt` estimated prompt tokens per request: sum of rate / prompt (module
    docstring) over its routable replicas."""
    if prompt <= 0:
        return 0.0
    return sum(r.saturated.rate or r.busy_prompt_tps or default_rate for r in pool.replicas if r.routable) / prompt
