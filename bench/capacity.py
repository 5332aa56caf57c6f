"""What the simulated replicas can do, computed from the simulator's own cost model (its preset), not measured
through a gateway: the harness's ground truth for capacities and for the engine limits a baseline is sized to.

Each number comes from driving the simulator's pure engine (`extproc.sim.engine.Engine`, no I/O, its own
clock) offline with the scenario's engine flags, so it follows the preset when the preset is refitted:
  * `ttft_alone_s(prompt)`: one request on an idle engine (frontend + its prefill chunks + first sample);
  * `capacity_rps(prompt, output)`: completions per second of one replica kept saturated with identical
    requests: a backlog of `SATURATION` requests queued at once, divided by the time the engine needs to finish
    them all (the batch's ramp-up and drain at the ends are a few percent of that time).
A pool's capacity is `replicas x capacity_rps`: replicas are independent engines.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from extproc.sim.engine import Engine, Request
from extproc.sim.presets import Preset, get_preset

SATURATION = 400  # requests queued at once to measure a saturated engine


@dataclass(frozen=True)
class EngineSpec:
    """The engine a scenario runs: a preset plus the `sluice sim` flags that change its limits."""

    preset: str = "tiny-cpu"
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    @staticmethod
    def of(preset: str, sim_args: list[str] | tuple[str, ...] = ()) -> "EngineSpec":
        """Parse the flags `sluice sim` understands that matter here; others (faults, ports) are ignored."""
        ap = argparse.ArgumentParser(add_help=False)
        ap.add_argument("--num-gpu-blocks", type=int)
        ap.add_argument("--max-num-seqs", type=int)
        ap.add_argument("--max-num-batched-tokens", type=int)
        known, _rest = ap.parse_known_args(list(sim_args))
        return EngineSpec(preset, known.num_gpu_blocks, known.max_num_seqs, known.max_num_batched_tokens)

    @property
    def base(self) -> Preset:
        return get_preset(self.preset)

    @property
    def seqs(self) -> int:
        """The engine's max_num_seqs: how many requests it runs at once."""
        return self.max_num_seqs or self.base.max_num_seqs

    def engine(self) -> Engine:
        p = self.base
        return Engine(p.cost, num_gpu_blocks=self.num_gpu_blocks or p.num_gpu_blocks, block_size=p.block_size,
                      max_num_seqs=self.seqs,
                      max_num_batched_tokens=self.max_num_batched_tokens or p.max_num_batched_tokens)


def _drive(engine: Engine, requests: list[Request]) -> None:
    for r in requests:
        engine.add(r, 0.0)
    steps = 0
    while engine.has_work() and steps < 2_000_000:
        step = engine.schedule()
        if step is None:
            nxt = engine.next_ready_time()
            if nxt is None or nxt <= engine.clock:
                break
            engine.clock = nxt
            continue
        engine.complete(step)
        steps += 1


@functools.lru_cache(maxsize=256)
def ttft_alone_s(spec: EngineSpec, prompt: int) -> float:
    """Seconds from arrival to the first token of one request on an idle replica."""
    engine = spec.engine()
    req = Request("alone", prompt, 1)
    _drive(engine, [req])
    assert req.first_token_at is not None
    return req.first_token_at - req.arrival


@functools.lru_cache(maxsize=256)
def capacity_rps(spec: EngineSpec, prompt: int, output: int) -> float:
    """Completions per second of one saturated replica for requests of `prompt` + `output` tokens."""
    engine = spec.engine()
    reqs = [Request(f"r{i}", prompt, output) for i in range(SATURATION)]
    _drive(engine, reqs)
    done = [r.last_token_at for r in reqs if r.finished]
    if len(done) < len(reqs) or max(done) <= 0:
        return float("nan")
    return len(done) / max(done)


def mix_capacity_rps(spec: EngineSpec, mix: list[tuple[float, int, int]]) -> float:
    """One replica's completions per second for a mix of (share, prompt, output): the harmonic combination of
    each kind's engine time per request (the engine's time is shared in proportion to the offered shares)."""
    total = sum(s for s, _p, _o in mix)
    seconds = sum((s / total) / capacity_rps(spec, p, o) for s, p, o in mix)
    return 1.0 / seconds


__all__ = ["EngineSpec", "ttft_alone_s", "capacity_rps", "mix_capacity_rps"]
