"""Where every Prometheus metric of the sidecar is defined: the core's (requests, streams, reloads, drains) here,
and each package with a policy of its own in its own module, imported at the end of this one so that importing
`extproc.metrics` registers every `sluice_*` series:

    extproc/admission/metrics.py   sluice_queue_*, sluice_admitted_total, sluice_shed_total, sluice_lane_*, ...
    extproc/budgets/metrics.py     sluice_budget_*, sluice_prompt_cost_*, sluice_prompt_shift_*, ...
    extproc/routing/metrics.py     sluice_replica_* (scraped state, health), sluice_scrape_*, sluice_pool_*,
                                   sluice_shared_load_*
    extproc/discovery/metrics.py   sluice_discovery_* (replicas by name: lookups, endpoints, changes)

No other module defines a metric (tests/ops/test_metrics_doc.py checks that, and that docs/operations.md lists
exactly these). The simulator (extproc/sim/metrics.py) is another process with vLLM's own names.

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
OPEN_STREAMS = Gauge("sluice_open_streams", "HTTP requests the sidecar is governing: ext_proc streams open, plus "
                     "forwarded requests whose ext_proc stream has ended and whose end the access log has not "
                     "reported yet.")
DETACHED_SWEPT = Counter("sluice_detached_swept_total", "Forwarded requests released by age because Envoy's access "
                         "log never reported their end (entries lost while it reconnected).")
READY = Gauge("sluice_ready", "1 when the sidecar is serving, 0 while starting or draining.")
TENANT_OPEN_STREAMS = Gauge(
    "sluice_tenant_open_streams", "Requests of a tenant open in this sidecar (queued or forwarded); tenants past "
    "tenants.label_tenants are summed under \"other\".", ["tenant"])
OBSERVED_TTFT = Histogram(
    "sluice_observed_ttft_seconds", "Time to first token of observed (sampled or metered) streaming requests, "
    "measured by the sidecar from its decision to the first content event.", ["pool"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40))
OBSERVED_REQUESTS = Counter("sluice_observed_requests_total", "Requests whose response body the sidecar observed.",
                            ["pool"])
PROMPT_ESTIMATE_RATIO = Histogram(
    "sluice_prompt_estimate_ratio", "Replica-reported prompt tokens / the sidecar's estimate, for observed requests "
    "(calibrates the token estimator).", ["pool"], buckets=(0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0))
SLOW_STREAMS_CUT = Counter("sluice_slow_streams_cut_total",
                           "Streams cut because the client drained slower than streaming.slow_consumer allows "
                           "(the replica's work is cancelled with them).", ["pool"])
OPEN_REQUESTS_CAP = Gauge("sluice_open_requests_limit",
                          "Open (queued + forwarded) requests this sidecar process accepts before answering 429 "
                          "gateway_at_capacity; alert when sluice_open_streams approaches it (P12).")
REPLICA_DRAINING = Gauge("sluice_replica_draining",
                         "1 while an operator has drained the replica (sluice drain): it takes no new requests.",
                         ["pool", "replica"])

# ---- policy reloads (extproc/reload.py) -------------------------------------------------------------------------
RELOADS = Counter("sluice_policy_reloads_total",
                  "Policy reload attempts (file change, SIGHUP, admin API), by result: ok (applied) or error "
                  "(rejected; the previous policy stays in force).", ["result"])
LAST_SUCCESS = Gauge("sluice_policy_last_reload_success",
                     "1 when the last policy reload attempt was applied (or none was made since start), 0 when it "
                     "was rejected and an older policy is in force.")
LAST_RELOAD_TS = Gauge("sluice_policy_last_reload_timestamp_seconds",
                       "Unix time of the last policy reload attempt (0: none since start).")
MAX_DOWNSTREAM_CONNECTIONS = Gauge(
    "sluice_policy_max_downstream_connections",
    "gateway.max_downstream_connections of the policy in force: Envoy's overload-manager limit on client "
    "connections (alerts compare envoy_http_downstream_cx_active with it).")

# ---- the packages' own (see the module docstring) ---------------------------------------------------------------
from extproc.admission import metrics as admission  # noqa: E402,F401
from extproc.budgets import metrics as budgets  # noqa: E402,F401
from extproc.routing import metrics as routing  # noqa: E402,F401
from extproc.discovery import metrics as discovery  # noqa: E402,F401
