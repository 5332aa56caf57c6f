"""Reading observed response bodies: SSE events split anywhere, TTFT, token counts, usage."""

import orjson

from extproc.streaming import ResponseObserver, Sampler, StreamingPolicy


def sse(*payloads: object) -> bytes:
    out = b""
    for p in payloads:
        out += b"data: " + (p if isinstance(p, bytes) else orjson.dumps(p)) + b"\n\n"
    return out


ROLE = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
TOK = {"choices": [{"delta": {"content": "hi"}}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": 3, "total_tokens": 45}}


def test_sse_split_across_chunks_counts_tokens_and_reads_usage():
    body = sse(ROLE, TOK, TOK, TOK, USAGE, b"[DONE]")
    obs = ResponseObserver(start=10.0, limit=1 << 20)
    obs.on_headers(200, "text/event-stream")
    # feed in 7-byte pieces: events and even the "data:" prefix are split
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)]
    for i, piece in enumerate(pieces):
        obs.on_chunk(piece, now=10.0 + 0.01 * i, end_of_stream=i == len(pieces) - 1)
    assert obs.done
    assert obs.events == 3
    assert obs.usage == USAGE["usage"]
    assert obs.prompt_tokens == 42 and obs.completion_tokens == 3
    assert obs.ttft_s is not None and obs.ttft_s > 0  # the role-only first event is not the first token


def test_role_only_event_is_not_first_token():
    obs = ResponseObserver(start=0.0, limit=100)
    obs.on_headers(200, "text/event-stream")
    obs.on_chunk(sse(ROLE), now=1.0, end_of_stream=False)
    assert obs.ttft_s is None
    obs.on_chunk(sse(TOK), now=2.0, end_of_stream=False)
    assert obs.ttft_s == 2.0


def test_without_usage_tokens_come_from_events():
    obs = ResponseObserver(start=0.0, limit=100)
    obs.on_headers(200, "text/event-stream")
    obs.on_chunk(sse(TOK, TOK, b"[DONE]"), now=1.0, end_of_stream=True)
    assert obs.usage is None and obs.completion_tokens == 2 and obs.prompt_tokens is None


def test_json_body_usage():
    body = orjson.dumps({"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": 5,
                                                                               "completion_tokens": 7}})
    obs = ResponseObserver(start=0.0, limit=1 << 20)
    obs.on_headers(200, "application/json")
    obs.on_chunk(body[:10], 1.0, False)
    obs.on_chunk(body[10:], 1.1, True)
    assert obs.done and obs.completion_tokens == 7 and obs.prompt_tokens == 5


def test_json_body_over_buffer_limit_is_not_parsed():
    body = orjson.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 7}, "pad": "x" * 500})
    obs = ResponseObserver(start=0.0, limit=100)
    obs.on_headers(200, "application/json")
    obs.on_chunk(body, 1.0, True)
    assert obs.done and obs.usage is None


def test_sampler_rate_and_metered_tenants():
    s = Sampler(StreamingPolicy(sample_rate=0.25, metered_tenants=["gold"]), seed=1)
    hits = sum(s.observe("t") for _ in range(4000))
    assert 800 < hits < 1200
    assert all(s.observe("gold") for _ in range(10))
    assert not any(Sampler(StreamingPolicy(sample_rate=0.0)).observe("t") for _ in range(100))
