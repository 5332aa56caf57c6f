"""Detached requests: once pinned, the ext_proc stream ends and Envoy's access log releases the request.

An ext_proc stream held open for the whole response costs Envoy a side stream and the sidecar a grpc.aio call
(about 64 KB per open stream, P12), so the sidecar only keeps it when it needs it (slow-consumer cut, observed
bodies). These tests drive the Gateway the way the servicer and the access-log receiver do.
"""

from __future__ import annotations

import asyncio
import time

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.accesslog import AccessLogReceiver
from extproc.config import policy_from_dict
from extproc.gateway import Gateway
from extproc.stream import State, Stream

REPLICA = "10.9.0.1:8000"


def _body(text: str) -> bytes:
    return orjson.dumps({"model": "det-m", "max_tokens": 5, "stream": True,
                         "messages": [{"role": "user", "content": text}]})


def _gateway(extra: dict | None = None, access_log: bool = True) -> tuple[Gateway, AccessLogReceiver]:
    gw = Gateway(policy_from_dict({"pools": [{"model": "det-m", "replicas": [REPLICA]}],
                                   "admission": {"kv_capacity_tokens": 60000}, **(extra or {})}))
    receiver = AccessLogReceiver({p.cluster: p.model for p in gw.pools.values()})
    if access_log:
        gw.attach_access_log(receiver)
    return gw, receiver


async def _forward(gw: Gateway, request_id: str) -> Stream:
    st = Stream()
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
        base_pb2.HeaderValue(key="x-request-id", raw_value=request_id.encode())]))
    gw.on_request_headers(st, headers)
    answer = await gw.on_request_body(st, pb.HttpBody(body=_body(request_id + str(id(st))), end_of_stream=True))
    assert answer.HasField("request_body"), answer
    return st


def _end(receiver: AccessLogReceiver, request_id: str, status: int = 200) -> None:
    entry = al.HTTPAccessLogEntry()
    entry.request.request_id = request_id
    entry.response.response_code.value = status
    entry.common_properties.upstream_cluster = "pool-det-m"
    receiver.handle(entry)


def _inflight(gw: Gateway) -> tuple[int, int]:
    r = gw.pools["det-m"].replicas[0]
    return r.inflight_requests, gw.open_requests


def test_forwarded_request_is_released_by_its_access_log_end() -> None:
    async def run() -> None:
        gw, receiver = _gateway()
        st = await _forward(gw, "req-1")
        assert st.state is State.DETACHED and st.ended
        assert st.detached_at > 0 and gw.inflight.detached == {"req-1": st}
        assert _inflight(gw) == (1, 1)           # still counted while the response streams
        progress = al.HTTPAccessLogEntry()       # a periodic (intermediate) entry does not end it
        progress.request.request_id = "req-1"
        progress.common_properties.intermediate_log_entry = True
        receiver.handle(progress)
        assert _inflight(gw) == (1, 1)
        _end(receiver, "other-request")          # someone else's end does not either
        assert _inflight(gw) == (1, 1)
        _end(receiver, "req-1")
        assert _inflight(gw) == (0, 0) and gw.inflight.detached == {} and st.holds == 0
        gw.close(st)                             # its ext_proc stream closing (before or after) releases nothing
        _end(receiver, "req-1")                  # a duplicate end is harmless
        assert _inflight(gw) == (0, 0)

    asyncio.run(run())


def test_failed_end_counts_a_replica_error() -> None:
    async def run() -> None:
        gw, receiver = _gateway()
        await _forward(gw, "req-5xx")
        replica = gw.pools["det-m"].replicas[0]
        before = replica.errors_total
        _end(receiver, "req-5xx", status=503)
        assert replica.errors_total == before + 1 and _inflight(gw) == (0, 0)

    asyncio.run(run())


def test_streams_stay_attached_without_access_log_or_when_the_sidecar_needs_them() -> None:
    async def run() -> None:
        gw, _ = _gateway(access_log=False)       # no other way to learn the end: the stream's close releases
        st = await _forward(gw, "req-2")
        assert st.state is State.FORWARDED and st.detached_at == 0 and gw.inflight.detached == {}
        gw.finish(st)
        gw, _ = _gateway({"streaming": {"slow_consumer": {"min_bytes_per_s": 1000}}})
        st = await _forward(gw, "req-3")         # a slow consumer is cut through its open ext_proc stream
        assert st.detached_at == 0 and gw.inflight.detached == {}
        gw.finish(st)

    asyncio.run(run())


def test_a_reused_request_id_keeps_the_second_stream_attached() -> None:
    """(With the retry budget on, a request id still in flight is refused as a duplicate before this point.)"""
    async def run() -> None:
        gw, receiver = _gateway({"budgets": {"retry": {"enabled": False}}})
        first = await _forward(gw, "dup")
        second = await _forward(gw, "dup")
        assert first.detached_at > 0 and second.detached_at == 0
        gw.finish(second)
        _end(receiver, "dup")
        assert _inflight(gw) == (0, 0)

    asyncio.run(run())


def test_sweep_releases_requests_whose_end_was_lost() -> None:
    async def run() -> None:
        gw, _ = _gateway()
        old = await _forward(gw, "lost")
        young = await _forward(gw, "young")
        old.detached_at = time.monotonic() - 100.0
        assert gw.inflight.sweep(max_age_s=50.0) == 1
        assert list(gw.inflight.detached) == ["young"] and young.detached_at > 0
        assert _inflight(gw) == (1, 1)

    asyncio.run(run())


def test_with_several_workers_a_forwarded_request_keeps_its_stream() -> None:
    """Envoy streams the access log to one worker only: another worker would never learn its detached requests'
    ends (they stayed counted until the sweep, and the replica looked full to that worker)."""
    async def run() -> None:
        gw, receiver = _gateway({"sidecar": {"workers": 2}})
        st = await _forward(gw, "req-w2")
        assert st.state is State.FORWARDED and not st.ended and gw.inflight.detached == {}
        assert _inflight(gw) == (1, 1)
        gw.close(st)                             # its ext_proc stream closing releases it
        assert _inflight(gw) == (0, 0) and st.holds == 0

    asyncio.run(run())
