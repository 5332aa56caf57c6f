"""The sidecar process: the grpc.aio ExternalProcessor service (servicer.py) plus a small HTTP server for /metrics
and /ready, and the background parts a policy asks for: discovery of replicas by name (endpoints.py), the shared
in-flight view (routing/shared_load.py), the scraper, the policy watcher, the admin API; in EPP mode the gRPC
health service. Every decision is in `gateway.Gateway` (or `epp_gateway.EppGateway`), so this file stays plumbing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from extproc import h2grpc
from extproc import metrics as m
from extproc.accesslog import AccessLogReceiver
from extproc.config import Policy
from extproc.admin.service import start_admin_server
from extproc.endpoints import Endpoints
from extproc.epp import EppHealth
from extproc.epp_gateway import EppGateway, EppServicer
from extproc.gateway import Gateway
from extproc.ports import port_is_free
from extproc.reload import PolicyWatcher, ReloadResult, note_policy
from extproc.routing.shared_load import shared_load_from_policy
from extproc.servicer import ExtProcServicer
from extproc.xds import render

log = logging.getLogger("sluice.server")
T = TypeVar("T")

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
# A replacement worker (`serve --take-over`) waits this long, at most, for the worker it replaces to free the
# metrics and admin ports (that one drains for at most its grace period, then exits).
TAKE_OVER_PORTS_S = 30.0
TAKE_OVER_RETRY_S = 0.1
HAND_OVER_SETTLE_S = 1.0  # a worker handing over waits this long after its GOAWAY before it counts its streams
NO_ROUTE_TIMEOUT_MAX_AGE_S = 3600.0  # no route timeout (streams may be long): a lost end is released after this


async def _sweep_detached(gateway: Gateway, max_age_s: float) -> None:
    """Backstop for detached requests (inflight.py) whose access-log end was lost."""
    while True:
        await asyncio.sleep(DETACHED_SWEEP_S)
        gateway.inflight.sweep(max_age_s)


def _make_gateway(policy: Policy) -> tuple[Gateway, ExtProcServicer]:
    """sluice's own shape, or the endpoint picker of an InferencePool (`epp.enabled`, epp_gateway.py)."""
    if policy.epp.enabled:
        epp_gateway = EppGateway(policy)
        return epp_gateway, EppServicer(epp_gateway)
    gateway = Gateway(policy)
    return gateway, ExtProcServicer(gateway)


async def _follow_readiness(health: EppHealth, endpoints: Endpoints, gateway: Gateway) -> None:
    """EPP mode: the gRPC readiness follows "endpoints known" (a first discovery report) and not shutting down."""
    while True:
        ready = endpoints.known and not gateway.draining
        if ready != health.ready:
            await health.set_ready(ready)
        await asyncio.sleep(0.5)


async def _start_site(runner: web.AppRunner, host: str, port: int) -> web.TCPSite:
    """The /metrics and /ready listener; a failed start leaves nothing registered in the runner (so it can be tried
    again)."""
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await site.stop()
        raise
    return site


async def _bind_when_free(what: str, start: Callable[[], Awaitable[T]], patience_s: float) -> T:
    """`start()` until it stops raising OSError (the port is taken), for at most `patience_s` (0: once)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    while True:
        try:
            return await start()
        except OSError as exc:
            if patience_s <= 0:
                raise
            if loop.time() >= deadline:
                raise OSError(f"{what}: the port is still taken after {patience_s:g} s ({exc})") from None
            await asyncio.sleep(TAKE_OVER_RETRY_S)


def grpc_server(policy: Policy, kind: str, servicer: pb_grpc.ExternalProcessorServicer,
                access_log: als_pb2_grpc.AccessLogServiceServicer | None) -> grpc.aio.Server | h2grpc.Server:
    """The gRPC server Envoy calls, serving `servicer`'s ext_proc streams and, when given, `access_log`'s stream:
    `kind` "h2" (the default, extproc/h2grpc.py: about a tenth of grpc.aio's CPU per ext_proc stream, issue #17)
    or "grpcio" (grpc.aio). bench/noop_sidecar.py builds its server here too, so its floor is this server's."""
    max_message = policy.limits.max_body_bytes + 65536
    if kind == "grpcio":
        server = grpc.aio.server(options=[
            ("grpc.max_concurrent_streams", 100_000),
            ("grpc.max_receive_message_length", max_message),
            ("grpc.so_reuseport", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ])
        pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
        if access_log is not None:
            als_pb2_grpc.add_AccessLogServiceServicer_to_server(access_log, server)
        return server
    h2 = h2grpc.Server(max_receive_message_length=max_message)
    h2.add_stream_stream(h2grpc.EXT_PROC_PATH, servicer.Process, ext_proc_pb.ProcessingRequest)
    if access_log is not None:
        h2.add_stream_unary(h2grpc.ACCESS_LOG_PATH, access_log.StreamAccessLogs, als_pb2.StreamAccessLogsMessage)
    return h2


async def serve(policy: Policy, worker: int = 0, grace_s: float = 10.0, xds_out: str | None = None,
                take_over: Path | None = None) -> None:
    """Run until SIGTERM/SIGINT (drain: stop admitting, let in-flight requests finish, exit) or SIGUSR2 (hand
    over to a replacement already serving on the same gRPC port, see `_hand_over`).

    With `xds_out` (the directory Envoy watches; worker 0 writes it): Envoy's files are rendered there at start
    and on every reload, and the EDS files of pools found at run time follow every discovery change.

    The ext_proc gRPC socket is bound with SO_REUSEPORT, so that a replacement can listen beside this worker during
    a recycle (`sluice up`, extproc/restarts.py). A normal start first checks that nothing listens on the port (a
    clear error for a real conflict); `take_over` (a file path) skips that check, writes the file once this worker
    serves ext_proc, then waits (at most TAKE_OVER_PORTS_S) for the metrics and admin ports the leaving worker
    still holds."""
    gateway, servicer = _make_gateway(policy)
    sc = policy.sidecar
    grpc_addr = f"{sc.host}:{sc.grpc_port + worker}"
    if take_over is None and not port_is_free(sc.host, sc.grpc_port + worker):
        raise OSError(f"cannot listen on {grpc_addr} (port taken)")
    health: EppHealth | None = None
    access_log: AccessLogReceiver | None = None
    if policy.epp.enabled:  # the gateway sends the picker no access log; it probes gRPC health instead (grpc.aio)
        server = grpc_server(policy, "grpcio", servicer, None)
        health = EppHealth()
        health.add_to(server)  # type: ignore[arg-type]
    else:
        access_log = AccessLogReceiver({p.cluster: p.model for p in gateway.pools.values()})
        server = grpc_server(policy, sc.grpc_server, servicer, access_log)
        gateway.attach_access_log(access_log)
    state = {"ready": False}
    runner = web.AppRunner(make_http_app(gateway, state), access_log=None)
    await runner.setup()
    await gateway.budgets.start()
    xds = xds_out if worker == 0 and not policy.epp.enabled else None
    # Replicas by name: resolved before the first scrape, so the starting set is known (and in EDS) when ready.
    endpoints = Endpoints(gateway.fleet, policy, xds)
    await endpoints.start()
    if xds is not None:
        render(policy, xds, "sluice", endpoints=endpoints.eds_endpoints())
    if isinstance(gateway, EppGateway) and policy.epp.failure_mode is None:
        gateway.failure_mode = endpoints.failure_mode(policy.default_pool.model) or gateway.failure_mode
    shared = shared_load_from_policy(policy, worker, gateway.fleet)
    if shared is not None:
        await shared.start()
    scraper = gateway.fleet.make_scraper()
    if scraper is not None:
        await scraper.scrape_once()  # first numbers before taking traffic (stale counts as saturated)
        await scraper.start()
    # Bound only now: a socket in the port's SO_REUSEPORT group takes its share of Envoy's new connections as soon
    # as it listens, so a replacement must not listen before it can answer.
    if server.add_insecure_port(grpc_addr) == 0:
        raise OSError(f"cannot listen on {grpc_addr} (port taken?)")
    await server.start()
    patience = 0.0
    if take_over is not None:
        take_over.write_text(f"{os.getpid()}\n")  # serving ext_proc: the supervisor may now send SIGUSR2 to the old
        patience = TAKE_OVER_PORTS_S
    await _bind_when_free(f"metrics on {sc.metrics_host}:{sc.metrics_port + worker}",
                          lambda: _start_site(runner, sc.metrics_host, sc.metrics_port + worker), patience)
    route_timeout = policy.gateway.request_timeout_s
    background = [asyncio.create_task(_sweep_detached(
        gateway, (route_timeout if route_timeout > 0 else NO_ROUTE_TIMEOUT_MAX_AGE_S) + 30.0))]
    if health is not None:
        await health.start(ready=False)
        background.append(asyncio.create_task(_follow_readiness(health, endpoints, gateway)))
    # Operations: the policy watcher (file change + SIGHUP) and the admin API, on loopback.
    note_policy(policy)
    reloads: set[asyncio.Task[None]] = set()

    def on_reload(result: ReloadResult) -> None:
        """An applied reload's name entries reach the running discovery sources."""
        if result.ok and (endpoints.active or any(p.discovered for p in gateway.policy.pools)):
            task = asyncio.get_running_loop().create_task(endpoints.on_reload(gateway.policy))
            reloads.add(task)
            task.add_done_callback(reloads.discard)

    # With xds_out (worker 0 only), a reload also re-renders the Envoy files there: replica changes reach Envoy.
    watcher = (PolicyWatcher(policy.source, gateway, on_change=on_reload, xds_out=xds)
               if Path(policy.source).is_file() else None)
    if watcher is not None:
        await watcher.start(sighup=True)
    admin = await _bind_when_free(
        f"admin API on 127.0.0.1:{sc.admin_port + worker}",
        lambda: start_admin_server(gateway, "127.0.0.1", sc.admin_port + worker, policy.source,
                                   on_reload=watcher.reload_async if watcher is not None else None), patience)
    state["ready"] = True
    m.READY.set(1)
    m.OPEN_REQUESTS_CAP.set(gateway.open_cap)
    log.info("sidecar ready: ext_proc on %s, metrics on http://%s:%d/metrics", grpc_addr, sc.metrics_host,
             sc.metrics_port + worker)
    print(f"sidecar ready on {grpc_addr}", flush=True)

    stop = asyncio.Event()
    handing_over = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR2, lambda: (handing_over.set(), stop.set()))
    await stop.wait()
    state["ready"] = False
    m.READY.set(0)
    if handing_over.is_set():
        await _hand_over(server, gateway, access_log, grace_s)
    else:
        await _drain(gateway, health, grace_s)
    for task in background:
        task.cancel()
    if watcher is not None:
        await watcher.stop()
    await admin.stop(grace=0.5)
    await server.stop(grace=1.0)
    await runner.cleanup()
    if scraper is not None:
        await scraper.stop()
    await endpoints.stop()
    if shared is not None:
        await shared.stop()
    await gateway.budgets.close()


async def _drain(gateway: Gateway, health: EppHealth | None, grace_s: float) -> None:
    """SIGTERM: new requests get a 503 `draining` with retry-after while in-flight ones finish (at most grace_s)."""
    gateway.draining = True
    if health is not None:
        await health.shutdown()  # gateways stop picking this EPP
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while loop.time() < deadline and any(p.inflight_requests for p in gateway.pools.values()):
        await asyncio.sleep(0.05)


def _queued(gateway: Gateway) -> int:
    """Requests waiting in this worker's admission queues."""
    return sum(s.queued_total() for s in gateway.schedulers.values())


async def _hand_over(server: grpc.aio.Server | h2grpc.Server, gateway: Gateway, access_log: AccessLogReceiver | None,
                     grace_s: float) -> None:
    """SIGUSR2, a replacement already serving on the same port: close this worker's listener and send Envoy a
    GOAWAY (grpc's server shutdown), so that Envoy opens its next connection, which only the replacement's socket
    can accept, and sends its new ext_proc streams there. This worker is not `draining`: a stream Envoy opened here
    before it read the GOAWAY is answered as usual.

    Envoy's access-log stream stays on the old connection until this worker ends it; the ends it carries release
    requests (slots, open-request counts) in whichever worker detached them. While requests wait in this worker's
    queue it keeps the stream (its releases dispatch them); once none waits (at once, usually) it ends it, and
    Envoy reconnects it to the replacement, whose own requests' ends would otherwise come here and never release
    them there. Then it answers the ext_proc streams it still holds (streams kept open to their end, P13) until
    none is left (counted from HAND_OVER_SETTLE_S after the GOAWAY) or grace_s passed, and cancels what remains. Requests it detached run on without it (Envoy streams them); their ends reach the replacement, which
    does not know them (ignored)."""
    stopping = asyncio.ensure_future(server.stop(grace_s))
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + grace_s
    while loop.time() < deadline and _queued(gateway) > 0:
        await asyncio.sleep(0.02)
    if access_log is not None:
        access_log.close_streams()
    # grpc's GOAWAY is graceful: streams Envoy opens before it has read it are still served here, so "no stream
    # open" means something only once Envoy has had time to read it
    await asyncio.sleep(max(0.0, start + HAND_OVER_SETTLE_S - loop.time()))
    while loop.time() < deadline and gateway.open_streams > 0:
        await asyncio.sleep(0.02)
    await server.stop(0)  # nothing of this worker's is left (its access-log streams ended above)
    await stopping
