"""The per-request state machine: what the sidecar does at each ext_proc message of one HTTP request.

    request_headers ─► (no body? decide now) ─► request_body ─► decide: reject | forward pinned
    response_headers ─► note status, first byte
    response_trailers / end_of_stream ─► completed
    stream closes (always) ─► release every slot in `finish`

The gRPC plumbing lives in `server.py`; this module has no I/O, so it is unit-testable with plain
protobuf messages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import metrics as m
from extproc import responses as R
from extproc.admission.queue import Waiter
from extproc.admission.output_length import OutputLengths
from extproc.admission.scheduler import Placement, Scheduler, Shed
from extproc.budgets import BudgetExceeded, Budgets, Charge
from extproc.config import Policy
from extproc.identity import Identity, UnknownKey
from extproc.request import ENDPOINTS, BadRequest, LLMRequest, parse_body
from extproc.routing.health import HealthTracker
from extproc.routing.placement import Placer
from extproc.streaming import DrainWatch, ResponseObserver, Sampler
from extproc.routing.pool import Pool, Replica
from extproc.tokens import make_estimator
from extproc.xds import DESTINATION_KEY

if TYPE_CHECKING:
    from extproc.accesslog import AccessLogReceiver

log = logging.getLogger("sluice.gateway")

# Client-sent headers that would let a client decide what only the gateway may decide: removed from every
# forwarded request (removing an absent header is free; one constant list, no per-request work). The pool
# header is not listed: the sidecar always overwrites it.
STRIPPED_HEADERS = [DESTINATION_KEY, "x-envoy-upstream-rq-timeout-ms",
                    "x-envoy-upstream-rq-per-try-timeout-ms", "x-envoy-max-retries", "x-envoy-retry-on",
                    "x-envoy-retry-grpc-on", "x-envoy-retriable-status-codes", "x-envoy-retriable-header-names",
                    "x-envoy-hedge-on-per-try-timeout", "x-envoy-upstream-alt-stat-name", "x-envoy-force-trace",
                    "x-envoy-upstream-stream-duration-ms"]

# Lifecycle states of one stream (explicit, so `finish` knows what to release).
NEW, QUEUED, FORWARDED, RESPONDING, DONE, REJECTED = "new", "queued", "forwarded", "responding", "done", "rejected"


@dataclass(slots=True)
class Head:
    """What the request headers said, kept until the body arrives."""

    method: str = ""
    path: str = ""
    content_length: int = -1
    tenant: str = "default"
    app: str = "default"
    task_id: str | None = None
    task_depth: int = 0
    priority: str = "interactive"
    retry_count: int = 0
    idempotency_key: str | None = None
    request_id: str = ""
    client_timeout_s: float | None = None
    api_key: str | None = None  # never logged; mapped to a tenant by identity


@dataclass(slots=True)
class Stream:
    """One ext_proc stream = one HTTP request."""

    state: str = NEW
    start: float = 0.0
    head: Head | None = None
    req: LLMRequest | None = None
    pool: Pool | None = None
    waiter: Waiter | None = None
    placement: Placement | None = None
    charge: Charge | None = None
    tenant_open: str | None = None  # tenant whose open-stream slot this stream holds
    counted_open: bool = False  # holds one of the sidecar's open-request slots
    gauged: bool = False  # counted in the in-flight gauges (reached _forward)
    observer: ResponseObserver | None = None  # set when this response's body is observed
    watch: DrainWatch | None = None  # slow-consumer tracking (streaming.slow_consumer)
    task: asyncio.Task | None = None  # the servicer task, so a slow stream can be cut from outside
    cut: bool = False
    budgets: Budgets | None = None  # the Budgets that issued `charge` (a reload may replace self.budgets)
    status: int = 0
    detached_at: float = 0.0  # > 0: forwarded, ext_proc stream closed; released by the access log (see detach)


MAX_DEADLINE_S = 86400.0  # a client deadline beyond a day is no deadline


def _float(raw: str) -> float | None:
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return min(value, MAX_DEADLINE_S * 1000)


def _int(raw: str, default: int = 0) -> int:
    try:
        return int(raw)
    except ValueError:
        return default


def _set_timeout(head: Head, text: str) -> None:
    head.client_timeout_s = _float(text)


def _set_deadline_ms(head: Head, text: str) -> None:
    ms = _float(text)
    if ms is not None:
        head.client_timeout_s = ms / 1000.0


def _set_retry_count(head: Head, text: str) -> None:
    head.retry_count = _int(text)


def _set_task_depth(head: Head, text: str) -> None:
    head.task_depth = _int(text)


def _setter(name: str, limit: int) -> "Callable[[Head, str], None]":  # noqa: F821
    def set_field(head: Head, text: str) -> None:
        setattr(head, name, text[:limit])
    return set_field


def _set_authorization(head: Head, text: str) -> None:
    head.api_key = text[7:] if text[:7].lower() == "bearer " else text


# One reader per header the sidecar reads; the key is the header name.
_HEADER_READERS = {
    "x-stainless-retry-count": _set_retry_count,
    "x-stainless-read-timeout": _set_timeout,
    "x-sluice-deadline-ms": _set_deadline_ms,
    "x-sluice-tenant": _setter("tenant", 64),
    "x-sluice-app": _setter("app", 64),
    "x-sluice-task-id": _setter("task_id", 128),
    "x-sluice-task-depth": _set_task_depth,
    "x-sluice-priority": _setter("priority", 16),
    "idempotency-key": _setter("idempotency_key", 128),
    "authorization": _set_authorization,
}


class Gateway:
    """Holds the pools and their schedulers and decides for each stream. One instance per sidecar process."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.pools: dict[str, Pool] = {p.model: Pool.from_config(p) for p in policy.pools}
        lim = policy.limits
        self.estimator = make_estimator(lim.tokenizer, lim.tokenizer_path or None, lim.bytes_per_token)
        self.max_body = lim.max_body_bytes
        self.default_output = lim.default_output_tokens
        self.admission = policy.admission
        self._is_fresh: Callable[[Replica, float], bool] | None = None  # set when a scraper runs
        self.routing = policy.routing
        self.health = {name: HealthTracker(pool, self.routing.health) for name, pool in self.pools.items()}
        self.placers = {name: self._placer(pool) for name, pool in self.pools.items()}
        self.schedulers = {name: Scheduler(pool, self.admission, self.placers[name])
                           for name, pool in self.pools.items()}
        self._pool_by_cluster = {pool.cluster: pool for pool in self.pools.values()}
        self.scraper = None  # set by the server when scraping is on
        self.estimate_ratio: dict[str, float] = {}  # replica-counted / estimated prompt tokens, from observations
        self.output_lengths = OutputLengths()  # per app: expected output of requests without max_tokens
        self.open_requests = 0
        self.open_cap = policy.sidecar.open_request_cap(policy.gateway.max_downstream_connections)
        self.live: dict[str, Stream] = {}  # request id -> forwarded stream, only while slow consumers are cut
        self.detached: dict[str, Stream] = {}  # request id -> forwarded stream whose ext_proc stream has closed
        self.identity = Identity(policy.tenants)
        self.budgets = Budgets(policy.budgets, capacity_tokens_per_s=self.capacity_tokens_per_s,
                               sidecar_count_hint=policy.sidecar.workers, label_tenant=self._tenant_label)
        self.streaming = policy.streaming
        self.sampler = Sampler(self.streaming)
        self._tenant_gauges: dict[str, object] = {}
        self.draining = False
        self.access_log: AccessLogReceiver | None = None
        self._replica_gauges: dict[Replica, tuple] = {}

    def _tenant_label(self, tenant: str) -> str:
        """The bounded tenant label of the current identity policy (it is replaced on reload)."""
        return self.identity.label(tenant)

    def _gauges(self, r: Replica) -> tuple:
        g = self._replica_gauges.get(r)
        if g is None:
            g = self._replica_gauges[r] = (m.INFLIGHT_REQUESTS.labels(r.pool, r.address),
                                           m.INFLIGHT_TOKENS.labels(r.pool, r.address))
        return g

    def apply_policy(self, policy: Policy) -> list[str]:
        """Hot reload: validate everything first (raises ValueError / PolicyError and changes nothing), then swap.

        Replicas that stay keep their live state and accounting; requests in flight release to the objects
        that placed them. Returns a list of human-readable changes."""
        admission = policy.admission
        if len(admission.lanes) != len(self.admission.lanes):
            raise ValueError("admission.lanes: changing the number of lanes needs a restart")
        budget_policy = policy.budgets
        routing = policy.routing
        identity = Identity(policy.tenants)
        identity.open_streams = self.identity.open_streams
        changes: list[str] = []
        new_pools: dict[str, Pool] = {}
        for cfg in policy.pools:
            old = self.pools.get(cfg.model)
            if old is None:
                new_pools[cfg.model] = Pool.from_config(cfg)
                changes.append(f"pool {cfg.model} added")
                continue
            keep = {r.address: r for r in old.replicas}
            replicas = [keep.get(a) or Replica(address=a, pool=cfg.model) for a in cfg.replicas]
            added = [a for a in cfg.replicas if a not in keep]
            removed = [a for a in keep if a not in cfg.replicas]
            if added or removed:
                changes.append(f"pool {cfg.model}: +{added} -{removed}")
            old.replicas = replicas
            new_pools[cfg.model] = old
        changes += [f"pool {name} removed" for name in self.pools if name not in new_pools]
        self.policy = policy
        self.admission = admission
        self.identity = identity
        self.open_cap = policy.sidecar.open_request_cap(policy.gateway.max_downstream_connections)
        self.pools = new_pools
        self.routing = routing
        self.health = {name: self.health[name] if name in self.health and self.health[name].pool is pool
                       else HealthTracker(pool, routing.health) for name, pool in new_pools.items()}
        for tracker in self.health.values():
            tracker.policy = routing.health
        old_schedulers = self.schedulers
        self._pool_by_cluster = {pool.cluster: pool for pool in new_pools.values()}
        self.placers = {name: self._placer(pool) for name, pool in new_pools.items()}
        if self.scraper is not None:
            self.scraper.pools[:] = [p for p in new_pools.values() if p.metrics_style != "none"]
        self.schedulers = {name: Scheduler(pool, admission, self.placers[name]) for name, pool in new_pools.items()}
        for name, old_sched in old_schedulers.items():
            new_sched = self.schedulers.get(name)
            if new_sched is not None and admission.calibrate_prompt_tokens:
                new_sched.calibration = old_sched.calibration  # what the engines counted still holds
                new_sched.calibration.enabled = True
                new_sched.m.estimate_factor(new_sched.calibration.factor)
            self._migrate_queue(old_sched, new_sched)
        if budget_policy != self.budgets.policy:
            self.budgets = Budgets(budget_policy, capacity_tokens_per_s=self.capacity_tokens_per_s,
                                   sidecar_count_hint=policy.sidecar.workers, label_tenant=self._tenant_label)
            changes.append("budgets policy replaced")
        return changes or ["no change"]

    def _migrate_queue(self, old: Scheduler, new: Scheduler | None) -> None:
        """Requests waiting under the old policy keep their place: re-queued (same deadline) or shed if the
        pool is gone."""
        for lane, queue in enumerate(old.queues):
            while queue.size:
                w = queue.peek()
                assert w is not None
                queue.pop(w)
                old.m.queued(lane, w.priority, -1)
                if w.future.done():
                    continue
                if new is None:
                    w.future.set_exception(Shed(503, "pool_removed", "the pool was removed by a policy reload"))
                    continue
                new.queues[lane].push(w)
                new.m.queued(lane, w.priority, +1)
        if new is not None and new.queued_total():
            new._arm_timer()
            new.kick()

    def _tenant_gauge(self, tenant: str) -> object:
        label = self.identity.label(tenant)
        g = self._tenant_gauges.get(label)
        if g is None:
            g = self._tenant_gauges[label] = m.TENANT_OPEN_STREAMS.labels(label)
        return g

    def attach_access_log(self, receiver: AccessLogReceiver) -> None:
        """Outcomes are counted from Envoy's access log (see accesslog.py); routing listens there too."""
        self.access_log = receiver
        receiver.listeners.append(self.on_access_log)
        receiver.progress_listeners.append(self.on_progress)
        receiver.end_listeners.append(self.on_request_end)

    # ---- detached requests: the ext_proc stream ends with the pin answer -------------------------------------
    def _detach(self, st: Stream, request_id: str) -> None:
        """Let the ext_proc stream end once the request is pinned; its slots are released when Envoy's access log
        reports the request's end. An ext_proc stream held open for the whole response costs about 64 KB per
        open stream (Envoy's side stream plus the grpc.aio call; measured in P12), and nothing more is needed
        from it unless the sidecar cuts slow consumers or observes the body. Needs the access log (the only
        other way to learn the end) and a request id no other open request uses."""
        if self.access_log is None or not request_id or request_id in self.detached:
            return
        st.detached_at = time.monotonic()
        self.detached[request_id] = st

    def on_request_end(self, request_id: str, status: int) -> None:
        """Envoy's final access-log entry of a request: release a detached one (exactly once: popped)."""
        st = self.detached.pop(request_id, None)
        if st is not None:
            st.status = status
            self.finish(st)
            m.OPEN_STREAMS.dec()

    def sweep_detached(self, max_age_s: float) -> int:
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

    def on_progress(self, request_id: str, bytes_sent: int) -> None:
        """Envoy's periodic report of an open request: cut it if its client drains too slowly (P13)."""
        st = self.live.get(request_id)
        if st is None or st.watch is None or st.cut:
            return
        if st.watch.update(bytes_sent, time.monotonic(), self.streaming.slow_consumer):
            st.cut = True
            if st.pool is not None:
                m.SLOW_STREAMS_CUT.labels(st.pool.model).inc()
            if st.task is not None:
                st.task.cancel()  # the servicer answers with an immediate response: client and replica reset

    def _placer(self, pool: Pool) -> Placer:
        placer = Placer(pool, self.admission, self._is_fresh)
        if self.routing.health.enabled:
            placer.allow_probe = self.health[pool.model].allow_probe
        return placer

    def set_freshness(self, is_fresh: Callable[[Replica, float], bool]) -> None:
        """With a scraper running, replicas whose metrics are stale count as saturated."""
        self._is_fresh = is_fresh
        for placer in self.placers.values():
            placer.is_fresh = is_fresh

    def on_scrape_round(self) -> None:
        """After every scrape: health re-evaluates each replica (weights, states), then queued requests that
        now fit are dispatched."""
        if self.routing.health.enabled:
            now = time.monotonic()
            for tracker in self.health.values():
                tracker.on_scrape_round(now)
        now = time.monotonic()
        for sched in self.schedulers.values():
            sched.on_scrape(now)
        self.kick_all()

    def on_access_log(self, outcome: str, entry: "HTTPAccessLogEntry") -> None:  # noqa: F821
        """Envoy's access log says how each forwarded request ended on which replica: errors feed health."""
        pool = self._pool_by_cluster.get(entry.common_properties.upstream_cluster)
        if pool is None or not self.routing.health.enabled:
            return
        sock = entry.common_properties.upstream_remote_address.socket_address
        if sock.address:
            self.health[pool.model].on_outcome(f"{sock.address}:{sock.port_value}", outcome)

    def capacity_tokens_per_s(self, model: str) -> float:
        """A pool's token throughput, for P10's capacity-at-cost report: per routable replica the prompt-token rate
        (over the scrape window) its engine showed the last time it was busy, else the
        policy's prefill rate. The last busy rate, not the peak: prefill per token slows as prompts grow, and the
        report is about the prompts now being sent."""
        pool = self.pools.get(model)
        if pool is None:
            return 0.0
        total = 0.0
        for r in pool.replicas:
            if not r.routable:
                continue
            e = r.engine
            busy = e.running + e.waiting > 0
            seen = e.prompt_tps  # prefill dominates a long prompt's cost (and completions are mostly unobserved)
            if busy and seen > 0:
                r.peak_tps = seen
            total += r.peak_tps or self.admission.prefill_tokens_per_s
        # The detector counts estimated tokens; the engine counts real ones: convert with the observed ratio.
        return total / self.estimate_ratio.get(model, 1.0)

    def kick_all(self) -> None:
        """Capacity may have changed (scrape, health): dispatch what now fits."""
        for sched in self.schedulers.values():
            if sched.queued_total():
                sched.kick()

    # ---- request head ------------------------------------------------------------------------------------
    def on_request_headers(self, st: Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        """Note the head and wait for the body (Envoy pipelines it right behind)."""
        st.start = time.monotonic()
        st.head = head = self.read_head(msg.headers.headers)
        if msg.end_of_stream:  # no body: nothing to govern, and nothing a replica could serve
            return self._reject(st, R.immediate(400, "request body is required", "missing_body"))
        if self.sampler.active and self.sampler.observe(head.tenant):
            # Envoy honours mode_override only in the answer to the headers.
            st.observer = ResponseObserver(st.start, self.streaming.max_buffer_bytes)
            return R.CONTINUE_REQUEST_HEADERS_OBSERVED
        return R.CONTINUE_REQUEST_HEADERS

    @staticmethod
    def read_head(headers: Iterable[base_pb2.HeaderValue]) -> Head:
        """The few headers the sidecar reads, from their raw bytes (latin-1 never fails: a client's stray
        non-UTF-8 byte must not break the ext_proc message or the request's governance)."""
        head = Head()
        for h in headers:
            key = h.key
            if key == ":path":
                head.path = h.raw_value.decode("latin-1").split("?", 1)[0]
            elif key == "x-request-id":
                head.request_id = h.raw_value.decode("latin-1")
            else:
                reader = _HEADER_READERS.get(key)
                if reader is not None:
                    reader(head, h.raw_value.decode("latin-1"))
        return head

    # ---- request body: the decision --------------------------------------------------------------------
    async def on_request_body(self, st: Stream, msg: pb.HttpBody) -> pb.ProcessingResponse | Waiter:
        """Answer now (reject or forward pinned), or return the Waiter of a request held in the queue: the
        servicer then tells Envoy to wait and awaits `wait`."""
        t0 = time.perf_counter()
        head = st.head or Head()
        if self.draining:
            return self._reject(st, R.immediate(503, "the gateway is shutting down; retry shortly", "draining",
                                                retry_after_s=1.0, should_retry=True))
        body = msg.body
        if len(body) > self.max_body:
            return self._reject(st, self._too_large())
        if head.path not in ENDPOINTS:
            return self._reject(st, R.immediate(404, f"unknown endpoint {head.path}", "unknown_endpoint"))
        try:
            req = parse_body(ENDPOINTS[head.path], body, self.estimator, self.default_output)
        except BadRequest as exc:
            return self._reject(st, R.immediate(exc.status, exc.message, exc.code, err_type=exc.err_type,
                                                param=exc.param))
        pool = self.pools.get(req.model)
        if pool is None:
            return self._reject(st, R.immediate(404, f"The model `{req.model}` does not exist.", "model_not_found",
                                                param="model"))
        try:
            head.tenant = self.identity.tenant_for(head.api_key, head.tenant)
        except UnknownKey:
            return self._reject(st, R.immediate(401, "a valid API key is required (Authorization: Bearer ...)",
                                                "invalid_api_key", err_type="authentication_error"))
        sched = self.schedulers[pool.model]
        sched.calibrate(req)
        self._fill_identity(req, head, st.start)
        if not req.output_limited:
            learned = self.output_lengths.expected(req.model, req.app)
            if learned:
                req.max_output_tokens = learned
        st.req = req
        st.pool = pool
        if self.open_requests >= self.open_cap:
            return self._reject(st, R.immediate(
                429, f"the gateway holds {self.open_requests} open requests, its limit; retry shortly",
                "gateway_at_capacity", retry_after_s=1.0, should_retry=True,
                extra_headers={"connection": "close"}))
        self.open_requests += 1
        st.counted_open = True
        if not self.identity.try_open(req.tenant):
            return self._reject(st, R.immediate(
                429, f"tenant {req.tenant!r} has {self.identity.stream_limit(req.tenant)} requests open, its limit",
                "tenant_stream_limit", retry_after_s=1.0, should_retry=True))
        st.tenant_open = req.tenant
        self._tenant_gauge(req.tenant).inc()
        try:
            budgets = self.budgets
            st.charge = budgets.admit_sync(req) if budgets.is_sync else await budgets.admit(req)
            st.budgets = budgets
        except BudgetExceeded as exc:
            return self._reject(st, R.immediate(exc.status, exc.message, exc.code, err_type=exc.err_type,
                                                retry_after_s=exc.retry_after_s, should_retry=exc.should_retry))
        if not self.admission.enabled:
            return self._forward_unmetered(st, pool, t0)
        try:
            result = sched.submit(req, st.start)
        except Shed as shed:
            return self._shed(st, shed)
        if isinstance(result, Placement):
            resp = self._forward(st, result)
            m.DECISION_SECONDS.observe(time.perf_counter() - t0)
            return resp
        st.waiter = result
        st.state = QUEUED
        return result

    async def wait(self, st: Stream) -> pb.ProcessingResponse:
        """Hold a queued request until it is dispatched or its deadline passes. If the client leaves meanwhile,
        the stream is cancelled here and `finish` drops it from the queue."""
        w = st.waiter
        assert w is not None and st.pool is not None
        sched = self.schedulers[st.pool.model]
        timeout = w.deadline - time.monotonic()
        if timeout > 0 and not w.future.done():
            await asyncio.wait((w.future,), timeout=timeout)
        if not w.future.done():
            return self._shed(st, sched.expired(w, time.monotonic()))
        exc = w.future.exception()
        if exc is not None:
            return self._shed(st, exc)  # type: ignore[arg-type]
        return self._forward(st, w.future.result())

    def _fill_identity(self, req: LLMRequest, head: Head, arrival: float) -> None:
        req.tenant = head.tenant
        req.app = head.app
        req.task_id = head.task_id
        req.task_depth = head.task_depth
        req.priority = head.priority
        req.retry_count = head.retry_count
        req.idempotency_key = head.idempotency_key
        req.request_id = head.request_id
        req.client_timeout_s = head.client_timeout_s
        req.arrival = arrival

    def _forward(self, st: Stream, placement: Placement) -> pb.ProcessingResponse:
        """The request holds its placement until the stream ends; answer Envoy with the pinned route."""
        req = st.req
        assert req is not None and st.pool is not None
        st.placement, st.state = placement, FORWARDED
        primary = placement.replica
        self._gauges(primary)[0].inc()
        self._gauges(primary)[1].inc(req.total_tokens)
        st.gauged = True
        timeout_ms = None
        if req.client_timeout_s is not None:
            # Work the client has given up on must be cancelled at the replica (P4).
            remaining = min(req.client_timeout_s, MAX_DEADLINE_S) - (time.monotonic() - req.arrival)
            timeout_ms = max(1, int(remaining * 1000))
        pin_str = ",".join(r.address for r in placement.pins)
        if st.observer is not None:
            st.observer.start = time.monotonic()  # TTFT counts from the decision, not from queue entry
        if self.streaming.slow_consumer.enabled and req.request_id:
            st.watch = DrainWatch()
            st.task = asyncio.current_task()
            self.live[req.request_id] = st
        elif st.observer is None:
            self._detach(st, req.request_id)
        return R.forward(st.pool.cluster, pin_str, upstream_timeout_ms=timeout_ms, remove_headers=STRIPPED_HEADERS)

    def _forward_unmetered(self, st: Stream, pool: Pool, t0: float) -> pb.ProcessingResponse:
        """Admission disabled: least in-flight tokens, no queue, no limits."""
        assert st.req is not None
        pins = pool.pick(st.req.total_tokens)
        if not pins:
            return self._reject(st, R.immediate(503, f"no replica of {pool.model} is available",
                                                "pool_unavailable", retry_after_s=1.0, should_retry=True))
        pins[0].place(st.req.total_tokens, st.req.prompt_tokens)
        resp = self._forward(st, Placement(pins[0], pins, -1, pins[0].scrape_epoch))
        m.DECISION_SECONDS.observe(time.perf_counter() - t0)
        return resp

    def _shed(self, st: Stream, shed: Shed) -> pb.ProcessingResponse:
        return self._reject(st, R.immediate(shed.status, shed.message, shed.code, retry_after_s=shed.retry_after_s,
                                            should_retry=shed.should_retry))

    def _too_large(self) -> pb.ProcessingResponse:
        return R.immediate(413, f"request body exceeds the gateway limit of {self.max_body} bytes",
                           "request_too_large")

    def _reject(self, st: Stream, resp: pb.ProcessingResponse) -> pb.ProcessingResponse:
        st.state = REJECTED
        ir = resp.immediate_response
        m.REJECTIONS.labels(str(ir.status.code), ir.details.removeprefix("sluice_")).inc()
        return resp

    # ---- response path ---------------------------------------------------------------------------------
    def on_response_headers(self, st: Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        content_type = ""
        for h in msg.headers.headers:
            if h.key == ":status":
                st.status = _int(h.raw_value.decode("latin-1"))
            elif h.key == "content-type":
                content_type = h.raw_value.decode("latin-1")
        if st.observer is not None:
            st.observer.on_headers(st.status, content_type)
        if st.state == FORWARDED:
            st.state = DONE if msg.end_of_stream else RESPONDING
        return R.CONTINUE_RESPONSE_HEADERS

    def on_response_trailers(self, st: Stream) -> pb.ProcessingResponse:
        if st.state in (FORWARDED, RESPONDING):
            st.state = DONE
        return R.CONTINUE_RESPONSE_TRAILERS

    def on_response_body(self, st: Stream, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if st.observer is not None:
            st.observer.on_chunk(msg.body, time.monotonic(), msg.end_of_stream)
        if msg.end_of_stream and st.state in (FORWARDED, RESPONDING):
            st.state = DONE
        return R.CONTINUE_RESPONSE_BODY

    def _record_observation(self, model: str, req: LLMRequest,
                            obs: ResponseObserver) -> tuple[int | None, int | None]:
        m.OBSERVED_REQUESTS.labels(model).inc()
        ttft = obs.ttft_s
        if ttft is not None:
            m.OBSERVED_TTFT.labels(model).observe(ttft)
        completion = obs.completion_tokens
        if completion is not None and obs.done and not req.output_limited:
            self.output_lengths.observe(model, req.app, completion // max(1, req.n))
        prompt = obs.prompt_tokens
        if prompt is not None and req.prompt_tokens > 0:
            ratio = prompt / req.prompt_tokens
            m.PROMPT_ESTIMATE_RATIO.labels(model).observe(ratio)
            old = self.estimate_ratio.get(model)
            self.estimate_ratio[model] = ratio if old is None else 0.8 * old + 0.2 * ratio
        return prompt, completion

    # ---- end of stream: always called, exactly once ---------------------------------------------------
    def finish(self, st: Stream) -> str:
        """Release everything the stream holds. Returns what the stream itself saw: `done` when the response's
        end was seen (trailers, or the last body chunk when observed), else its last state: with the cheap
        response mode a finished and an abandoned request look alike here, so the authoritative outcome is
        counted from Envoy's access log."""
        w = st.waiter
        if w is not None and st.placement is None and st.pool is not None and st.pool.model in self.schedulers:
            fut = w.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                st.placement = fut.result()  # dispatched just as the client left: release below
            else:
                self.schedulers[st.pool.model].abandon(w)
                if not fut.done():
                    fut.cancel()
        placement, req = st.placement, st.req
        if st.watch is not None and req is not None:
            self.live.pop(req.request_id, None)
            st.watch = None
        if placement is not None and req is not None:
            replica = placement.replica
            if placement.owner is not None:
                placement.owner.release(placement, req)
            else:
                replica.release(req.total_tokens, req.prompt_tokens, placement.epoch)
            if st.gauged:
                gauges = self._gauges(replica)
                gauges[0].dec()
                gauges[1].dec(req.total_tokens)
                st.gauged = False
            if st.status >= 500:
                replica.errors_total += 1
            st.placement = None
            forwarded = True
        else:
            forwarded = False
        if st.counted_open:
            self.open_requests -= 1
            st.counted_open = False
        if st.tenant_open is not None:
            self.identity.close(st.tenant_open)
            self._tenant_gauge(st.tenant_open).dec()  # type: ignore[attr-defined]
            st.tenant_open = None
        prompt_actual = completion_actual = None
        obs = st.observer
        if obs is not None and req is not None and st.pool is not None:
            prompt_actual, completion_actual = self._record_observation(st.pool.model, req, obs)
            if obs.done and st.state in (FORWARDED, RESPONDING):
                st.state = DONE
        if st.charge is not None:
            # Never forwarded (shed after the budget check): refund its tokens. Forwarded: actual usage where
            # the body was observed, else the estimate stands.
            if not forwarded:
                prompt_actual = completion_actual = 0
            (st.budgets or self.budgets).settle_sync(
                st.charge, completed=forwarded and st.status < 500,
                prompt_tokens=prompt_actual, completion_tokens=completion_actual)
            st.charge = None
        return st.state
