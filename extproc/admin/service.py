"""The admin gRPC service (proto/sluice/v1/admin.proto): status, drain, undrain, reload.

One per sidecar worker, on loopback by default (`sidecar.admin_port` + worker index): it changes routing, so it
must not be reachable from clients. Every handler runs on the sidecar's event loop, so it reads and changes the
Gateway's objects without locks, between two requests' decisions.

    Status   snapshot of pools, replicas (state, weight, drain flag, score inputs) and lanes (queue depths)
    Drain    replica.draining = True: no new requests; requests in flight finish
    Undrain  draining = False, and the replica re-enters through slow start (RECOVERING at the first step)
    Reload   re-read the policy file (extproc/reload.py); invalid: the old policy stays, the error is returned
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Union

import grpc

from extproc.admin import admin_pb2 as pb
from extproc.admin import admin_pb2_grpc as pb_grpc
from extproc.metrics import REPLICA_DRAINING
from extproc.routing.pool import DEGRADED, EJECTED, Pool, Replica

if TYPE_CHECKING:
    from extproc.gateway import Gateway
    from extproc.reload import ReloadResult

log = logging.getLogger("sluice.admin")

UNDRAIN_REASON = "undrain"

ReloadHook = Callable[[str], Union["ReloadResult", Awaitable["ReloadResult"]]]


def _scrape_age(r: Replica, now: float) -> float:
    at = r.engine.scraped_at
    return now - at if at > 0 else -1.0


def replica_status(r: Replica, now: float | None = None) -> pb.ReplicaStatus:
    now = time.monotonic() if now is None else now
    e = r.engine
    return pb.ReplicaStatus(
        address=r.address, state=r.state, weight=r.weight, draining=r.draining, routable=r.routable,
        retired=r.retired, shared_inflight_requests=r.shared_requests, shared_inflight_tokens=r.shared_tokens,
        state_reason=r.state_reason, state_age_s=max(0.0, now - r.state_since),
        kv_usage=e.kv_usage, waiting=e.waiting, running=e.running, ttft_p95_s=e.ttft_p95_s,
        generation_tps=e.generation_tps, scrape_age_s=_scrape_age(r, now), scrape_failures=e.scrape_failures,
        kv_capacity_tokens=r.kv_capacity_tokens or e.kv_capacity_tokens,
        inflight_requests=r.inflight_requests, inflight_tokens=r.inflight_tokens,
        lane_inflight=list(r.lane_inflight), served_total=r.served_total, errors_total=r.errors_total,
    )


def _counter_by_pool(metric: Any, pool: str, key: str | None) -> dict[str, float]:
    """Sum a labelled counter's samples of one pool, by one label (key None: one total under "")."""
    out: dict[str, float] = {}
    for family in metric.collect():
        for s in family.samples:
            if not s.name.endswith("_total") or s.labels.get("pool") != pool:
                continue
            k = s.labels.get(key, "") if key else ""
            out[k] = out.get(k, 0.0) + s.value
    return out


def pool_status(gateway: Gateway, pool: Pool, now: float | None = None) -> pb.PoolStatus:
    from extproc.admission import metrics as am

    now = time.monotonic() if now is None else now
    out = pb.PoolStatus(model=pool.model, cluster=pool.cluster,
                        all_degraded=gateway.fleet.health[pool.model].all_degraded,
                        inflight_requests=pool.inflight_requests, inflight_tokens=pool.inflight_tokens)
    out.replicas.extend(replica_status(r, now) for r in pool.replicas)
    sched = gateway.schedulers.get(pool.model)
    if sched is not None:
        priorities = list(sched.policy.priorities)
        for i, lane in enumerate(sched.policy.lanes):
            queue = sched.queues[i]
            ls = pb.LaneStatus(name=lane.name, queued=len(queue), max_queue=lane.max_queue,
                               max_concurrency=lane.max_concurrency,
                               inflight_requests=sched.lane_requests[i], inflight_tokens=sched.lane_tokens[i])
            for p, n in enumerate(queue.sizes_by_priority()):
                if n and p < len(priorities):
                    ls.queued_by_priority[priorities[p]] = n
            out.lanes.append(ls)
            out.queued += len(queue)
    for reason, value in _counter_by_pool(am.SHED, pool.model, "reason").items():
        out.shed_total[reason] = value
    out.admitted_total = sum(_counter_by_pool(am.ADMITTED, pool.model, None).values())
    return out


def begin_slow_start(gateway: Gateway, pool: Pool, r: Replica, now: float | None = None) -> None:
    """Put a replica at the start of slow start (RECOVERING, first step weight) through the pool's health
    tracker, so its step timer restarts too."""
    gateway.fleet.health[pool.model].begin_slow_start(r, UNDRAIN_REASON, "operator undrain", now)


class ReplicaNotFound(LookupError):
    pass


def find_replica(gateway: Gateway, address: str, pool: str = "") -> tuple[Pool, Replica]:
    """The (pool, replica) serving `address`; `pool` disambiguates an address listed in several pools."""
    matches = []
    for p in gateway.pools.values():
        if pool and p.model != pool:
            continue
        r = p.by_address(address)
        if r is not None:
            matches.append((p, r))
    if not matches:
        where = f"pool {pool!r}" if pool else "any pool"
        known = ", ".join(r.address for p in gateway.pools.values() for r in p.replicas
                          if not pool or p.model == pool)
        raise ReplicaNotFound(f"replica {address!r} is not in {where} (known: {known or 'none'})")
    if len(matches) > 1:
        raise ReplicaNotFound(f"replica {address!r} serves several pools "
                              f"({', '.join(p.model for p, _ in matches)}): name one with --pool")
    return matches[0]


def drain(gateway: Gateway, address: str, pool: str = "") -> pb.DrainResponse:
    p, r = find_replica(gateway, address, pool)
    changed = not r.draining
    r.draining = True
    REPLICA_DRAINING.labels(p.model, r.address).set(1)
    if changed:
        log.warning("replica %s/%s drained by operator: no new requests (%d in flight finish)", p.model,
                    r.address, r.inflight_requests)
    msg = (f"{r.address} drained: no new requests; {r.inflight_requests} in flight will finish" if changed
           else f"{r.address} was already drained ({r.inflight_requests} in flight)")
    return pb.DrainResponse(replica=replica_status(r), pool=p.model, changed=changed, message=msg)


def undrain(gateway: Gateway, address: str, pool: str = "") -> pb.DrainResponse:
    p, r = find_replica(gateway, address, pool)
    changed = r.draining
    if changed:
        r.draining = False
        REPLICA_DRAINING.labels(p.model, r.address).set(0)
        if not (r.engine.scrape_failures and r.state in (DEGRADED, EJECTED)):
            begin_slow_start(gateway, p, r)  # an unreachable one stays put: health starts it once it answers
        log.warning("replica %s/%s undrained by operator: %s at weight %g", p.model, r.address, r.state, r.weight)
        gateway.fleet.kick_all()  # capacity came back: dispatch what waits
        msg = f"{r.address} undrained: {r.state} at weight {r.weight:g} (slow start)"
    else:
        msg = f"{r.address} was not drained ({r.state}, weight {r.weight:g})"
    return pb.DrainResponse(replica=replica_status(r), pool=p.model, changed=changed, message=msg)


def result_to_pb(result: ReloadResult) -> pb.ReloadResponse:
    return pb.ReloadResponse(ok=result.ok, changes=list(result.changes), error=result.error, source=result.source,
                             at_unix_s=result.at, trigger=result.trigger)


class AdminServicer(pb_grpc.AdminServicer):
    """`on_reload(trigger)` performs a reload and returns its ReloadResult (e.g. `PolicyWatcher.reload`, which
    also re-renders Envoy's files); by default `extproc.reload.reload_policy(policy_path, gateway)`."""

    def __init__(self, gateway: Gateway, policy_path: str | os.PathLike[str] | None,
                 on_reload: ReloadHook | None = None) -> None:
        self.gw = gateway
        self.policy_path = str(policy_path) if policy_path else (gateway.policy.source or "")
        self.on_reload = on_reload
        self.started = time.monotonic()

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        from extproc import reload as rl

        now = time.monotonic()
        if request.pool and request.pool not in self.gw.pools:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no pool {request.pool!r} (pools: {', '.join(self.gw.pools)})")
        out = pb.StatusResponse(draining=self.gw.draining, policy_source=self.gw.policy.source or self.policy_path,
                                uptime_s=now - self.started, pid=os.getpid())
        for model, pool in self.gw.pools.items():
            if not request.pool or model == request.pool:
                out.pools.append(pool_status(self.gw, pool, now))
        last = rl.last_result()
        if last is not None:
            out.last_reload.CopyFrom(result_to_pb(last))
        return out

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        return await self._change(drain, request, context)

    async def Undrain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        return await self._change(undrain, request, context)

    async def _change(self, fn: Callable[..., pb.DrainResponse], request: pb.DrainRequest,
                      context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        if not request.replica:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "replica address (ip:port) is required")
        try:
            return fn(self.gw, request.replica, request.pool)
        except ReplicaNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            raise  # unreachable: abort raises

    async def Reload(self, request: pb.ReloadRequest, context: grpc.aio.ServicerContext) -> pb.ReloadResponse:
        from extproc import reload as rl

        if self.on_reload is not None:
            result = self.on_reload("admin")
            if inspect.isawaitable(result):
                result = await result
        else:
            result = rl.reload_policy(self.policy_path, self.gw, trigger="admin")
        return result_to_pb(result)  # type: ignore[arg-type]


async def start_admin_server(gateway: Gateway, host: str = "127.0.0.1", port: int = 50061,
                             policy_path: str | os.PathLike[str] | None = None,
                             on_reload: ReloadHook | None = None) -> grpc.aio.Server:
    """Start the admin gRPC server (loopback by default: drain and reload must not be reachable by clients).
    Raises OSError when the port is taken. Stop it with `await server.stop(grace)`."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_AdminServicer_to_server(AdminServicer(gateway, policy_path, on_reload), server)
    addr = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(addr)
    except RuntimeError as exc:  # grpcio raises instead of returning 0 in some versions
        raise OSError(f"admin API cannot listen on {addr}: {exc}") from None
    if bound == 0:
        raise OSError(f"admin API cannot listen on {addr} (port taken?)")
    await server.start()
    log.info("admin API on %s:%d", host, bound)
    return server


__all__ = ["AdminServicer", "start_admin_server", "drain", "undrain", "find_replica", "pool_status",
           "replica_status", "begin_slow_start", "ReplicaNotFound", "REPLICA_DRAINING"]
