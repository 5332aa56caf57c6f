"""The per-request state machine: what the sidecar does at each ext_proc message of one HTTP request.

    request_headers ─► (no body? decide now) ─► request_body ─► decide: reject | forward pinned
    response_headers ─► note status, first byte
    response_trailers / end_of_stream ─► completed
    stream closes (always) ─► release every slot in `finish`

The gRPC plumbing lives in `server.py`; this module has no I/O, so it is unit-testable with plain
protobuf messages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import metrics as m
from extproc import responses as R
from extproc.config import Policy
from extproc.request import ENDPOINTS, BadRequest, LLMRequest, parse_body
from extproc.routing.pool import Pool, Replica
from extproc.tokens import make_estimator
from extproc.xds import DESTINATION_KEY, POOL_HEADER

log = logging.getLogger("sluice.gateway")

# Client-sent headers that would let a client decide what only the gateway may decide.
_GATEWAY_ONLY = (POOL_HEADER, DESTINATION_KEY)

# Lifecycle states of one stream (explicit, so `finish` knows what to release).
NEW, FORWARDED, RESPONDING, DONE, REJECTED = "new", "forwarded", "responding", "done", "rejected"


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
    strip: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Stream:
    """One ext_proc stream = one HTTP request."""

    state: str = NEW
    start: float = 0.0
    head: Head | None = None
    req: LLMRequest | None = None
    pool: Pool | None = None
    replica: Replica | None = None
    tokens: int = 0
    status: int = 0
    first_byte: float = 0.0


def _float(raw: bytes) -> float | None:
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 else None


def _int(raw: bytes, default: int = 0) -> int:
    try:
        return int(raw)
    except ValueError:
        return default


class Gateway:
    """Holds the pools and decides for each stream. One instance per sidecar process."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.pools: dict[str, Pool] = {p.model: Pool.from_config(p) for p in policy.pools}
        lim = policy.limits
        self.estimator = make_estimator(lim.tokenizer, lim.tokenizer_path or None, lim.bytes_per_token)
        self.max_body = lim.max_body_bytes
        self.default_output = lim.default_output_tokens
        self.draining = False
        self._models_payload = {"object": "list", "data": [
            {"id": p.model, "object": "model", "created": 0, "owned_by": "sluice"} for p in policy.pools]}
        self._outcomes = {(p.model, o): m.REQUESTS.labels(p.model, o)
                          for p in policy.pools for o in ("completed", "cancelled", "failed", "rejected")}
        self._inflight_req = {r: m.INFLIGHT_REQUESTS.labels(r.pool, r.address)
                              for pool in self.pools.values() for r in pool.replicas}
        self._inflight_tok = {r: m.INFLIGHT_TOKENS.labels(r.pool, r.address)
                              for pool in self.pools.values() for r in pool.replicas}

    # ---- request headers -------------------------------------------------------------------------------
    def on_request_headers(self, st: Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        st.start = time.monotonic()
        head = Head()
        for h in msg.headers.headers:
            key = h.key
            if key[0] == ":":
                if key == ":path":
                    head.path = h.raw_value.decode("latin-1").split("?", 1)[0]
                elif key == ":method":
                    head.method = h.raw_value.decode("latin-1")
            elif key.startswith("x-"):
                self._read_x_header(head, key, h.raw_value)
            elif key == "content-length":
                head.content_length = _int(h.raw_value, -1)
            elif key == "idempotency-key":
                head.idempotency_key = h.raw_value.decode("latin-1")
        st.head = head
        if self.draining:
            return self._reject(st, R.immediate(503, "the gateway is shutting down; retry shortly", "draining",
                                                retry_after_s=1.0, should_retry=True))
        if head.path == "/v1/models" and head.method == "GET":
            st.state = DONE
            return R.json_response(200, self._models_payload)
        if head.path not in ENDPOINTS:
            return self._reject(st, R.immediate(404, f"unknown endpoint {head.method} {head.path}",
                                                "unknown_endpoint"))
        if head.method != "POST":
            return self._reject(st, R.immediate(405, f"{head.path} accepts POST only", "method_not_allowed"))
        if head.content_length > self.max_body:
            return self._reject(st, self._too_large())
        if msg.end_of_stream:
            return self._reject(st, R.immediate(400, "request body is required", "missing_body"))
        return R.CONTINUE_REQUEST_HEADERS

    def _read_x_header(self, head: Head, key: str, raw: bytes) -> None:
        if key.startswith("x-envoy-") or key in _GATEWAY_ONLY:
            head.strip.append(key)
        elif key == "x-stainless-retry-count":
            head.retry_count = _int(raw)
        elif key == "x-stainless-read-timeout":
            head.client_timeout_s = _float(raw)
        elif key == "x-sluice-deadline-ms":
            ms = _float(raw)
            if ms is not None:
                head.client_timeout_s = ms / 1000.0
        elif key == "x-request-id":
            head.request_id = raw.decode("latin-1")
        elif key == "x-sluice-tenant":
            head.tenant = raw.decode("latin-1")[:64]
        elif key == "x-sluice-app":
            head.app = raw.decode("latin-1")[:64]
        elif key == "x-sluice-task-id":
            head.task_id = raw.decode("latin-1")[:128]
        elif key == "x-sluice-task-depth":
            head.task_depth = _int(raw)
        elif key == "x-sluice-priority":
            head.priority = raw.decode("latin-1")

    # ---- request body: the decision --------------------------------------------------------------------
    def on_request_body(self, st: Stream, msg: pb.HttpBody) -> pb.ProcessingResponse:
        t0 = time.perf_counter()
        head = st.head or Head()
        body = msg.body
        if len(body) > self.max_body:
            return self._reject(st, self._too_large())
        try:
            req = parse_body(ENDPOINTS[head.path], body, self.estimator, self.default_output)
        except BadRequest as exc:
            return self._reject(st, R.immediate(exc.status, exc.message, exc.code, err_type=exc.err_type,
                                                param=exc.param))
        pool = self.pools.get(req.model)
        if pool is None:
            return self._reject(st, R.immediate(404, f"The model `{req.model}` does not exist.", "model_not_found",
                                                param="model"))
        self._fill_identity(req, head, st.start)
        st.req = req
        st.pool = pool
        pins = pool.pick(req.total_tokens)
        if not pins:
            return self._reject(st, R.immediate(503, f"no replica of {req.model} is available", "pool_unavailable",
                                                retry_after_s=1.0, should_retry=True))
        resp = self._dispatch(st, pins)
        m.DECISION_SECONDS.observe(time.perf_counter() - t0)
        return resp

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

    def _dispatch(self, st: Stream, pins: list[Replica]) -> pb.ProcessingResponse:
        """Account the request on the primary replica and answer Envoy with the pinned route."""
        req = st.req
        assert req is not None and st.pool is not None
        primary = pins[0]
        tokens = req.total_tokens
        primary.place(tokens)
        self._inflight_req[primary].inc()
        self._inflight_tok[primary].inc(tokens)
        st.replica, st.tokens, st.state = primary, tokens, FORWARDED
        timeout_ms = None
        if req.client_timeout_s is not None:
            # Work the client has given up on must be cancelled at the replica (P4).
            remaining = req.client_timeout_s - (time.monotonic() - req.arrival)
            timeout_ms = max(1, int(remaining * 1000))
        pin_str = ",".join(r.address for r in pins)
        return R.forward(st.pool.cluster, pin_str, upstream_timeout_ms=timeout_ms,
                         remove_headers=st.head.strip if st.head and st.head.strip else None)

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
        for h in msg.headers.headers:
            if h.key == ":status":
                st.status = _int(h.raw_value)
                break
        st.first_byte = time.monotonic()
        if st.state == FORWARDED:
            st.state = DONE if msg.end_of_stream else RESPONDING
        return R.CONTINUE_RESPONSE_HEADERS

    def on_response_trailers(self, st: Stream) -> pb.ProcessingResponse:
        if st.state in (FORWARDED, RESPONDING):
            st.state = DONE
        return R.CONTINUE_RESPONSE_TRAILERS

    def on_response_body(self, st: Stream, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if msg.end_of_stream and st.state in (FORWARDED, RESPONDING):
            st.state = DONE
        return R.CONTINUE_RESPONSE_BODY

    # ---- end of stream: always called, exactly once ---------------------------------------------------
    def finish(self, st: Stream) -> str:
        """Release everything the stream holds; return its outcome. Completed vs cancelled is decided by
        whether the response's end was seen, never by the gRPC status (Envoy resets streams either way)."""
        pool, replica = st.pool, st.replica
        if st.state == REJECTED:
            outcome = "rejected"
        elif st.state == DONE:
            outcome = "failed" if st.status >= 500 else "completed"
        else:
            outcome = "failed" if st.status >= 500 else "cancelled"
        if replica is not None:
            replica.release(st.tokens)
            self._inflight_req[replica].dec()
            self._inflight_tok[replica].dec(st.tokens)
            if st.status >= 500:
                replica.errors_total += 1
            st.replica = None
        if pool is not None:
            self._outcomes[(pool.model, outcome)].inc()
        return outcome
