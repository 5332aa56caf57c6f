"""Prompt token estimation behind one small interface, so an exact tokenizer can replace the heuristic.

The default heuristic costs a few microseconds per KB of prompt: admission needs a good-enough size class
(P2, P3), not an exact count. An exact tokenizer (HuggingFace `tokenizer.json` through `tokenizers`, or a
tiktoken encoding) can be loaded from a local file; nothing is ever downloaded at run time.
"""

from __future__ import annotations

from typing import Protocol


class TokenEstimator(Protocol):
    def count(self, text: str) -> int: ...


class HeuristicEstimator:
    """About 4 bytes of ASCII text per token (the BPE rule of thumb); non-ASCII text (CJK, accents) is counted by
    UTF-8 bytes with a density factor, since it tokenizes denser than English prose."""

    def __init__(self, bytes_per_token: float = 4.0) -> None:
        self._inv = 1.0 / bytes_per_token

    def count(self, text: str) -> int:
        if not text:
            return 0
        if text.isascii():
            return max(1, int(len(text) * self._inv + 0.5))
        # Non-ASCII: UTF-8 byte length over-counts CJK (3 bytes, about 1 token per char), so count chars.
        return max(1, int(len(text.encode("utf-8", "surrogatepass")) * self._inv * 1.33 + 0.5))


class HFTokenizerEstimator:
    """Exact counts from a local HuggingFace `tokenizer.json` (requires the `tokenizers` package)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer  # optional dependency, imported only when configured

        self._tok = Tokenizer.from_file(path)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


class TiktokenEstimator:
    """Exact counts from a local tiktoken BPE file (requires the `tiktoken` package)."""

    def __init__(self, path: str, pattern: str | None = None) -> None:
        import tiktoken  # optional dependency
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(path)
        pat = pattern or r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
        self._enc = tiktoken.Encoding(name="local", pat_str=pat, mergeable_ranks=ranks, special_tokens={})

    def count(self, text: str) -> int:
        return len(self._enc.encode_ordinary(text))


def make_estimator(kind: str = "heuristic", path: str | None = None, bytes_per_token: float = 4.0) -> TokenEstimator:
    """Build the estimator the policy names: `heuristic`, `hf` (tokenizer.json) or `tiktoken`."""
    if kind == "heuristic":
        return HeuristicEstimator(bytes_per_token)
    if not path:
        raise ValueError(f"tokenizer kind {kind!r} needs a local file path")
    if kind == "hf":
        return HFTokenizerEstimator(path)
    if kind == "tiktoken":
        return TiktokenEstimator(path)
    raise ValueError(f"unknown tokenizer kind {kind!r} (expected heuristic, hf or tiktoken)")
