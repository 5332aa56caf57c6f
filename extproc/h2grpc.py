"""A minimal gRPC server over cleartext HTTP/2 (h2c) on an asyncio Protocol, for the two streaming RPCs Envoy calls on
the sidecar: ext_proc `Process` (bidi) and the access log's `StreamAccessLogs` (client stream). Issue #17: grpc.aio
spends 0.35-0.45 ms of CPU per ext_proc request (two messages each way) even for a servicer that decides nothing;
this server spends about a tenth of that (measured side by side, docs/benchmarks.md), because it does only what
these RPCs need: frames parsed in one pass per socket read, the peer's header blocks decoded once per distinct
block (the sidecar announces an HPACK table size of 0, so a block decodes the same every time), the answers'
header blocks prebuilt, and every frame of one loop iteration written with one send.

The handlers are grpc.aio's servicer methods, unchanged: `handler(request_iterator, context)`, where the context
offers `read()` (a message, or `grpc.aio.EOF` once the peer half-closed), `write(msg)` and `abort(code, details)`,
and the request iterator yields the messages. A stream's handler runs as its own task; the peer's RST_STREAM (or
the connection's loss) cancels it, as grpc.aio does. Unary responses (`StreamAccessLogs`) are the handler's return
value. Not supported, because Envoy does not use them here: TLS, compression, server push, request priorities,
unary requests, response metadata.

Shutdown follows grpc's server: `stop(grace)` closes the listener and sends every connection a GOAWAY naming the
last stream it will serve (streams Envoy opens after it are refused, and Envoy's retry policy on the ext_proc
stream sends them again on a new connection), then cancels the handlers still running after `grace` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc
import hpack

log = logging.getLogger("sluice.h2grpc")

EOF = grpc.aio.EOF
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
MAX_WINDOW = 2**31 - 1
REFILL_AT = 1 << 30  # bytes received on a stream (or the connection) before its window is topped up again
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, REFUSED_STREAM, CANCEL = 0x0, 0x1, 0x3, 0x7, 0x8
EXT_PROC_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ACCESS_LOG_PATH = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
# The sidecar's SETTINGS: HPACK table 0 (header blocks decode statelessly), streams without limit, the largest windows.
OUR_SETTINGS = struct.pack(">HIHIHI", 0x1, 0, 0x3, MAX_WINDOW, 0x4, MAX_WINDOW)
# Prebuilt header blocks (HPACK literals without indexing): ":status: 200" + "content-type: application/grpc".
RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"


def _frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, ftype, flags, stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """One header as an HPACK literal without indexing, new name (values here are short: one-byte lengths)."""
    return b"\x00" + _hpack_len(name) + name + _hpack_len(value) + value


def _hpack_len(s: bytes) -> bytes:
    n = len(s)
    if n < 127:
        return bytes([n])
    out, n = [127], n - 127
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _trailers(code: int, details: str = "") -> bytes:
    block = _literal(b"grpc-status", str(code).encode())
    if details:
        block += _literal(b"grpc-message", details.encode("utf-8", "replace")[:1000])
    return block


TRAILERS_OK = _trailers(0)


class AbortError(Exception):
    """Raised by `context.abort`: the RPC ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Method:
    __slots__ = ("handler", "request_cls", "unary_response")

    def __init__(self, handler: Callable[..., Any], request_cls: Any, unary_response: bool) -> None:
        self.handler, self.request_cls, self.unary_response = handler, request_cls, unary_response


class Call:
    """One RPC: the handler's context and request iterator."""

    __slots__ = ("conn", "sid", "method", "inbox", "waiter", "ended", "started", "done", "task", "buf",
                 "recv_unacked", "send_window", "__weakref__")

    def __init__(self, conn: "Connection", sid: int, method: Method) -> None:
        self.conn, self.sid, self.method = conn, sid, method
        self.inbox: deque[Any] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False      # the peer half-closed (no more messages)
        self.started = False    # our response headers are sent
        self.done = False       # our trailers (or a reset) are sent
        self.task: asyncio.Task[Any] | None = None
        self.buf = bytearray()  # the start of a message split over DATA frames
        self.recv_unacked = 0
        self.send_window = conn.peer_initial_window

    # --- grpc.aio ServicerContext's reader/writer API ---
    async def read(self) -> Any:
        while not self.inbox:
            if self.ended:
                return EOF
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.inbox.popleft()

    async def write(self, message: Any) -> None:
        if self.done:
            raise asyncio.CancelledError()
        self.conn.send_message(self, message.SerializeToString())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise AbortError(code, details)

    def __aiter__(self) -> "Call":
        return self

    async def __anext__(self) -> Any:
        msg = await self.read()
        if msg is EOF:
            raise StopAsyncIteration
        return msg

    # --- from the connection ---
    def deliver(self, message: Any) -> None:
        self.inbox.append(message)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def end(self) -> None:
        self.ended = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Connection(asyncio.Protocol):
    def __init__(self, server: "Server") -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.preface = False
        self.decoder = hpack.Decoder()
        self.calls: dict[int, Call] = {}
        self.out: list[bytes] = []
        self.flush_pending = False
        self.recv_unacked = 0
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.send_window = 65535
        self.blocked: deque[tuple[Call, bytes, int]] = deque()  # DATA waiting for the peer's window
        self.pending_headers: tuple[int, int, bytes] | None = None
        self.last_sid = 0
        self.goaway_sid: int | None = None
        self.closed = False

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self.transport.write(_frame(SETTINGS, 0, 0, OUR_SETTINGS)  # type: ignore[union-attr]
                             + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - 65535)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            self._cancel(call)
        self.calls.clear()

    def data_received(self, data: bytes) -> None:
        try:
            self._receive(data)
        except Exception:  # a malformed peer: the connection goes, the server stays
            log.exception("ext_proc connection closed: bad HTTP/2 input")
            self._close(PROTOCOL_ERROR)
            return
        self._flush()

    # --- input ---
    def _receive(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        if not self.preface:
            if len(buf) < len(PREFACE):
                self.buf = buf
                return
            if buf[:len(PREFACE)] != PREFACE:
                raise ValueError("not an HTTP/2 client preface")
            self.preface = True
            buf = buf[len(PREFACE):]
        pos, n = 0, len(buf)
        while n - pos >= 9:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            end = pos + 9 + length
            if end > n:
                break
            ftype, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            payload = buf[pos + 9:end]
            pos = end
            if self.pending_headers is not None and ftype != CONTINUATION:
                raise ValueError("a header block was interrupted")
            if ftype == DATA:
                self._on_data(sid, flags, payload, length)
            elif ftype == HEADERS:
                if flags & PADDED:
                    payload = payload[1:len(payload) - payload[0]]
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
                if flags & END_HEADERS:
                    self._on_headers(sid, flags, payload)
                else:
                    self.pending_headers = (sid, flags, payload)
            elif ftype == CONTINUATION:
                if self.pending_headers is None or self.pending_headers[0] != sid:
                    raise ValueError("CONTINUATION without its HEADERS")
                psid, pflags, block = self.pending_headers
                if flags & END_HEADERS:
                    self.pending_headers = None
                    self._on_headers(psid, pflags, block + payload)
                else:
                    self.pending_headers = (psid, pflags, block + payload)
            elif ftype == SETTINGS:
                if flags & ACK:
                    self.decoder.max_allowed_table_size = 0  # our table size 0 is in force from here
                else:
                    self._on_settings(payload)
            elif ftype == WINDOW_UPDATE:
                self._on_window_update(sid, int.from_bytes(payload[:4], "big") & 0x7FFFFFFF)
            elif ftype == PING:
                if not flags & ACK:
                    self.out.append(_frame(PING, ACK, 0, payload))
            elif ftype == RST_STREAM:
                call = self.calls.pop(sid, None)
                if call is not None:
                    call.done = True
                    self._cancel(call)
            elif ftype == GOAWAY:
                pass  # the peer opens no new streams here; running ones finish
            # PRIORITY, PUSH_PROMISE (never sent to a server) and unknown frame types are ignored
        self.buf = buf[pos:]
        if self.recv_unacked >= REFILL_AT:
            self.out.append(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.recv_unacked)))
            self.recv_unacked = 0

    def _on_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 0x4:  # INITIAL_WINDOW_SIZE: applies to every open stream's send window
                if value > MAX_WINDOW:
                    raise ValueError("bad INITIAL_WINDOW_SIZE")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for call in self.calls.values():
                    call.send_window += delta
            elif key == 0x5:
                self.peer_max_frame = value
        self.out.append(_frame(SETTINGS, ACK, 0))
        self._unblock()

    def _on_window_update(self, sid: int, increment: int) -> None:
        if sid == 0:
            self.send_window += increment
        else:
            call = self.calls.get(sid)
            if call is None:
                return
            call.send_window += increment
        self._unblock()

    def _decode(self, block: bytes) -> dict[str, str]:
        d = self.decoder
        if d.max_allowed_table_size == 0 and not d.header_table.dynamic_entries:
            cache = self.server.header_cache
            hit = cache.get(block)
            if hit is None:
                hit = dict(d.decode(block))
                if len(cache) < 1024 and not d.header_table.dynamic_entries:
                    cache[block] = hit
            return hit
        return dict(d.decode(block))

    def _on_headers(self, sid: int, flags: int, block: bytes) -> None:
        call = self.calls.get(sid)
        if call is not None:  # the peer's trailers
            if flags & END_STREAM:
                call.end()
            return
        headers = self._decode(block)
        if sid <= self.last_sid:
            return  # a closed stream's late trailers
        self.last_sid = sid
        if self.goaway_sid is not None and sid > self.goaway_sid:
            self.out.append(_frame(RST_STREAM, 0, sid, struct.pack(">I", REFUSED_STREAM)))
            return
        method = self.server.methods.get(headers.get(":path", ""))
        if method is None:
            self.out.append(_frame(HEADERS, END_HEADERS | END_STREAM, sid,
                                   RESPONSE_HEADERS + _trailers(grpc.StatusCode.UNIMPLEMENTED.value[0],
                                                                "unknown method")))
            return
        call = Call(self, sid, method)
        self.calls[sid] = call
        if flags & END_STREAM:
            call.ended = True
        call.task = task = self.loop.create_task(self._run(call))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    def _on_data(self, sid: int, flags: int, payload: bytes, length: int) -> None:
        self.recv_unacked += length
        call = self.calls.get(sid)
        if call is None:
            return
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        call.recv_unacked += length
        if call.recv_unacked >= REFILL_AT and not flags & END_STREAM:
            self.out.append(_frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", call.recv_unacked)))
            call.recv_unacked = 0
        # A message in one frame (the usual case) is parsed from the payload itself; the part of a message split
        # over frames gathers in `call.buf`, appended to in place (re-joining it per frame was quadratic in its size).
        if call.buf:
            call.buf += payload
            data: bytes | bytearray = call.buf
        else:
            data = payload
        limit = self.server.max_receive_message_length
        pos, n = 0, len(data)
        while n - pos >= 5:
            if data[pos] != 0:
                self._fail(call, grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
                return
            size = int.from_bytes(data[pos + 1:pos + 5], "big")
            if size > limit:
                self._fail(call, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"received message larger than max ({size} vs. {limit})")
                return
            if n - pos - 5 < size:
                break
            try:
                message = call.method.request_cls.FromString(bytes(data[pos + 5:pos + 5 + size]))
            except Exception:
                self._fail(call, grpc.StatusCode.INTERNAL, "the request message could not be parsed")
                return
            pos += 5 + size
            call.deliver(message)
        if data is call.buf:
            del call.buf[:pos]
        elif pos < n:
            call.buf += data[pos:]
        if flags & END_STREAM:
            call.end()

    # --- the handler ---
    async def _run(self, call: Call) -> None:
        try:
            result = await call.method.handler(call, call)
        except asyncio.CancelledError:
            if not call.done:  # cancelled by us (a stop): the peer learns it
                self._reset(call, CANCEL)
            return
        except AbortError as exc:
            self._finish(call, exc.code.value[0], exc.details)
            return
        except Exception:
            log.exception("gRPC handler failed")
            self._finish(call, grpc.StatusCode.UNKNOWN.value[0], "the handler failed")
            return
        if call.method.unary_response and result is not None and not call.done:
            self.send_message(call, result.SerializeToString())
        self._finish(call, 0, "")

    def _cancel(self, call: Call) -> None:
        call.done = True
        if call.task is not None and not call.task.done():
            call.task.cancel()

    # --- output ---
    def send_message(self, call: Call, body: bytes) -> None:
        if call.done or self.closed:
            return
        if not call.started:
            call.started = True
            self.out.append(_frame(HEADERS, END_HEADERS, call.sid, RESPONSE_HEADERS))
        self._send_data(call, b"\x00" + len(body).to_bytes(4, "big") + body, 0)
        self._schedule_flush()

    def _send_data(self, call: Call, data: bytes, flags: int) -> None:
        """DATA within the peer's windows, in frames of at most its frame size; the rest waits (in order) for a
        WINDOW_UPDATE. flags -1: `data` is a prebuilt frame (trailers) that goes once the DATA before it went."""
        if self.blocked:  # keep the order: behind what already waits
            self.blocked.append((call, data, flags))
            return
        if flags == -1:
            self.out.append(data)
            return
        while True:
            room = min(self.send_window, call.send_window, self.peer_max_frame)
            if len(data) <= room:
                self.send_window -= len(data)
                call.send_window -= len(data)
                self.out.append(_frame(DATA, flags, call.sid, data))
                return
            if room <= 0:
                self.blocked.append((call, data, flags))
                return
            self.send_window -= room
            call.send_window -= room
            self.out.append(_frame(DATA, 0, call.sid, data[:room]))
            data = data[room:]

    def _unblock(self) -> None:
        waiting, self.blocked = self.blocked, deque()
        while waiting:
            call, data, flags = waiting.popleft()
            self._send_data(call, data, flags)
        self._schedule_flush()

    def _finish(self, call: Call, code: int, details: str) -> None:
        """Trailers end the stream (after its DATA, which may wait for the peer's window)."""
        if call.done or self.closed:
            self.calls.pop(call.sid, None)
            return
        call.done = True
        trailers = TRAILERS_OK if code == 0 and not details else _trailers(code, details)
        block = trailers if call.started else RESPONSE_HEADERS + trailers
        frame = _frame(HEADERS, END_HEADERS | END_STREAM, call.sid, block)
        if self.blocked:
            self.blocked.append((call, frame, -1))
        else:
            self.out.append(frame)
        self.calls.pop(call.sid, None)
        self._schedule_flush()

    def _fail(self, call: Call, code: grpc.StatusCode, details: str) -> None:
        self._finish(call, code.value[0], details)
        self._cancel(call)

    def _reset(self, call: Call, error: int) -> None:
        call.done = True
        self.calls.pop(call.sid, None)
        if not self.closed:
            self.out.append(_frame(RST_STREAM, 0, call.sid, struct.pack(">I", error)))
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self.flush_pending:
            self.flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_pending = False
        if self.out and not self.closed and self.transport is not None:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def goaway(self) -> None:
        """No stream after the last one seen is served here; the peer opens its next ones elsewhere."""
        if self.goaway_sid is None and not self.closed:
            self.goaway_sid = self.last_sid
            self.out.append(_frame(GOAWAY, 0, 0, struct.pack(">II", self.last_sid, NO_ERROR)))
            self._schedule_flush()

    def _close(self, error: int) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(_frame(GOAWAY, 0, 0, struct.pack(">II", self.last_sid, error)))
            self.transport.close()


class Server:
    """The subset of grpc.aio.Server that the sidecar uses: add a method, bind, start, stop, wait."""

    def __init__(self, max_receive_message_length: int = 4 * 1024 * 1024) -> None:
        self.max_receive_message_length = max_receive_message_length
        self.methods: dict[str, Method] = {}
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.header_cache: dict[bytes, dict[str, str]] = {}
        self.sockets: list[socket.socket] = []
        self.servers: list[asyncio.AbstractServer] = []
        self.stopped = asyncio.Event()

    def add_stream_stream(self, path: str, handler: Callable[..., Any], request_cls: Any) -> None:
        self.methods[path] = Method(handler, request_cls, unary_response=False)

    def add_stream_unary(self, path: str, handler: Callable[..., Any], request_cls: Any) -> None:
        self.methods[path] = Method(handler, request_cls, unary_response=True)

    def add_insecure_port(self, address: str) -> int:
        """Bind now (SO_REUSEPORT, as the grpc.aio server is), listen at start; the port, or 0 if taken."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((host, int(port)))
        except OSError:
            sock.close()
            return 0
        self.sockets.append(sock)
        return sock.getsockname()[1]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self.sockets:
            sock.listen(1024)
            sock.setblocking(False)
            self.servers.append(await loop.create_server(lambda: Connection(self), sock=sock))

    async def stop(self, grace: float | None) -> None:
        for srv in self.servers:
            srv.close()
        for conn in list(self.connections):
            conn.goaway()
        if grace:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            while loop.time() < deadline and any(c.calls for c in self.connections):
                await asyncio.sleep(0.02)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for conn in list(self.connections):
            conn._flush()
            if conn.transport is not None:
                conn.transport.close()
        self.stopped.set()

    async def wait_for_termination(self) -> None:
        await self.stopped.wait()
