"""A replica's prefill throughput while its engine had a queue (routing/capacity.py), in the engine's own prompt
tokens.

Engines count a prompt's tokens in one lump when its prefill ends (`vllm:prompt_tokens_total`; the first-token
count rises by one at the same moment), so tokens counted over a scrape interval are 0 or whole prompts: a
window of a few seconds held 2-4 prefills of P10's 5,500-token prompts, +-1 of them at its edges (+-30 %). The
rate is therefore taken between prefill ends: within one run of saturated scrapes (waiting > 0 at both ends of
each interval), the prompt tokens counted after the run's first counted end, over the time since that end:

    rate = sum(prompt tokens counted at each later end) / sum(time since the run's previous end)

The sums decay with TAU_S, so the newer prompt mix counts most, and are kept while the engine is not saturated
(the last saturated rate stands). A restart (counters down) starts a new run.

The engine's tokens, not this sidecar's estimates of them: capacity.py divides the rate by an app's calibrated
prompt estimate (admission/token_calibration.py), which is in the engine's units. A rate in estimated tokens
kept the units of the factor it was measured at: when the calibration's first window rescaled every estimate by
1/1.5, P10's capacity read 1.66 requests/s against a true 1.17 (1.40 with the rate in the engine's tokens, the rest
being the prefill-bound rate's, capacity.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

TAU_S = 10.0  # decay time of the saturated sums (the scrape window's length)


@dataclass(slots=True)
class SaturatedRate:
    """One replica's prefill throughput while its engine had a queue, in the engine's prompt tokens/s."""

    seconds: float = 0.0      # decayed time from each run's first counted prefill end to its last
    tokens: float = 0.0       # decayed prompt tokens that ended within that time
    at: float = 0.0           # scraped_at of the previous scrape (0: none)
    firsts: float = -1.0      # the engine's first-token count then (-1: none, or not exported)
    prompts: float = -1.0     # the engine's prompt-token count then (-1: none, or not exported)
    waiting: int = 0          # its waiting queue then
    anchor: float = -1.0      # scraped_at of the last prefill end counted in the current saturated run (-1: none)
    added_at: float = 0.0     # scraped_at of the last measurement added (0: none)

    @property
    def rate(self) -> float:
        """tokens / seconds (0: never measured)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def observe(self, e: Any) -> None:
        """A new scrape `e` (EngineState)."""
        at = e.scraped_at
        if at <= self.at:
            return
        firsts = float(getattr(e, "first_tokens_total", -1.0))
        prompts = float(getattr(e, "prompt_tokens_total", -1.0))
        ended = firsts - self.firsts if firsts >= 0 and self.firsts >= 0 else -1.0
        counted = prompts - self.prompts if prompts >= 0 and self.prompts >= 0 else -1.0
        saturated = (self.waiting > 0 and e.waiting > 0 and ended >= 0 and counted >= 0
                     and not getattr(e, "restarted", False))
        if not saturated:
            self.anchor = -1.0
        elif ended > 0:
            if self.anchor >= 0 and counted > 0:
                self._add(at, at - self.anchor, counted)
            self.anchor = at
        self.at, self.firsts, self.prompts, self.waiting = at, firsts, prompts, e.waiting

    def _add(self, at: float, seconds: float, tokens: float) -> None:
        """sums = sums x exp(-(time since the last measurement) / TAU_S) + this measurement."""
        keep = math.exp(-(at - self.added_at) / TAU_S) if self.added_at > 0 else 0.0
        self.seconds = self.seconds * keep + seconds
        self.tokens = self.tokens * keep + tokens
        self.added_at = at
