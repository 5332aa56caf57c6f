"""Envoy's gRPC access log, received by the sidecar: the authoritative end of every request.

Why: with the cheap response mode (body NONE) the ext_proc stream ends the same way whether the client read
the whole answer or hung up, and upstreams rarely send trailers. Envoy's access log knows: response flags say
"downstream connection termination", "upstream request timeout", "upstream reset". So outcomes
(completed / cancelled / timeout / failed) are counted here, and per-replica signals (errors, time to first
upstream byte) are handed to whoever listens (routing's health tracking). Entries arrive in batches
(`buffer_flush_interval`), so the cost is one gRPC message per batch, not per request.
"""

from __future__ import annotations

import asyncio

import logging
from typing import AsyncIterator, Callable

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from extproc import metrics as m
from extproc.head import binding_deadline_s, logged_deadline_s

log = logging.getLogger("sluice.accesslog")

COMPLETED, CANCELLED, TIMEOUT, FAILED = "completed", "cancelled", "timeout", "failed"

EntryListener = Callable[[str, al.HTTPAccessLogEntry], None]
ProgressListener = Callable[[str, int], None]  # (request id, bytes written to the client so far)
EndListener = Callable[[str, int], None]  # (request id, HTTP status) of every finished request


def classify(entry: al.HTTPAccessLogEntry) -> str | None:
    """Outcome of one finished request, or None for requests the sidecar answered itself (counted as
    rejections where they happen) and intermediate (still running) entries."""
    common = entry.common_properties
    if common.intermediate_log_entry:
        return None
    details = entry.response.response_code_details
    if details.startswith("sluice_"):
        return None
    flags = common.response_flags
    if flags.downstream_connection_termination or flags.downstream_remote_reset:
        return CANCELLED
    if (flags.upstream_request_timeout or flags.stream_idle_timeout or flags.duration_timeout
            or flags.upstream_max_stream_duration_reached):
        return TIMEOUT
    code = entry.response.response_code.value
    if (code >= 500 or code == 0 or flags.upstream_remote_reset or flags.upstream_connection_failure
            or flags.upstream_connection_termination or flags.no_healthy_upstream or flags.local_reset
            or flags.upstream_protocol_error or flags.upstream_overflow or flags.upstream_retry_limit_exceeded):
        return FAILED  # includes a stream cut mid-response by a crashing replica (UPE after a 200)
    return COMPLETED


def client_deadline_passed(entry: al.HTTPAccessLogEntry, route_timeout_s: float) -> bool:
    """The request ended at the route timeout, and that timeout was the client's own deadline, from which the
    sidecar set it (`head.binding_deadline_s`; the deadline headers are logged with each entry: xds.py): the
    client's time ran out, which says no more about the replica than a client that hung up. A replica that is
    slow for everyone shows it in its TTFT and pace against its peers (routing/health.py). A timeout at the
    operator's own route timeout (`gateway.request_timeout_s`, shorter than the client's deadline) stays an
    error."""
    if not entry.common_properties.response_flags.upstream_request_timeout:
        return False
    deadline = logged_deadline_s(entry.request.request_headers)
    return binding_deadline_s(deadline, route_timeout_s) is not None


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """Counts outcomes per pool and notifies listeners with (outcome, entry)."""

    def __init__(self, cluster_to_pool: dict[str, str]) -> None:
        self._pool_of = cluster_to_pool
        self._counters: dict[tuple[str, str], object] = {}
        self.listeners: list[EntryListener] = []
        self.progress_listeners: list[ProgressListener] = []
        self.end_listeners: list[EndListener] = []
        self.streams: set[asyncio.Task[object]] = set()  # the StreamAccessLogs calls running (Envoy's streams)
        self.closing = False  # set by close_streams: a stream opened later is ended at once too

    def _count(self, pool: str, outcome: str) -> None:
        child = self._counters.get((pool, outcome))
        if child is None:
            child = self._counters[(pool, outcome)] = m.REQUESTS.labels(pool, outcome)
        child.inc()  # type: ignore[attr-defined]

    def handle(self, entry: al.HTTPAccessLogEntry) -> None:
        if entry.common_properties.intermediate_log_entry:
            for listener in self.progress_listeners:
                listener(entry.request.request_id, entry.common_properties.downstream_wire_bytes_sent)
            return
        if self.end_listeners:
            request_id, status = entry.request.request_id, entry.response.response_code.value
            for end in self.end_listeners:
                end(request_id, status)
        outcome = classify(entry)
        if outcome is None:
            return
        pool = self._pool_of.get(entry.common_properties.upstream_cluster)
        if pool is None:
            return  # never routed to a pool (e.g. sidecar unreachable with fail-closed)
        self._count(pool, outcome)
        for listener in self.listeners:
            listener(outcome, entry)

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
                               context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this sidecar worker is handing over")
        task = asyncio.current_task()
        if task is not None:
            self.streams.add(task)
        try:
            async for msg in request_iterator:
                for entry in msg.http_logs.log_entry:
                    try:
                        self.handle(entry)
                    except Exception:  # a bad entry must never kill the log stream
                        log.exception("access log entry could not be handled")
        except asyncio.CancelledError:
            if not self.closing:
                raise
            # ended by close_streams: a cancelled handler sends no status, so end the RPC with one
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this sidecar worker is handing over")
        finally:
            self.streams.discard(task)  # type: ignore[arg-type]
        return als_pb2.StreamAccessLogsResponse()

    def close_streams(self) -> int:
        """End Envoy's open access-log streams with UNAVAILABLE (a worker handing over: Envoy reconnects them to
        its replacement); returns how many."""
        self.closing = True
        for task in list(self.streams):
            task.cancel()
        return len(self.streams)
