"""The per-request decisions: what the sidecar does at each ext_proc message of one HTTP request.

    request_headers ─► (headers over the limit, bad key, no body? reject now; not for a replica? pass)
        ─► request_body ─► decide: reject | queue | forward pinned
    response_headers ─► note status, first byte
    response_trailers / end_of_stream ─► done
    the request's end (its ext_proc stream closes, or the access log reports it) ─► `finish` releases every hold

Each message moves the request's `Stream` through its states (extproc/stream.py: the states, the transitions
allowed, and the holds a stream takes). The pools' parts (health, placement, queues) are the Fleet's
(fleet.py); requests followed after the answer are InFlight's (inflight.py). The gRPC plumbing lives in
`server.py`; this module has no I/O, so it is unit-testable with plain protobuf messages.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import metrics as m
from extproc import responses as R
from extproc.admission.scheduler import Placement, Shed
from extproc.budgets import BudgetExceeded, Budgets, OriginalInFlight
from extproc.config import Policy
from extproc.fleet import Fleet
from extproc.head import STRIPPED_HEADERS, HeaderRoom, binding_deadline_s, read_head, to_int
from extproc.identity import Identity, UnknownKey
from extproc.inflight import InFlight
from extproc.live_gauges import LiveGauges
from extproc.request import ENDPOINTS, BadRequest, LLMRequest, parse_body
from extproc.routing.pool import Pool, Replica
from extproc.stream import Hold, State, Stream
from extproc.observed import ObservedStats
from extproc.streaming import DrainWatch, ResponseObserver, Sampler
from extproc.tokens import make_estimator
from extproc.xds import headers_limit_message

if TYPE_CHECKING:
    from extproc.accesslog import AccessLogReceiver

# The states, as module constants: an Enum member looked up on its class costs about 0.1 us, per use.
NEW, HEADERS, QUEUED, FORWARDED, DETACHED = State.NEW, State.HEADERS, State.QUEUED, State.FORWARDED, State.DETACHED
RESPONDING, CUT, DONE, REJECTED, PASSED = State.RESPONDING, State.CUT, State.DONE, State.REJECTED, State.PASSED
_ANSWERED = (FORWARDED, RESPONDING)  # forwarded, the response's end not seen yet


class Gateway:
    """Decides for each stream. One instance per sidecar process."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.fleet = Fleet(policy)
        lim = policy.limits
        self.estimator = make_estimator(lim.tokenizer, lim.tokenizer_path or None, lim.bytes_per_token)
        self.max_body = lim.max_body_bytes
        self.default_output = lim.default_output_tokens
        self.streaming = policy.streaming
        self.sampler = Sampler(self.streaming)
        self.observed = ObservedStats()
        self.inflight = InFlight(self.finish, self.streaming.slow_consumer)
        self.identity = Identity(policy.tenants)
        self.header_room = self.make_header_room(policy)
        self.budgets = self.make_budgets(policy)
        self.open_requests = 0
        self.open_streams = 0  # sluice_open_streams, read when Prometheus scrapes
        m.OPEN_STREAMS.set_function(lambda: self.open_streams)
        self.open_cap = policy.sidecar.open_request_cap(policy.gateway.max_downstream_connections)
        self.draining = False
        # Envoy streams its whole access log to one sidecar worker, so only a lone worker learns the end of every
        # request it forwarded: with several workers a forwarded request keeps its ext_proc stream until it ends.
        self.detaches = policy.sidecar.workers == 1
        self.gauges = LiveGauges(self._tenant_label)
        self.fleet.on_removed.append(self.gauges.forget_replica)

    # The Fleet's, by pool, for the decisions below (a reload rebuilds them in place).
    pools = property(lambda self: self.fleet.pools)
    schedulers = property(lambda self: self.fleet.schedulers)
    admission = property(lambda self: self.fleet.admission)

    def make_budgets(self, policy: Policy) -> Budgets:
        return Budgets(policy.budgets, capacity_rps=self.capacity_rps,
                       sidecar_count_hint=policy.sidecar.workers, label_tenant=self._tenant_label)

    @staticmethod
    def make_header_room(policy: Policy) -> HeaderRoom:
        gw = policy.gateway
        return HeaderRoom.for_limits(gw.max_request_headers, gw.max_request_headers_kb,
                                     [p.cluster for p in policy.pools])

    def adopt(self, policy: Policy, identity: Identity, budgets: Budgets) -> None:
        """A reload's new policy (extproc/reload.py has rebuilt the fleet): the objects that depend on it."""
        self.policy = policy
        self.identity = identity
        self.header_room = self.make_header_room(policy)
        self.budgets = budgets
        self.open_cap = policy.sidecar.open_request_cap(policy.gateway.max_downstream_connections)

    def attach_access_log(self, receiver: AccessLogReceiver) -> None:
        """Outcomes are counted from Envoy's access log (accesslog.py); health and InFlight listen there too."""
        receiver.listeners.append(self.fleet.on_outcome)
        self.inflight.attach(receiver)

    def capacity_rps(self, model: str, prompt: float) -> float:
        """P10's capacity at an app's prompt size, from the current fleet (routing/capacity.py)."""
        return self.fleet.capacity_rps(model, prompt)

    def _tenant_label(self, tenant: str) -> str:
        """The bounded tenant label of the current identity policy (it is replaced on reload)."""
        return self.identity.label(tenant)

    # ---- request head ------------------------------------------------------------------------------------
    def open_stream(self) -> Stream:
        """A new ext_proc stream, counted in sluice_open_streams until `finish`."""
        self.open_streams += 1
        return Stream(holds=Hold.OPEN_STREAM)

    def on_request_headers(self, st: Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        """Note the head and let Envoy send the buffered body. Refused here, before anything
        else is looked at: headers that would leave no room for the sidecar's own (431), then, with API keys
        required, a missing or unknown key (401). A request without a body for Envoy's own routes (/v1/models:
        those reach the sidecar only when keys are required) passes once its key is known."""
        st.start = time.monotonic()
        if not self.header_room.fits(msg.headers):
            return self._reject(st, R.immediate(431, headers_limit_message(self.policy),
                                                "request_headers_too_large"))
        st.head = head = read_head(msg.headers.headers)
        try:
            head.tenant = self.identity.tenant_for(head.api_key, head.tenant)
        except UnknownKey:
            return self._reject(st, R.immediate(401, "a valid API key is required (Authorization: Bearer ...)",
                                                "invalid_api_key", err_type="authentication_error"))
        if msg.end_of_stream:  # no body: nothing to govern
            if head.path not in ENDPOINTS:  # GET /v1/models ...: Envoy's own route answers
                st.move(PASSED)
                return R.CONTINUE_REQUEST_HEADERS
            return self._reject(st, R.immediate(400, "request body is required", "missing_body"))
        st.move(HEADERS)
        if self.sampler.active and self.sampler.observe(head.tenant):
            # Envoy honours mode_override only in the answer to the headers.
            st.observer = ResponseObserver(st.start, self.streaming.max_buffer_bytes)
            return R.CONTINUE_REQUEST_HEADERS_OBSERVED
        return R.CONTINUE_REQUEST_HEADERS

    # ---- request body: the decision --------------------------------------------------------------------
    async def on_request_body(self, st: Stream, msg: pb.HttpBody) -> pb.ProcessingResponse:
        """Answer now (reject or forward pinned), or queue the request and tell Envoy to wait (`st.held`): the
        servicer then awaits `wait` for the decision."""
        t0 = time.perf_counter()
        head = st.head
        assert head is not None  # the headers came first (State.HEADERS)
        if self.draining:
            return self._reject(st, R.immediate(503, "the gateway is shutting down; retry shortly", "draining",
                                                retry_after_s=1.0, should_retry=True))
        body = msg.body
        if len(body) > self.max_body:
            return self._reject(st, R.immediate(413, f"request body exceeds the gateway limit of {self.max_body} "
                                                "bytes", "request_too_large"))
        if head.path not in ENDPOINTS:
            return self._reject(st, R.immediate(404, f"unknown endpoint {head.path}", "unknown_endpoint"))
        try:
            req = parse_body(ENDPOINTS[head.path], body, self.estimator, self.default_output)
        except BadRequest as exc:
            return self._reject(st, R.immediate(exc.status, exc.message, exc.code, err_type=exc.err_type,
                                                param=exc.param))
        fleet = self.fleet
        pool = self.pool_for(req)
        if pool is None:
            return self._reject(st, R.immediate(404, f"The model `{req.model}` does not exist.", "model_not_found",
                                                param="model"))
        sched = fleet.schedulers[pool.model]
        sched.calibrate(req)
        head.identify(req, st.start)
        if not req.output_limited:
            learned = self.observed.output_lengths.expected(req.model, req.app)
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
        st.take(Hold.OPEN_REQUEST)
        if not self.identity.try_open(req.tenant):
            return self._reject(st, R.immediate(
                429, f"tenant {req.tenant!r} has {self.identity.stream_limit(req.tenant)} requests open, its limit",
                "tenant_stream_limit", retry_after_s=1.0, should_retry=True))
        st.take(Hold.TENANT_STREAM)
        self.gauges.tenant_open_streams(req.tenant).inc()
        try:
            budgets = self.budgets
            try:
                st.charge = budgets.admit_sync(req) if budgets.is_sync else await budgets.admit(req)
            except OriginalInFlight as pending:  # its end may still be on its way: wait briefly
                st.charge = await budgets.admit_when_ended(req, pending)
            st.budgets = budgets
            st.take(Hold.BUDGET)
        except BudgetExceeded as exc:
            return self._reject(st, R.immediate(exc.status, exc.message, exc.code, err_type=exc.err_type,
                                                retry_after_s=exc.retry_after_s, should_retry=exc.should_retry))
        if not fleet.admission.enabled:
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
        st.take(Hold.WAITER)
        st.move(QUEUED)
        # Ask Envoy to wait (once) past the queue's late limit; the decision follows from `wait`.
        return R.hold(max(0.05, max(result.deadline, result.late_until) - time.monotonic()) + 1.0)

    async def wait(self, st: Stream) -> pb.ProcessingResponse:
        """Hold a queued request until it is dispatched or its deadline (then its late limit: `serve_late`) passes.
        If the client leaves meanwhile, the stream is cancelled here and `finish` drops it from the queue."""
        w = st.waiter
        assert w is not None and st.pool is not None
        sched = self.schedulers[st.pool.model]
        # serve_late moves the deadline to the late limit, once
        while not w.future.done() and (time.monotonic() < w.deadline or sched.serve_late(w, time.monotonic())):
            await asyncio.wait((w.future,), timeout=max(0.0, w.deadline - time.monotonic()))
        if not w.future.done():
            shed = sched.expired(w, time.monotonic())
            st.drop(Hold.WAITER)
            return self._shed(st, shed)
        st.drop(Hold.WAITER)
        exc = w.future.exception()
        if exc is not None:
            return self._shed(st, exc)  # type: ignore[arg-type]
        return self._forward(st, w.future.result())

    def pool_for(self, req: LLMRequest) -> Pool | None:
        """The pool serving the request's model (None: 404)."""
        return self.fleet.pools.get(req.model)

    def _forward(self, st: Stream, placement: Placement) -> pb.ProcessingResponse:
        """The request holds its placement until the stream ends; answer Envoy with the pinned route."""
        req = st.req
        assert req is not None and st.pool is not None
        st.placement = placement
        st.take(Hold.PLACEMENT)
        st.move(FORWARDED)
        self.gauges.count_replica(placement.replica)
        timeout_ms = None
        deadline = binding_deadline_s(req.client_timeout_s, self.policy.gateway.request_timeout_s)
        if deadline is not None:
            # Work the client has given up on must be cancelled at the replica (P4).
            timeout_ms = max(1, int((deadline - (time.monotonic() - req.arrival)) * 1000))
        if st.observer is not None:
            st.observer.start = time.monotonic()  # TTFT counts from the decision, not from queue entry
        if self.streaming.slow_consumer.enabled and req.request_id:
            st.watch = DrainWatch()
            st.task = asyncio.current_task()
            self.inflight.watch(st, req.request_id)
        elif st.observer is None and self.detaches:
            self.inflight.detach(st, req.request_id)
        return self.pin_answer(st, placement.pins, timeout_ms)

    def pin_answer(self, st: Stream, pins: list[Replica], timeout_ms: int | None) -> pb.ProcessingResponse:
        """Envoy's answer for a placed request: the pool header and the pin list in envoy.lb metadata."""
        assert st.pool is not None
        return R.forward(st.pool.cluster, ",".join(r.address for r in pins), upstream_timeout_ms=timeout_ms,
                         remove_headers=STRIPPED_HEADERS)

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

    def _reject(self, st: Stream, resp: pb.ProcessingResponse) -> pb.ProcessingResponse:
        st.move(REJECTED)
        ir = resp.immediate_response
        after = R.retry_asked(resp) if st.req is not None else None  # it tells the client to retry (None: no)
        if st.req is not None and after is not None and self.budgets.credits_refusals:
            self.budgets.refused(st.req, after)  # no replica saw it: its retry is not charged (budgets/credits.py)
        elif st.req is not None and ir.status.code == 429 and not self.budgets.promise_retry(st.req, after):
            R.forbid_retry(resp)  # its retry would be refused as a retry storm (a 5xx: business layers retry anyway)
        m.REJECTIONS.labels(str(ir.status.code), ir.details.removeprefix("sluice_")).inc()
        return resp

    # ---- response path ---------------------------------------------------------------------------------
    def on_response_headers(self, st: Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        content_type = ""
        for h in msg.headers.headers:
            if h.key == ":status":
                st.status = to_int(h.raw_value.decode("latin-1"))
            elif h.key == "content-type":
                content_type = h.raw_value.decode("latin-1")
        if st.observer is not None:
            st.observer.on_headers(st.status, content_type)
        if st.state is FORWARDED:
            st.answered(msg.end_of_stream)
        return R.CONTINUE_RESPONSE_HEADERS

    def on_response_trailers(self, st: Stream) -> pb.ProcessingResponse:
        if st.state in _ANSWERED:
            st.move(DONE)
        return R.CONTINUE_RESPONSE_TRAILERS

    def on_response_body(self, st: Stream, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if st.observer is not None:
            st.observer.on_chunk(msg.body, time.monotonic(), msg.end_of_stream)
        if msg.end_of_stream and st.state in _ANSWERED:
            st.move(DONE)
        return R.CONTINUE_RESPONSE_BODY

    # ---- the end: cancelled, closed, finished ------------------------------------------------------------
    def on_cancelled(self, st: Stream) -> pb.ProcessingResponse | None:
        """The servicer's task was cancelled. A stream the sidecar cut (slow consumer) answers with an unsolicited
        immediate response, which makes Envoy reset both the client's stream and the replica's (the generation
        stops); any other cancellation is Envoy resetting the stream (client gone, or the request simply ended:
        Envoy half-closes then resets) and gets no answer: `finish` tells which from what was seen."""
        if st.state is CUT:
            return R.immediate(408, "the client read the stream too slowly; it was cut", "slow_consumer")
        return None

    def close(self, st: Stream) -> None:
        """The ext_proc stream ended. A detached request lives on until the access log reports its end."""
        if st.state is not DETACHED:
            self.finish(st)

    def finish(self, st: Stream) -> State:
        """Release everything the stream holds, in the reverse order of `Hold`, exactly once (a second call finds
        nothing held). Returns what the stream itself saw: DONE when the response's end was seen (trailers, or the
        last body chunk when observed), else its last state: with the cheap response mode a finished and an
        abandoned request look alike here, so the authoritative outcome is counted from Envoy's access log."""
        if not st.holds:
            return st.state
        req = st.req  # set before any hold but OPEN_STREAM is taken
        if st.holds & Hold.WAITER and not st.holds & Hold.PLACEMENT:
            fut = st.waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                st.placement = fut.result()  # dispatched just as the client left: released below
                st.take(Hold.PLACEMENT)
        prompt_actual = completion_actual = None
        obs = st.observer
        if obs is not None and req is not None and st.pool is not None:
            prompt_actual, completion_actual = self.observed.record(st.pool.model, req, obs)
            if obs.done and st.state in _ANSWERED:
                st.move(DONE)
        holds, st.holds = st.holds, 0  # each released once, below, in the reverse order of Hold
        forwarded = bool(holds & Hold.PLACEMENT)
        if holds & (Hold.DETACHED | Hold.LIVE):
            self.inflight.forget(st, req.request_id, holds)
        placement = st.placement
        if holds & Hold.PLACEMENT:
            replica = placement.replica
            if placement.owner is not None:
                placement.owner.release(placement, req)
            else:
                replica.release(req.total_tokens, req.prompt_tokens, placement.epoch)
            if st.status >= 500:
                replica.errors_total += 1
            if replica.retired and not replica.inflight_requests:
                self.fleet.sweep_retired()  # its last request: it leaves the pool
            st.placement = None
        if holds & Hold.WAITER:
            w = st.waiter
            sched = self.schedulers.get(st.pool.model)
            if sched is not None:
                sched.abandon(w)
            if not w.future.done():
                w.future.cancel()
        if holds & Hold.BUDGET:
            # Never forwarded (shed after the budget check): refund its tokens. Forwarded: actual usage where
            # the body was observed, else the estimate stands.
            if not forwarded:
                prompt_actual = completion_actual = 0
            st.budgets.settle_sync(st.charge, completed=forwarded and st.status < 500,
                                   prompt_tokens=prompt_actual, completion_tokens=completion_actual)
            st.charge = None
        if holds & Hold.TENANT_STREAM:
            self.identity.close(req.tenant)
            self.gauges.tenant_open_streams(req.tenant).dec()
        if holds & Hold.OPEN_REQUEST:
            self.open_requests -= 1
        if holds & Hold.OPEN_STREAM:
            self.open_streams -= 1
        return st.state
