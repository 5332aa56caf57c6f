"""Named hardware/model presets: the engine's cost model constants and its default limits.

The cost of one engine step (one forward pass over a batch, vLLM V1 style) is

    step_s = base + prefill_tok * P + decode_seq * S + attn_pair * A + attn_ctx_pair * C + kv_read_tok * K

* ``P``: prefill tokens computed in the step (chunks of prompts, capped by the token budget);
* ``S``: sequences that sample a token in the step (decodes plus prompts finishing prefill);
* ``A``: attention pairs within prefill chunks: a chunk of ``n`` tokens adds ``n * (n + 1) / 2``;
* ``C``: pairs of a chunk with the context before it: a chunk of ``n`` tokens starting at
  position ``c`` adds ``n * c`` (earlier chunks, or a prefix-cache hit). ``A`` and ``C`` make an
  8,000-token prompt cost more than twice a 4,000-token one (attention is quadratic);
* ``K``: context tokens read by decodes (each decode reads its whole KV cache).

A request also pays ``frontend + frontend_tok * prompt_tokens`` once, before it reaches the engine
queue: HTTP parsing, tokenization, hashing and the hop from vLLM's API server process to EngineCore.
It delays that request only. Where the API server shares the engine's core (vLLM-CPU: one core runs the
API server, EngineCore's scheduler and the worker), a request that arrives while the engine is busy also
takes ``server_core`` seconds of that core: the next step runs that much longer,

    step_s += server_core x (requests that arrived while the engine was busy since the last step)

On an idle engine that work happens while nothing else runs, inside ``frontend``.

The constants of ``tiny-cpu`` are fitted by ``sluice sim calibrate --against`` to a measurement of a
real vLLM 0.32 CPU engine (bench/results/calibration-vllm-cpu.json; docs/simulator.md); those of
``llama-8b-h100`` are derived from public hardware and model specifications, cited inline.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["CostModel", "Preset", "PRESETS", "get_preset", "measurement_path", "preset_to_json",
           "preset_from_json", "contended_quantile"]

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work in one engine step (see the module docstring for the formula).

    ``abort``, ``metrics_base`` and ``metrics_per_seq`` are API-server costs, not engine steps: the
    time from a client's disconnect until the engine drops the request, and how long ``GET /metrics``
    takes (``metrics_base + metrics_per_seq * running``). ``server_core`` is the API server's and the
    scheduler's work per request on the engine's own core, which a busy engine's steps pay (0: they run
    elsewhere, as beside a GPU).
    """

    base: float
    prefill_tok: float
    decode_seq: float
    attn_pair: float
    kv_read_tok: float
    frontend: float
    attn_ctx_pair: float | None = None  # per (chunk token, earlier-context token) pair; None: attn_pair
    frontend_tok: float = 0.0  # API-server work per prompt token before the engine sees the request
    abort: float = 0.0
    metrics_base: float = 0.0
    metrics_per_seq: float = 0.0
    server_core: float = 0.0  # seconds of the engine's core per request that arrives while it is busy

    def step_seconds(self, prefill_tokens: int, samples: int, attn_pairs: float, kv_read: int,
                     ctx_pairs: float = 0.0) -> float:
        ctx = self.attn_pair if self.attn_ctx_pair is None else self.attn_ctx_pair
        return (
            self.base
            + self.prefill_tok * prefill_tokens
            + self.decode_seq * samples
            + self.attn_pair * attn_pairs
            + ctx * ctx_pairs
            + self.kv_read_tok * kv_read
        )

    def at_speed(self, speed: float) -> "CostModel":
        """The same engine on hardware `speed` times as fast as the preset's: every engine-step cost and the API
        server's work (`frontend`, `frontend_tok`, `server_core`) divided by `speed`; the abort and /metrics
        costs stay as measured.

        Why: make bench-real's real engines run two to a 2-core machine beside the clients, Envoy and the
        gateway, and deliver `load_scale` of the preset's throughput there (bench/rig.py). Simulated replicas that
        stand in for them in the same comparison run at that speed, or they carry the same load at about half
        the utilisation and queue where the engines do not. A uniform speed is an approximation: on those engines a
        light load of long prompts runs at about the preset's speed (docs/benchmarks.md, "The simulated column on
        the rig's shared cores")."""
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        if speed == 1:
            return self
        k = 1.0 / speed
        ctx = None if self.attn_ctx_pair is None else self.attn_ctx_pair * k
        return replace(self, base=self.base * k, prefill_tok=self.prefill_tok * k, decode_seq=self.decode_seq * k,
                       attn_pair=self.attn_pair * k, kv_read_tok=self.kv_read_tok * k, attn_ctx_pair=ctx,
                       frontend=self.frontend * k, frontend_tok=self.frontend_tok * k,
                       server_core=self.server_core * k)

    def metrics_latency(self, running: int, prefilling: int = 0) -> float:
        """Seconds one ``GET /metrics`` takes with ``running`` sequences in the engine."""
        return self.metrics_base + self.metrics_per_seq * running


@dataclass(frozen=True)
class Preset:
    """A cost model plus the engine limits a replica of that kind starts with."""

    name: str
    description: str
    cost: CostModel
    num_gpu_blocks: int
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    mean_output_tokens: float = 200.0
    # Reference measurements the calibration compares against: name -> value (seconds or tok/s).
    references: dict[str, float] = field(default_factory=dict)
    # The measurement (a `sluice sim calibrate --against` JSON under bench/results/) it was fitted to.
    measurement: str | None = None
    # GET /metrics latency with two busy engines sharing the machine: deciles 0, 0.1 .. 1 (seconds),
    # measured; the `metrics-latency contended` fault draws each scrape's latency from them.
    metrics_contended: tuple[float, ...] = ()

    def with_overrides(self, **kw: object) -> "Preset":
        kw = {k: v for k, v in kw.items() if v is not None}
        return replace(self, **kw)  # type: ignore[arg-type]


# tiny-cpu: fitted by `python -m bench.vllm_cpu calibrate` (sluice sim calibrate --against) to a real
# vLLM 0.32.0 CPU engine on this project's machine kind (AMD EPYC, 2 cores), 2026-12-02,
# sluice commit d84ce9b; the measurement, with every sample, the command and the rows, is
# bench/results/calibration-vllm-cpu.json, and tests/sim/test_sim_calibration.py keeps these constants equal
# to the fit stored there. The engine: the tiny random Llama of bench/vllm_cpu.py (hidden 128, 4 layers),
# --dtype float32, --max-num-seqs 64, --max-num-batched-tokens 2048 (default), --enforce-eager, one core
# (VLLM_CPU_OMP_THREADS_BIND=0), --kv-cache-memory-bytes 256M = 512 blocks of 128 tokens.
TINY_CPU = Preset(
    name="tiny-cpu",
    description="tiny random Llama on vLLM 0.32.0's CPU backend, one core, fitted to a measurement",
    cost=CostModel(
        base=0.003747,
        prefill_tok=2.767e-05,
        decode_seq=0.0002449,
        attn_pair=1.04e-07,
        kv_read_tok=1.274e-12,
        frontend=0.006093,
        attn_ctx_pair=7.385e-08,
        frontend_tok=1.554e-06,
        abort=0.02223,
        metrics_base=0.01924,
        metrics_per_seq=0.0002682,
    ),
    num_gpu_blocks=512,
    block_size=128,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    # The engine serves 8,192 positions; the simulator keeps 32,768 so scenarios with longer prompts
    # (P3's 12,000 tokens) still run on it.
    max_model_len=32768,
    mean_output_tokens=200.0,
    measurement="calibration-vllm-cpu.json",
    metrics_contended=(0.031971, 0.042288, 0.049635, 0.057783, 0.065298, 0.074217, 0.078175, 0.129985, 0.1572, 0.564163, 3.200092),
)


# llama-8b-h100: Llama-3.1-8B-Instruct, bf16, one H100 SXM 80 GB, vLLM defaults.
# Sources (public):
#  - NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense BF16.
#  - Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128,
#    max_position_embeddings 131072; 8.03e9 parameters (16.06 GB in bf16).
#  - vLLM docs: gpu_memory_utilization 0.9, block_size 16, max_num_seqs 256,
#    max_num_batched_tokens 2048 with chunked prefill (V1 default for online serving).
# Derivations:
#  - base: every step reads all weights: 16.06 GB / (3.35 TB/s * 0.8 achieved) = 6.0 ms.
#  - prefill_tok: 2 * 8.03e9 FLOPs per token / (989 TFLOPS * 0.6 MFU) = 27 us.
#  - attn_pair: 4 * 32 layers * 4096 FLOPs per query-key pair / (989 TFLOPS * 0.4) = 1.3 ns.
#  - kv_read_tok: KV per token = 2 * 32 * 8 * 128 * 2 B = 128 KiB; / (3.35 TB/s * 0.8) = 49 ns.
#  - decode_seq: ~20 us per sequence of scheduler, sampling and detokenization (CPU side).
#  - frontend: ~2.5 ms API server (HTTP, tokenization, ZMQ hop to EngineCore).
#  - num_gpu_blocks: 80 GiB * 0.9 - 15 GiB weights - ~3 GiB activations/CUDA graphs = 54 GiB
#    / 128 KiB per token = ~442k tokens = ~27,600 blocks of 16.
LLAMA_8B_H100 = Preset(
    name="llama-8b-h100",
    description="Llama-3.1-8B bf16 on one H100 SXM 80GB, derived from public specs",
    cost=CostModel(
        base=6.0e-3,
        prefill_tok=27e-6,
        decode_seq=20e-6,
        attn_pair=1.3e-9,
        kv_read_tok=49e-9,
        frontend=2.5e-3,
    ),
    num_gpu_blocks=27600,
    max_model_len=131072,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (TINY_CPU, LLAMA_8B_H100)}


def get_preset(name: str) -> Preset:
    """A named preset, or one written by ``sluice sim calibrate --write-preset FILE`` (a .json path), or the preset
    a measurement of ``sluice sim calibrate --json FILE`` was fitted to (its ``preset``)."""
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith(".json") and Path(name).is_file():
        try:
            data = json.loads(Path(name).read_text())
            if "measurements" in data and "preset" in data:
                data = data["preset"]
            return preset_from_json(data)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"preset file {name}: {e}") from None
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))} or a preset .json file")


def measurement_path(preset: Preset) -> Path | None:
    """The stored measurement ``preset`` was fitted to, when it has one and the file is here."""
    if preset.measurement is None:
        return None
    path = RESULTS_DIR / preset.measurement
    if path.is_file():
        return path
    try:  # an installed (non-editable) package carries bench/results as package data
        from importlib.resources import files

        res = files("bench") / "results" / preset.measurement
        return Path(str(res)) if res.is_file() else None
    except (ModuleNotFoundError, OSError):
        return None


def contended_quantile(deciles: tuple[float, ...], q: float) -> float:
    """The ``q`` quantile (0..1) of a distribution given by its deciles, linear in between."""
    if not deciles:
        return 0.0
    pos = min(max(q, 0.0), 1.0) * (len(deciles) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(deciles) - 1)
    return deciles[lo] + (deciles[hi] - deciles[lo]) * (pos - lo)


def preset_to_json(p: Preset) -> dict[str, Any]:
    data = asdict(p)
    data.pop("references", None)
    return data


def preset_from_json(data: dict[str, Any]) -> Preset:
    data = dict(data)
    cost = CostModel(**data.pop("cost"))
    data["metrics_contended"] = tuple(data.get("metrics_contended", ()))
    return Preset(cost=cost, **data)
