"""Expected output of a request that sets no `max_tokens`: the app's own recent p90, learned (P2, P9).

A request without `max_tokens` / `max_completion_tokens` may generate until the model stops; admission must
still reserve KV for its output. A fixed guess (`limits.default_output_tokens`) is wrong both ways: too small
for an app that writes essays (its reservations undercount, P9's preemptions return), too large for a
classifier answering in ten tokens (its requests wait for KV they never use). Each app's completions say what
it really needs: the p90 of its recent natural lengths (completions of requests that set no limit, so never cut
short by one) replaces the fixed guess once enough are seen.

Completion lengths are known only for responses the sidecar observes (`streaming.sample_rate`,
`streaming.metered_tenants`): with observation off, nothing is learned and the fixed default stands.

State is bounded: the last WINDOW lengths per (model, app), at most MAX_APPS apps (the least recently seen
forgotten first). The p90 is recomputed every REFRESH observations, not per request.
"""

from __future__ import annotations

from collections import OrderedDict, deque

WINDOW = 200       # recent completions kept per app
MIN_SAMPLES = 20   # before this many, the configured default stands
REFRESH = 10       # recompute the p90 every this many observations
MAX_APPS = 1_000   # (model, app) pairs tracked
QUANTILE = 0.9


class _App:
    __slots__ = ("lengths", "p90", "since")

    def __init__(self) -> None:
        self.lengths: deque[int] = deque(maxlen=WINDOW)
        self.p90 = 0
        self.since = 0  # observations since the last recompute


class OutputLengths:
    """Per sidecar. `observe` after an observed response; `expected` when a request sets no limit."""

    def __init__(self) -> None:
        self._apps: OrderedDict[tuple[str, str], _App] = OrderedDict()

    def observe(self, model: str, app: str, completion_tokens: int) -> None:
        """One natural completion length (per choice) of an app's request that set no output limit."""
        if completion_tokens < 0:
            return
        key = (model, app)
        a = self._apps.get(key)
        if a is None:
            if len(self._apps) >= MAX_APPS:
                self._apps.popitem(last=False)
            a = self._apps[key] = _App()
        else:
            self._apps.move_to_end(key)
        a.lengths.append(completion_tokens)
        a.since += 1
        if len(a.lengths) >= MIN_SAMPLES and (a.since >= REFRESH or not a.p90):
            ordered = sorted(a.lengths)
            a.p90 = max(1, ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))])
            a.since = 0

    def expected(self, model: str, app: str) -> int:
        """The app's learned p90 output tokens per choice, or 0 when not enough is known yet."""
        a = self._apps.get((model, app))
        return a.p90 if a is not None else 0
