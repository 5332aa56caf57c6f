"""Every Prometheus metric of the budgets package (default registry), names prefixed `sluice_`.

Label values come from bounded sets: pools and tenants go through `BoundedLabels` (at most `cap` distinct values,
the rest collapse into `other`), apps are bounded by the prompt-shift tracker. Label children are resolved once
and cached, never per request.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

OTHER = "other"

RETRIES_SEEN = Counter("sluice_budget_retries_seen_total",
                       "Requests recognised as retries (retry header, reused key or duplicate body), by pool.",
                       ["pool"])
RETRIES_ALLOWED = Counter("sluice_budget_retries_allowed_total", "Retries admitted by the retry budget, by pool.",
                          ["pool"])
RETRIES_CREDITED = Counter("sluice_budget_retries_credited_total",
                           "Retries of requests this sidecar refused with x-should-retry: true, admitted without "
                           "charging the retry share (one per refusal), by pool.", ["pool"])
RETRIES_REJECTED = Counter("sluice_budget_retries_rejected_total",
                           "Retries refused: reason=budget (429, share exceeded) or duplicate_in_flight (409).",
                           ["pool", "reason"])
TASK_REJECTIONS = Counter("sluice_budget_task_rejections_total", "Calls refused by a task budget, by limit.", ["limit"])
TENANT_TOKENS = Counter("sluice_budget_tenant_tokens_total",
                        "Tokens charged to tenants after settlement (actual usage when known, else the estimate).",
                        ["tenant"])
TENANT_REJECTIONS = Counter("sluice_budget_tenant_rejections_total",
                            "Requests refused by the tenant tokens-per-minute limit.", ["tenant"])
STORE_FALLBACK_ACTIVE = Gauge("sluice_budget_store_fallback_active",
                              "1 while the shared store (Redis) is unreachable and local limits apply.")
STORE_FALLBACK_TRANSITIONS = Counter("sluice_budget_store_fallback_transitions_total",
                                     "Transitions into (direction=enter) and out of (exit) local fallback.",
                                     ["direction"])
STORE_ERRORS = Counter("sluice_budget_store_errors_total", "Store operations that failed and were served locally.")
PROMPT_COST = Gauge("sluice_prompt_cost_tokens_per_request",
                    "Recent mean tokens per completed request, per app; kind=prompt|completion|total.",
                    ["app", "kind"])
PROMPT_BASELINE = Gauge("sluice_prompt_cost_baseline_tokens_per_request",
                        "Baseline tokens per completed request the shift detector compares against, per app.", ["app"])
PROMPT_SHIFT_EVENTS = Counter("sluice_prompt_shift_events_total", "Sustained prompt cost shifts detected, per app.",
                              ["app"])
PROMPT_CAPACITY = Gauge("sluice_prompt_capacity_requests_per_second",
                        "Requests/s the pool sustains at this app's recently admitted prompt size: its prefill "
                        "throughput while saturated / prompt tokens (P10: what a prompt change costs).", ["app"])
PROMPT_SHIFT_RATIO = Gauge("sluice_prompt_shift_ratio", "Recent cost per request over the baseline, per app.", ["app"])


class BoundedLabels:
    """Cache of label children for one label, at most `cap` distinct values; the rest share the `other` child."""

    __slots__ = ("_metric", "_cap", "_children", "_fixed")

    def __init__(self, metric: Any, cap: int = 64, **fixed: str) -> None:
        self._metric = metric
        self._cap = cap
        self._children: dict[str, Any] = {}
        self._fixed = fixed

    def get(self, value: str) -> Any:
        child = self._children.get(value)
        if child is None:
            if len(self._children) >= self._cap:
                value = OTHER
                child = self._children.get(OTHER)
            if child is None:
                child = self._metric.labels(value, *self._fixed.values()) if self._fixed else self._metric.labels(value)
                self._children[value] = child
        return child
