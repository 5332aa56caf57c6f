"""Parsing OpenAI bodies into LLMRequest and estimating prompt tokens."""

import orjson
import pytest

from extproc.request import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, BadRequest, parse_body
from extproc.tokens import HeuristicEstimator, make_estimator

EST = HeuristicEstimator()


def chat(**kw) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    body.update(kw)
    return orjson.dumps(body)


def test_chat_fields_are_read():
    req = parse_body(ENDPOINT_CHAT, chat(stream=True, max_tokens=77, n=2, stream_options={"include_usage": True}),
                     EST, 256)
    assert (req.model, req.stream, req.max_output_tokens, req.n, req.include_usage) == ("m", True, 77, 2, True)
    assert req.expected_output_tokens == 154
    assert req.total_tokens == req.prompt_tokens + 154


def test_max_completion_tokens_wins_over_max_tokens():
    req = parse_body(ENDPOINT_CHAT, chat(max_tokens=10, max_completion_tokens=20), EST, 256)
    assert req.max_output_tokens == 20


def test_default_output_tokens_when_unset():
    assert parse_body(ENDPOINT_CHAT, chat(), EST, 123).max_output_tokens == 123


def test_completions_prompt_string_and_list():
    one = parse_body(ENDPOINT_COMPLETIONS, orjson.dumps({"model": "m", "prompt": "a" * 400}), EST, 16)
    many = parse_body(ENDPOINT_COMPLETIONS, orjson.dumps({"model": "m", "prompt": ["a" * 200, "b" * 200]}), EST, 16)
    assert one.prompt_tokens == 100
    assert 95 <= many.prompt_tokens <= 105


def test_prompt_tokens_grow_with_prompt():
    small = parse_body(ENDPOINT_CHAT, chat(), EST, 1)
    big = parse_body(ENDPOINT_CHAT, chat(messages=[{"role": "user", "content": "word " * 4000}]), EST, 1)
    assert big.prompt_tokens > 100 * small.prompt_tokens // 10
    assert 4000 <= big.prompt_tokens <= 6000  # ~1.25 tokens per "word " at 4 bytes/token


def test_same_system_prompt_same_prefix_key():
    sys_msg = {"role": "system", "content": "You are a helpful assistant. " * 10}
    a = parse_body(ENDPOINT_CHAT, chat(messages=[sys_msg, {"role": "user", "content": "q1"}]), EST, 1)
    b = parse_body(ENDPOINT_CHAT, chat(messages=[sys_msg, {"role": "user", "content": "q2"}]), EST, 1)
    c = parse_body(ENDPOINT_CHAT, chat(messages=[{"role": "system", "content": "other"},
                                                 {"role": "user", "content": "q1"}]), EST, 1)
    assert a.prefix_key == b.prefix_key != c.prefix_key
    assert a.body_fingerprint != b.body_fingerprint


@pytest.mark.parametrize("raw, code", [
    (b"{not json", "invalid_json"),
    (b"[1,2]", "invalid_json"),
    (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "missing_model"),
    (orjson.dumps({"model": "m"}), "missing_messages"),
    (orjson.dumps({"model": "m", "messages": []}), "missing_messages"),
    (orjson.dumps({"model": "m", "messages": ["x"]}), "invalid_message"),
    (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": 5}]}), "invalid_message"),
    (chat(max_tokens=0), "invalid_value"),
    (chat(max_tokens="5"), "invalid_value"),
    (chat(stream="yes"), "invalid_value"),
    (chat(n=True), "invalid_value"),
])
def test_bad_chat_bodies_are_400(raw, code):
    with pytest.raises(BadRequest) as exc:
        parse_body(ENDPOINT_CHAT, raw, EST, 1)
    assert exc.value.status == 400
    assert exc.value.code == code


def test_bad_completion_prompt():
    with pytest.raises(BadRequest) as exc:
        parse_body(ENDPOINT_COMPLETIONS, orjson.dumps({"model": "m", "prompt": 7}), EST, 1)
    assert exc.value.code == "missing_prompt"


def test_multipart_content_counts_text_parts():
    content = [{"type": "text", "text": "x" * 400}, {"type": "image_url", "image_url": {"url": "data:"}}]
    req = parse_body(ENDPOINT_CHAT, chat(messages=[{"role": "user", "content": content}]), EST, 1)
    assert req.prompt_tokens == 100 + 4 + 3  # text + one message + reply priming


def test_heuristic_counts_cjk_denser_than_ascii():
    assert EST.count("") == 0
    assert EST.count("abcd" * 100) == 100
    assert EST.count("汉字" * 100) > 100  # ~1 token per CJK character


def test_estimator_factory_rejects_unknown_and_missing_path():
    with pytest.raises(ValueError):
        make_estimator("nope")
    with pytest.raises(ValueError):
        make_estimator("hf", None)
