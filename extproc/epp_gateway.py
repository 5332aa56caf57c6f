"""sluice as the endpoint picker (EPP) of a Gateway API InferencePool: the per-request decisions of `Gateway`, with
what the endpoint-picker protocol changes (docs/epp.md; the protocol's pieces are in epp.py):

    request headers   the gateway's subset hint (`envoy.lb.subset_hint` metadata) restricts the candidates
    request body      one pool per EPP: the route already chose it, so the body's model is read for accounting,
                      never a 404. No candidate (an empty pool, or none the hint allows): 503. Otherwise admission
                      as usual: dispatched, queued, or shed with 429 / 503
    the answer        the pin list, first `epp.max_endpoints` of it, in the x-gateway-destination-endpoint header
                      and the envoy.lb metadata (the same value)
    response headers  the endpoint that served (x-gateway-destination-endpoint-served, or upstream.address): the
                      request's accounting moves there when the gateway fell back down the list
    the end           the ext_proc stream's end (the gateway sends the EPP no access log); its status feeds the
                      replica's health (error rate) like Envoy's access log does in sluice's own shape

Failure mode: when the decision itself fails (a bug), FailOpen answers with a ready endpoint of the pool (within
the subset) unaccounted, FailClose with a 503; the gateway applies the InferencePool's own failureMode when sluice
cannot be reached at all.
"""

from __future__ import annotations

import logging
import random

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import epp
from extproc import responses as R
from extproc.config import Policy
from extproc.gateway import Gateway
from extproc.head import STRIPPED_HEADERS
from extproc.request import LLMRequest
from extproc.routing.health import COMPLETED, FAILED
from extproc.routing.pool import Pool, Replica
from extproc.servicer import ExtProcServicer
from extproc.stream import State, Stream
from extproc.xds import DESTINATION_KEY

log = logging.getLogger("sluice.epp")

FAIL_OPEN, FAIL_CLOSE = "FailOpen", "FailClose"
# Removed from the forwarded request; the destination header is set by the answer itself.
_REMOVED = [h for h in STRIPPED_HEADERS if h != DESTINATION_KEY]
_UNDECIDED = (State.HEADERS, State.QUEUED)


class EppGateway(Gateway):
    """The Gateway of a sidecar in EPP mode (`epp.enabled`). `failure_mode`: the policy's, else the
    InferencePool's (Kubernetes discovery), else FailClose; the server sets it once discovery has started."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.failure_mode = policy.epp.failure_mode or FAIL_CLOSE

    def pool_for(self, req: LLMRequest | None) -> Pool | None:
        """The one pool this picker serves, whatever model the body names."""
        return next(iter(self.fleet.pools.values()), None)

    def pin_answer(self, st: Stream, pins: list[Replica], timeout_ms: int | None) -> pb.ProcessingResponse:
        extra = [("x-envoy-upstream-rq-timeout-ms", str(timeout_ms))] if timeout_ms is not None else ()
        return epp.pick_answer([r.address for r in pins], max_endpoints=self.policy.epp.max_endpoints,
                               extra_headers=extra, remove_headers=_REMOVED)

    def _candidates(self, st: Stream) -> list[Replica]:
        pool = self.pool_for(None)
        subset = st.head.subset if st.head is not None else None
        if pool is None:
            return []
        return [r for r in pool.replicas if r.routable and (subset is None or subset.allows(r.address))]

    # ---- the decision, with the failure mode ---------------------------------------------------------------
    async def on_request_body(self, st: Stream, msg: pb.HttpBody) -> pb.ProcessingResponse:
        try:
            if not self._candidates(st):
                pool = self.pool_for(None)
                subset_given = st.head is not None and st.head.subset is not None
                return self._reject(st, epp.no_endpoint_answer(pool.model if pool else "the pool", subset_given))
            return await super().on_request_body(st, msg)
        except Exception:
            return self._failed(st)

    async def wait(self, st: Stream) -> pb.ProcessingResponse:
        try:
            return await super().wait(st)
        except Exception:
            return self._failed(st)

    def _failed(self, st: Stream) -> pb.ProcessingResponse:
        """The decision raised: FailOpen answers any ready endpoint (unaccounted), FailClose a 503."""
        log.exception("the endpoint pick failed (%s)", self.failure_mode)
        ready = self._candidates(st) if self.failure_mode == FAIL_OPEN else []
        if ready:
            if st.state in _UNDECIDED:
                st.move(State.FORWARDED)
            return epp.pick_answer([random.choice(ready).address], max_endpoints=1, remove_headers=_REMOVED)
        if st.state in _UNDECIDED:
            st.move(State.REJECTED)
        return R.immediate(503, "the endpoint picker failed to decide; retry shortly", "picker_error",
                           retry_after_s=1.0, should_retry=True)

    # ---- the response: who served, and how it ended --------------------------------------------------------
    def on_served(self, st: Stream, served: str | None) -> None:
        """The gateway reports the endpoint that served: if it fell back from the pin the request was placed on,
        the request's accounting (in-flight tokens, lane; the gauges read it) moves to the one that serves it."""
        p, req = st.placement, st.req
        if served is None or p is None or req is None or st.pool is None or p.replica.address == served:
            return
        to = st.pool.by_address(served)
        if to is None:
            return  # not one of the pool's replicas as sluice knows it: nothing to move to
        self.gauges.count_replica(to)  # its gauges read its own accounting from now on
        if p.owner is not None:
            p.epoch, p.growth = p.owner.placer.move(p.replica, to, req, p.lane, p.epoch, p.growth, p.answered)
        else:  # admission off: plain accounting
            p.replica.release(req.total_tokens, req.prompt_tokens, p.epoch)
            to.place(req.total_tokens, req.prompt_tokens)
            p.epoch = to.scrape_epoch
        p.replica = to

    def finish(self, st: Stream) -> State:
        """Release as usual; the response's status is the replica's outcome for health (no access log here)."""
        placement, pool = st.placement, st.pool
        state = super().finish(st)
        if placement is not None and pool is not None and st.status and self.fleet.routing.health.enabled:
            health = self.fleet.health.get(pool.model)
            if health is not None and (st.status >= 500 or state is State.DONE):
                health.on_outcome(placement.replica.address, FAILED if st.status >= 500 else COMPLETED)
        return state


class EppServicer(ExtProcServicer):
    """The ext_proc servicer in EPP mode: the subset hint comes with the request headers, the served endpoint with
    the response headers, both in ProcessingRequest metadata (or attributes) rather than in the headers."""

    gw: EppGateway

    def request_headers(self, st: Stream, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        answer = self.gw.on_request_headers(st, msg.request_headers)
        if st.head is not None:
            st.head.subset = epp.subset_hint(msg)
        return answer

    def response_headers(self, st: Stream, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        self.gw.on_served(st, epp.served_endpoint(msg))
        return self.gw.on_response_headers(st, msg.response_headers)
