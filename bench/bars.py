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


BARS: list[Bar] = [
    Bar("P1", "sluice goodput_rps >= envoy-rr's", _cmp("goodput_rps", lambda a, b: a >= b), _pair("goodput_rps")),
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
    Bar("P4", "sluice ghost_tokens_per_cancel <= one decode step (1 token per sequence)",
        _lim("ghost_tokens_per_cancel", lambda a: a <= 1.0), _pair("ghost_tokens_per_cancel")),
    # Informational: with replicas that ignore disconnects no gateway can stop forwarded work (docs/benchmarks.md).
    Bar("P4n", "no-abort replicas: sluice wasted_tokens <= envoy-rr's (informational)",
        _cmp("wasted_tokens", lambda a, b: a <= b), _pair("wasted_tokens")),
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
    Bar("P12", "rejected_clean == 1.0", _lim("rejected_clean", lambda a: a == 1.0), _pair("rejected_clean")),
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


def table(results: dict[str, Any]) -> str:
    meta = results.get("_meta", {})
    lines = [f"Bars from the issues, judged on `{meta.get('command', '?')}` at commit `{meta.get('commit', '?')}`.",
             "", "| scenario | bar | measured | result |", "|---|---|---|---|"]
    for bar, ok, shown in evaluate(results):
        verdict = "met" if ok else ("not judged" if ok is None else "**not met**")
        lines.append(f"| {bar.scenario} | {bar.text} | {shown} | {verdict} |")
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
