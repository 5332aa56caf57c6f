"""The filler words of every harness prompt (bench/scenarios/base.py `text_of`).

One list, read by the harness that writes prompts and by the tiny real model's tokenizer training
(bench/vllm_cpu.py), so that a filler word is one token on the simulator and on the real engine alike, as a
common English word is one token (about 1.3 per word on average) in a real model's tokenizer. Trained without
them, the tiny BPE split each word into about 3 tokens, and a prompt's bytes per token on the real engines was
half the simulator's.
"""

from __future__ import annotations

# Words of at most six letters: the simulator's tokenizer counts each as one token.
FILLER_WORDS: tuple[str, ...] = tuple(
    "alpha bravo delta echo golf hotel india juliet kilo lima mike oscar papa quebec romeo sierra tango "
    "victor xray yankee zulu".split())

__all__ = ["FILLER_WORDS"]
