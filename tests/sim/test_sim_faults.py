"""Faults and disconnects over real loopback sockets."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from tests.waiting import wait_for_async

from .conftest import chat_body, words

pytestmark = pytest.mark.asyncio


async def fault(http: aiohttp.ClientSession, sim, name: str, value=None) -> dict:
    async with http.post(sim.admin_url + "/sim/fault", json={"fault": name, "value": value}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def raw_stream(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a raw HTTP/1.1 connection and send a streaming request (no client library)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = orjson.dumps(body)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    return reader, writer


async def read_until(reader: asyncio.StreamReader, marker: bytes, timeout: float = 5.0) -> bytes:
    buf = b""
    async with asyncio.timeout(timeout):
        while marker not in buf:
            chunk = await reader.read(65536)
            if not chunk:
                break
            buf += chunk
    return buf


async def test_stream_disconnect_frees_blocks_within_one_step(sim_factory) -> None:
    # time-scale 0.25: each decode step takes ~20 ms of wall time, so "one step" is measurable.
    sim = await sim_factory(time_scale=0.25)
    eng = sim.engine
    reader, writer = await raw_stream(sim.port, chat_body(words(300), max_tokens=1000, stream=True))
    got = await read_until(reader, b'"content":" ')  # a generated token arrived
    assert b"200 OK" in got
    assert len(eng.running) == 1 and eng.pool.used() > 0
    steps_before = eng.stats.steps
    writer.transport.abort()  # the client goes away (RST)
    assert await wait_for_async(lambda: eng.pool.used() == 0, timeout=2.0, interval=0.001)
    assert eng.stats.steps - steps_before <= 1
    assert eng.stats.finished["abort"] == 1 and not eng.running
    assert eng.stats.ghost_tokens <= 1


async def test_non_stream_disconnect_aborts_too(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=1)
    eng = sim.engine
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=2000),
                             timeout=aiohttp.ClientTimeout(total=0.2)) as r:
            await r.read()
    assert await wait_for_async(lambda: eng.stats.finished["abort"] == 1, timeout=3.0)
    assert eng.pool.used() == 0 and not eng.running
    assert eng.stats.generation_tokens < 2000


async def test_disconnect_while_queued_removes_the_request(sim_factory) -> None:
    sim = await sim_factory(time_scale=1, faults=[("hang", True)])
    eng = sim.engine
    reader, writer = await raw_stream(sim.port, chat_body(max_tokens=10, stream=True))
    assert await wait_for_async(lambda: len(eng.waiting) == 1)
    writer.close()
    assert await wait_for_async(lambda: not eng.waiting)
    assert eng.stats.finished["abort"] == 1


async def test_no_abort_keeps_generating_and_counts_ghost_tokens(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=5)
    await fault(http, sim, "no-abort")
    eng = sim.engine
    reader, writer = await raw_stream(sim.port, chat_body(max_tokens=150, stream=True))
    await read_until(reader, b'"content":" ')
    writer.transport.abort()
    assert await wait_for_async(lambda: eng.stats.finished["length"] == 1, timeout=10.0)
    assert eng.stats.finished["abort"] == 0
    assert eng.stats.ghost_tokens > 100  # tokens made after the client left
    async with http.get(sim.url + "/metrics") as r:
        text = await r.text()
    line = next(x for x in text.splitlines() if x.startswith("sim_ghost_tokens_total"))
    assert float(line.rsplit(" ", 1)[1]) == eng.stats.ghost_tokens
    state = await fault(http, sim, "no-abort", False)
    assert state["faults"]["no_abort"] is False and state["counters"]["ghost_tokens"] > 100


async def test_slow_keeps_health_200_while_ttft_rises(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=1)
    body = chat_body(words(200), max_tokens=1)
    async with http.post(sim.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
    fast = sim.engine.stats.ttft.sum
    await fault(http, sim, "slow", 20)
    task = asyncio.create_task(http.post(sim.url + "/v1/chat/completions", json=body))
    assert await wait_for_async(lambda: sim.engine.has_work())
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200  # half-dead: alive by the classic check
    async with await task as r:
        assert r.status == 200
    slow = sim.engine.stats.ttft.sum - fast
    assert slow > 5 * fast
    state = await fault(http, sim, "clear")
    assert state["faults"]["slow"] == 1.0


async def test_hang_accepts_but_never_produces(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20)
    await fault(http, sim, "hang")
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=3, stream=True)) as r:
        assert r.status == 200  # headers go out before any token, as with vLLM
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.content.readany(), 0.3)
        assert sim.engine.stats.generation_tokens == 0
        async with http.get(sim.url + "/health") as h:
            assert h.status == 200
        async with http.get(sim.admin_url + "/sim/state") as s:
            state = await s.json()
        assert state["faults"]["hang"] is True and state["waiting"] + state["running"] == 1
        await fault(http, sim, "hang", False)
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    assert sim.engine.stats.generation_tokens == 3


async def test_crash_resets_connections_and_recover_reopens_the_port(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=2, num_gpu_blocks=500)
    port = sim.port
    reader, writer = await raw_stream(port, chat_body(words(100), max_tokens=5000, stream=True))
    await read_until(reader, b'"content":" ')
    state = await fault(http, sim, "crash")
    assert state["faults"]["crashed"] is True
    assert state["running"] == 0 and state["used_blocks"] == 0
    try:
        rest = await read_until(reader, b"[DONE]", timeout=3.0)
    except ConnectionResetError:
        rest = b"reset"
    assert rest == b"reset" or (b"[DONE]" not in rest and reader.at_eof())  # cut, not finished
    writer.close()
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(f"http://127.0.0.1:{port}/health") as r:
            await r.read()
    async with http.get(sim.admin_url + "/sim/state") as r:
        assert (await r.json())["faults"]["crashed"] is True  # admin stays reachable
    await fault(http, sim, "recover")
    async with http.get(f"http://127.0.0.1:{port}/health") as r:
        assert r.status == 200
    async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body(max_tokens=2)) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2


async def test_error_rate(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=50, seed=3)
    await fault(http, sim, "error-rate", 0.5)
    statuses = []
    for _ in range(40):
        async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=1)) as r:
            statuses.append(r.status)
            if r.status == 500:
                err = (await r.json())["error"]
                assert err["code"] == 500 and err["type"] == "InternalServerError"
    assert set(statuses) == {200, 500}
    assert 8 <= statuses.count(500) <= 32
    await fault(http, sim, "error-rate", 1)
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=1)) as r:
        assert r.status == 500
    await fault(http, sim, "clear")
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=1)) as r:
        assert r.status == 200


async def test_kv_shrink_preempts_running_work(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=2, num_gpu_blocks=100, max_model_len=1024, block_size=16, prefix_cache=False)
    eng = sim.engine
    body = chat_body(words(290), max_tokens=60, stream=True)  # ~19 blocks each, 23 at the end
    tasks = [asyncio.create_task(http.post(sim.url + "/v1/chat/completions", json=body)) for _ in range(3)]
    assert await wait_for_async(lambda: len(eng.running) == 3 and eng.stats.generation_tokens >= 3)
    state = await fault(http, sim, "kv-shrink", 0.5)
    assert state["usable_blocks"] == 49  # 100 - 50 lost - the null block
    for t in tasks:
        async with await t as r:
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
    assert eng.stats.preemptions >= 1
    assert eng.stats.finished["length"] == 3
    async with http.get(sim.url + "/metrics") as r:
        text = await r.text()
    assert f'vllm:num_preemptions_total{{engine="0",model_name="sim-model"}} {float(eng.stats.preemptions)}' in text


async def test_bad_fault_commands_are_400(sim_factory, http) -> None:
    sim = await sim_factory()
    for body in ({"fault": "explode"}, {"fault": "slow"}, {"fault": "error-rate", "value": 2},
                 {"value": 1}):
        async with http.post(sim.admin_url + "/sim/fault", json=body) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "fault"


async def test_crash_through_the_api_port_still_answers(sim_factory, http) -> None:
    sim = await sim_factory(admin_port=-1)
    assert sim.admin_url is None
    async with http.post(sim.url + "/sim/fault", json={"fault": "crash"}) as r:
        assert r.status == 200 and (await r.json())["faults"]["crashed"] is True
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(sim.url + "/health", headers={"Connection": "close"}) as r:
            await r.read()
    await sim.apply_fault("recover")
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200


async def test_clearing_slow_mid_step_shortens_the_step(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=1, faults=[("slow", 1000.0)])  # a 100-token step: ~8 s
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=2)))
    assert await wait_for_async(lambda: len(sim.engine.running) == 1)
    await asyncio.sleep(0.05)  # the slow step is under way: the fault is cleared in its middle
    t0 = loop.time()
    await sim.apply_fault("clear")
    async with await task as r:
        assert r.status == 200
    assert loop.time() - t0 < 2.0
