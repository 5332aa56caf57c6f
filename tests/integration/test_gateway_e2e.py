"""End to end through the real Envoy binary, the sidecar process and simulated replicas, driven by the
official openai SDK."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from extproc.supervisor import Stack

from .conftest import REPLICA_HEADER, metric_sum, sim_metric, wait_for

pytestmark = pytest.mark.integration
MODEL = "sim-model"


def client(stack: Stack, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="test", max_retries=0, **kw)


def aclient(stack: Stack, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="test", max_retries=0, **kw)


def post_raw(stack: Stack, path: str, body: bytes, method: str = "POST") -> tuple[int, dict, dict]:
    req = urllib.request.Request(stack.base_url + path, data=body if method == "POST" else None, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_non_streaming_chat_via_openai_sdk(stack: Stack):
    raw = client(stack).chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Say something."}])
    assert REPLICA_HEADER.match(raw.headers["x-sim-replica"])
    assert raw.headers["x-sim-replica"] in stack.policy.default_pool.replicas
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens > 0


def test_streaming_chat_with_usage_via_openai_sdk(stack: Stack):
    stream = client(stack).chat.completions.create(
        model=MODEL, max_tokens=20, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Stream please."}])
    text, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert len(text) >= 10
    assert usage is not None and usage.completion_tokens == 20


def test_completions_endpoint(stack: Stack):
    out = client(stack).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert out.choices[0].text
    assert out.usage.completion_tokens == 8


def test_models_list_comes_from_the_policy(stack: Stack):
    models = client(stack).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_requests_in_flight_spread_by_inflight_load(stack: Stack):
    lines = []  # each stream's line iterator stays referenced: an abandoned one closes its connection at once

    async def open_stream(c: openai.AsyncOpenAI, streams: contextlib.AsyncExitStack) -> str:
        # identical prompts, longer than a prefix level: a prefix held by one request in flight must not draw the
        # copies to its replica (each sequence counts in the score, and a held prefix only in whole KV blocks)
        resp = await streams.enter_async_context(c.chat.completions.with_streaming_response.create(
            model=MODEL, max_tokens=3000, stream=True, messages=[{"role": "user", "content": "load " * 150}]))
        lines.append(resp.iter_lines())
        while not (await anext(lines[-1])).startswith("data:"):
            pass  # up to the first token: the engine runs the request
        return resp.headers["x-sim-replica"]

    def scraped_as_running(served: list[str]) -> bool:
        """The sidecar's latest scrape of every replica shows each request placed there running, none waiting."""
        return all(metric_sum(stack.metrics_url, "sluice_replica_running", replica=a) == served.count(a)
                   and metric_sum(stack.metrics_url, "sluice_replica_waiting", replica=a) == 0
                   for a in stack.policy.default_pool.replicas)

    async def run() -> list[str]:
        served: list[str] = []
        async with aclient(stack) as c, contextlib.AsyncExitStack() as streams:
            # each request is placed while the earlier ones generate (3,000 tokens: all still do at the 12th),
            # once the scrapes show them: what runs where decides, not the moment a scrape caught a request in an
            # engine's queue on its way to running
            for _ in range(12):
                served.append(await open_stream(c, streams))
                assert await asyncio.to_thread(wait_for, lambda: scraped_as_running(served))
        return served

    # an idle pool first: an earlier test's request holds its slots until Envoy's access log reports its end
    assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_inflight_requests") == 0)
    served = asyncio.run(run())
    counts = sorted(served.count(a) for a in stack.policy.default_pool.replicas)
    assert counts == [4, 4, 4], served
    # the streams were closed mid-generation: their replicas' accounting is released
    assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_inflight_requests") == 0)
    assert metric_sum(stack.metrics_url, "sluice_inflight_tokens") == 0


def test_midstream_disconnect_releases_accounting_and_stops_generation(stack: Stack):
    with httpx.Client(base_url=stack.base_url, timeout=10) as http:
        body = {"model": MODEL, "stream": True, "max_tokens": 3000,
                "messages": [{"role": "user", "content": "long answer please"}]}
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            replica = resp.headers["x-sim-replica"]
            # Keep the iterator referenced: an abandoned httpx line iterator closes the connection at once.
            lines_iter = resp.iter_lines()
            seen = 0
            while seen < 5:
                seen += next(lines_iter).startswith("data:")
            assert metric_sum(stack.metrics_url, "sluice_inflight_requests", replica=replica) >= 1
        # leaving the `with` closes the connection mid-stream
    assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_inflight_requests", replica=replica) == 0, 3)
    assert wait_for(lambda: sim_metric(replica, "vllm:num_requests_running") == 0, 3)
    generated = sim_metric(replica, "vllm:generation_tokens_total")
    asyncio.run(asyncio.sleep(0.5))  # the window in which a replica that kept generating would add tokens
    assert sim_metric(replica, "vllm:generation_tokens_total") == generated, "replica kept generating"
    assert generated < 3000
    assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_requests_total", outcome="cancelled") >= 1, 5)


def test_outcome_counted_completed(stack: Stack):
    before = metric_sum(stack.metrics_url, "sluice_requests_total", outcome="completed")
    client(stack).chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_requests_total", outcome="completed") > before, 5)


def test_malformed_json_is_400_with_openai_error(stack: Stack):
    status, headers, body = post_raw(stack, "/v1/chat/completions", b"{nope")
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert body["error"]["code"] == "invalid_json"
    assert body["error"]["type"] == "invalid_request_error"


def test_missing_messages_is_400(stack: Stack):
    with pytest.raises(openai.BadRequestError) as exc:
        client(stack).chat.completions.create(model=MODEL, messages=[])
    assert exc.value.code == "missing_messages"


def test_unknown_model_is_404(stack: Stack):
    with pytest.raises(openai.NotFoundError) as exc:
        client(stack).chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    assert exc.value.code == "model_not_found"
    assert "gpt-nope" in exc.value.message


def test_body_over_limit_is_413_json(stack: Stack):
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 1_200_000}]}).encode()
    status, headers, body = post_raw(stack, "/v1/chat/completions", big)
    assert status == 413
    assert body["error"]["code"] == "request_too_large"


def test_large_prompt_under_limit_passes_the_small_stream_buffer(stack: Stack):
    """The listener keeps a 64 KiB buffer for streaming memory, yet a 100 KB prompt must still pass."""
    out = client(stack).chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "word " * 20_000}])
    assert out.usage.prompt_tokens > 15_000


def test_unknown_endpoint_is_404_json(stack: Stack):
    status, _headers, body = post_raw(stack, "/v1/embeddings", b"{}")
    assert status == 404
    assert body["error"]["code"] == "unknown_endpoint"


def test_client_cannot_pin_itself(stack: Stack):
    """A client-sent destination or pool header must not choose the replica or cluster. The target is a replica
    the gateway will not pick (drained through the admin API), so a request that reaches it was pinned by the
    client. The replica is undrained afterwards (it comes back through slow start)."""
    target = stack.policy.default_pool.replicas[-1]
    assert admin_cli(stack, "drain", target).returncode == 0
    try:
        c = client(stack, default_headers={"x-gateway-destination-endpoint": target, "x-sluice-pool": "pool-x"})
        served = []
        for _ in range(4):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
            served.append(raw.headers["x-sim-replica"])
        assert raw.parse().choices[0].message.content
        assert target not in served, served
    finally:
        assert admin_cli(stack, "undrain", target).returncode == 0
        assert not replica_status(stack, target)["draining"]


def admin_cli(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "extproc.cli", *args, "--config", str(stack.run_dir / "policy.yaml")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def replica_status(stack: Stack, address: str) -> dict:
    proc = admin_cli(stack, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    pools = json.loads(proc.stdout)["sidecars"][0]["status"]["pools"]
    return next(r for p in pools for r in p["replicas"] if r["address"] == address)


def test_envoy_stats_show_ext_proc(stack: Stack):
    with urllib.request.urlopen(stack.admin_url + "/stats/prometheus", timeout=5) as resp:
        text = resp.read().decode()
    assert "envoy_http_ext_proc_sluice_streams_started" in text


def test_client_deadline_cancels_replica_work(stack: Stack):
    """x-sluice-deadline-ms (or the SDK's x-stainless-read-timeout) becomes Envoy's upstream timeout: when it
    passes, the replica's generation is cancelled instead of running on for nobody (P4)."""
    import time

    generated_before = {a: sim_metric(a, "vllm:generation_tokens_total") for a in stack.policy.default_pool.replicas}
    t0 = time.monotonic()
    with httpx.Client(base_url=stack.base_url, timeout=10) as http:
        body = {"model": MODEL, "stream": True, "max_tokens": 3000, "messages": [{"role": "user", "content": "x"}]}
        with http.stream("POST", "/v1/chat/completions", json=body,
                         headers={"x-sluice-deadline-ms": "600"}) as resp:
            replica = resp.headers["x-sim-replica"]
            with pytest.raises(httpx.HTTPError):
                for _ in resp.iter_lines():
                    pass
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0, elapsed
    assert wait_for(lambda: sim_metric(replica, "vllm:num_requests_running") == 0, 3)
    generated = sim_metric(replica, "vllm:generation_tokens_total") - generated_before[replica]
    assert 0 < generated < 1000, generated  # about 0.6 s of decoding, not the 3,000 tokens asked for
    assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_requests_total", outcome="timeout") >= 1, 5)
