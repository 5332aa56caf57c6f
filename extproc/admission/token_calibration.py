"""Prompt-size estimates calibrated against the engines' own token counts (P1, P2, P7).

The default estimator counts about 4 bytes of text per token; real tokenizers differ with the text (English prose
runs nearer 5-6 bytes per token, code and JSON nearer 3). Every admission decision inherits that error: the lane,
the KV footprint, the prefill backlog, the predicted TTFT. Measured in P1f: 2,000-token prompts estimated at about
3,000 made the sidecar predict each prefill would end twice as late as it did, so quiet tenants' requests waited in
the queue behind prefills that had already ended.

The engines count the real tokens (`vllm:prompt_tokens_total`, `sglang:prompt_tokens_total`), and this sidecar
knows what it estimated for every prompt it sent. Over a window of enough tokens, real / estimated is the error;
every new estimate is multiplied by the factor learned from it (`Scheduler.calibrate`).

- Alignment: an engine counts a prompt once it is prefilled, the sidecar when it dispatches it. The estimated side
  of an interval is what was dispatched minus the growth of the placer's predicted backlog (prompts dispatched and
  not yet prefilled), so a burst in flight at a scrape does not read as an estimate error.
- Other senders: a replica running more requests than this sidecar has in flight on it also serves someone else
  (another sidecar, a direct client); their tokens are not in our estimate, so its interval is left out.
- Restarts and sick replicas: a counter that went down, or a replica not HEALTHY, is left out.
- Requests cancelled before their prefill are estimated but never counted by the engine: the factor reads low by
  their share of the window's tokens (measured in P4: a few percent).

The factor moves by at most MAX_STEP per window: estimates feed the prompt-shift detector (P10), which must not
read the calibration converging as a change of the app's prompts. It stays within [1 / BOUND, BOUND].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from extproc.routing.pool import HEALTHY, Replica

WINDOW_TOKENS = 30_000  # estimated prompt tokens per measurement (about 10-20 requests of a typical chat mix)
ALPHA = 0.7             # weight of a new window (geometric): the text mix of a pool changes slowly
MAX_STEP = 1.15         # no window moves the factor by more than this factor either way
BOUND = 3.0             # the factor stays within [1 / BOUND, BOUND]
OTHER_SENDERS_SLACK = 2  # engine requests beyond ours tolerated (requests just released, retries elsewhere)


@dataclass(slots=True)
class _Seen:
    """One replica at its previous scrape."""

    at: float = 0.0        # scraped_at
    total: float = -1.0    # the engine's prompt-token counter (-1: none yet)
    placed: int = 0        # this sidecar's estimated prompt tokens placed on it, cumulative
    backlog: float = 0.0   # the placer's predicted unprefilled prompt tokens


class TokenCalibration:
    """Per pool. `update` after every scrape round; `factor` multiplies every new prompt estimate."""

    def __init__(self, enabled: bool = True, factor: float = 1.0) -> None:
        self.enabled = enabled
        self.factor = factor
        self.seen: dict[str, _Seen] = {}
        self._real = 0.0  # the current window: engine-counted prompt tokens ...
        self._est = 0.0   # ... and this sidecar's (calibrated) estimate of the same prompts
        self.windows = 0  # measurements taken (for tests and the admin view)

    def update(self, replicas: list[Replica], backlog: Callable[[Replica, float], float], now: float) -> float:
        """Add the new scrapes' intervals to the window; close it when it holds enough tokens. Returns the factor."""
        if not self.enabled:
            return self.factor
        for r in replicas:
            s = self.seen.get(r.address)
            if s is None:
                s = self.seen[r.address] = _Seen()
            self._observe(s, r, backlog(r, now))
        if self._est >= WINDOW_TOKENS and self._real > 0:
            step = (self._real / self._est) ** ALPHA
            step = min(MAX_STEP, max(1.0 / MAX_STEP, step))
            self.factor = min(BOUND, max(1.0 / BOUND, self.factor * step))
            self._real = self._est = 0.0
            self.windows += 1
        return self.factor

    def _observe(self, s: _Seen, r: Replica, backlog: float) -> None:
        e = r.engine
        if e.scraped_at <= s.at:
            return  # no new scrape of this replica
        total = e.prompt_tokens_total
        usable = (s.total >= 0 and total >= s.total and r.state == HEALTHY
                  and e.running + e.waiting <= r.inflight_requests + OTHER_SENDERS_SLACK)
        if usable:
            est = (r.placed_prompt_total - s.placed) - (backlog - s.backlog)
            real = total - s.total
            if est > 0 and real >= 0:
                self._real += real
                self._est += est
        s.at, s.total, s.placed, s.backlog = e.scraped_at, total, r.placed_prompt_total, backlog

    def apply(self, prompt_tokens: int) -> int:
        """A new estimate in the engines' units."""
        f = self.factor
        if f == 1.0:
            return prompt_tokens
        return max(1, int(prompt_tokens * f + 0.5))
