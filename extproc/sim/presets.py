"""Named hardware/model presets: the engine's cost model constants and its default limits.

The cost of one engine step (one forward pass over a batch, vLLM V1 style) is

    step_s = base + prefill_tok * P + decode_seq * S + attn_pair * A + kv_read_tok * K

* ``P``: prefill tokens computed in the step (chunks of prompts, capped by the token budget);
* ``S``: sequences that sample a token in the step (decodes plus prompts finishing prefill);
* ``A``: attention pairs of prefill chunks: a chunk of ``n`` tokens whose first token sits at
  position ``c`` attends to ``n * (c + (n + 1) / 2)`` earlier tokens. This term is what makes
  an 8,000-token prompt cost more than twice a 4,000-token one (attention is quadratic);
* ``K``: context tokens read by decodes (each decode reads its whole KV cache).

A request also pays ``frontend`` once, before it reaches the engine queue: HTTP parsing,
tokenization and the hop from vLLM's API server process to EngineCore. It delays that request
only; it does not occupy the engine.

The constants of ``tiny-cpu`` are fitted to a real vLLM 0.32 CPU build serving a tiny model on
this project's machines (see docs/simulator.md and ``python -m extproc.sim calibrate``); those
of ``llama-8b-h100`` are derived from public hardware and model specifications, cited inline.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["CostModel", "Preset", "PRESETS", "get_preset"]


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work in one engine step (see the module docstring for the formula)."""

    base: float
    prefill_tok: float
    decode_seq: float
    attn_pair: float
    kv_read_tok: float
    frontend: float

    def step_seconds(self, prefill_tokens: int, samples: int, attn_pairs: float, kv_read: int) -> float:
        return (
            self.base
            + self.prefill_tok * prefill_tokens
            + self.decode_seq * samples
            + self.attn_pair * attn_pairs
            + self.kv_read_tok * kv_read
        )


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

    def with_overrides(self, **kw: object) -> "Preset":
        kw = {k: v for k, v in kw.items() if v is not None}
        return replace(self, **kw)  # type: ignore[arg-type]


# tiny-cpu: fitted (least squares by hand, then checked by `calibrate`) to these real vLLM 0.32
# CPU-build measurements (docs/ARCHITECTURE.md, "Reference behaviour"):
#   TTFT 15-18 ms @ 100 prompt tokens, 330-350 ms @ 4,000, ~1.1 s @ 8,000;
#   decode 3.6-6.5 ms/token alone; 139-190 tokens/s per stream with 16 concurrent streams
#   (read as per stream: a batch of 16 costs ~6 ms per step, barely more than 1 stream,
#   which is what a weight-bandwidth-bound decode looks like; 139-190 tok/s *aggregate*
#   would mean 84-115 ms per step for 16 sequences, 20x a single stream, which no
#   batched engine shows);
#   short requests behind a 4,000-token prompt: TTFT 26-430 ms.
# Solving TTFT(100), TTFT(4000), TTFT(8000) with 2,048-token chunks gives the quadratic
# term: TTFT(8000) - 2*TTFT(4000) ~= attn_pair * 16e6 - frontend.
TINY_CPU = Preset(
    name="tiny-cpu",
    description="tiny model on vLLM 0.32's CPU backend (2 cores), fitted to measurements",
    cost=CostModel(
        base=4.9e-3,
        prefill_tok=26.8e-6,
        decode_seq=70e-6,
        attn_pair=26.8e-9,
        kv_read_tok=26.8e-9,
        frontend=8.6e-3,
    ),
    # A 0.5B-class model (24 layers, 2 KV heads x 64 dims, bf16 = 12 KiB/token) in vLLM's
    # default 4 GiB CPU KV space would hold ~350k tokens; 4,096 blocks (65,536 tokens) is
    # chosen instead so KV pressure (P7, P9) shows up in demos. Override with --num-gpu-blocks.
    num_gpu_blocks=4096,
    max_model_len=32768,
    references={
        "ttft_100": 0.0165,  # 15-18 ms
        "ttft_4000": 0.340,  # 330-350 ms
        "ttft_8000": 1.10,  # about 1.1 s
        "decode_ms_per_token_1": 0.00505,  # 3.6-6.5 ms per token, one stream (midpoint)
        "decode_tok_s_per_stream_16": 164.5,  # 139-190 tok/s per stream at 16 streams (midpoint)
        "hol_short_ttft_min": 0.026,  # lower end of 26-430 ms
        "hol_short_ttft_max": 0.430,  # upper end of 26-430 ms
        "hol_short_ttft_mean": 0.228,  # midpoint of 26-430 ms (arrivals spread over the prefill)
    },
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
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
