"""The one record every stage of the sidecar reads: an OpenAI request reduced to what governance needs.

Parsing happens once per request, on the buffered body; everything downstream (admission, routing,
budgets, metrics) reads this record and never touches the raw JSON again.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from extproc.tokens import TokenEstimator

if TYPE_CHECKING:
    from extproc.epp import Subset

# Which OpenAI endpoints the sidecar understands, by path (query string stripped).
ENDPOINT_CHAT = "chat"
ENDPOINT_COMPLETIONS = "completions"
ENDPOINTS = {"/v1/chat/completions": ENDPOINT_CHAT, "/v1/completions": ENDPOINT_COMPLETIONS}

PRIORITIES = ("interactive", "batch", "sheddable")
DEFAULT_OUTPUT_TOKENS = 256  # used when the client sets no max_tokens (a learned per-app value may replace it)


class BadRequest(Exception):
    """A client error the sidecar answers itself, with an OpenAI-style body."""

    def __init__(self, status: int, message: str, code: str, err_type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.err_type = err_type
        self.param = param


@dataclass(slots=True)
class LLMRequest:
    """One inference request as the gateway sees it. Token numbers are estimates until usage is known."""

    request_id: str
    endpoint: str
    model: str
    stream: bool
    prompt_tokens: int
    max_output_tokens: int
    n: int = 1
    tenant: str = "default"
    app: str = "default"
    task_id: str | None = None
    task_depth: int = 0          # agent loop depth / step number the client reports (x-sluice-task-depth)
    priority: str = "interactive"
    retry_count: int = 0
    idempotency_key: str | None = None
    client_timeout_s: float | None = None
    arrival: float = 0.0
    prefix_key: int = 0          # hash of the leading prompt text (system prompt): the P10 fingerprint
    prefix_chain: tuple[int, ...] = ()  # chained hashes of the prompt's first PREFIX_LADDER[i] characters (prefix
                                        # affinity: which prefix a prompt shares with earlier ones)
    prompt_units: int = 0        # the token calibration's epoch its prompt_tokens estimate is in (the prompt-shift
                                 # detector compares estimates of one epoch only; token_calibration.py)
    prompt_chars: int = 0        # characters of prompt text (prefix levels in characters -> tokens)
    prefix_held: int = 0         # tokens of its prompt that requests in flight on its replica held in KV when it
                                 # was placed (admission: it adds only the rest to that replica's KV)
    prefill_new: float = 0.0     # uncached prompt tokens its replica computes, and their prefill work (placement.py
    prefill_work: float = 0.0    # `prefill_work`), charged when it was placed (the prefill speed is measured per work)
    work_mark: float = -1.0      # its replica's `placed_work_total` once it was placed (-1: moved, not known)
    body_fingerprint: bytes = b""  # digest of the whole body: duplicate / retry detection
    include_usage: bool = False
    output_limited: bool = True  # the client set max_tokens / max_completion_tokens (else an expectation is used)
    subset: Subset | None = None  # EPP mode: the gateway's subset hint; placement considers only what it allows
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def expected_output_tokens(self) -> int:
        return self.max_output_tokens * self.n

    def time_left_s(self, now: float) -> float | None:
        """Seconds until the client's own timeout (None: it sent none)."""
        if self.client_timeout_s is None:
            return None
        return self.client_timeout_s - (now - self.arrival)

    @property
    def total_tokens(self) -> int:
        """Prompt plus expected output: what admission meters (P2: requests are not equivalent)."""
        return self.prompt_tokens + self.expected_output_tokens


PREFIX_CHARS = 512  # leading characters of the prompt that identify a template / system prompt

# Prefix levels, in characters of prompt text: 512, 558, 608, ... (each 2**(1/8), about 9 %, longer than the last)
# until that step would pass PREFIX_STEP characters (about 128 tokens: a KV block of the CPU engine, a few of a
# GPU's), then PREFIX_STEP characters apart, and once PREFIX_STEP is under 1/PREFIX_FINE of the level, 1/PREFIX_FINE
# of it (1.6 %), up to 2**21 characters. The longest level two prompts share misses at most one step of the text
# they share: for a cached multi-turn chat or system prompt that is its tail, which is what the engine computes and
# what decides its lane. A purely geometric ladder (9 % steps) left up to 540 tokens of a cached 6,000-token prompt
# predicted uncached, which with the question put it in the long lane (PX). The chain is one pass over the text
# whatever the step; finer steps only add dictionary lookups (about 60 levels for a 6,000-token prompt, 350 at 2**21).
PREFIX_STEP = 512
PREFIX_FINE = 64


def _prefix_ladder(first: int = 512, last: int = 1 << 21) -> tuple[int, ...]:
    """Level k+1 = level k + min(9 % of it, max(PREFIX_STEP, 1/PREFIX_FINE of it)), from `first` to `last`."""
    levels = [first]
    while levels[-1] < last:
        level = levels[-1]
        step = min(int(level * (2 ** 0.125 - 1)), max(PREFIX_STEP, level // PREFIX_FINE))
        levels.append(min(last, level + max(1, step)))
    return tuple(levels)


PREFIX_LADDER: tuple[int, ...] = _prefix_ladder()


def prefix_chain(text: str) -> tuple[int, ...]:
    """CRC32 of the first PREFIX_LADDER[i] characters of `text`, for every level the text is long enough for,
    chained (each level's hash continues the previous one's), so one pass over the text computes them all."""
    if len(text) < PREFIX_LADDER[0]:
        return ()
    out = []
    crc = 0
    start = 0
    for end in PREFIX_LADDER:
        if end > len(text):
            break
        crc = zlib.crc32(text[start:end].encode("utf-8", "surrogatepass"), crc)
        out.append(crc)
        start = end
    return tuple(out)


# Chat templates add role and separator tokens: about 4 per message plus 3 to prime the reply (OpenAI's rule).
TOKENS_PER_MESSAGE = 4
TOKENS_PER_REPLY = 3


def _prompt_text(endpoint: str, body: dict[str, Any]) -> tuple[str, str]:
    """Return (full prompt text, leading text used as the template fingerprint)."""
    if endpoint == ENDPOINT_CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(400, "'messages' must be a non-empty array", "missing_messages", param="messages")
        parts: list[str] = []
        for msg in messages:
            if not isinstance(msg, dict):
                raise BadRequest(400, "each message must be an object", "invalid_message", param="messages")
            content = msg.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):  # multi-part content: count the text parts
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        parts.append(part["text"])
            elif content is not None:
                raise BadRequest(400, "message content must be a string or an array", "invalid_message",
                                 param="messages")
        text = "\n".join(parts)
        first = messages[0]
        lead = first.get("content") if first.get("role") == "system" and isinstance(first.get("content"), str) else text
        return text, lead[:PREFIX_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if not all(isinstance(p, str) for p in prompt) or not prompt:
            raise BadRequest(400, "'prompt' must be a string or an array of strings", "invalid_prompt", param="prompt")
        text = "\n".join(prompt)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise BadRequest(400, "'prompt' must be a string or an array of strings", "missing_prompt", param="prompt")
    return text, text[:PREFIX_CHARS]


def _template_tokens(endpoint: str, body: dict[str, Any]) -> int:
    if endpoint != ENDPOINT_CHAT:
        return 0
    return TOKENS_PER_MESSAGE * len(body["messages"]) + TOKENS_PER_REPLY


def _positive_int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(400, f"'{key}' must be a positive integer", "invalid_value", param=key)
    return value


def parse_body(endpoint: str, raw: bytes, estimator: TokenEstimator, default_output_tokens: int) -> LLMRequest:
    """Parse an OpenAI request body. Raises BadRequest for anything a replica would reject anyway."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object", "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(400, "'model' is required and must be a string", "missing_model", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be a boolean", "invalid_value", param="stream")
    text, lead = _prompt_text(endpoint, body)
    max_out = _positive_int(body, "max_completion_tokens", None)
    if max_out is None:
        max_out = _positive_int(body, "max_tokens", None)
    n = _positive_int(body, "n", 1)
    opts = body.get("stream_options")
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    return LLMRequest(
        request_id="",
        endpoint=endpoint,
        model=model,
        stream=stream,
        prompt_tokens=estimator.count(text) + _template_tokens(endpoint, body),
        max_output_tokens=max_out or default_output_tokens,
        output_limited=max_out is not None,
        n=n or 1,
        prefix_key=zlib.crc32(lead.encode("utf-8", "surrogatepass")),
        prefix_chain=prefix_chain(text),
        prompt_chars=len(text),
        body_fingerprint=hashlib.blake2b(raw, digest_size=16).digest(),
        include_usage=include_usage,
    )
