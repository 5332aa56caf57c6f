"""Prompt cost shift detection (P10): an app's tokens per request changed, and so did the pool's capacity for it.

Per app (and, for the admin view, per system-prompt fingerprint `prefix_key` within the app) every completed
request contributes cost = prompt tokens + completion tokens (completion unknown -> the app's running mean of
known completions). Per request, O(K) with K = sustain_requests (a small constant, default 5):

  recent    = MEDIAN cost of the last K requests (ring buffer). A median, so a burst shorter than K/2 requests
              never moves it and one shorter than K never alerts.
  baseline  = the same statistic, smoothed: the mean of the warm-up medians (first `baseline_requests` requests),
              then an EWMA (alpha = 1 / baseline_requests) of `recent`, updated only while no shift is suspected,
              so a shift never leaks into the baseline it is measured against. Comparing median with median keeps
              skewed cost distributions (median < mean) from looking like a shift.
  ratio     = recent / baseline; a request is "shifted" when |ratio - 1| > threshold.
  After K shifted requests in a row (the recent window then holds only post-change requests for a step change)
  ONE event: metric `sluice_prompt_shift_events_total{app}` and one structured log record (logger
  `sluice.budgets.prompt_shift`, `extra={"event": "prompt_shift", ...}`) with the app, old and new MEAN
  tokens/request (prompt and completion too), the old and new fingerprint, and the pool capacity in requests/s at
  both prompt sizes = capacity_rps(model, prompt tokens) (routing/capacity.py). Old mean = EWMA of costs as they leave the
  recent window while stable; new mean = mean of the last K requests. The baseline then moves to the new level.

The capacity gauge `sluice_prompt_capacity_requests_per_second{app}` is read when Prometheus scrapes:

  capacity = capacity_rps(model, the mean estimated prompt of the app's last K ADMITTED requests)

capacity_rps divides the pool's prefill throughput at saturation, in the engines' prompt tokens/s
(routing/capacity.py), by that prompt, an estimate calibrated to the engines' units. Admitted, not completed: after
a prompt change the new requests take seconds to complete, or none completes while the pool is overloaded by them
(P10: no request of the new prompt completed in the 7 s after the change), and a gauge fed by completions kept the
old prompt's capacity.

A prompt's cost is the engine's count where the response reported usage, else the admission estimate, in the
units of the token calibration (admission/token_calibration.py). Its first measurement can rescale every estimate
at once (1.58x on real engines): that starts a new calibration epoch, and the app's baseline is learned again from
estimates of the new epoch, so the calibration converging never reads as a prompt change.

State is bounded: at most `max_apps` apps (later apps collapse into `other`, which is tracked but never alerts)
and `max_fingerprints_per_app` fingerprints per app (least recently seen evicted).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable

from extproc.budgets import metrics
from extproc.budgets.policy import PromptShiftPolicy

log = logging.getLogger("sluice.budgets.prompt_shift")

OTHER = metrics.OTHER


def fingerprint_hex(prefix_key: int) -> str:
    return f"{prefix_key & 0xFFFFFFFF:08x}"


class _Fingerprint:
    __slots__ = ("requests", "mean_prompt", "mean_completion", "last_seen")

    def __init__(self) -> None:
        self.requests = 0
        self.mean_prompt = 0.0
        self.mean_completion = 0.0
        self.last_seen = 0.0


class _App:
    __slots__ = ("name", "model", "requests", "warm_n", "warm_prompt", "warm_completion",
                 "baseline", "base_prompt", "base_completion", "base_med", "warm_med", "warm_med_n",
                 "completion_mean", "completion_known",
                 "ring_p", "ring_c", "ring_f", "pos", "filled", "sum_p", "sum_c", "over", "run_fps", "stable_fp",
                 "fps", "events", "last_event", "ratio", "adm_prompt", "adm_pos", "adm_n", "adm_sum", "units",
                 "g_total", "g_prompt", "g_completion", "g_base", "g_ratio", "c_events", "g_capacity")

    def __init__(self, name: str, k: int) -> None:
        self.name = name
        self.model = ""
        self.requests = 0
        self.warm_n = 0
        self.warm_prompt = 0.0
        self.warm_completion = 0.0
        self.baseline: float | None = None
        self.base_prompt = 0.0
        self.base_completion = 0.0
        self.base_med = 0.0
        self.warm_med = 0.0
        self.warm_med_n = 0
        self.completion_mean = 0.0
        self.completion_known = 0
        self.ring_p = [0.0] * k
        self.ring_c = [0.0] * k
        self.ring_f = [0] * k
        self.pos = 0
        self.filled = 0
        self.sum_p = 0.0
        self.sum_c = 0.0
        self.over = 0
        self.run_fps: dict[int, int] = {}
        self.stable_fp: int | None = None
        self.fps: OrderedDict[int, _Fingerprint] = OrderedDict()
        self.events = 0
        self.last_event: dict[str, Any] | None = None
        self.ratio = 1.0
        self.adm_prompt = [0.0] * k  # estimated prompts of the last k admitted requests (ring), and their sum
        self.adm_pos = 0
        self.adm_n = 0
        self.adm_sum = 0.0
        self.units: dict[str, int] = {}  # per model, the calibration epoch of the estimates compared
        # The recent means, baseline and ratio are read when Prometheus scrapes, not set per request.
        self.g_total = metrics.PROMPT_COST.labels(name, "total")
        self.g_total.set_function(lambda: self.mean(self.sum_p + self.sum_c))
        self.g_capacity = metrics.PROMPT_CAPACITY.labels(name)
        self.g_prompt = metrics.PROMPT_COST.labels(name, "prompt")
        self.g_prompt.set_function(lambda: self.mean(self.sum_p))
        self.g_completion = metrics.PROMPT_COST.labels(name, "completion")
        self.g_completion.set_function(lambda: self.mean(self.sum_c))
        self.g_base = metrics.PROMPT_BASELINE.labels(name)
        self.g_base.set_function(lambda: self.baseline or 0.0)
        self.g_ratio = metrics.PROMPT_SHIFT_RATIO.labels(name)
        self.g_ratio.set_function(lambda: self.ratio if self.baseline is not None else 0.0)
        self.c_events = metrics.PROMPT_SHIFT_EVENTS.labels(name)

    def mean(self, total: float) -> float:
        """`total` over the requests in the recent window (0 before the first)."""
        return total / self.filled if self.filled else 0.0

    def restart(self) -> None:
        """Learn the baseline again from the next requests: the ones seen so far are in other units."""
        k = len(self.ring_p)
        self.warm_n = self.warm_med_n = 0
        self.warm_prompt = self.warm_completion = self.warm_med = self.base_med = 0.0
        self.baseline = None
        self.ring_p, self.ring_c, self.ring_f = [0.0] * k, [0.0] * k, [0] * k
        self.pos = self.filled = self.over = 0
        self.sum_p = self.sum_c = 0.0
        self.run_fps.clear()
        self.ratio = 1.0

    def admit(self, prompt: float) -> None:
        """One admitted request's estimated prompt into the ring of the last k."""
        i = self.adm_pos
        self.adm_sum += prompt - (self.adm_prompt[i] if self.adm_n == len(self.adm_prompt) else 0.0)
        self.adm_prompt[i] = prompt
        self.adm_pos = (i + 1) % len(self.adm_prompt)
        self.adm_n = min(self.adm_n + 1, len(self.adm_prompt))

    def admitted_prompt(self) -> float:
        """Mean estimated prompt of the last k admitted requests (0 before the first)."""
        return self.adm_sum / self.adm_n if self.adm_n else 0.0


class PromptShiftTracker:
    """Feed `observe()` once per completed request; read `snapshot()` for the admin API.

    `capacity_rps(model, prompt) -> requests/s` is what the pool sustains at that prompt size, supplied by the
    server; when it is None or fails, capacities are reported as None.
    """

    def __init__(self, policy: PromptShiftPolicy | None = None,
                 capacity_rps: Callable[[str, float], float] | None = None) -> None:
        self.policy = policy or PromptShiftPolicy()
        self.capacity_rps = capacity_rps
        self._k = self.policy.sustain_requests
        self._alpha = 1.0 / self.policy.baseline_requests
        self._apps: dict[str, _App] = {}
        self.events: list[dict[str, Any]] = []  # the last few events (bounded), newest last
        self._max_events = 32

    def _app(self, name: str) -> _App:
        st = self._apps.get(name)
        if st is None:
            if len(self._apps) >= self.policy.max_apps:
                name = OTHER
                st = self._apps.get(OTHER)
            if st is None:
                st = self._apps[name] = _App(name, self._k)
                st.g_capacity.set_function(lambda st=st: self.admitted_capacity(st.name) or 0.0)
        return st

    def admitted(self, app: str, model: str, prompt_tokens: int) -> None:
        """Account one admitted request (its estimated prompt): the capacity gauge's prompt size."""
        if not self.policy.enabled:
            return
        st = self._app(app)
        st.model = model
        st.admit(float(prompt_tokens))

    def admitted_capacity(self, app: str) -> float | None:
        """Requests/s the pool sustains at the app's recently admitted prompt size (None: unknown)."""
        st = self._apps.get(app)
        return None if st is None else self._capacity(st.model, st.admitted_prompt())

    def observe(self, app: str, model: str, prefix_key: int, prompt_tokens: int,
                completion_tokens: int | None, now: float | None = None,
                units: int | None = None) -> dict[str, Any] | None:
        """Account one completed request. Returns the event dict when this request completed a shift.

        `units`: the token calibration's epoch its `prompt_tokens` estimate was made in (None: the engine counted
        them). Estimates of a later epoch restart the app's baseline (the calibration changed the units, not the
        app its prompts); one of an earlier epoch (a request in flight across the change) is left out."""
        if not self.policy.enabled:
            return None
        st = self._app(app)
        st.model = model
        if units is not None and not self._same_units(st, model, units):
            return None
        st.requests += 1
        prompt = float(prompt_tokens)
        if completion_tokens is None:
            completion = st.completion_mean
        else:
            completion = float(completion_tokens)
            st.completion_known += 1
            span = min(st.completion_known, self.policy.baseline_requests)
            st.completion_mean += (completion - st.completion_mean) / span
        self._fingerprint(st, prefix_key, prompt, completion, now)
        # recent window: ring buffer with running sums
        k = self._k
        i = st.pos
        out_p, out_c, out_f = st.ring_p[i], st.ring_c[i], st.ring_f[i]
        evicted = st.filled == k
        st.ring_p[i] = prompt
        st.ring_c[i] = completion
        st.ring_f[i] = prefix_key
        st.pos = (i + 1) % k
        if evicted:
            st.sum_p += prompt - out_p
            st.sum_c += completion - out_c
        else:
            st.filled += 1
            st.sum_p += prompt
            st.sum_c += completion
        n = st.filled
        mean = (st.sum_p + st.sum_c) / n
        costs = sorted([st.ring_p[j] + st.ring_c[j] for j in range(n)])
        med = costs[n // 2] if n % 2 else (costs[n // 2 - 1] + costs[n // 2]) / 2
        if st.baseline is None:  # warming up
            st.warm_n += 1
            st.warm_prompt += prompt
            st.warm_completion += completion
            if n == k:
                st.warm_med += med
                st.warm_med_n += 1
            if st.warm_n >= self.policy.baseline_requests:
                st.base_prompt = st.warm_prompt / st.warm_n
                st.base_completion = st.warm_completion / st.warm_n
                st.baseline = st.base_prompt + st.base_completion
                st.base_med = st.warm_med / st.warm_med_n if st.warm_med_n else med
                st.stable_fp = prefix_key
            return None
        a = self._alpha
        if evicted and st.over == 0:  # drift: the old mean learns what left the recent window unshifted
            st.stable_fp = out_f
            st.base_prompt += a * (out_p - st.base_prompt)
            st.base_completion += a * (out_c - st.base_completion)
            st.baseline = st.base_prompt + st.base_completion
        ratio = med / st.base_med if st.base_med > 0 else (1.0 if med <= 0 else float("inf"))
        st.ratio = ratio
        if abs(ratio - 1.0) <= self.policy.threshold:
            st.over = 0
            st.run_fps.clear()
            st.base_med += a * (med - st.base_med)
            return None
        st.over += 1
        st.run_fps[prefix_key] = st.run_fps.get(prefix_key, 0) + 1
        if st.over < k or st.name == OTHER:
            return None
        return self._emit(st, mean, med, now)

    @staticmethod
    def _same_units(st: _App, model: str, units: int) -> bool:
        """False for an estimate older than the app's units; a newer one restarts the app's baseline."""
        seen = st.units.get(model)
        if seen is not None and units < seen:
            return False
        if seen is not None and units > seen:
            st.restart()
        st.units[model] = units
        return True

    def _fingerprint(self, st: _App, fp: int, prompt: float, completion: float, now: float | None) -> None:
        fps = st.fps
        f = fps.get(fp)
        if f is None:
            if len(fps) >= self.policy.max_fingerprints_per_app:
                fps.popitem(last=False)
            f = fps[fp] = _Fingerprint()
        else:
            fps.move_to_end(fp)
        f.requests += 1
        span = min(f.requests, self.policy.baseline_requests)
        f.mean_prompt += (prompt - f.mean_prompt) / span
        f.mean_completion += (completion - f.mean_completion) / span
        f.last_seen = time.time() if now is None else now

    def _capacity(self, model: str, prompt: float) -> float | None:
        """Requests/s the pool sustains at `prompt` tokens per request: capacity_rps(model, prompt)."""
        fn = self.capacity_rps
        if fn is None or prompt <= 0:
            return None
        try:
            cap = float(fn(model, prompt))
        except Exception:  # the integrator's callable must not break settle
            log.debug("capacity_rps(%r) failed", model, exc_info=True)
            return None
        return cap if cap > 0 else None

    def _emit(self, st: _App, recent: float, med: float, now: float | None) -> dict[str, Any]:
        k = st.filled
        old = st.baseline or 0.0
        new_fp = max(st.run_fps.items(), key=lambda kv: kv[1])[0]
        event = {
            "event": "prompt_shift",
            "app": st.name,
            "model": st.model,
            "old_tokens_per_request": round(old, 1),
            "new_tokens_per_request": round(recent, 1),
            "old_prompt_tokens": round(st.base_prompt, 1),
            "new_prompt_tokens": round(st.sum_p / k, 1),
            "old_completion_tokens": round(st.base_completion, 1),
            "new_completion_tokens": round(st.sum_c / k, 1),
            "ratio": round(recent / old, 3) if old > 0 else None,
            "median_ratio": round(st.ratio, 3),
            "old_fingerprint": fingerprint_hex(st.stable_fp) if st.stable_fp is not None else None,
            "new_fingerprint": fingerprint_hex(new_fp),
            "old_capacity_rps": self._capacity(st.model, st.base_prompt),
            "new_capacity_rps": self._capacity(st.model, st.sum_p / k),
            "at": time.time() if now is None else now,
        }
        st.events += 1
        st.last_event = event
        st.c_events.inc()
        st.base_prompt = st.sum_p / k
        st.base_completion = st.sum_c / k
        st.baseline = recent
        st.base_med = med
        st.ratio = 1.0
        st.over = 0
        st.run_fps.clear()
        st.stable_fp = new_fp
        self.events.append(event)
        if len(self.events) > self._max_events:
            del self.events[0]
        old_rps, new_rps = event["old_capacity_rps"], event["new_capacity_rps"]
        cap_txt = (f"; pool capacity {old_rps:.3g} -> {new_rps:.3g} requests/s"
                   if old_rps is not None and new_rps is not None else "")
        log.warning("prompt cost shift: app %s now costs %.0f tokens/request (was %.0f), system prompt %s%s",
                    st.name, recent, old, event["new_fingerprint"], cap_txt, extra=event)
        return event

    def snapshot(self) -> list[dict[str, Any]]:
        """Current state per app for the admin API (cheap: O(apps x fingerprints), bounded)."""
        out = []
        for st in self._apps.values():
            n = st.filled or 1
            recent = (st.sum_p + st.sum_c) / n if st.filled else None
            out.append({
                "app": st.name,
                "model": st.model,
                "requests": st.requests,
                "baseline_tokens_per_request": None if st.baseline is None else round(st.baseline, 1),
                "recent_tokens_per_request": None if recent is None else round(recent, 1),
                "baseline_median_tokens": round(st.base_med, 1),
                "recent_prompt_tokens": round(st.sum_p / n, 1),
                "recent_completion_tokens": round(st.sum_c / n, 1),
                "ratio": round(st.ratio, 3),
                "shifting": st.over > 0,
                "shift_events": st.events,
                "last_event": st.last_event,
                "capacity_rps": self._capacity(st.model, st.admitted_prompt()),
                "fingerprints": [
                    {"fingerprint": fingerprint_hex(fp), "requests": f.requests,
                     "mean_prompt_tokens": round(f.mean_prompt, 1),
                     "mean_completion_tokens": round(f.mean_completion, 1), "last_seen": f.last_seen}
                    for fp, f in reversed(st.fps.items())
                ],
            })
        return out
