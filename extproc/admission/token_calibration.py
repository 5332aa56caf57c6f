"""Prompt-size estimates calibrated against the engines' own token counts (P1, P2, P7).

The default estimator counts about 4 bytes of text per token; real tokenizers differ with the text (English prose
runs nearer 5-6 bytes per token, code and JSON nearer 3). Every admission decision inherits that error: the lane,
the KV footprint, the prefill backlog, the predicted TTFT. Measured in P1f: 2,000-token prompts estimated at about
3,000 made the sidecar predict each prefill would end twice as late as it did, so quiet tenants' requests waited in
the queue behind prefills that had already ended.

The engines count the real tokens (`vllm:prompt_tokens_total`, `sglang:prompt_tokens_total`, counted when a
request's prefill ends) and the requests whose prefill ended (the TTFT histogram's count), so they tell the mean
real prompt per request. This sidecar knows what it estimated for the same requests: per replica, its placements
in order; each prefill the engine counts is matched with the oldest placement not matched yet (engines schedule
first come, first served), in raw estimate tokens (before calibration: the placement's estimate / the factor it
was made with). Over a window of enough tokens:

    target = mean real prompt of the prefills counted / mean raw estimate of the placements matched to them

and every new estimate is the raw one x the factor learned from it (`Scheduler.calibrate`).

- Matched, not as they happen: when an app's prompts grow 5.5x (P10), the engine prefills the old ones from its
  queue for seconds while the new ones are placed. Compared as they happened, that lag read as an estimate error
  (a P10-shaped test, tests/admission/test_token_calibration.py: a first window of 0.54 where the engine counts
  2/3 of the estimate). In raw units, a factor that changed while a request waited does not feed back into its
  own measurement.
- Means, not sums: a replica that lags behind (a slow or sick one still prefilling what it was sent, P8) finishes
  fewer prompts, but their mean size is the same. Comparing sums counted the lag as an estimate error: a sick
  replica's unprefilled prompts read as "the sidecar overestimates", the factor fell, and every replica was
  overfilled (measured in P8: TTFT p95 0.53 s against 0.07 s without calibration).
- What the engine never counts (a request aborted while it waited) would shift the matching: at most the engine's
  waiting requests + 1 (the one prefilling) + the placements since the scrape stay unmatched; older ones are
  dropped.
- Other senders (the other workers of this sidecar, `sidecar.workers`, and other sidecars of the gateway) are
  counted by the engines too, and change nothing: their prefills match this sidecar's placements early, but they
  send the same mix of prompts, so the means agree. A client
  that bypasses the gateway with a different mix would bias the factor (within its bounds); it is not detected.
- Restarts and sick replicas: a counter that went down (the engine's, or this sidecar's for a replica removed and
  added again by reloads), or a replica not HEALTHY, is left out.

The first window sets the factor to its target: a pool's text mix is far from 4 bytes per token from the start
(1.58x on the real-engine rig's text), and every request until the factor fits is mis-laned (P7 on real engines:
5,000-token prompts estimated at 8,000 predicted a 0.7 s prefill at 2.7 s, the long lane, one replica at a time).
The first window takes seconds to fill (30,000 estimated tokens: 4 of P7's long prompts, 5 s), and a sidecar that
just started mis-lanes until then: measured on the real engines, P7's second long prompt waited 1.4 s behind the
first in the long lane and was shed, twice. So until it closes, the factor already follows what the window holds,
at every scrape where the sums are exact: every placement on every replica of the pool matched by a prefill the
engine counted (nothing in flight unprefilled), at least WARM_MIN_REQUESTS of them. Boundary errors, a short
prompt's prefill counted against a long one's placement, cancel at those moments, so a few requests suffice; at a
scrape that catches a prefill in flight the factor keeps its value.
Later windows move it towards the target, x (target / factor) ^ ALPHA, by at most MAX_STEP: the mix changes slowly,
and a change of the app's prompts must not read as one of units. The prompt-shift detector (P10) compares estimates,
so a factor that moves by more than MAX_STEP starts a new `epoch`: each estimate carries the epoch it was made in
(`LLMRequest.prompt_units`), and the detector learns an app's baseline again in the new one rather than read the
change of units as a change of the app's prompts (budgets/prompt_shift.py). The factor stays within [1 / BOUND,
BOUND].
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from extproc.routing.pool import HEALTHY, Replica

WINDOW_TOKENS = 30_000  # estimated prompt tokens per measurement (about 10-20 requests of a typical chat mix)
MIN_REQUESTS = 10       # ... and at least this many prefills counted by the engines
WARM_MIN_REQUESTS = 3   # before the first window closes, the factor follows it from this many matched prefills
ALPHA = 0.7             # weight of a window after the first (geometric): the text mix of a pool changes slowly
MAX_STEP = 1.15         # no window after the first moves the factor by more than this factor either way
BOUND = 3.0             # the factor stays within [1 / BOUND, BOUND]

# Epochs are numbered across every calibration of the process, so a calibration built anew (a reload that turns it
# on or off: its estimates are raw again) starts an epoch later than any estimate made before it.
_epochs = itertools.count()


@dataclass(slots=True)
class _Seen:
    """One replica at its previous scrape: the engine's counters and this sidecar's placements."""

    at: float = 0.0        # scraped_at
    prompts: float = -1.0  # the engine's prompt-token counter (-1: none yet)
    firsts: float = -1.0   # the engine's first-token count
    placed: int = 0        # this sidecar's estimated prompt tokens placed on it, cumulative ...
    requests: int = 0      # ... in this many requests
    # Placements the engine has not counted as prefilled yet, oldest first: [requests, estimated tokens] per
    # scrape interval, and their requests in all.
    unprefilled: deque[list[float]] = field(default_factory=deque)
    unprefilled_n: float = 0.0

    def placed_since(self, r: Replica, factor: float) -> float:
        """Queue the placements on `r` since the previous scrape, estimated at `factor`, in raw estimate tokens;
        their count (< 0: `r` is a new object)."""
        n = r.placed_requests_total - self.requests
        if n > 0:
            self.unprefilled.append([float(n), (r.placed_prompt_total - self.placed) / factor])
            self.unprefilled_n += n
        elif n < 0:
            self.forget()
        return n

    def prefilled(self, k: float) -> tuple[float, float]:
        """The engine counted `k` more prefills: take the oldest `k` placements. Returns (requests, tokens)."""
        n = tokens = 0.0
        q = self.unprefilled
        while q and n < k:
            batch = q[0]
            take = min(batch[0], k - n)
            part = batch[1] * take / batch[0]
            n += take
            tokens += part
            if take >= batch[0]:
                q.popleft()
            else:
                batch[0] -= take
                batch[1] -= part
        self.unprefilled_n -= n
        return n, tokens

    def trim(self, keep: float) -> None:
        """Keep at most `keep` requests unmatched, dropping the oldest (never counted: aborted while waiting)."""
        q = self.unprefilled
        while q and self.unprefilled_n - q[0][0] >= keep:
            self.unprefilled_n -= q.popleft()[0]

    def forget(self) -> None:
        self.unprefilled.clear()
        self.unprefilled_n = 0.0


class TokenCalibration:
    """Per pool. `update` after every scrape round; `factor` multiplies every new prompt estimate."""

    def __init__(self, enabled: bool = True, factor: float = 1.0) -> None:
        self.enabled = enabled
        self.factor = factor
        self.seen: dict[str, _Seen] = {}
        # The current window: engine-counted prompt tokens and prefills; this sidecar's raw estimates (before
        # calibration) of the same prefills, and how many it matched.
        self._real = self._real_n = self._est = self._est_n = 0.0
        self.windows = 0  # measurements taken (for tests and the admin view)
        self.epoch = next(_epochs)  # a new one whenever a window moves the factor by more than MAX_STEP
        self._epoch_factor = factor  # the factor the epoch began with

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
            self._close_window(self._real / self._real_n, self._est / self._est_n)
        elif self.windows == 0 and self._est_n >= WARM_MIN_REQUESTS and self._all_matched(replicas):
            self._set(self._real / self._real_n / (self._est / self._est_n))
        return self.factor

    def _all_matched(self, replicas: list[Replica]) -> bool:
        """Every placement on every replica of the pool is matched by a prefill the engine counted: the window's
        sums are exact now (no prefill counted against another request's placement at its edge). A replica that
        left the pool counts no more prefills: its unmatched placements would hold the warm-up off for good."""
        seen = self.seen
        return all(seen[r.address].unprefilled_n == 0 for r in replicas)

    def _set(self, factor: float) -> None:
        """Set the factor (within [1 / BOUND, BOUND]); a new epoch once it is more than MAX_STEP from the factor
        the epoch began with."""
        self.factor = min(BOUND, max(1.0 / BOUND, factor))
        f0 = self._epoch_factor
        if max(self.factor / f0, f0 / self.factor) > MAX_STEP:
            self.epoch = next(_epochs)
            self._epoch_factor = self.factor

    def _close_window(self, real_mean: float, raw_mean: float) -> None:
        """The factor after a window whose prefills the engines counted at `real_mean` tokens each and this sidecar
        estimated at `raw_mean` before calibration: real / raw on the first; later, x (real / raw / factor) ^ ALPHA
        within MAX_STEP either way; always within [1 / BOUND, BOUND]."""
        if self.windows == 0:
            self._set(real_mean / raw_mean)  # only the first window (and the warm-up) can move it more than MAX_STEP
        else:
            step = min(MAX_STEP, max(1.0 / MAX_STEP, (real_mean / raw_mean / self.factor) ** ALPHA))
            self.factor = min(BOUND, max(1.0 / BOUND, self.factor * step))
        self._real = self._real_n = self._est = self._est_n = 0.0
        self.windows += 1

    def _observe(self, s: _Seen, r: Replica) -> None:
        e = r.engine
        if e.scraped_at <= s.at:
            return  # no new scrape of this replica
        prompts = getattr(e, "prompt_tokens_total", -1.0)
        firsts = getattr(e, "first_tokens_total", -1.0)
        placed = s.placed_since(r, self.factor)
        if s.prompts >= 0 and s.firsts >= 0 and placed >= 0:
            if prompts < s.prompts or firsts < s.firsts:
                s.forget()  # the engine restarted: what it had not prefilled is gone
            else:
                n, tokens = s.prefilled(firsts - s.firsts)
                if r.state == HEALTHY:
                    self._real += prompts - s.prompts
                    self._real_n += firsts - s.firsts
                    self._est += tokens
                    self._est_n += n
        # Unprefilled are at most the engine's waiting requests, the one prefilling, and the placements it could
        # not have seen yet (since the scrape began).
        s.trim(e.waiting + 1 + max(placed, 0))
        s.at, s.prompts, s.firsts = e.scraped_at, prompts, firsts
        s.placed, s.requests = r.placed_prompt_total, r.placed_requests_total

    def apply(self, prompt_tokens: int) -> int:
        """A new estimate in the engines' units."""
        f = self.factor
        if f == 1.0:
            return prompt_tokens
        return max(1, int(prompt_tokens * f + 0.5))
