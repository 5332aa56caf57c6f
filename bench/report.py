"""Markdown for the scenario results: one table per scenario (systems as columns), and a summary page.

A metric a system cannot produce is null in the JSON and "none" here. A scenario whose envoy-rr column does not
show its problem is marked "problem not reproduced": the scenario is wrong, not passed.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

from bench.scenarios.base import Metric, Scenario

SYSTEM_ORDER = ("envoy-rr", "envoy-tuned", "smg", "sluice")
COMMON = (  # every scenario's whole-cost metrics (bench/scenarios/base.py: slo_metrics, worst_class_ratio)
    ("slo_goodput_rps", "user requests meeting the scenario's SLO (first token within the SLO from the first send, "
                        "retries included, and completed) per second of offered load", "req/s", "higher"),
    ("offered_rps", "user requests offered per second (every arrival once, whatever its attempts): the most this "
                    "system's slo_goodput_rps can be", "req/s", ""),
    ("worst_class_ratio", "sluice only: min over classes of its class SLO goodput / the best baseline's "
                          "(refused-by-design classes left out)", "x", "higher"),
    ("gateway_cpu_s", "CPU seconds the gateway's processes (Envoy and the sidecar, or smg) used from the first "
                      "request to the end of the drain: on this machine it is taken from the replicas and the "
                      "clients", "s", "lower"),
)


def git_commit() -> str:
    """The short commit of the working directory's checkout, `+dirty` when tracked files differ from it: the code a
    run measured (the bench tools stamp their results with it)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):  # no git, or it hung past the timeout: the run goes on
        return "unknown"


def fmt(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "none"
        if value == int(value) and abs(value) < 1e6:
            return str(int(value))
        a = abs(value)
        if a >= 100:
            return f"{value:.0f}"
        if a >= 10:
            return f"{value:.1f}"
        if a >= 1:
            return f"{value:.2f}".rstrip("0").rstrip(".")
        if a >= 0.01:
            return f"{value:.3f}".rstrip("0").rstrip(".")
        return f"{value:.2g}"
    return str(value)


def ordered_systems(systems: list[str]) -> list[str]:
    return [s for s in SYSTEM_ORDER if s in systems] + [s for s in systems if s not in SYSTEM_ORDER]


def reproduced_label(flag: bool | None, judge: str = "envoy-rr") -> str:
    if flag is None:
        return f"not run ({judge} missing)"
    return "yes" if flag else "**problem not reproduced**"


def metric_docs(sc: Scenario) -> dict[str, Metric]:
    docs = {k: Metric(k, doc, unit, better) for k, doc, unit, better in COMMON}
    docs.update({m.key: m for m in sc.metrics_doc})
    return docs


PER_CLASS = ("class_slo_goodput", "class_ttft_p95_s", "class_failed", "class_calls")


def class_table(by_system: dict[str, dict[str, Any]], refused: tuple[str, ...] = ()) -> str:
    """Per class: SLO goodput (req/s), TTFT p95 from the first send (censored, s), failed / offered calls."""
    systems = ordered_systems(list(by_system))
    classes: list[str] = []
    for s in systems:
        for c in ((by_system.get(s) or {}).get("class_calls") or {}):
            if c not in classes:
                classes.append(c)
    if not classes:
        return ""
    lines = ["| class | " + " | ".join(f"{s}: goodput / p95 / failed" for s in systems) + " |",
             "|---|" + "---|" * len(systems)]
    for c in classes:
        cells = []
        for s in systems:
            m = by_system.get(s) or {}
            g = (m.get("class_slo_goodput") or {}).get(c)
            p = (m.get("class_ttft_p95_s") or {}).get(c)
            f = (m.get("class_failed") or {}).get(c)
            n = (m.get("class_calls") or {}).get(c)
            cells.append(f"{fmt(g)} / {fmt(p)} / {fmt(f)} of {fmt(n)}")
        label = c + (" (refused by design)" if c in refused else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(metrics: dict[str, Any], key: str) -> str:
    """A metric's value; over several repetitions (`--seeds N`) the median with [min-max]."""
    lo_hi = (metrics.get("spread") or {}).get(key)
    if lo_hi and lo_hi[0] != lo_hi[1]:
        return f"{fmt(metrics.get(key))} [{fmt(lo_hi[0])}-{fmt(lo_hi[1])}]"
    return fmt(metrics.get(key))


def render_table(sc: Scenario, by_system: dict[str, dict[str, Any]], reproduced: bool | None = None,
                 why: str = "", errors: dict[str, str] | None = None) -> str:
    """The scenario's table: one row per metric, one column per system; then the per-class table."""
    systems = ordered_systems(list(by_system))
    docs = metric_docs(sc)
    keys = list(docs)
    for s in systems:
        for k, v in (by_system.get(s) or {}).items():
            if k not in keys and not isinstance(v, (dict, list)) and k != "worst_class":
                keys.append(k)
    keys = [k for k in keys if k not in PER_CLASS and k != "refused_classes"]
    lines = [f"| metric | {' | '.join(systems)} | better |", "|---|" + "---|" * len(systems) + "---|"]
    for k in keys:
        m = docs.get(k)
        label = f"`{k}`" + (f" ({m.unit})" if m and m.unit else "")
        cells = [_cell(by_system.get(s) or {}, k) for s in systems]
        if k == "worst_class_ratio" and (by_system.get("sluice") or {}).get("worst_class"):
            cells = [c + (f" ({by_system['sluice']['worst_class']})" if s == "sluice" else "")
                     for c, s in zip(cells, systems)]
        lines.append(f"| {label} | {' | '.join(cells)} | {m.better if m else ''} |")
    out = "\n".join(lines) + "\n\nPer class (SLO goodput req/s / TTFT p95 from the first send, s, censored / " \
        "calls that failed of those offered):\n\n" + class_table(by_system, sc.refused_classes)
    out += (f"\n\nProblem reproduced on {sc.reproduced_on}: {reproduced_label(reproduced, sc.reproduced_on)}"
            + (f" ({why})" if why else "") + "\n")
    for s, err in (errors or {}).items():
        if err:
            out += f"\n{s}: error: {err.splitlines()[0][:300]}\n"
    return out


def scenario_section(sc: Scenario, by_system: dict[str, dict[str, Any]], meta: dict[str, Any],
                     heading: str = "##", plots_rel: str | None = None) -> str:
    sid = sc.id
    doc = sc.describe()
    ts = sc.time_scale
    policy = (meta.get("sluice_policy") or {}).get(sid)
    replicas = (meta.get("replicas") or {}).get(sid, sc.replicas)
    pool = ("real vLLM-CPU engines (`--backend vllm-cpu`)" if meta.get("backend") == "vllm-cpu"
            else f"`{sc.preset}` simulator")
    parts = [f"{heading} {sid}: {sc.title}", "", doc, "",
             f"Replicas: {replicas} x {pool}, time_scale {ts:g} "
             f"(time metrics in scenario seconds = wall x {ts:g}).", ""]
    if policy is not None:
        parts += [f"Sluice's additions to its shipped defaults (`_meta.sluice_policy`): `{json.dumps(policy)}`", ""]
    tuned = ((meta.get("baselines") or {}).get(sid) or {}).get("envoy-tuned")
    if tuned:
        parts += [f"envoy-tuned sized with: `{json.dumps(tuned)}`", ""]
    parts.append(render_table(sc, by_system, (meta.get("reproduced") or {}).get(sid), (meta.get("why") or {}).get(sid, ""),
                              (meta.get("errors") or {}).get(sid)))
    runs = (meta.get("runs") or {}).get(sid) or {}
    notes = [f"{s}: {n}" for s, info in runs.items() for n in info.get("notes", [])]
    if notes:
        parts.append("Notes: " + "; ".join(notes) + "\n")
    if runs:
        parts.append("Wall time per system-run (s, including stack start): "
                     + ", ".join(f"{s} {info.get('wall_s', 'error')}" for s, info in runs.items()) + "\n")
    if plots_rel is not None:
        parts.append(f"![{sid}: TTFT over time and KV usage per replica, every system]({plots_rel}/{sid}.png)\n")
    metric_docs = "\n".join(f"- `{m.key}`: {m.doc}" for m in sc.metrics_doc)
    parts.append("Metrics:\n" + metric_docs + "\n")
    return "\n".join(parts)


def header(meta: dict[str, Any]) -> str:
    return (f"<!-- generated by `{meta.get('command', 'sluice bench run')}` at commit {meta.get('commit', '?')}, "
            f"{meta.get('date', '')}; quick={meta.get('quick')} seed={meta.get('seed')}"
            + (f" seeds={meta['seeds']} (medians [min-max])" if (meta.get("seeds") or 1) > 1 else "") + " -->\n")


def write_scenario(sc: Scenario, by_system: dict[str, dict[str, Any]], meta: dict[str, Any], results_dir: Path) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{sc.id}.md"
    text = header(meta) + f"Command: `{meta.get('command', '')}`  \nCommit: `{meta.get('commit', '')}`\n\n"
    text += scenario_section(sc, by_system, meta, heading="#", plots_rel=".")
    path.write_text(text)
    return path


METHOD = """\
How to run: `sluice bench run all --quick --json bench/results/scenarios.json` (or name scenarios: `P1 P3 P7`;
`--systems envoy-rr,sluice` to compare fewer systems). Per scenario and system the harness starts the same
simulated replica pool fresh (same preset, same seeds) with the system in front, replays the scenario's
open-loop workload (arrival times fixed in advance, streaming requests; TTFT = time to the first content SSE
event), polls every replica's `/sim/state` every 250 ms, injects the scenario's faults, stops the stack and
computes the metrics. Systems:

- `envoy-rr`: Envoy, round robin, Envoy's defaults, no ext_proc: the naive baseline that must show each problem;
- `envoy-tuned`: Envoy as an experienced operator configures it for an LLM pool (least_request with slow start,
  circuit breakers sized to replicas x max_num_seqs, active /health checks, outlier detection, retries on reset /
  connect-failure / 503 on other hosts within a retry budget, admission_control, a per-tenant local_ratelimit
  where the scenario has tenants): `extproc/baselines.py`, each choice explained there;
- `smg`: the Shepherd Model Gateway (`smg launch --policy cache_aware`, its retries, circuit breaker, health checks
  and overload protection as shipped);
- `sluice`: Envoy + the sluice ext_proc sidecar at its shipped defaults, told only the scenario's deployment facts
  (the SLO as `admission.ttft_target_s`, tenants, a task budget), listed above each table.

Clients are the openai SDK by default (max_retries 2 with its backoff and jitter, honouring retry-after and
x-should-retry, sending x-stainless-retry-count and x-stainless-read-timeout, failing a stream at an error event as
the SDK raises there; `bench/openloop.py`). Every
scenario reports `slo_goodput_rps` (user requests whose first token came within the scenario's SLO of their
first send, retries included, and that completed, per second of offered load), the same per class with each
class's TTFT p95 from the first send (requests without a first token censored at the time their user waited,
failures counted next to it), and for sluice `worst_class_ratio` (its worst class against the best baseline).

Times are in scenario seconds: the simulator runs `time_scale` times faster than the hardware it models
(scenario seconds = wall seconds x time_scale; every scenario here uses 1). The machine is a shared 2-core VM:
the gateway, the replicas and the load generator compete for CPU, so absolute numbers are noisy; the
comparison between columns of one run is the result; `--seeds N` repeats every system-run on N workloads of
the same shape (other arrival draws, other simulator and client seeds) and shows each metric as its median
[min-max], for scenarios where one run decides nothing. `none` = the system cannot produce that metric (for
example, no gateway signal exists). "problem not reproduced" = envoy-rr did not show the problem, so the
scenario is wrong for this build, not passed.

Adding a scenario: one module per problem in `bench/scenarios/` (registered in `bench/scenarios/__init__.py`),
a class `S(Scenario)` whose module docstring states the workload, the SLO, the classes, the headline metrics,
the rule that says envoy-rr reproduced the problem, and what sluice is told (`slo_ttft_s`, `sluice_facts`:
deployment facts only, checked by tests/bench/test_harness_units.py). `workload(quick)` returns open-loop
arrivals and faults in scenario seconds; `metrics(run)` computes the scenario's own numbers from the recorded
run (`bench/scenarios/base.py: RunData`); `reproduced(metrics)` judges the envoy-rr column.
Harness tests: `pytest tests/bench`.
"""


DEPENDENCIES = """\
## What the sluice column depends on

Every metric is measured from outside (clients, replicas, Envoy admin); only these read the sidecar or need a
sidecar feature to move. The names below are what the harness reads or sends; a metric whose signal a system
does not export is `none`.

| scenario | metric | sidecar feature | signal the harness reads / sends |
|---|---|---|---|
| P1 | `shed_fraction`, `shed_latency_p99_s`, `replica_waiting_max` | bounded queue, early shed (`admission`) | client-side status 429/503, `retry-after(-ms)` |
| P2, P3, P7, P9 | TTFT, `hol_slowdown`, `kv_usage_spread`, `preemptions` | token-metered admission, lanes, live-load placement, KV headroom | replica `/sim/state` only |
| P4, P4n | `ghost_tokens` | holding requests in the sidecar's queue; deadlines | request header `x-stainless-read-timeout` (wall seconds); replica `sim_ghost_tokens_total` + `late_tokens` (after the client's `x-sim-deadline`) |
| P5 | `amplification` | retry budget (`budgets.retry`) | request header `x-stainless-retry-count`; response headers `x-should-retry`, `retry-after-ms` / `retry-after` |
| P6 | `recollapses`, `time_to_full_s` | health state machine, slow start (`routing.health`) | replica `/sim/state` only |
| P8 | `detect_s` | business health (`routing.health`) | sidecar gauge `sluice_replica_state{pool,replica,state}` = 1 with state != healthy (or `sluice_replica_healthy{replica}` = 0); envoy-tuned: `envoy_cluster_outlier_detection_ejections_active` > 0 |
| P10 | `detect_s` | prompt-shift detector (`budgets.prompt_shift`) | request header `x-sluice-app`; sidecar counter `sluice_prompt_shift_events_total{app}` > 0 |
| P10 | `capacity_estimate_error` | capacity estimate per app | sidecar gauge `sluice_prompt_capacity_requests_per_second{app}` against the true capacity from the simulator's cost model (`bench/capacity.py`) |
| P11 | `max_calls_per_task`, `max_tokens_per_task` | task and tenant budgets (`budgets.tasks`, `budgets.tenants`) | request headers `x-sluice-tenant`, `x-sluice-task-id`, `x-sluice-task-depth`; a 4xx ends the task |
| P12 | `rejected_clean` | open-request cap (`sidecar.max_open_requests`, derived from the connection limit) | a clean 429 vs a closed connection |
| P13 | `slow_streams_cut` | slow-consumer cut (`streaming.slow_consumer`) | replica abort counters; client-side early end of stream |
"""


def overview(result: dict[str, Any], scenarios: list[Scenario]) -> str:
    """One line per scenario: its headline metrics, systems side by side."""
    meta = result.get("_meta") or {}
    systems = ordered_systems(list(meta.get("systems") or SYSTEM_ORDER))
    lines = [f"| scenario | metric | {' | '.join(systems)} | better | reproduced |",
             "|---|---|" + "---|" * len(systems) + "---|---|"]
    for sc in scenarios:
        by = result.get(sc.id) or {}
        keys = list(sc.headline) or [m.key for m in sc.metrics_doc[:1]]
        flag = (meta.get("reproduced") or {}).get(sc.id)
        keys = ["slo_goodput_rps"] + [k for k in keys if k != "slo_goodput_rps"]
        if "sluice" in systems:
            keys.insert(1, "worst_class_ratio")
        docs = metric_docs(sc)
        for i, k in enumerate(keys):
            m = docs.get(k)
            unit = f" ({m.unit})" if m and m.unit else ""
            cells = " | ".join(fmt((by.get(s) or {}).get(k)) for s in systems)
            first = f"{sc.id} {sc.title}" if i == 0 else ""
            rep = reproduced_label(flag) if i == 0 else ""
            lines.append(f"| {first} | `{k}`{unit} | {cells} | {m.better if m else ''} | {rep} |")
    return "\n".join(lines) + "\n"


def offered_cell(row: dict[str, Any]) -> str:
    """The most user requests any system's run offered per second, and sluice's own where it differs: closed-loop
    clients (P11's agents past their budget, PX's sessions, which end at a refused turn) offer more where they are
    served, so sluice's goodput is bounded by its own run's offer."""
    offers = {s: m.get("offered_rps") for s, m in row.items() if isinstance(m, dict) and m.get("offered_rps")}
    if not offers:
        return fmt(None)
    top, mine = max(offers.values()), offers.get("sluice")
    return fmt(top) if mine is None or mine == top else f"{fmt(top)} (sluice {fmt(mine)})"


def goodput_table(result: dict[str, Any]) -> str:
    """Per scenario: the requests offered per second (the ceiling of every goodput), every system's SLO goodput,
    sluice's ratio to the best baseline, its worst class against the best baseline, whether envoy-rr shows the
    problem and whether envoy-tuned still does."""
    meta = result.get("_meta") or {}
    systems = ordered_systems(list(meta.get("systems") or SYSTEM_ORDER))
    baselines = [s for s in systems if s != "sluice"]
    lines = ["| scenario | offered | " + " | ".join(f"{s}" for s in systems)
             + " | sluice / best baseline | worst_class_ratio (class) | envoy-rr shows it | envoy-tuned shows it |",
             "|---|---|" + "---|" * len(systems) + "---|---|---|---|"]
    from bench.bars import served_goodput

    for sid, row in result.items():
        if sid.startswith("_"):
            continue
        vals = {s: (row.get(s) or {}).get("slo_goodput_rps") for s in systems}
        served = {s: served_goodput(row, s) for s in systems}
        best = max([v for s, v in served.items() if s in baselines and v is not None], default=None)
        mine = served.get("sluice")
        refused = (row.get("sluice") or {}).get("refused_classes") or []
        rel = (f"{mine / best:.2f}x" if mine is not None and best else "none") + (
            f" (without {', '.join(refused)}: {fmt(mine)} vs {fmt(best)})" if refused else "")
        sl = row.get("sluice") or {}
        worst = f"{fmt(sl.get('worst_class_ratio'))} ({sl.get('worst_class') or '-'})"
        rep = (meta.get("reproduced") or {}).get(sid)
        tuned = ((meta.get("reproduced_by") or {}).get(sid) or {}).get("envoy-tuned")
        offered = offered_cell(row)
        lines.append(f"| {sid} | {offered} | " + " | ".join(fmt(vals[s]) for s in systems) + f" | {rel} | {worst} | "
                     f"{'yes' if rep else ('no' if rep is not None else 'not run')} | "
                     f"{'not run' if tuned is None else ('yes' if tuned[0] else 'no')} |")
    return "\n".join(lines) + "\n"


def write_summary(result: dict[str, Any], path: Path, results_dir: Path,
                  scenarios: list[Scenario] | None = None) -> Path:
    from bench.scenarios import get_scenarios

    meta = result.get("_meta") or {}
    ids = [k for k in result if not k.startswith("_")]
    if scenarios is None:
        scenarios = get_scenarios(ids) if ids else []
    for sc in scenarios:
        sc.workload(bool(meta.get("quick", True)))  # scenarios whose settings depend on the mode
    lines = [header(meta), "# Scenario benchmarks (P1..P13)", "",
             f"Command: `{meta.get('command', '')}`  ", f"Commit: `{meta.get('commit', '')}`  ",
             f"Date: {meta.get('date', '')}  ", f"Total wall time: {meta.get('wall_s', '?')} s", "", METHOD, "",
             "## SLO goodput (req/s) per scenario and system", "", goodput_table(result), "",
             "## Overview (headline metrics)", "", overview(result, scenarios), DEPENDENCIES,
             "## Reproduced on envoy-rr", "", "| scenario | reproduced | why |", "|---|---|---|"]
    for sc in scenarios:
        flag = (meta.get("reproduced") or {}).get(sc.id)
        lines.append(f"| {sc.id} {sc.title} | {reproduced_label(flag)} | {(meta.get('why') or {}).get(sc.id, '')} |")
    lines.append("")
    try:
        rel = Path("..") / results_dir if not results_dir.is_absolute() else results_dir
    except ValueError:
        rel = results_dir
    for sc in scenarios:
        lines.append(scenario_section(sc, result[sc.id], meta, heading="##", plots_rel=str(rel)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


RESULTS_BEGIN = "<!-- results:begin (generated by `sluice bench run all`; do not edit by hand) -->"
RESULTS_END = "<!-- results:end -->"


def results_block(result: dict[str, Any]) -> str:
    """The published headline of a complete run: where it came from, every system's SLO goodput per scenario with
    sluice's ratio to the best baseline and its worst class, and how many issue-15 bars held. README.md and
    docs/benchmarks.md carry it between RESULTS_BEGIN and RESULTS_END, so no number there is typed by hand."""
    from bench.bars import GOODPUT_MARGIN, honest_bars

    meta = result.get("_meta") or {}
    honest = honest_bars(result)
    judged = [ok for _sid, _text, ok, _shown in honest if ok is not None]
    unreachable = [sid for sid, _text, ok, shown in honest if ok is False and "out of reach" in shown]
    reach = (f" The goodput bars of {', '.join(unreachable)} are out of reach at their load: the best baseline "
             f"serves more than 1/{GOODPUT_MARGIN} of what is offered within the SLO." if unreachable else "")
    return "\n".join([
        RESULTS_BEGIN,
        f"Run: `{meta.get('command', '?')}` at commit `{meta.get('commit', '?')}`, {meta.get('date', '')}, "
        f"{fmt(meta.get('wall_s'))} s of wall time on the shared 2-core machine. SLO goodput in req/s (user requests "
        "whose first token came within the scenario's SLO of their first send, retries included):",
        "",
        goodput_table(result).rstrip("\n"),
        "",
        f"Issue-15 bars met: {sum(judged)} of {len(judged)} judged (bench/results/bars.md lists each).{reach}",
        RESULTS_END,
    ])


DETAILS_BEGIN = "<!-- details:begin (generated by `sluice bench run all`; do not edit by hand) -->"
DETAILS_END = "<!-- details:end -->"


def details_block(result: dict[str, Any]) -> str:
    """docs/benchmarks.md's generated detail for the same run: every bar with its measured value, and what
    sluice was told beyond its shipped defaults in each scenario."""
    from bench.bars import table as bars_table

    policy = (result.get("_meta") or {}).get("sluice_policy") or {}
    told = ["| scenario | sluice is told (beyond its shipped defaults) |", "|---|---|"]
    told += [f"| {sid} | `{json.dumps(additions)}` |" for sid, additions in policy.items()]
    return "\n".join([DETAILS_BEGIN, "### The bars", "", bars_table(result), "",
                      "### What sluice is told (`_meta.sluice_policy`)", "", *told, DETAILS_END])


def _replace_between(path: Path, begin_marker: str, end_marker: str, block: str) -> bool:
    if not path.is_file():
        return False
    text = path.read_text()
    begin, end = text.find(begin_marker), text.find(end_marker)
    if begin < 0 or end < begin:
        return False
    path.write_text(text[:begin] + block + text[end + len(end_marker):])
    return True


def update_results_block(result: dict[str, Any], path: Path) -> bool:
    """Replace the generated blocks in `path` (README.md, docs/benchmarks.md): the results block, and the details
    block where the page has one. False when the file has no results markers."""
    found = _replace_between(path, RESULTS_BEGIN, RESULTS_END, results_block(result))
    if found:
        _replace_between(path, DETAILS_BEGIN, DETAILS_END, details_block(result))
    return found
