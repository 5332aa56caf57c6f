"""The ext_proc servicer: one `Process` call = one HTTP request in Envoy. It only moves messages between Envoy and
the Gateway; every decision, state and hold is the Gateway's (gateway.py), so this file stays plumbing.

`Process` uses grpc.aio's reader/writer API (`context.read` / `context.write`) rather than an async generator over
the request iterator: each message then passes through no generator frames of its own, which is a part of the
per-request cost that is not grpc.aio's floor.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import responses as R
from extproc.gateway import Gateway
from extproc.stream import Stream

EOF = grpc.aio.EOF


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """Moves ext_proc messages between Envoy and the Gateway; every decision, state and hold is the Gateway's.
    The header hooks are where a mode (the endpoint picker, extproc/epp_gateway.py) reads or answers differently."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> None:
        gw = self.gw
        read, write = context.read, context.write
        st = gw.open_stream()
        try:
            while True:
                msg = await read()
                if msg is EOF:
                    return
                kind = msg.WhichOneof("request")
                if kind == "request_body":
                    await write(await gw.on_request_body(st, msg.request_body))
                    if st.held:  # Envoy was told to wait: the decision follows
                        await write(await gw.wait(st))
                    if st.ended:
                        return
                elif kind == "request_headers":
                    await write(self.request_headers(st, msg))
                    if st.ended:  # answered at the headers (e.g. a 401): nothing more to read
                        return
                elif kind == "response_headers":
                    await write(self.response_headers(st, msg))
                elif kind == "response_trailers":
                    await write(gw.on_response_trailers(st))
                elif kind == "response_body":
                    await write(gw.on_response_body(st, msg.response_body))
                elif kind == "request_trailers":
                    await write(R.CONTINUE_REQUEST_TRAILERS)
        except asyncio.CancelledError:
            answer = gw.on_cancelled(st)
            if answer is None:
                raise
            await write(answer)
        finally:
            gw.close(st)

    def request_headers(self, st: Stream, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        return self.gw.on_request_headers(st, msg.request_headers)

    def response_headers(self, st: Stream, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        return self.gw.on_response_headers(st, msg.response_headers)
