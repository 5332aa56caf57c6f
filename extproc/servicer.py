"""The ext_proc servicer: one `Process` call = one HTTP request in Envoy. It only moves messages between Envoy and
the Gateway; every decision, state and hold is the Gateway's (gateway.py), so this file stays plumbing.
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


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """Moves ext_proc messages between Envoy and the Gateway; every decision, state and hold is the Gateway's."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        gw = self.gw
        st = gw.open_stream()
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("request")
                if kind == "request_body":
                    yield await gw.on_request_body(st, msg.request_body)
                    if st.held:  # Envoy was told to wait: the decision follows
                        yield await gw.wait(st)
                    if st.ended:
                        return
                elif kind == "request_headers":
                    yield self.request_headers(st, msg)
                elif kind == "response_headers":
                    yield self.response_headers(st, msg)
                elif kind == "response_trailers":
                    yield gw.on_response_trailers(st)
                elif kind == "response_body":
                    yield gw.on_response_body(st, msg.response_body)
                elif kind == "request_trailers":
                    yield R.CONTINUE_REQUEST_TRAILERS
        except asyncio.CancelledError:
            answer = gw.on_cancelled(st)
            if answer is None:
                raise
            yield answer
        finally:
            gw.close(st)

    def request_headers(self, st: Stream, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        return self.gw.on_request_headers(st, msg.request_headers)

    def response_headers(self, st: Stream, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        return self.gw.on_response_headers(st, msg.response_headers)
