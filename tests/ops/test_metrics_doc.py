"""Every sluice_* metric is defined in one of the five metrics modules, and docs/operations.md lists exactly the
metrics they define (no documented name that does not exist, no metric left undocumented)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from prometheus_client import Counter
from prometheus_client.metrics import MetricWrapperBase

import extproc.metrics

ROOT = Path(__file__).resolve().parents[2]
METRICS_MODULES = {"extproc/metrics.py", "extproc/admission/metrics.py", "extproc/budgets/metrics.py",
                   "extproc/routing/metrics.py", "extproc/discovery/metrics.py"}


def defined() -> set[str]:
    """The names a user queries: counters with their `_total`, the rest as registered."""
    modules = [extproc.metrics, extproc.metrics.admission, extproc.metrics.budgets, extproc.metrics.routing,
               extproc.metrics.discovery]
    names = set()
    for mod in modules:
        for value in vars(mod).values():
            if isinstance(value, MetricWrapperBase):
                names.add(value._name + ("_total" if isinstance(value, Counter) else ""))  # noqa: SLF001
    return names


def documented() -> set[str]:
    """`sluice_*` names in the metrics table of docs/operations.md; `{a,b}` inside a name expands, `{labels}` at
    the end is dropped."""
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("| traffic |"):]
    table = table[:table.index("\n\n")]
    names = set()
    for code in re.findall(r"`([^`]+)`", table):
        for token in re.findall(r"(?<![a-z0-9_])sluice_[a-z0-9_]*(?:\{[a-z_,()]+\}[a-z0-9_()]*)*", code):
            token = re.sub(r"\{[a-z_,]+\}$", "", token)
            m = re.fullmatch(r"(sluice_[a-z0-9_]*)\{([a-z_,]+)\}([a-z0-9_]*)", token)
            if m:
                names.update(m[1] + part + m[3] for part in m[2].split(","))
            else:
                names.add(token)
    return names


def test_docs_list_exactly_the_metrics_the_code_defines():
    code, docs = defined(), documented()
    assert len(code) > 50
    assert sorted(docs - code) == [], "documented in docs/operations.md but not defined"
    assert sorted(code - docs) == [], "defined but missing from the metrics table in docs/operations.md"


def test_no_other_module_defines_a_metric():
    kinds = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
    offenders = []
    for path in (ROOT / "extproc").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel in METRICS_MODULES or rel.startswith("extproc/sim/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                if name in kinds and node.args and isinstance(node.args[0], ast.Constant) \
                        and str(node.args[0].value).startswith("sluice_"):
                    offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []
