"""Forwarded requests the sidecar still follows after its answer, through Envoy's access log (accesslog.py):

- detached: once pinned, a request that needs nothing more from its ext_proc stream lets it end (an ext_proc
  stream held open for the whole response costs about 64 KB: Envoy's side stream plus the grpc.aio call,
  measured in P12); its holds are released when the access log reports the request's end, or by `sweep` when
  that entry was lost. Needs the access log (the only other way to learn the end) and a request id no other open
  request uses.
- live: with slow-consumer cutting on (P13), a request keeps its ext_proc stream; Envoy's periodic report of the
  bytes written to the client feeds its drain rate, and a stream under `streaming.slow_consumer.min_bytes_per_s`
  for longer than its grace is cut: its servicer task is cancelled and answers with an immediate response, which
  resets both the client's stream and the replica's.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from extproc import metrics as m
from extproc.stream import Hold, State, Stream

if TYPE_CHECKING:
    from extproc.accesslog import AccessLogReceiver
    from extproc.streaming import SlowConsumerPolicy

log = logging.getLogger("sluice.inflight")

_CUTTABLE = (State.FORWARDED, State.RESPONDING)


class InFlight:
    def __init__(self, release: Callable[[Stream], object], slow_consumer: SlowConsumerPolicy) -> None:
        self._release = release  # Gateway.finish
        self.slow_consumer = slow_consumer
        self.access_log: AccessLogReceiver | None = None
        self.live: dict[str, Stream] = {}      # request id -> forwarded stream whose client's drain is watched
        self.detached: dict[str, Stream] = {}  # request id -> forwarded stream whose ext_proc stream has ended

    def attach(self, receiver: AccessLogReceiver) -> None:
        self.access_log = receiver
        receiver.progress_listeners.append(self.on_progress)
        receiver.end_listeners.append(self.on_request_end)

    # ---- registering a forwarded stream --------------------------------------------------------------------
    def watch(self, st: Stream, request_id: str) -> None:
        """Follow the client's drain rate of this stream, to cut it when too slow."""
        st.take(Hold.LIVE)
        self.live[request_id] = st

    def detach(self, st: Stream, request_id: str) -> bool:
        """Let the ext_proc stream end with the pin answer; the access log's end releases the request. False
        (the stream stays attached) without an access log or a request id of its own."""
        if self.access_log is None or not request_id or request_id in self.detached:
            return False
        st.take(Hold.DETACHED)
        st.move(State.DETACHED)
        st.detached_at = time.monotonic()
        self.detached[request_id] = st
        return True

    def forget(self, st: Stream, request_id: str, holds: int) -> None:
        """Release the registrations among `holds` (Gateway.finish, which has cleared them on the stream)."""
        if holds & Hold.DETACHED and self.detached.get(request_id) is st:
            del self.detached[request_id]
        if holds & Hold.LIVE:
            if self.live.get(request_id) is st:
                del self.live[request_id]
            st.watch = st.task = None

    # ---- what the access log says -------------------------------------------------------------------------
    def on_request_end(self, request_id: str, status: int) -> None:
        """Envoy's final access-log entry of a request: release it if detached (once: finish unregisters it)."""
        st = self.detached.get(request_id)
        if st is not None:
            st.status = status
            self._release(st)

    def on_progress(self, request_id: str, bytes_sent: int) -> None:
        """Envoy's periodic report of an open request: cut it if its client drains too slowly (P13)."""
        st = self.live.get(request_id)
        if st is None or st.watch is None or st.state not in _CUTTABLE:
            return
        if st.watch.update(bytes_sent, time.monotonic(), self.slow_consumer):
            st.move(State.CUT)
            if st.pool is not None:
                m.SLOW_STREAMS_CUT.labels(st.pool.model).inc()
            if st.task is not None:
                st.task.cancel()  # the servicer answers with an immediate response: client and replica reset

    def sweep(self, max_age_s: float) -> int:
        """Release detached requests whose end never arrived (an access-log entry lost while Envoy reconnected):
        older than any request can live. Returns how many were released."""
        if not self.detached:
            return 0
        cutoff = time.monotonic() - max_age_s
        stale = [rid for rid, st in self.detached.items() if st.detached_at < cutoff]
        for rid in stale:
            self.on_request_end(rid, self.detached[rid].status)
        if stale:
            m.DETACHED_SWEPT.inc(len(stale))
            log.warning("released %d requests whose end Envoy's access log never reported", len(stale))
        return len(stale)
