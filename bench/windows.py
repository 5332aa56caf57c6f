"""What became of the user calls sent in each window of a run: within the SLO, completed late, or failed.

A run's headline numbers are averages over its whole length, and the length decides what they say: a system whose
queues grow without bound looks fine for as long as they are short, and a run that starts with every cache cold
measures mostly the warm-up. This reads the records of `sluice bench run ... --records DIR` (one JSON line per
client attempt, `bench.runner.write_records`; gzipped or not) and splits each run's user calls by when they were
first sent:

    python -m bench.windows DIR --slo 0.5 [--window 10] [--scenario PX]

Where the first token's time went, per class of the calls first sent from `--since` seconds on (`--split`):
before the replica answered (from the first send to the final attempt's response headers: the gateway's queue,
earlier attempts, the hops) and after it (from the headers to the first token: the engine's own queue and the
prefill). The simulator and vLLM answer a streamed request's headers when they accept it, before its prefill.

    python -m bench.windows DIR --split --since 9 [--scenario P1f]

A call (every SDK and business retry of one user request, `bench.scenarios.base.Call`) is within the SLO when its
final attempt completed with its first token at most `--slo` seconds after the first send, late when it completed
later, and failed otherwise (refused, errored, timed out or unfinished at the run's end).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
from pathlib import Path

from bench.openloop import Record
from bench.scenarios.base import Call, RunData, pct

OUTCOMES = ("within SLO", "late", "failed")


def read_calls(path: Path) -> list[Call]:
    """The user calls of one records file, in send order (times in wall seconds since the run's t0), grouped as the
    scenarios group them (`RunData.calls`)."""
    names = {f.name for f in dataclasses.fields(Record)}
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as lines:
        records = [Record(**{k: v for k, v in json.loads(line).items() if k in names}) for line in lines]
    end = max((r.end or r.start for r in records), default=0.0)
    return RunData(path.name, "", 1.0, [], records=records, duration=end).calls()


def outcome(call: Call, slo_s: float) -> str:
    if not call.ok:
        return "failed"
    ttft = call.ttft
    return "within SLO" if ttft is not None and ttft <= slo_s else "late"


def by_window(calls: list[Call], slo_s: float, window_s: float) -> dict[int, dict[str, int]]:
    """Window start (s) -> outcome -> calls first sent in that window."""
    out: dict[int, dict[str, int]] = {}
    for call in calls:
        start = int(call.first_send // window_s * window_s)
        counts = out.setdefault(start, dict.fromkeys(OUTCOMES, 0))
        counts[outcome(call, slo_s)] += 1
    return out


def table(files: list[Path], slo_s: float, window_s: float) -> str:
    """A markdown table: one row per records file, one column per window, cells `within / late / failed`."""
    rows = {f.name.split(".")[0]: by_window(read_calls(f), slo_s, window_s) for f in files}
    starts = sorted({w for counts in rows.values() for w in counts})
    head = "| run | " + " | ".join(f"{w:g}-{w + window_s:g} s" for w in starts) + " |"
    lines = [f"Calls by first send: within the SLO ({slo_s:g} s) / completed late / failed", "", head,
             "|---|" + "---|" * len(starts)]
    for name, counts in rows.items():
        cells = [" / ".join(str(counts.get(w, {}).get(o, 0)) for o in OUTCOMES) for w in starts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def split(calls: list[Call], since_s: float) -> dict[str, tuple[list[float], list[float]]]:
    """Class -> (seconds before the replica's response headers, seconds from them to the first token) of each call
    first sent at or after `since_s` whose final attempt got a first token."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for call in calls:
        last = call.final
        if call.first_send < since_s or last.first_token is None or last.headers_at is None:
            continue
        before, after = out.setdefault(call.kind, ([], []))
        before.append(last.headers_at - call.first_send)
        after.append(last.first_token - last.headers_at)
    return out


def split_table(files: list[Path], since_s: float) -> str:
    """A markdown table: one row per records file and class, the p50 and p95 of each part of the first token's time."""
    lines = [f"First token's time of the calls first sent from {since_s:g} s on, seconds: p50 / p95", "",
             "| run | class | calls | before the replica's headers | from them to the first token |",
             "|---|---|---|---|---|"]
    for f in files:
        for kind, (before, after) in sorted(split(read_calls(f), since_s).items()):
            cells = [" / ".join(f"{pct(xs, q):.3f}" for q in (50, 95)) for xs in (before, after)]
            lines.append(f"| {f.name.split('.')[0]} | {kind} | {len(before)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path, help="the --records directory of a bench run")
    ap.add_argument("--slo", type=float, help="the scenario's TTFT SLO, seconds (required without --split)")
    ap.add_argument("--window", type=float, default=10.0, help="window length, seconds (default 10)")
    ap.add_argument("--scenario", default="", help="only this scenario's records (file name prefix)")
    ap.add_argument("--split", action="store_true", help="where the first token's time went, per class")
    ap.add_argument("--since", type=float, default=0.0, help="with --split: calls first sent from here on, seconds")
    args = ap.parse_args(argv)
    if not args.split and args.slo is None:
        ap.error("--slo is required without --split")
    files = sorted(p for p in args.records.glob(f"{args.scenario}*.jsonl*") if p.suffix in (".jsonl", ".gz"))
    if not files:
        raise SystemExit(f"no records (*.jsonl, *.jsonl.gz) under {args.records}")
    print(split_table(files, args.since) if args.split else table(files, args.slo, args.window))


if __name__ == "__main__":
    main()
