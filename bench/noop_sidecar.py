"""`python -m bench.noop_sidecar serve --config FILE --worker N ...`: the floor of sluice's ext_proc hop.

A stand-in for `sluice serve` (same arguments, same ports, the same gRPC server and event loop) whose
servicer decides nothing: it answers the request headers with a prebuilt "continue", the buffered body with a
prebuilt answer pinning the pool's first replica (the same protobuf shape as the sidecar's forward answer), and
ends the stream; the access-log stream is read and dropped. The sidecar's CPU per request minus this one's is
what sluice's own code costs; this one's is the gRPC server's (and Python's) per-stream work for two messages each
way. The server is the sidecar's default, extproc/h2grpc.py; `SLUICE_NOOP_SERVER=grpcio` serves it on grpc.aio
(`sidecar.grpc_server: grpcio`) instead. Run it in place of `sluice serve` beside the real sidecar, each behind its
own Envoy rendered the same way, and compare them in one session: `python -m bench.hop_ab base= noop=:bench.noop_sidecar`
(and `noop-aio=:bench.noop_sidecar%SLUICE_NOOP_SERVER=grpcio`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import AsyncIterator

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import responses as R
from extproc.config import load_policy
from extproc.head import STRIPPED_HEADERS
from extproc.server import grpc_server

EOF = grpc.aio.EOF


class NoopServicer(pb_grpc.ExternalProcessorServicer):
    """Headers: continue; body: the prebuilt pinned answer, then the stream ends (as a detached request's)."""

    def __init__(self, forward: pb.ProcessingResponse) -> None:
        self.forward = forward

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> None:
        read, write = context.read, context.write
        while True:
            msg = await read()
            if msg is EOF:
                return
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                await write(R.CONTINUE_REQUEST_HEADERS)
            elif kind == "request_body":
                await write(self.forward)
                return
            else:
                await write(R.CONTINUE_RESPONSE_TRAILERS)


class DropAccessLog(als_pb2_grpc.AccessLogServiceServicer):
    async def StreamAccessLogs(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
                               context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        async for _ in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()


async def serve(config: str, worker: int) -> None:
    policy = load_policy(config)
    sc, pool = policy.sidecar, policy.pools[0]
    forward = R.forward(pool.cluster, pool.addresses[0], remove_headers=STRIPPED_HEADERS)
    server = grpc_server(policy, os.environ.get("SLUICE_NOOP_SERVER", "h2"), NoopServicer(forward), DropAccessLog())
    server.add_insecure_port(f"{sc.host}:{sc.grpc_port + worker}")
    await server.start()
    app = web.Application()
    app.router.add_get("/ready", lambda _r: web.json_response({"ready": True}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, sc.metrics_host, sc.metrics_port + worker).start()
    print(f"noop sidecar ready on {sc.host}:{sc.grpc_port + worker}", flush=True)
    await server.wait_for_termination()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.noop_sidecar")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--xds-out")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.config, args.worker))
    else:
        uvloop.run(serve(args.config, args.worker))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
