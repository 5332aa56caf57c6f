"""The Grafana dashboard and its provisioning: valid PromQL over metrics the project exports, the promised
panels, a layout without overlaps, provisioning that points where docker-compose mounts it."""

from __future__ import annotations

import subprocess

import yaml

from tests.tools import tool

from .promql import DASHBOARD, DEPLOY, ROOT, dashboard, dashboard_exprs, dashboard_panels, exported_metric_names, \
    metric_names


def test_every_expression_names_only_exported_metrics():
    exported = exported_metric_names()
    exprs = dashboard_exprs()
    assert len(exprs) > 40
    unknown = {where: sorted(metric_names(e) - exported) for where, e in exprs.items()}
    unknown = {k: v for k, v in unknown.items() if v}
    assert not unknown, f"dashboard queries name metrics nobody exports: {unknown}"
    assert all(metric_names(e) for e in exprs.values()), "a query without any metric"


def test_every_expression_is_valid_promql(tmp_path):
    """Each query (Grafana variables substituted) as a recording rule: promtool parses them all."""
    promtool = tool("promtool")
    rules = []
    for i, expr in enumerate(dashboard_exprs().values()):
        if expr.startswith("label_values("):
            continue
        concrete = (expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
                    .replace("$pool", ".*"))
        rules.append({"record": f"dashboard:query_{i}", "expr": concrete})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # and promtool does reject bad PromQL (the check is not vacuous)
    bad = {"groups": [{"name": "bad", "rules": [{"record": "x:y", "expr": "sum(rate(x[1m]"}]}]}
    path.write_text(yaml.safe_dump(bad))
    assert subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, timeout=60).returncode != 0


def test_promised_panels_are_there():
    titles = {p.get("title") for p in dashboard_panels()}
    rows = {p["title"] for p in dashboard_panels() if p["type"] == "row"}
    assert {"Pool overview", "Replicas", "Lanes and queues", "Shedding and rejections", "Budgets",
            "Token cost by app (P10)"} <= rows
    for title in ("KV-cache usage", "Engine queue (waiting)", "p95 TTFT", "Replica health state",
                  "Queue depth by lane", "Queue wait p95 by lane", "Shed by reason", "Retries",
                  "Tokens per request by app", "Client connections vs limit"):
        assert title in titles, title
    exprs = " ".join(dashboard_exprs().values())
    for metric in ("sluice_replica_kv_usage", "sluice_replica_waiting", "sluice_replica_ttft_p95_seconds",
                   "sluice_replica_state", "sluice_queue_depth", "sluice_queue_wait_seconds_bucket",
                   "sluice_shed_total", "sluice_budget_retries_rejected_total",
                   "sluice_prompt_cost_tokens_per_request"):
        assert metric in exprs, metric


def test_layout_has_unique_ids_and_no_overlaps():
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_datasource_and_provisioning_match_compose():
    dash = dashboard()
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    uids = {t["datasource"]["uid"] for p in dashboard_panels(dash) for t in p.get("targets", [])}
    assert uids == {ds["uid"]}
    assert ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/sluice.yml").read_text())["providers"][0]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert DASHBOARD.parent == ROOT / "deploy/grafana/dashboards"
    assert dash["uid"] == "sluice" and any(v["name"] == "pool" for v in dash["templating"]["list"])
