"""The OpenAI-compatible HTTP surface: formats, errors, headers, metrics, determinism, openai SDK."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.sim import tokenizer
from tests.waiting import wait_for_async

from .conftest import chat_body, words

pytestmark = pytest.mark.asyncio

VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body, insisting on the exact ``data: ...\\n\\n`` framing."""
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    out = []
    for e in events[:-1]:
        assert e.startswith(b"data: "), e
        out.append(e[len(b"data: "):])
    assert out[-1] == b"[DONE]"
    return out[:-1]


async def test_non_stream_chat_has_usage_and_replica_header(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20, name="replica-a")
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=7)) as r:
        assert r.status == 200
        assert r.headers["x-sim-replica"] == "replica-a"
        body = await r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    u = body["usage"]
    assert u["completion_tokens"] == 7
    assert u["prompt_tokens"] == tokenizer.chat_prompt([{"role": "user", "content": "hello there"}], False)[0]
    assert u["total_tokens"] == u["prompt_tokens"] + 7
    assert tokenizer.count_tokens(choice["message"]["content"]) == 7


async def test_stream_chat_sse_format_and_usage(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20)
    body = chat_body(max_tokens=5, stream=True, stream_options={"include_usage": True})
    async with http.post(sim.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert "x-sim-replica" in r.headers
        raw = await r.read()
    chunks = [orjson.loads(e) for e in sse_events(raw)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 5
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * 4 + ["length"]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert tokenizer.count_tokens(text) == 5


async def test_completions_stream_and_non_stream(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20)
    async with http.post(sim.url + "/v1/completions",
                         json={"prompt": "once upon a time", "max_tokens": 4}) as r:
        body = await r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens"] == 4
    async with http.post(sim.url + "/v1/completions",
                         json={"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3, "stream": True}) as r:
        chunks = [orjson.loads(e) for e in sse_events(await r.read())]
    assert len(chunks) == 3 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) != ""


async def test_natural_length_without_max_tokens_is_seeded(sim_factory, http) -> None:
    a = await sim_factory(time_scale=50, seed=1)
    b = await sim_factory(time_scale=50, seed=1)
    c = await sim_factory(time_scale=50, seed=2)
    outs = []
    for sim in (a, b, c):
        async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=None)) as r:
            outs.append(await r.json())
    assert outs[0]["choices"][0]["message"]["content"] == outs[1]["choices"][0]["message"]["content"]
    assert outs[0]["usage"] == outs[1]["usage"]
    assert outs[0]["choices"][0]["message"]["content"] != outs[2]["choices"][0]["message"]["content"]
    assert outs[0]["choices"][0]["finish_reason"] == "stop"
    # Same seed, same prompt, same max_tokens: same text; a different prompt changes it.
    texts = []
    for prompt in ("alpha", "alpha", "beta"):
        async with http.post(a.url + "/v1/chat/completions", json=chat_body(prompt, max_tokens=20)) as r:
            texts.append((await r.json())["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] != texts[2]


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/chat/completions", chat_body(words(40), max_tokens=100), 400, "max_tokens"),
        ("/v1/chat/completions", chat_body(words(300)), 400, "messages"),
        ("/v1/chat/completions", chat_body(n=2), 400, "n"),
        ("/v1/chat/completions", chat_body(max_tokens=0), 400, "max_tokens"),
        ("/v1/chat/completions", {**chat_body(), "model": "other"}, 404, "model"),
        ("/v1/chat/completions", chat_body(stream_options={"include_usage": True}), 400, "stream_options"),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 3}, 400, "prompt"),
        ("/v1/chat/completions", {"model": "sim-model"}, 400, "messages"),
    ],
)
async def test_errors_are_openai_style(sim_factory, http, path, body, status, param) -> None:
    sim = await sim_factory(time_scale=20, max_model_len=128)
    async with http.post(sim.url + path, json=body) as r:
        assert r.status == status
        assert r.headers["x-sim-replica"] == sim.name
        err = (await r.json())["error"]
    assert err["code"] == status and err["param"] == param
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] in ("BadRequestError", "NotFoundError")
    assert sim.engine.stats.finished == {"stop": 0, "length": 0, "abort": 0}


async def test_framework_errors_are_json_too(sim_factory, http) -> None:
    sim = await sim_factory()
    async with http.get(sim.url + "/nope") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == 404
    async with http.get(sim.url + "/v1/chat/completions") as r:
        assert r.status == 405 and (await r.json())["error"]["code"] == 405
    async with http.post(sim.url + "/v1/completions", data=b"{not json") as r:
        assert r.status == 400 and (await r.json())["error"]["type"] == "BadRequestError"


async def test_models_and_health(sim_factory, http) -> None:
    sim = await sim_factory(model="m1")
    async with http.get(sim.url + "/v1/models") as r:
        data = (await r.json())["data"]
    assert [m["id"] for m in data] == ["m1"] and data[0]["max_model_len"] == 32768
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200 and r.headers["x-sim-replica"] == f"127.0.0.1:{sim.port}"


async def test_metrics_have_exact_vllm_names_and_values(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20, model="m1")
    for _ in range(3):
        async with http.post(sim.url + "/v1/chat/completions", json={**chat_body(max_tokens=4), "model": "m1"}) as r:
            assert r.status == 200
    async with http.get(sim.url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in VLLM_METRICS.items():
        assert fams[name].type == kind, name
        for s in fams[name].samples:
            assert s.labels["engine"] == "0" and s.labels["model_name"] == "m1"
    lines = set(line.split("{")[0] for line in text.splitlines() if not line.startswith("#"))
    for exact in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                  "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                  "vllm:generation_tokens_total", "vllm:request_success_total",
                  "vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc",
                  "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_sum",
                  "sim_ghost_tokens_total"):
        assert exact in lines, exact

    def value(name: str, **labels: str) -> float:
        for fam in fams.values():
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        raise KeyError(name)

    assert value("vllm:generation_tokens_total") == 12
    assert value("vllm:request_success_total", finished_reason="length") == 3
    assert value("vllm:time_to_first_token_seconds_count") == 3
    assert value("vllm:inter_token_latency_seconds_count") == 9
    assert value("vllm:num_requests_running") == 0
    assert 0 <= value("vllm:kv_cache_usage_perc") <= 1


async def test_metrics_sglang_style(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20, metrics_style="sglang")
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=2)) as r:
        assert r.status == 200
    async with http.get(sim.url + "/metrics") as r:
        text = await r.text()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
            "sglang:cache_hit_rate", "sglang:time_to_first_token_seconds"} <= names
    assert not any(n.startswith("vllm:") for n in names)


async def test_metric_times_are_wall_seconds(sim_factory, http) -> None:
    """With time-scale 10 a 4,000-token prefill (~340 ms modelled) takes ~34 ms of wall time,
    and the scraped TTFT says so: a gateway's own timing and the replica's agree."""
    sim = await sim_factory(time_scale=10)
    loop_time = __import__("asyncio").get_running_loop().time
    t0 = loop_time()
    async with http.post(sim.url + "/v1/completions",
                         json={"prompt": words(4000), "max_tokens": 1, "stream": True}) as r:
        async for _ in r.content.iter_any():
            break
        client_ttft = loop_time() - t0
        await r.read()
    h = sim.engine.stats.ttft
    assert h.count == 1
    assert 0.025 < h.sum <= client_ttft + 0.005
    assert h.sum > 0.5 * client_ttft


async def test_short_request_behind_long_prompt_over_http(sim_factory, http) -> None:
    """Head-of-line blocking end to end: chunked prefill of a long prompt delays a short one."""
    sim = await sim_factory(time_scale=4)
    loop_time = __import__("asyncio").get_running_loop().time

    async def ttft(body: dict) -> float:
        t0 = loop_time()
        async with http.post(sim.url + "/v1/completions", json={**body, "stream": True}) as r:
            async for _ in r.content.iter_any():
                break
            t = loop_time() - t0
            await r.read()
        return t

    idle = await ttft({"prompt": words(100), "max_tokens": 1})
    aio = __import__("asyncio")
    long = aio.create_task(ttft({"prompt": words(4000), "max_tokens": 1}))
    assert await wait_for_async(sim.engine.has_work, 5.0, 0.001)  # the long prompt is in the engine first
    blocked = await ttft({"prompt": words(100), "max_tokens": 1})
    await long
    assert blocked > 3 * idle
    assert blocked > 0.03  # at least one 2,048-token chunk (~100 ms modelled, 25 ms at scale 4)


async def test_openai_sdk_stream_and_non_stream(sim_factory) -> None:
    import openai
    sim = await sim_factory(time_scale=20)
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="sk-sim", max_retries=0, timeout=20)
    try:
        resp = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6)
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage is not None and resp.usage.completion_tokens == 6
        assert resp.choices[0].message.content
        stream = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True})
        text = ""
        usage = None
        finish = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        assert usage is not None and usage.completion_tokens == 6 and usage.prompt_tokens > 0
        assert finish == "length"
        assert text == resp.choices[0].message.content  # same prompt, same seed: same words
        comp = await client.completions.create(model="sim-model", prompt="abc", max_tokens=3)
        assert comp.usage is not None and comp.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    finally:
        await client.close()


async def test_prefix_cache_metrics_over_http(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20, prefix_cache=True, block_size=16)
    body = chat_body(words(500), max_tokens=2)
    for _ in range(2):
        async with http.post(sim.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
    st = sim.engine.stats
    assert st.prefix_queries > 1000
    assert st.prefix_hits >= 480  # the second request found (almost) all its blocks


async def test_several_sims_in_one_loop_have_their_own_metrics(sim_factory, http) -> None:
    a = await sim_factory(time_scale=20, name="a")
    b = await sim_factory(time_scale=20, name="b")
    async with http.post(a.url + "/v1/chat/completions", json=chat_body(max_tokens=3)) as r:
        assert r.headers["x-sim-replica"] == "a"
    assert a.engine.stats.generation_tokens == 3 and b.engine.stats.generation_tokens == 0
    async with http.get(b.url + "/metrics") as r:
        assert "vllm:generation_tokens_total{engine=\"0\",model_name=\"sim-model\"} 0.0" in await r.text()
    assert isinstance(http, aiohttp.ClientSession)


async def test_a_replica_at_half_speed_serves_a_request_in_twice_the_engine_time(sim_factory, http) -> None:
    """`sluice sim --speed 0.5` (what make bench-real passes for its rig): the replica's engine runs the preset's
    costs doubled, says so in its state, and the same prompt's prefill takes twice as long (the step from its
    scheduling to its first token, on the simulated clock: `prefill_time`, exact; the time from its arrival, e2e,
    also holds the event loop's wake-ups, which a loaded machine stretches)."""
    fast = await sim_factory(time_scale=20, seed=3)
    slow = await sim_factory(time_scale=20, seed=3, speed=0.5)
    assert slow.state()["speed"] == 0.5 and fast.state()["speed"] == 1.0
    assert slow.engine.cost.decode_seq == pytest.approx(2 * fast.engine.cost.decode_seq)
    spans = []
    for sim in (fast, slow):
        async with http.post(sim.url + "/v1/chat/completions", json=chat_body("x " * 600, max_tokens=16)) as r:
            assert r.status == 200
            await r.json()
        prefill = sim.engine.stats.prefill_time
        assert prefill.count == 1
        spans.append(prefill.sum)
    assert spans[1] == pytest.approx(2 * spans[0], rel=1e-6)
