"""Helpers for the monitoring tests: metric names referenced by PromQL, and the names the project exports."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "sluice.json"

# Envoy's stats used by deploy/ (alerts, dashboard), as Envoy 1.40 names them on /stats/prometheus with the
# rendered config (HCM stat_prefix "ingress", ext_proc stat_prefix "sluice"). tests/ops/test_prometheus_live.py
# checks every one of them against a running Envoy.
ENVOY_METRICS = frozenset({
    "envoy_http_downstream_cx_active",
    "envoy_http_downstream_rq_total",
    "envoy_http_downstream_rq_xx",
    "envoy_http_downstream_rq_active",
    "envoy_http_downstream_rq_time_bucket",
    "envoy_cluster_upstream_rq_total",
    "envoy_cluster_upstream_rq_retry",
    "envoy_cluster_upstream_rq_retry_overflow",
    "envoy_cluster_upstream_rq_xx",
    "envoy_listener_downstream_cx_overload_reject",
    "envoy_listener_downstream_global_cx_overflow",
    "envoy_http_ext_proc_sluice_streams_started",
    "envoy_http_ext_proc_sluice_streams_failed",
    "envoy_http_ext_proc_sluice_message_timeouts",
    "envoy_http_ext_proc_sluice_immediate_responses_sent",
    "envoy_http_ext_proc_sluice_failure_mode_allowed",
})
# Series Prometheus itself adds to every scrape.
PROMETHEUS_SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan", "atan2", "start", "end"}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_VARS = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NUMBERS = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*(?![\w:])")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression (also Grafana's `label_values(metric, label)`)."""
    s = _STRINGS.sub('""', expr)
    s = _VARS.sub("1", s)
    s = re.sub(r"\{[^}]*\}", "", s)       # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)      # ranges and subqueries
    s = _LABEL_LISTS.sub(" ", s)
    lv = re.match(r"^\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,", s)
    if lv:
        return {lv.group(1)}
    s = _NUMBERS.sub(" ", s)
    names = set()
    for m in _IDENT.finditer(s):
        name = m.group(0)
        rest = s[m.end():].lstrip()
        if rest.startswith("(") or name in _KEYWORDS:
            continue  # function or aggregation
        names.add(name)
    return names


def _family_samples(family: Any) -> Iterator[str]:
    t, name = family.type, family.name
    if t == "counter":
        yield name + "_total"
    elif t == "histogram":
        yield from (name + "_bucket", name + "_count", name + "_sum")
    elif t == "summary":
        yield from (name, name + "_count", name + "_sum")
    elif t == "info":
        yield name + "_info"
    else:
        yield name


def sidecar_metric_names() -> set[str]:
    """Every sample name the sidecar process exports: import every extproc module (each defines its metrics at
    import) and read the default registry."""
    import extproc
    from prometheus_client import REGISTRY

    for mod in pkgutil.walk_packages(extproc.__path__, "extproc."):
        if mod.name.endswith("__main__"):
            continue
        importlib.import_module(mod.name)
    names: set[str] = set()
    for family in REGISTRY.collect():
        names.update(_family_samples(family))
    return names


def replica_metric_names() -> set[str]:
    """Every sample name the simulated replicas export (vLLM and SGLang styles), from the simulator's collector."""
    from prometheus_client.parser import text_string_to_metric_families

    from extproc.sim.engine import Engine
    from extproc.sim.metrics import SimCollector, make_registry, render
    from extproc.sim.presets import get_preset

    p = get_preset("tiny-cpu")
    engine = Engine(p.cost, num_gpu_blocks=p.num_gpu_blocks, block_size=p.block_size, max_num_seqs=p.max_num_seqs,
                    max_num_batched_tokens=p.max_num_batched_tokens)
    names: set[str] = set()
    for style in ("vllm", "sglang"):
        text = render(make_registry(SimCollector(lambda: engine, "m", style))).decode()
        for fam in text_string_to_metric_families(text):
            names.update(s.name for s in fam.samples)
            names.update(_family_samples(fam))
    return names


def exported_metric_names() -> set[str]:
    return sidecar_metric_names() | replica_metric_names() | ENVOY_METRICS | PROMETHEUS_SYNTHETIC


def alert_exprs() -> dict[str, str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"] if "alert" in r}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dash: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    dash = dash or dashboard()
    out = []
    for panel in dash.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return out


def dashboard_exprs(dash: dict[str, Any] | None = None) -> dict[str, str]:
    """'panel title / refId' -> expression, plus the templating queries."""
    dash = dash or dashboard()
    out: dict[str, str] = {}
    for panel in dashboard_panels(dash):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out[f"{panel.get('title')} / {target.get('refId')}"] = target["expr"]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and query:
            out[f"variable {var['name']}"] = query
    return out
