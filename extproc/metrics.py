"""Every Prometheus metric the sidecar core exports, in one place (packages with their own policy —
budgets, admission, routing — keep theirs in their own `metrics.py`, imported from here so one import
registers everything).

Hot-path rule: label children are resolved once (per pool / replica / outcome) and cached by the caller;
no `labels()` lookups per request where a cached child will do.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # the *_created series double the exposition size and nobody graphs them

REQUESTS = Counter(
    "sluice_requests_total",
    "Requests forwarded to a pool, by final outcome from Envoy's access log: completed, cancelled (client "
    "left), timeout (deadline or idle timeout), failed (replica 5xx, reset or unreachable).",
    ["pool", "outcome"],
)
REJECTIONS = Counter(
    "sluice_rejections_total",
    "Requests the sidecar answered itself instead of forwarding, by HTTP status and reason code.",
    ["status", "reason"],
)
INFLIGHT_REQUESTS = Gauge(
    "sluice_inflight_requests", "Requests this sidecar placed on a replica and not yet released.", ["pool", "replica"]
)
INFLIGHT_TOKENS = Gauge(
    "sluice_inflight_tokens",
    "Estimated tokens (prompt + expected output) this sidecar placed on a replica and not yet released.",
    ["pool", "replica"],
)
DECISION_SECONDS = Histogram(
    "sluice_decision_seconds",
    "Sidecar time from receiving the request body to answering Envoy (excludes queue waits).",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)
OPEN_STREAMS = Gauge("sluice_open_streams", "ext_proc streams currently open (one per HTTP request in Envoy).")
PROMPT_TOKENS = Counter(
    "sluice_prompt_tokens_estimated_total", "Estimated prompt tokens of forwarded requests.", ["pool"]
)
UPSTREAM_STATUS = Counter(
    "sluice_upstream_responses_total", "Response status classes seen from replicas.", ["pool", "replica", "class"]
)
READY = Gauge("sluice_ready", "1 when the sidecar is serving, 0 while starting or draining.")
TENANT_OPEN_STREAMS = Gauge(
    "sluice_tenant_open_streams", "Requests of a tenant open in this sidecar (queued or forwarded); tenants past "
    "tenants.label_tenants are summed under \"other\".", ["tenant"])
