"""A deterministic stand-in tokenizer for the simulator.

Why not a real BPE tokenizer: the simulator must start instantly, load no files and cost little
CPU per request; what matters is that prompt sizes scale like a real model's (about 0.75 English
words per token) and that the same text always gives the same tokens (prefix caching hashes
token ids). Rules:

* ASCII letters: a word of up to 6 letters is one token, a longer one is split into 4-letter
  pieces (BPE keeps common words whole and splits rare long ones);
* digits: groups of up to 3 (like tiktoken's cl100k);
* CJK / kana / hangul characters: one token each;
* other letters (accented, Cyrillic, ...): runs split in 4-character pieces;
* punctuation and symbols: one token per character; whitespace is free (BPE folds a leading
  space into the next word).

Output text comes from a fixed vocabulary of short words, each one output token, so counting the
generated text with :func:`count_tokens` gives back ``completion_tokens`` exactly.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import zlib
from typing import Any, Iterable

__all__ = [
    "count_tokens",
    "token_ids",
    "chat_prompt",
    "output_offset",
    "natural_length",
    "output_piece",
    "output_text",
    "WORD_STREAM",
]

_ASCII_RE = re.compile(r"[A-Za-z]+|[0-9]{1,3}|[^\sA-Za-z0-9]")
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_UNI_RE = re.compile(
    rf"[{_CJK}]|[A-Za-z]+|[0-9]{{1,3}}|(?:(?![{_CJK}])[^\W\d_])+|[^\s\w]|_"
)
_WHOLE = 6  # words up to this many characters are one token
_PIECE = 4  # longer runs are cut in pieces of this size


def _pieces(text: str) -> list[str]:
    return (_ASCII_RE if text.isascii() else _UNI_RE).findall(text)


def count_tokens(text: str) -> int:
    """Number of tokens in ``text`` (fast path: no ids are built)."""
    n = 0
    for p in _pieces(text):
        lp = len(p)
        n += 1 if lp <= _WHOLE else (lp + _PIECE - 1) // _PIECE
    return n


def _split(pieces: Iterable[str]) -> Iterable[str]:
    for p in pieces:
        if len(p) <= _WHOLE:
            yield p
        else:
            for i in range(0, len(p), _PIECE):
                yield p[i : i + _PIECE]


def token_ids(text: str) -> list[int]:
    """Stable token ids (crc32 of each piece): the same text gives the same ids in any process."""
    crc = zlib.crc32
    return [crc(p.encode()) & 0x7FFFFFFF for p in _split(_pieces(text))]


# Chat template: like Llama 3's, a few special tokens per message plus the assistant header.
_BOS = 1
_ROLE_IDS = {"system": 2, "user": 3, "assistant": 4, "tool": 5, "developer": 6}
_EOT = 7
_GEN_PROMPT = [8, 4, 9]
PER_MESSAGE_OVERHEAD = 4  # header start, role, header end, end-of-turn
PROMPT_OVERHEAD = 4  # BOS + generation prompt (3)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    return str(content)


def chat_prompt(messages: list[dict[str, Any]], with_ids: bool) -> tuple[int, list[int] | None]:
    """Token count (and ids when ``with_ids``) of a chat prompt after the chat template."""
    if not with_ids:
        n = PROMPT_OVERHEAD
        for m in messages:
            n += PER_MESSAGE_OVERHEAD + count_tokens(_content_text(m.get("content")))
        return n, None
    ids = [_BOS]
    for m in messages:
        ids.append(10)
        ids.append(_ROLE_IDS.get(str(m.get("role")), 11))
        ids.append(12)
        ids.extend(token_ids(_content_text(m.get("content"))))
        ids.append(_EOT)
    ids.extend(_GEN_PROMPT)
    return len(ids), ids


# ---- output text -------------------------------------------------------------------------

_VOCAB = (
    "the of and to in is that it for on was with as at by be this are from or an have not "
    "but all can one they we had were more your her out up so what about time when there "
    "its who will each which their said how been has many some them these would other into "
    "make like him see two way look could first more water long down day did get come made "
    "may part over new sound take only place little work know year live back give most very "
    "after thing our just name good great where help line right too mean old same tell boy "
    "follow came want show also around form three small set put end does another well large "
    "must big even such turn here why ask went men read need land home us move try kind hand "
    "picture again change off play spell air away animal house point page letter mother "
    "answer found study still learn should world high every near add food between own below "
    "country plant last school father keep tree never start city earth eye light thought "
    "head under story saw left few while along might close some thing seem next hard open "
    "example begin life always those both paper together group often run important until "
    "model token cache queue batch"
).split()
# Only words the tokenizer counts as one token, so output text re-counts exactly.
_VOCAB = [w for w in _VOCAB if len(w) <= _WHOLE]


def _build_stream(length: int = 8192, seed: int = 1234567) -> tuple[str, ...]:
    rng = random.Random(seed)
    out: list[str] = []
    since = 0
    for _ in range(length):
        if since >= 6 and rng.random() < 0.12:
            out.append("." if rng.random() < 0.7 else ",")
            since = 0
        else:
            out.append(" " + rng.choice(_VOCAB))
            since += 1
    return tuple(out)


WORD_STREAM: tuple[str, ...] = _build_stream()
_STREAM_LEN = len(WORD_STREAM)


def _digest(seed: int, key: bytes) -> int:
    h = hashlib.blake2b(key, digest_size=8, person=b"sluicesim")
    h.update(seed.to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def output_offset(seed: int, key: bytes) -> int:
    """Where in the word stream a request's output starts: fixed per (seed, request content)."""
    return _digest(seed, key) % _STREAM_LEN


def natural_length(seed: int, key: bytes, mean: float, cap: int) -> int:
    """Seeded geometric output length (what a model stopping at EOS looks like), 1..cap."""
    d = _digest(seed ^ 0x5F3759DF, key)
    u = ((d >> 11) + 0.5) / float(1 << 53)
    p = 1.0 / max(mean, 1.0)
    n = 1 + int(math.log(u) / math.log(1.0 - p)) if p < 1.0 else 1
    return max(1, min(n, cap))


def output_piece(offset: int, i: int) -> str:
    """Text of output token ``i`` (0-based) for a request whose stream starts at ``offset``."""
    w = WORD_STREAM[(offset + i) % _STREAM_LEN]
    return w[1:] if i == 0 and w[0] == " " else w


def output_text(offset: int, start: int, stop: int) -> str:
    """Text of output tokens ``start..stop-1``."""
    return "".join(output_piece(offset, i) for i in range(start, stop))
