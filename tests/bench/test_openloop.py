"""The open-loop generator against an in-process aiohttp server: schedule timing, retries, disconnects."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import pytest
from aiohttp import web

from bench.openloop import Arrival, ClientSpec, run_open_loop


def _sse(i: int) -> bytes:
    return b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i


async def _server(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/v1/chat/completions"


async def test_arrivals_keep_their_schedule_when_responses_are_slow():
    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-sim-replica": "r1"})
        await resp.prepare(request)
        await asyncio.sleep(0.4)  # every response takes longer than the gap between arrivals
        await resp.write(_sse(0) + _sse(1) + b"data: [DONE]\n\n")
        return resp

    runner, url = await _server(slow)
    try:
        arrivals = [Arrival(at=0.05 * i, body={"i": i}) for i in range(12)]
        records, _t0 = await run_open_loop(url, arrivals, deadline_s=5.0)
    finally:
        await runner.cleanup()
    assert len(records) == 12
    lateness = [r.start - r.sched for r in records]
    assert max(lateness) < 0.05, lateness           # open loop: sent on time, not after the previous answer
    assert all(r.ok and r.tokens == 2 and r.replica == "r1" for r in records)
    assert all(0.35 < r.ttft < 0.8 for r in records)  # TTFT = first content event, not the headers


async def test_sdk_retries_send_retry_count_and_honour_retry_after():
    seen: list[str] = []

    async def flaky(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("x-stainless-retry-count", "?"))
        if len(seen) < 3:
            return web.json_response({"error": {"message": "busy"}}, status=503, headers={"retry-after-ms": "20"})
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(_sse(0) + b"data: [DONE]\n\n")
        return resp

    runner, url = await _server(flaky)
    try:
        spec = ClientSpec(sdk_max_retries=2, sdk_backoff_s=5.0)  # a 5 s backoff would blow the deadline
        records, _ = await run_open_loop(url, [Arrival(at=0.0, body={}, client=spec)], deadline_s=3.0)
    finally:
        await runner.cleanup()
    assert seen == ["0", "1", "2"]
    assert [r.status for r in records] == [503, 503, 200] and records[-1].ok
    assert [r.attempt for r in records] == [0, 1, 2] and {r.user for r in records} == {0}


async def test_should_retry_false_stops_sdk_and_business_retries():
    calls = 0

    async def shed(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.json_response({"error": {}}, status=429, headers={"x-should-retry": "false"})

    runner, url = await _server(shed)
    try:
        spec = ClientSpec(sdk_max_retries=2, business_retries=2)
        records, _ = await run_open_loop(url, [Arrival(at=0.0, body={}, client=spec)], deadline_s=3.0)
    finally:
        await runner.cleanup()
    assert calls == 1 and records[0].status == 429 and records[0].should_retry == "false"


def _endless(cancelled: asyncio.Event) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A replica that streams 1,000 tokens, 20 ms apart, and sets `cancelled` when its client goes away."""
    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            for i in range(1000):
                await resp.write(_sse(i))
                await asyncio.sleep(0.02)
        except (asyncio.CancelledError, ConnectionResetError):
            cancelled.set()
            raise
        return resp
    return endless


async def test_timeouts_and_disconnects_reach_the_server():
    cancelled = asyncio.Event()
    runner, url = await _server(_endless(cancelled))
    try:
        arrivals = [Arrival(at=0.0, body={}, client=ClientSpec(cancel_after_tokens=3)),
                    Arrival(at=0.0, body={}, client=ClientSpec(timeout_s=0.3))]
        t = time.monotonic()
        records, _ = await run_open_loop(url, arrivals, deadline_s=3.0)
        assert time.monotonic() - t < 2.0
        await asyncio.wait_for(cancelled.wait(), 2.0)
    finally:
        await runner.cleanup()
    by = sorted(records, key=lambda r: r.cancelled)
    assert by[1].cancelled and by[1].tokens == 3 and not by[1].done
    assert by[0].timed_out and by[0].error == "timeout" and 0.25 < by[0].latency < 0.6


async def test_deadline_bounds_the_run():
    async def hang(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.Response()

    runner, url = await _server(hang)
    try:
        t = time.monotonic()
        records, _ = await run_open_loop(url, [Arrival(at=0.0, body={})], deadline_s=0.4)
        assert time.monotonic() - t < 2.0
    finally:
        await runner.cleanup()
    assert records[0].error == "unfinished" and records[0].end is not None


def test_arrival_count_is_bounded():
    with pytest.raises(ValueError):
        asyncio.run(run_open_loop("http://127.0.0.1:9/x", [Arrival(at=0, body={})] * 3, 1.0, max_arrivals=2))


async def test_lingering_client_times_out_but_keeps_reading_and_counts_late_tokens():
    seen: dict[str, float] = {}
    finished = asyncio.Event()

    async def slow_tail(request: web.Request) -> web.StreamResponse:
        seen["deadline"] = float(request.headers["x-sim-deadline"])
        seen["sent_at"] = time.time()
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(_sse(0) + _sse(1))
        await asyncio.sleep(0.8)  # well past the client's 0.3 s timeout
        await resp.write(_sse(2) + _sse(3) + _sse(4) + b"data: [DONE]\n\n")
        finished.set()  # the connection stayed open: nothing cancelled this handler
        return resp

    runner, url = await _server(slow_tail)
    try:
        spec = ClientSpec(timeout_s=0.3, linger_s=5.0, mark_deadline=True)
        records, _ = await run_open_loop(url, [Arrival(at=0.0, body={}, client=spec)], deadline_s=4.0)
        assert finished.is_set()
    finally:
        await runner.cleanup()
    [r] = records
    assert r.timed_out and r.error == "timeout" and not r.ok and not r.done  # the client gave up at 0.3 s
    assert r.tokens == 2 and r.late_tokens == 3                              # the rest arrived for nobody
    assert r.latency < 0.8                                 # its end is its deadline, not the tail at 0.8 s
    assert abs(seen["deadline"] - (seen["sent_at"] + 0.3)) < 0.25


async def test_linger_is_bounded_by_its_cap_and_closes_the_connection():
    cancelled = asyncio.Event()
    runner, url = await _server(_endless(cancelled))
    try:
        spec = ClientSpec(timeout_s=0.2, linger_s=0.3)
        t = time.monotonic()
        records, _ = await run_open_loop(url, [Arrival(at=0.0, body={}, client=spec)], deadline_s=10.0)
        assert time.monotonic() - t < 5.0                         # the cap, not the 10 s run deadline, ended it
        await asyncio.wait_for(cancelled.wait(), 2.0)
    finally:
        await runner.cleanup()
    [r] = records
    assert r.timed_out and r.late_tokens > 0 and r.tokens + r.late_tokens < 1000


async def test_run_deadline_ends_lingering_connections():
    cancelled = asyncio.Event()
    runner, url = await _server(_endless(cancelled))
    try:
        spec = ClientSpec(timeout_s=0.1, linger_s=60.0)
        t = time.monotonic()
        records, _ = await run_open_loop(url, [Arrival(at=0.0, body={}, client=spec)], deadline_s=0.5)
        assert time.monotonic() - t < 5.0
        await asyncio.wait_for(cancelled.wait(), 2.0)
    finally:
        await runner.cleanup()
    assert records[0].timed_out and records[0].late_tokens > 0
