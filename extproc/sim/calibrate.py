"""`sluice sim calibrate`: run the engine model on the reference scenarios, compare to measurements.

Runs in simulated time (no HTTP, no sleeping), so it takes well under a second. Each scenario
mirrors one measured row of a real vLLM 0.32 engine (docs/ARCHITECTURE.md):

* ``ttft_N``: one request of N prompt tokens on an idle engine, time to first token;
* ``decode_ms_per_token_1``: one stream, mean gap between tokens after the first;
* ``decode_tok_s_per_stream_16``: 16 streams started together, tokens/s of each stream;
* ``hol_short_ttft_min`` / ``_max`` / ``_mean``: a 100-token request arriving while a
  4,000-token prompt is in prefill (20 runs, arrival spread evenly over the long prompt's
  TTFT): best, worst and mean.

Exit status 1 when a ratio falls outside 0.7..1.3, so CI can pin the calibration.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from .engine import Engine, Request, run_offline
from .presets import Preset, get_preset

__all__ = ["Row", "calibrate", "main", "LOW", "HIGH"]

LOW, HIGH = 0.7, 1.3


@dataclass
class Row:
    name: str
    reference: float | None
    simulated: float
    unit: str

    @property
    def ratio(self) -> float | None:
        if not self.reference:
            return None
        return self.simulated / self.reference

    def as_json(self) -> dict[str, object]:
        r = self.ratio
        return {"name": self.name, "reference": self.reference, "simulated": round(self.simulated, 6),
                "ratio": None if r is None else round(r, 4), "unit": self.unit}


def _engine(p: Preset) -> Engine:
    return Engine(p.cost, num_gpu_blocks=p.num_gpu_blocks, block_size=p.block_size,
                  max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens)


def _ttft(p: Preset, prompt: int) -> float:
    r = Request("r", prompt, 1)
    run_offline(_engine(p), [(0.0, r)])
    assert r.first_token_at is not None
    return r.first_token_at - r.arrival


def _decode_gaps(p: Preset, streams: int, out: int) -> list[float]:
    """Per-stream mean seconds per token after the first token."""
    reqs = [Request(f"s{i}", 100, out) for i in range(streams)]
    run_offline(_engine(p), [(0.0, r) for r in reqs])
    gaps = []
    for r in reqs:
        assert r.first_token_at is not None
        gaps.append((r.last_token_at - r.first_token_at) / (r.num_output - 1))
    return gaps


def _hol(p: Preset, runs: int = 20) -> list[float]:
    window = _ttft(p, 4000)
    out = []
    for k in range(runs):
        eng = _engine(p)
        long = Request("long", 4000, 50)
        short = Request("short", 100, 1)
        run_offline(eng, [(0.0, long), (window * k / runs, short)])
        assert short.first_token_at is not None
        out.append(short.first_token_at - short.arrival)
    return out


def calibrate(preset: Preset) -> list[Row]:
    ref = preset.references
    rows = [
        Row("ttft_100", ref.get("ttft_100"), _ttft(preset, 100), "s"),
        Row("ttft_4000", ref.get("ttft_4000"), _ttft(preset, 4000), "s"),
        Row("ttft_8000", ref.get("ttft_8000"), _ttft(preset, 8000), "s"),
    ]
    one = _decode_gaps(preset, 1, 200)
    rows.append(Row("decode_ms_per_token_1", ref.get("decode_ms_per_token_1"), one[0], "s"))
    sixteen = _decode_gaps(preset, 16, 300)
    tps = sum(1.0 / g for g in sixteen) / len(sixteen)
    rows.append(Row("decode_tok_s_per_stream_16", ref.get("decode_tok_s_per_stream_16"), tps, "tok/s"))
    hol = _hol(preset)
    rows.append(Row("hol_short_ttft_min", ref.get("hol_short_ttft_min"), min(hol), "s"))
    rows.append(Row("hol_short_ttft_max", ref.get("hol_short_ttft_max"), max(hol), "s"))
    rows.append(Row("hol_short_ttft_mean", ref.get("hol_short_ttft_mean"), sum(hol) / len(hol), "s"))
    return rows


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1000:.2f} ms" if v < 0.1 else f"{v * 1000:.1f} ms"
    return f"{v:.1f} {unit}"


def render_table(preset: Preset, rows: list[Row]) -> str:
    lines = [f"calibration of preset {preset.name}: {preset.description}",
             f"{'scenario':<28} {'reference':>12} {'simulated':>12} {'ratio':>7}"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        lines.append(f"{r.name:<28} {_fmt(r.reference, r.unit):>12} {_fmt(r.simulated, r.unit):>12} {ratio:>7}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sluice sim calibrate",
                                 description="Compare the engine model with reference measurements.")
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--json", dest="json_file", default=None, help="also write the rows to FILE")
    args = ap.parse_args(argv)
    try:
        preset = get_preset(args.preset)
    except ValueError as e:
        print(f"sim calibrate: {e}", file=sys.stderr)
        return 2
    rows = calibrate(preset)
    print(render_table(preset, rows))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump([r.as_json() for r in rows], f, indent=2)
            f.write("\n")
    bad = [r for r in rows if r.ratio is not None and not LOW <= r.ratio <= HIGH]
    if bad:
        print(f"out of range ({LOW}-{HIGH}): {', '.join(r.name for r in bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
