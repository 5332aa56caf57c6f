"""Prompt-size estimates calibrated against the engines' own token counts (P1, P2, P7).

The default estimator counts about 4 bytes of text per token; real tokenizers differ with the text (English prose
runs nearer 5-6 bytes per token, code and JSON nearer 3). Every admission decision inherits that error: the lane,
the KV footprint, the prefill backlog, the predicted TTFT. Measured in P1f: 2,000-token prompts estimated at about
3,000 made the sidecar predict each prefill would end twice as late as it did, so quiet tenants' requests waited in
the queue behind prefills that had already ended.

The engines count the real tokens (`vllm:prompt_tokens_total`, `sglang:prompt_tokens_total`, counted when a
request's prefill ends) and the requests whose prefill ended (the TTFT histogram's count), so they tell the mean
real prompt per request. This sidecar knows the mean estimate of the requests it sent. Over a window of enough
tokens, their ratio is the estimate's error; every new estimate is multiplied by the factor learned from it
(`Scheduler.calibrate`).

- Means, not sums: a replica that lags behind (a slow or sick one still prefilling what it was sent, P8) finishes
  fewer prompts, but their mean size is the same. Comparing sums counted the lag as an estimate error: a sick
  replica's unprefilled prompts read as "the sidecar overestimates", the factor fell, and every replica was
  overfilled (measured in P8: TTFT p95 0.53 s against 0.07 s without calibration).
- Other senders (the other workers of this sidecar, `sidecar.workers`, and other sidecars of the gateway) are
  counted by the engines too, and change nothing: they send the same mix of prompts, so the means agree. A client
  that bypasses the gateway with a different mix would bias the factor (within its bounds); it is not detected.
- Restarts and sick replicas: a counter that went down (the engine's, or this sidecar's for a replica removed and
  added again by reloads), or a replica not HEALTHY, is left out.

The factor moves by at most MAX_STEP per window: estimates feed the prompt-shift detector (P10), which must not
read the calibration converging as a change of the app's prompts. It stays within [1 / BOUND, BOUND].
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.routing.pool import HEALTHY, Replica

WINDOW_TOKENS = 30_000  # estimated prompt tokens per measurement (about 10-20 requests of a typical chat mix)
MIN_REQUESTS = 10       # ... and at least this many prefills counted by the engines
ALPHA = 0.7             # weight of a new window (geometric): the text mix of a pool changes slowly
MAX_STEP = 1.15         # no window moves the factor by more than this factor either way
BOUND = 3.0             # the factor stays within [1 / BOUND, BOUND]


@dataclass(slots=True)
class _Seen:
    """One replica at its previous scrape: the engine's counters and this sidecar's placements."""

    at: float = 0.0        # scraped_at
    prompts: float = -1.0  # the engine's prompt-token counter (-1: none yet)
    firsts: float = -1.0   # the engine's first-token count
    placed: int = 0        # this sidecar's estimated prompt tokens placed on it, cumulative ...
    requests: int = 0      # ... in this many requests


class TokenCalibration:
    """Per pool. `update` after every scrape round; `factor` multiplies every new prompt estimate."""

    def __init__(self, enabled: bool = True, factor: float = 1.0) -> None:
        self.enabled = enabled
        self.factor = factor
        self.seen: dict[str, _Seen] = {}
        # The current window: engine-counted prompt tokens and prefills; this sidecar's (calibrated) estimates
        # and requests placed.
        self._real = self._real_n = self._est = self._est_n = 0.0
        self.windows = 0  # measurements taken (for tests and the admin view)

    def update(self, replicas: list[Replica], now: float) -> float:
        """Add the new scrapes' intervals to the window; close it when it holds enough. Returns the factor."""
        if not self.enabled:
            return self.factor
        for r in replicas:
            s = self.seen.get(r.address)
            if s is None:
                s = self.seen[r.address] = _Seen()
            self._observe(s, r)
        if self._est >= WINDOW_TOKENS and self._real_n >= MIN_REQUESTS and self._est_n >= MIN_REQUESTS:
            real_mean = self._real / self._real_n
            est_mean = self._est / self._est_n
            step = (real_mean / est_mean) ** ALPHA
            step = min(MAX_STEP, max(1.0 / MAX_STEP, step))
            self.factor = min(BOUND, max(1.0 / BOUND, self.factor * step))
            self._real = self._real_n = self._est = self._est_n = 0.0
            self.windows += 1
        return self.factor

    def _observe(self, s: _Seen, r: Replica) -> None:
        e = r.engine
        if e.scraped_at <= s.at:
            return  # no new scrape of this replica
        prompts = getattr(e, "prompt_tokens_total", -1.0)
        firsts = getattr(e, "first_tokens_total", -1.0)
        usable = (s.prompts >= 0 and s.firsts >= 0 and prompts >= s.prompts and firsts >= s.firsts
                  and r.placed_requests_total >= s.requests and r.state == HEALTHY)
        if usable:
            self._real += prompts - s.prompts
            self._real_n += firsts - s.firsts
            self._est += r.placed_prompt_total - s.placed
            self._est_n += r.placed_requests_total - s.requests
        s.at, s.prompts, s.firsts = e.scraped_at, prompts, firsts
        s.placed, s.requests = r.placed_prompt_total, r.placed_requests_total

    def apply(self, prompt_tokens: int) -> int:
        """A new estimate in the engines' units."""
        f = self.factor
        if f == 1.0:
            return prompt_tokens
        return max(1, int(prompt_tokens * f + 0.5))
