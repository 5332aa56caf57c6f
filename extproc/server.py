"""The sidecar process: the grpc.aio ExternalProcessor service plus a small HTTP server for /metrics and /ready.

One `Process` call = one HTTP request in Envoy. The servicer only moves messages; every decision is in
`gateway.Gateway`, so this file stays plumbing.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import AsyncIterator

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from envoy.service.accesslog.v3 import als_pb2_grpc

from extproc import metrics as m
from extproc.accesslog import AccessLogReceiver
from extproc import responses as R
from extproc.config import Policy
from pathlib import Path

from extproc.admin.service import start_admin_server
from extproc.gateway import Gateway
from extproc.reload import PolicyWatcher, note_policy

log = logging.getLogger("sluice.server")


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
                    yield gw.on_request_headers(st, msg.request_headers)
                elif kind == "response_headers":
                    yield gw.on_response_headers(st, msg.response_headers)
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


async def _metrics(_request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_http_app(gateway: Gateway, state: dict[str, bool]) -> web.Application:
    async def ready(_request: web.Request) -> web.Response:
        if state.get("ready") and not gateway.draining:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False}, status=503)

    app = web.Application()
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/ready", ready)
    return app


DETACHED_SWEEP_S = 10.0
NO_ROUTE_TIMEOUT_MAX_AGE_S = 3600.0  # no route timeout (streams may be long): a lost end is released after this


async def _sweep_detached(gateway: Gateway, max_age_s: float) -> None:
    """Backstop for detached requests (inflight.py) whose access-log end was lost."""
    while True:
        await asyncio.sleep(DETACHED_SWEEP_S)
        gateway.inflight.sweep(max_age_s)


async def serve(policy: Policy, worker: int = 0, grace_s: float = 10.0, xds_out: str | None = None) -> None:
    """Run until SIGTERM/SIGINT; then stop admitting, let in-flight requests finish, exit."""
    gateway = Gateway(policy)
    sc = policy.sidecar
    server = grpc.aio.server(options=[
        ("grpc.max_concurrent_streams", 100_000),
        ("grpc.max_receive_message_length", policy.limits.max_body_bytes + 65536),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ])
    pb_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(gateway), server)
    access_log = AccessLogReceiver({p.cluster: p.model for p in gateway.pools.values()})
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(access_log, server)
    gateway.attach_access_log(access_log)
    grpc_addr = f"{sc.host}:{sc.grpc_port + worker}"
    if server.add_insecure_port(grpc_addr) == 0:
        raise OSError(f"cannot listen on {grpc_addr} (port taken?)")
    state = {"ready": False}
    runner = web.AppRunner(make_http_app(gateway, state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, sc.metrics_host, sc.metrics_port + worker)
    await gateway.budgets.start()
    scraper = gateway.fleet.make_scraper()
    if scraper is not None:
        await scraper.scrape_once()  # first numbers before taking traffic (stale counts as saturated)
        await scraper.start()
    await server.start()
    await site.start()
    route_timeout = policy.gateway.request_timeout_s
    sweeper = asyncio.create_task(_sweep_detached(
        gateway, (route_timeout if route_timeout > 0 else NO_ROUTE_TIMEOUT_MAX_AGE_S) + 30.0))
    # Operations: the policy watcher (file change + SIGHUP) and the admin API, on loopback.
    note_policy(policy)
    # With xds_out (worker 0 only), a reload also re-renders the Envoy files there: replica changes reach Envoy.
    watcher = (PolicyWatcher(policy.source, gateway, xds_out=xds_out if worker == 0 else None)
               if Path(policy.source).is_file() else None)
    if watcher is not None:
        await watcher.start(sighup=True)
    admin = await start_admin_server(gateway, "127.0.0.1", sc.admin_port + worker, policy.source,
                                     on_reload=watcher.reload_async if watcher is not None else None)
    state["ready"] = True
    m.READY.set(1)
    m.OPEN_REQUESTS_CAP.set(gateway.open_cap)
    log.info("sidecar ready: ext_proc on %s, metrics on http://%s:%d/metrics", grpc_addr, sc.metrics_host,
             sc.metrics_port + worker)
    print(f"sidecar ready on {grpc_addr}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Graceful: new requests get a 503 with retry-after while in-flight ones finish.
    gateway.draining = True
    m.READY.set(0)
    deadline = loop.time() + grace_s
    while loop.time() < deadline and any(p.inflight_requests for p in gateway.pools.values()):
        await asyncio.sleep(0.05)
    sweeper.cancel()
    if watcher is not None:
        await watcher.stop()
    await admin.stop(grace=0.5)
    await server.stop(grace=1.0)
    await runner.cleanup()
    if scraper is not None:
        await scraper.stop()
    await gateway.budgets.close()
