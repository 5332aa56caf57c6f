"""The issues' acceptance bars, checked against a scenario run's JSON: `python -m bench.bars FILE [--markdown OUT]`.

Each bar is written here once, as the issue states it, and evaluated on the numbers a real run produced, so the
published pass/fail table can never drift from the measurements.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

Row = dict[str, dict[str, Any]]


@dataclass
class Bar:
    scenario: str
    text: str
    check: Callable[[Row], bool | None]  # None: cannot be judged (a value is missing)
    shown: Callable[[Row], str]


def _v(row: Row, system: str, key: str) -> Any:
    return (row.get(system) or {}).get(key)


def _all(*vals: Any) -> bool:
    return all(v is not None for v in vals)


def _fmt(x: Any) -> str:
    if x is None:
        return "none"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _pair(key: str) -> Callable[[Row], str]:
    return lambda r: f"sluice {_fmt(_v(r, 'sluice', key))}, envoy-rr {_fmt(_v(r, 'envoy-rr', key))}"


def _one(*keys: str) -> Callable[[Row], str]:
    return lambda r: ", ".join(f"{k} {_fmt(_v(r, 'sluice', k))}" for k in keys)


def _cmp(key: str, op: Callable[[Any, Any], bool]) -> Callable[[Row], bool | None]:
    def check(r: Row) -> bool | None:
        a, b = _v(r, "sluice", key), _v(r, "envoy-rr", key)
        return op(a, b) if _all(a, b) else None
    return check


def _lim(key: str, op: Callable[[Any], bool]) -> Callable[[Row], bool | None]:
    def check(r: Row) -> bool | None:
        a = _v(r, "sluice", key)
        return op(a) if a is not None else None
    return check


# ---- issue 15: the honest yardstick ------------------------------------------------------------------------------
BASELINES = ("envoy-rr", "envoy-tuned", "smg")
GOODPUT_MARGIN = 1.1
# Where no baseline can do what the scenario measures, its own headline bar stands (judged against envoy-tuned)
# instead of the goodput margin.
OWN_HEADLINE = {"P4", "P4n", "P12"}
# What sluice may be told beyond its shipped defaults (dotted paths; a prefix ending in "." allows the section):
# the SLO everywhere; tenants where the scenario is about tenants; a task budget and the sidecar topology that
# shares it where it is about agents.
ALLOWED_EVERYWHERE = ("admission.ttft_target_s",)
ALLOWED_FOR = {"P1f": ("tenants.",), "P11": ("tenants.", "budgets.tasks.", "budgets.store.", "sidecar.workers"),
               "PG": ("budgets.store.",)}


def _paths(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict) and tree:
        return [p for k, v in tree.items() for p in _paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]]


def policy_violations(scenario: str, additions: dict[str, Any]) -> list[str]:
    """The fields of a scenario's `_meta.sluice_policy` that are not deployment facts it may state."""
    allowed = ALLOWED_EVERYWHERE + ALLOWED_FOR.get(scenario, ())
    return [p for p in _paths(additions)
            if not any(p == a or (a.endswith(".") and p.startswith(a)) for a in allowed)]


def best_baseline(row: Row, key: str) -> tuple[str | None, Any]:
    vals = [(s, _v(row, s, key)) for s in BASELINES if _v(row, s, key) is not None]
    return max(vals, key=lambda sv: sv[1]) if vals else (None, None)


def served_goodput(row: Row, system: str) -> float | None:
    """A system's SLO goodput over the classes sluice does not refuse by design (all classes when it names none)."""
    m = row.get(system) or {}
    refused = set((row.get("sluice") or {}).get("refused_classes") or [])
    if not refused:
        return m.get("slo_goodput_rps")
    classes = m.get("class_slo_goodput")
    if classes is None:
        return None
    return round(sum(v or 0.0 for c, v in classes.items() if c not in refused), 3)


def served_offered(row: Row) -> float | None:
    """The requests sluice's run offered per second over the classes it does not refuse by design: the ceiling of
    its `served_goodput` (open-loop arrivals are the same for every system; closed-loop clients, such as sessions
    that end at a refused turn, offer what their own system's answers lead them to)."""
    m = row.get("sluice") or {}
    offered = m.get("offered_rps")
    refused = set(m.get("refused_classes") or [])
    calls = m.get("class_calls") or {}
    if offered is None or not refused:
        return offered
    total = sum(calls.values())
    return round(offered * sum(n for c, n in calls.items() if c not in refused) / total, 3) if total else None


def best_served(row: Row) -> float | None:
    """The best baseline's `served_goodput` in this row (None when no baseline has one)."""
    return max([v for v in (served_goodput(row, b) for b in BASELINES if b in row) if v is not None], default=None)


def out_of_reach(row: Row) -> bool:
    """The goodput margin asks for more than the scenario offers: the best baseline already serves more than
    1 / GOODPUT_MARGIN of the offered requests within the SLO, so no system could be GOODPUT_MARGIN x ahead of
    it at this load (the scenario would need more load, or a problem the baseline does not solve)."""
    offered, best = served_offered(row), best_served(row)
    return _all(offered, best) and GOODPUT_MARGIN * best > offered


def _goodput_check(r: Row) -> bool | None:
    mine, best = served_goodput(r, "sluice"), best_served(r)
    return mine >= GOODPUT_MARGIN * best if _all(mine, best) else None


def _goodput_shown(r: Row) -> str:
    vals = {b: served_goodput(r, b) for b in BASELINES if b in r}
    best = max([b for b in vals if vals[b] is not None], key=lambda b: vals[b], default=None)
    others = ", ".join(f"{b} {_fmt(v)}" for b, v in vals.items())
    shown = f"sluice {_fmt(served_goodput(r, 'sluice'))}; {others} (best: {best})"
    if out_of_reach(r):
        shown += (f"; offered {_fmt(served_offered(r))}: {GOODPUT_MARGIN}x the best baseline's is more than the "
                  "scenario offers (out of reach at this load)")
    return shown


def _tuned_lim(key: str, op: Callable[[Any], bool]) -> Callable[[Row], bool | None]:
    """The scenario's own bar: sluice meets it and envoy-tuned does not."""
    def check(r: Row) -> bool | None:
        a, b = _v(r, "sluice", key), _v(r, "envoy-tuned", key)
        if a is None:
            return None
        return op(a) and (b is None or not op(b))
    return check


def _tuned_pair(key: str) -> Callable[[Row], str]:
    return lambda r: f"sluice {_fmt(_v(r, 'sluice', key))}, envoy-tuned {_fmt(_v(r, 'envoy-tuned', key))}"


def honest_bars(results: dict[str, Any]) -> list[tuple[str, str, bool | None, str]]:
    """(scenario, bar, verdict, measured) for issue 15's bars, every scenario in the run."""
    meta = results.get("_meta") or {}
    out: list[tuple[str, str, bool | None, str]] = []
    for sid, row in results.items():
        if sid.startswith("_"):
            continue
        if sid in OWN_HEADLINE:
            out.append((sid, f"sluice slo_goodput_rps >= {GOODPUT_MARGIN}x the best baseline's (informational: "
                        "the scenario's own bar below stands)", None, _goodput_shown(row)))
        else:
            refused = (row.get("sluice") or {}).get("refused_classes") or []
            over = f" (over the classes it does not refuse: all but {', '.join(refused)})" if refused else ""
            out.append((sid, f"sluice slo_goodput_rps >= {GOODPUT_MARGIN}x the best baseline's{over}",
                        _goodput_check(row), _goodput_shown(row)))
        refused = (row.get("sluice") or {}).get("refused_classes") or []
        ratio = _v(row, "sluice", "worst_class_ratio")
        shown = f"{_fmt(ratio)} (class {(row.get('sluice') or {}).get('worst_class')})"
        if refused:
            out.append((sid, f"worst_class_ratio >= 0.9 (not judged: sluice refuses {', '.join(refused)} by design)",
                        None, shown))
        else:
            out.append((sid, "worst_class_ratio >= 0.9", None if ratio is None else ratio >= 0.9, shown))
        bad = policy_violations(sid, (meta.get("sluice_policy") or {}).get(sid) or {})
        out.append((sid, "_meta.sluice_policy has deployment facts only", not bad if sid in (meta.get("sluice_policy") or {})
                    else None, ", ".join(bad) or "ok"))
        rep = (meta.get("reproduced") or {}).get(sid)
        out.append((sid, "reproduces its problem on envoy-rr", rep, (meta.get("why") or {}).get(sid, "")))
        fixed = ((meta.get("reproduced_by") or {}).get(sid) or {}).get("envoy-tuned")
        out.append((sid, "envoy-tuned still shows the problem (informational)", None,
                    "not run" if fixed is None else ("yes" if fixed[0] else "no, envoy-tuned fixes it") + f": {fixed[1]}"))
    return out


# ---- issue 16: the scenarios on real engines ----------------------------------------------------------------------
REAL_MARGIN = 2.0
# scenario -> the headline metric (lower is better) sluice must beat the best baseline on by REAL_MARGIN
REAL_HEADLINES = {"P3": "hol_slowdown", "P7": "ttft_p95_s", "P9": "preemptions", "PX": "ttft_p95_s"}


def real_bars(results: dict[str, Any]) -> list[tuple[str, str, bool | None, str]]:
    """(scenario, bar, verdict, measured) for issue 16's bars: on real engines, sluice's headline value x
    REAL_MARGIN <= the best (lowest) baseline's and strictly below it (0 vs 0 beats nothing), and sluice's
    slo_goodput_rps >= the best baseline's. A `--seeds N` run is judged on its medians, and each bar also says in
    how many repetitions it held on that repetition's own numbers."""
    bars = _real_bars_once(results)
    reps = [r for r in (_repetition(results, k) for k in range(repetitions(results))) if r is not None]
    if len(reps) < 2:
        return bars
    per_rep = [_real_bars_once(r) for r in reps]
    return [(sid, text, ok, f"{shown} (met in {sum(1 for rb in per_rep if rb[i][2])} of {len(per_rep)} "
                            "repetitions)")
            for i, (sid, text, ok, shown) in enumerate(bars)]


def repetitions(results: dict[str, Any]) -> int:
    """How many repetitions (`--seeds N`) the results' runs have: 1 for single runs."""
    return max((len((m or {}).get("per_rep") or []) for sid, row in results.items() if not sid.startswith("_")
                for m in row.values() if isinstance(m, dict)), default=0) or 1


def repetition(row: Row, k: int) -> Row | None:
    """Repetition k of one scenario's `--seeds N` run as a run of its own: each system's numbers (`per_rep[k]`) and
    class goodputs (`per_rep_class_slo_goodput[k]`), with sluice's refused classes; None when a system lacks it."""
    out: Row = {}
    for system, m in row.items():
        if not isinstance(m, dict):
            continue
        per = m.get("per_rep") or []
        if len(per) <= k:
            return None
        classes = (m.get("per_rep_class_slo_goodput") or [None] * (k + 1))[k]
        out[system] = {**per[k], "class_slo_goodput": classes, "refused_classes": m.get("refused_classes") or []}
    return out or None


def _repetition(results: dict[str, Any], k: int) -> dict[str, Any] | None:
    """Repetition k of the real-engine scenarios (REAL_HEADLINES), or None when one of them lacks it."""
    out = {sid: repetition(row, k) for sid, row in results.items() if sid in REAL_HEADLINES}
    return None if any(r is None for r in out.values()) else out


def _real_bars_once(results: dict[str, Any]) -> list[tuple[str, str, bool | None, str]]:
    """The bars of the scenarios the results hold (a batch of other scenarios has none)."""
    out: list[tuple[str, str, bool | None, str]] = []
    for sid, key in REAL_HEADLINES.items():
        if sid not in results:
            continue
        row = results[sid] or {}
        mine = _v(row, "sluice", key)
        base = [(b, _v(row, b, key)) for b in BASELINES if _v(row, b, key) is not None]
        best_b, best = min(base, key=lambda bv: bv[1]) if base else (None, None)
        ok = (mine * REAL_MARGIN <= best and mine < best) if _all(mine, best) else None
        out.append((sid, f"sluice {key} beats the best baseline's by >= {REAL_MARGIN:g}x", ok,
                    f"sluice {_fmt(mine)}, best baseline {best_b} {_fmt(best)}"))
        g_mine = _v(row, "sluice", "slo_goodput_rps")
        g_b, g_best = best_baseline(row, "slo_goodput_rps")
        out.append((sid, "sluice slo_goodput_rps not lower than the best baseline's",
                    g_mine >= g_best if _all(g_mine, g_best) else None,
                    f"sluice {_fmt(g_mine)}, best baseline {g_b} {_fmt(g_best)}"))
    return out


# ---- the earlier issues' bars ------------------------------------------------------------------------------------
BARS: list[Bar] = [
    Bar("P4", "sluice ghost_tokens_per_cancel <= one decode step (1 token per sequence) while envoy-tuned's is not",
        _tuned_lim("ghost_tokens_per_cancel", lambda a: a <= 1.0), _tuned_pair("ghost_tokens_per_cancel")),
    Bar("P12", "rejected_clean == 1.0 while envoy-tuned's is not",
        _tuned_lim("rejected_clean", lambda a: a == 1.0), _tuned_pair("rejected_clean")),
    Bar("P4n", "no-abort replicas: sluice wasted_tokens <= envoy-tuned's (informational)",
        lambda r: (_v(r, "sluice", "wasted_tokens") <= _v(r, "envoy-tuned", "wasted_tokens"))
        if _all(_v(r, "sluice", "wasted_tokens"), _v(r, "envoy-tuned", "wasted_tokens")) else None,
        _tuned_pair("wasted_tokens")),
    Bar("P1", "sluice slo_goodput_rps >= envoy-rr's", _cmp("slo_goodput_rps", lambda a, b: a >= b),
        _pair("slo_goodput_rps")),
    Bar("P1", "sluice ttft_p95_s within the 2 s SLO while envoy-rr's is not",
        lambda r: (_v(r, "sluice", "ttft_p95_s") <= 2.0 < _v(r, "envoy-rr", "ttft_p95_s"))
        if _all(_v(r, "sluice", "ttft_p95_s"), _v(r, "envoy-rr", "ttft_p95_s")) else None, _pair("ttft_p95_s")),
    Bar("P1", "sluice shed_latency_p99_s <= 0.05", _lim("shed_latency_p99_s", lambda a: a <= 0.05),
        _one("shed_latency_p99_s")),
    Bar("P1f", "a tenant flooding at 10x leaves the other tenant's ttft_p95 within 1.5x of its solo value",
        _lim("other_tenant_ttft_p95_ratio", lambda a: a <= 1.5), _pair("other_tenant_ttft_p95_ratio")),
    Bar("P2", "sluice ttft_p95_s <= 1/3 of envoy-rr's", _cmp("ttft_p95_s", lambda a, b: a <= b / 3),
        _pair("ttft_p95_s")),
    Bar("P3", "sluice hol_slowdown <= 2.0 (envoy-rr >= 3)",
        lambda r: (_v(r, "sluice", "hol_slowdown") <= 2.0 and _v(r, "envoy-rr", "hol_slowdown") >= 3)
        if _all(_v(r, "sluice", "hol_slowdown"), _v(r, "envoy-rr", "hol_slowdown")) else None,
        _pair("hol_slowdown")),
    Bar("P5", "sluice amplification <= 1.2 while envoy-rr's >= 3",
        lambda r: (_v(r, "sluice", "amplification") <= 1.2 and _v(r, "envoy-rr", "amplification") >= 3)
        if _all(_v(r, "sluice", "amplification"), _v(r, "envoy-rr", "amplification")) else None,
        _pair("amplification")),
    Bar("P5", "sluice goodput_rps >= envoy-rr's", _cmp("goodput_rps", lambda a, b: a >= b), _pair("goodput_rps")),
    Bar("P6", "sluice recollapses == 0 while envoy-rr's >= 1",
        lambda r: (_v(r, "sluice", "recollapses") == 0 and _v(r, "envoy-rr", "recollapses") >= 1)
        if _all(_v(r, "sluice", "recollapses"), _v(r, "envoy-rr", "recollapses")) else None, _pair("recollapses")),
    Bar("P7", "sluice kv_usage_spread <= 0.15", _lim("kv_usage_spread", lambda a: a <= 0.15),
        _pair("kv_usage_spread")),
    Bar("P7", "sluice kv_usage_spread <= half of envoy-rr's", _cmp("kv_usage_spread", lambda a, b: a <= b / 2),
        _pair("kv_usage_spread")),
    Bar("P8", "sluice detect_s <= 10 and envoy-rr never detects",
        lambda r: (_v(r, "sluice", "detect_s") is not None and _v(r, "sluice", "detect_s") <= 10
                   and _v(r, "envoy-rr", "detect_s") is None) if r.get("sluice") else None, _pair("detect_s")),
    Bar("P8", "sluice sick_share_after_detect <= 0.01", _lim("sick_share_after_detect", lambda a: a <= 0.01),
        _pair("sick_share_after_detect")),
    Bar("P9", "sluice preemptions == 0 where envoy-rr's > 0",
        lambda r: (_v(r, "sluice", "preemptions") == 0 and _v(r, "envoy-rr", "preemptions") > 0)
        if _all(_v(r, "sluice", "preemptions"), _v(r, "envoy-rr", "preemptions")) else None, _pair("preemptions")),
    Bar("P9", "sluice ttft_p99_s lower than envoy-rr's", _cmp("ttft_p99_s", lambda a, b: a < b), _pair("ttft_p99_s")),
    Bar("P10", "sluice detect_s <= 60", _lim("detect_s", lambda a: a <= 60), _one("detect_s")),
    Bar("P10", "sluice capacity_estimate_error <= 0.2", _lim("capacity_estimate_error", lambda a: a <= 0.2),
        _one("capacity_estimate_error")),
    Bar("P11", "max_calls_per_task == the configured 8, two sidecars sharing Redis",
        _lim("max_calls_per_task", lambda a: a == 8), _pair("max_calls_per_task")),
    Bar("P11", "other tenant's ttft_p95 within 1.5x of its value without the agents",
        lambda r: (_v(r, "sluice", "other_tenant_ttft_p95_s") <= 1.5 * _v(r, "sluice", "other_tenant_ttft_p95_idle_s"))
        if _all(_v(r, "sluice", "other_tenant_ttft_p95_s"), _v(r, "sluice", "other_tenant_ttft_p95_idle_s"))
        else None, _one("other_tenant_ttft_p95_s", "other_tenant_ttft_p95_idle_s")),
    Bar("PG", "shared setup's ttft_p95_s <= 0.7 x the independent one's",
        lambda r: (_v(r, "shared", "ttft_p95_s") <= 0.7 * _v(r, "independent", "ttft_p95_s"))
        if _all(_v(r, "shared", "ttft_p95_s"), _v(r, "independent", "ttft_p95_s")) else None,
        lambda r: f"shared {_fmt(_v(r, 'shared', 'ttft_p95_s'))}, "
                  f"independent {_fmt(_v(r, 'independent', 'ttft_p95_s'))}"),
    Bar("P12", "admitted streams keep flowing (admitted_flowing == 1.0)", _lim("admitted_flowing", lambda a: a == 1.0),
        _one("admitted_flowing", "open_streams_max")),
    Bar("P12", "Envoy + sidecar memory grows by <= 100 KB per open stream",
        _lim("gateway_kb_per_open_stream", lambda a: a <= 100), _pair("gateway_kb_per_open_stream")),
    Bar("P13", "gateway_rss_mb_per_slow_stream <= 0.25", _lim("gateway_rss_mb_per_slow_stream", lambda a: a <= 0.25),
        _pair("gateway_rss_mb_per_slow_stream")),
    Bar("P13", "slow streams are cut (slow_streams_cut > 0)", _lim("slow_streams_cut", lambda a: a > 0),
        _pair("slow_streams_cut")),
    # Flat over time: the last third of the run adds at most a tenth of the run's growth (full run only: in the
    # 10 s quick run the slow streams' buffers are still filling in the middle third, so it is not judged).
    Bar("P13", "gateway RSS flat over time (gateway_rss_drift_mb <= 10% of gateway_rss_growth_mb)",
        lambda r: (_v(r, "sluice", "gateway_rss_drift_mb") <= 0.1 * _v(r, "sluice", "gateway_rss_growth_mb"))
        if _all(_v(r, "sluice", "gateway_rss_drift_mb"), _v(r, "sluice", "gateway_rss_growth_mb")) else None,
        _one("gateway_rss_drift_mb", "gateway_rss_growth_mb")),
]


def evaluate(results: dict[str, Row]) -> list[tuple[Bar, bool | None, str]]:
    out = []
    for bar in BARS:
        row = results.get(bar.scenario)
        if not row:
            out.append((bar, None, "not run"))
            continue
        try:
            ok = bar.check(row)
        except TypeError:
            ok = None
        out.append((bar, ok, bar.shown(row)))
    return out


def _verdict(ok: bool | None) -> str:
    return "met" if ok else ("not judged" if ok is None else "**not met**")


def table(results: dict[str, Any]) -> str:
    meta = results.get("_meta", {})
    lines = [f"Bars judged on `{meta.get('command', '?')}` at commit `{meta.get('commit', '?')}`.", "",
             "Issue 15 (sluice at its shipped defaults against the best of envoy-rr, envoy-tuned and smg):", "",
             "| scenario | bar | measured | result |", "|---|---|---|---|"]
    honest = honest_bars(results)
    for sid, text, ok, shown in honest:
        lines.append(f"| {sid} | {text} | {shown} | {_verdict(ok)} |")
    judged = [ok for _s, _t, ok, _m in honest if ok is not None]
    unreachable = [sid for sid, text, ok, shown in honest if ok is False and "out of reach" in shown]
    reach = (f" {len(unreachable)} of the goodput bars not met ({', '.join(unreachable)}) are out of reach at their "
             f"scenario's load: the best baseline serves more than 1/{GOODPUT_MARGIN} of the offered requests within "
             "the SLO." if unreachable else "")
    lines += ["", f"Issue 15: {sum(judged)} of {len(judged)} judged bars met.{reach}", "",
              "The scenarios' own bars (earlier issues; P4 and P12 judged against envoy-tuned):", "",
              "| scenario | bar | measured | result |", "|---|---|---|---|"]
    for bar, ok, shown in evaluate(results):
        lines.append(f"| {bar.scenario} | {bar.text} | {shown} | {_verdict(ok)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bars", description=__doc__)
    parser.add_argument("json", help="the --json file of `sluice bench run`")
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args(argv)
    text = table(json.loads(Path(args.json).read_text()))
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
