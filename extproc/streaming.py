"""Watching a response's body, for the requests chosen to be observed (a sample, or every request of a metered
tenant): time to first token, tokens streamed, and the final `usage` the replica reports.

Most requests stay on the cheap response mode (no body events at all); an observed one is switched to STREAMED
response bodies with `mode_override`, which costs sidecar CPU per chunk, hence the sampling.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import orjson

from extproc.schema import positive, require


@dataclass
class SlowConsumerPolicy:
    """P13: cut streams whose client drains slower than a floor."""

    min_bytes_per_s: float = 0.0      # drain-rate floor (bytes/s written to the client); 0 = off
    grace_s: float = 10.0             # how long a stream may stay under the floor before it is cut
    report_interval_s: float = 2.0    # Envoy reports each open request's bytes this often (access-log flush)

    @property
    def enabled(self) -> bool:
        return self.min_bytes_per_s > 0

    def validate(self, path: str) -> None:
        require(self.min_bytes_per_s >= 0, f"{path}.min_bytes_per_s", "must be >= 0")
        positive(self, path, "grace_s", "report_interval_s")


@dataclass
class StreamingPolicy:
    """Observed responses (TTFT, tokens, usage) and slow consumers."""

    sample_rate: float = 0.0          # share of requests observed (0..1); an observed response costs sidecar
                                      # CPU per body chunk
    metered_tenants: list[str] = field(default_factory=list)  # tenants whose every request is observed (exact
                                                               # token accounting)
    max_buffer_bytes: int = 1 << 20   # a non-streaming JSON body is buffered up to this size to read its usage
    slow_consumer: SlowConsumerPolicy = field(default_factory=SlowConsumerPolicy)  # P13: cut streams whose client
                                                                                   # drains slower than a floor

    @property
    def observes(self) -> bool:
        """Some responses are observed (sampled or metered): the sampler is asked per request."""
        return self.sample_rate > 0 or bool(self.metered_tenants)

    def validate(self, path: str) -> None:
        require(0.0 <= self.sample_rate <= 1.0, f"{path}.sample_rate", "must be in [0, 1]")


class Sampler:
    def __init__(self, policy: StreamingPolicy, seed: int | None = None) -> None:
        self.policy = policy
        self.metered = frozenset(policy.metered_tenants)
        self.active = policy.observes
        self._random = random.Random(seed).random

    def observe(self, tenant: str) -> bool:
        return tenant in self.metered or (self.policy.sample_rate > 0 and self._random() < self.policy.sample_rate)


_TEXT_KEYS = (b'"content":"', b'"content": "', b'"text":"', b'"text": "')


def _has_text(payload: bytes) -> bool:
    """Does this SSE event carry generated text (a non-empty delta content or completion text)?"""
    for key in _TEXT_KEYS:
        i = payload.find(key)
        if i >= 0 and payload[i + len(key):i + len(key) + 1] not in (b'"', b""):
            return True
    return False


class ResponseObserver:
    """Incremental reader of one response body: SSE events (split anywhere across chunks) or a JSON body."""

    __slots__ = ("start", "first_token_at", "events", "usage", "done", "_partial", "_sse", "_json", "_limit",
                 "status")

    def __init__(self, start: float, limit: int) -> None:
        self.start = start
        self.first_token_at = 0.0
        self.events = 0          # content-bearing SSE events: about one token each for vLLM-style streams
        self.usage: dict[str, int] | None = None
        self.done = False
        self.status = 0
        self._partial = b""
        self._sse: bool | None = None
        self._json: list[bytes] = []
        self._limit = limit

    def on_headers(self, status: int, content_type: str) -> None:
        self.status = status
        self._sse = content_type.startswith("text/event-stream")

    def on_chunk(self, data: bytes, now: float, end_of_stream: bool) -> None:
        if self._sse is False:
            self._collect_json(data, end_of_stream)
            return
        buf = self._partial + data if self._partial else data
        *events, self._partial = buf.split(b"\n\n")
        for event in events:
            self._on_event(event, now)
        if end_of_stream:
            if self._partial.strip():
                self._on_event(self._partial, now)
            self._partial = b""
            self.done = True

    def _on_event(self, event: bytes, now: float) -> None:
        if not event.startswith(b"data:"):
            return
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        if _has_text(payload):
            if not self.first_token_at:
                self.first_token_at = now
            self.events += 1
        if b'"usage":{' in payload or b'"usage": {' in payload:
            try:
                usage = orjson.loads(payload).get("usage")
            except orjson.JSONDecodeError:
                return
            if isinstance(usage, dict):
                self.usage = usage

    def _collect_json(self, data: bytes, end_of_stream: bool) -> None:
        if self._limit > 0:
            self._json.append(data)
            self._limit -= len(data)
        if not end_of_stream:
            return
        self.done = True
        if self._limit < 0:
            return
        try:
            body = orjson.loads(b"".join(self._json))
        except orjson.JSONDecodeError:
            return
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):
            self.usage = usage

    @property
    def ttft_s(self) -> float | None:
        return self.first_token_at - self.start if self.first_token_at else None

    @property
    def completion_tokens(self) -> int | None:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return self.events if self._sse else None

    @property
    def prompt_tokens(self) -> int | None:
        if self.usage and isinstance(self.usage.get("prompt_tokens"), int):
            return self.usage["prompt_tokens"]
        return None


class DrainWatch:
    """Per open request: the client's drain rate from Envoy's periodic access-log reports (bytes written to the
    downstream socket), and since when it has stayed under the floor."""

    __slots__ = ("bytes", "at", "slow_since")

    def __init__(self) -> None:
        self.bytes = -1
        self.at = 0.0
        self.slow_since = 0.0

    def update(self, sent: int, now: float, policy: SlowConsumerPolicy) -> bool:
        """Record a report; True when the stream has been too slow for longer than the grace period."""
        prev_bytes, prev_at = self.bytes, self.at
        self.bytes, self.at = sent, now
        if prev_bytes < 0 or sent <= 0 or now <= prev_at:
            return False  # first report, or nothing sent yet (queued / before the first token): not judged
        rate = (sent - prev_bytes) / (now - prev_at)
        if rate >= policy.min_bytes_per_s:
            self.slow_since = 0.0
            return False
        if not self.slow_since:
            self.slow_since = prev_at
        return now - self.slow_since >= policy.grace_s
