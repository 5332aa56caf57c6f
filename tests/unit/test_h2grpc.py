"""extproc/h2grpc.py, the sidecar's own gRPC server, spoken to by grpcio's client (a second, independent HTTP/2 and
gRPC implementation): the ext_proc bidi stream, the access log's client stream, limits, cancellation, shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import h2grpc

HEADERS = pb.ProcessingRequest(request_headers=pb.HttpHeaders())


class Servicer:
    def __init__(self) -> None:
        self.cancelled = 0
        self.entries = 0

    async def Process(self, request_iterator, context) -> None:  # as extproc/servicer.py: read/write
        try:
            while True:
                msg = await context.read()
                if msg is h2grpc.EOF:
                    return
                if msg.WhichOneof("request") == "request_body":
                    body = msg.request_body.body
                    answer = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(body=body))
                    await context.write(answer)
                    return
                await context.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def StreamAccessLogs(self, request_iterator, context):
        async for msg in request_iterator:
            self.entries += len(msg.http_logs.log_entry)
            if msg.http_logs.log_entry[0].request.request_id == "stop":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "enough")
        return als_pb2.StreamAccessLogsResponse()


async def _serve(limit: int = 1 << 20):
    servicer = Servicer()
    server = h2grpc.Server(max_receive_message_length=limit)
    server.add_stream_stream(h2grpc.EXT_PROC_PATH, servicer.Process, pb.ProcessingRequest)
    server.add_stream_unary(h2grpc.ACCESS_LOG_PATH, servicer.StreamAccessLogs, als_pb2.StreamAccessLogsMessage)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    return server, servicer, port


@asynccontextmanager
async def _connected(limit: int = 1 << 20) -> AsyncIterator[tuple[h2grpc.Server, Servicer, grpc.aio.Channel]]:
    """A started server, its servicer and a grpcio channel to it; the server stops on the way out."""
    server, servicer, port = await _serve(limit)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield server, servicer, channel
    finally:
        await server.stop(0)


async def test_ext_proc_stream_two_messages_each_way_many_times() -> None:
    async with _connected() as (_server, _servicer, channel):
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one(i: int) -> None:
            call = stub.Process()
            await call.write(HEADERS)
            assert (await call.read()).HasField("request_headers")
            body = f"body {i}".encode() * (1 + i % 7)
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
            assert (await call.read()).immediate_response.body == body
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK

        await asyncio.gather(*(one(i) for i in range(200)))


async def test_large_messages_cross_frames_and_flow_control_windows() -> None:
    async with _connected(limit=8 << 20) as (_server, _servicer, channel):
        stub = pb_grpc.ExternalProcessorStub(channel)
        body = bytes(range(256)) * (3 << 12)  # 3 MB: many DATA frames in, the answer split to the peer's frames
        for _ in range(3):
            call = stub.Process()
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
            assert (await call.read()).immediate_response.body == body
            assert await call.code() == grpc.StatusCode.OK


async def test_a_message_over_the_limit_ends_the_rpc_with_resource_exhausted() -> None:
    async with _connected(limit=1000) as (_server, _servicer, channel):
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * 5000)))
        assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_access_log_client_stream_and_abort() -> None:
    async with _connected() as (_server, servicer, channel):
        stub = als_pb2_grpc.AccessLogServiceStub(channel)

        def messages(n: int, last: str = "r"):
            for i in range(n):
                msg = als_pb2.StreamAccessLogsMessage()
                msg.http_logs.log_entry.add().request.request_id = last if i == n - 1 else "r"
                yield msg

        assert isinstance(await stub.StreamAccessLogs(messages(5)), als_pb2.StreamAccessLogsResponse)
        assert servicer.entries == 5
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.StreamAccessLogs(messages(3, last="stop"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details() == "enough"


async def test_peer_cancel_cancels_the_handler_and_unknown_methods_are_unimplemented() -> None:
    async with _connected() as (server, servicer, channel):
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(HEADERS)
        await call.read()
        call.cancel()
        for _ in range(100):
            if servicer.cancelled:
                break
            await asyncio.sleep(0.01)
        assert servicer.cancelled == 1 and not server.tasks
        unknown = channel.unary_unary("/no.Such/Method", request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await unknown(b"")
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_stop_cancels_running_handlers_after_the_grace_and_refuses_a_second_bind() -> None:
    server, servicer, port = await _serve()
    assert h2grpc.Server().add_insecure_port(f"127.0.0.1:{port}") > 0  # SO_REUSEPORT, as grpc.aio's server
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(HEADERS)
        await call.read()
        await server.stop(0.1)
        assert servicer.cancelled == 1
        assert await call.code() == grpc.StatusCode.CANCELLED
    await asyncio.wait_for(server.wait_for_termination(), 1)
