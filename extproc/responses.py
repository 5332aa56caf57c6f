"""Building the ext_proc answers the sidecar sends back to Envoy.

Constant answers are built once at import and reused (protobuf serialises the same object any number of
times); per-request answers are cached whole where they repeat (the pinned answer per pin list) or reuse cached
pieces, so the hot path allocates as little as it can.
"""

from __future__ import annotations

from functools import lru_cache

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from extproc.xds import DESTINATION_KEY, LB_NAMESPACE, POOL_HEADER

# What an observed request switches to: response headers, every body chunk, and trailers (see streaming.py).
OBSERVE_MODE = pm.ProcessingMode(
    request_header_mode=pm.ProcessingMode.SEND,
    request_body_mode=pm.ProcessingMode.BUFFERED,
    request_trailer_mode=pm.ProcessingMode.SKIP,
    response_header_mode=pm.ProcessingMode.SEND,
    response_body_mode=pm.ProcessingMode.STREAMED,
    response_trailer_mode=pm.ProcessingMode.SEND,
)

CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
# Continue, and switch this request's response to observed mode (see streaming.py).
CONTINUE_REQUEST_HEADERS_OBSERVED = pb.ProcessingResponse(request_headers=pb.HeadersResponse(),
                                                          mode_override=OBSERVE_MODE)
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # Envoy 1.40 ignores HeaderValue.value in ext_proc answers: only raw_value is applied.
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


_JSON_CT = _header("content-type", "application/json")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 431: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable", 504: "timeout"}


def error_body(message: str, code: str, err_type: str | None = None, status: int = 400,
               param: str | None = None) -> bytes:
    """The OpenAI error object: what the openai SDK parses into APIStatusError.message / .code."""
    return orjson.dumps({"error": {"message": message, "type": err_type or ERROR_TYPES.get(status, "error"),
                                   "param": param, "code": code}})


def immediate(status: int, message: str, code: str, *, err_type: str | None = None, param: str | None = None,
              retry_after_s: float | None = None, should_retry: bool | None = None,
              extra_headers: dict[str, str] | None = None) -> pb.ProcessingResponse:
    """Answer the client directly (the request never reaches a replica).

    `retry-after`/`retry-after-ms` and `x-should-retry` are what the official OpenAI SDKs read to decide
    whether and when to retry (P5)."""
    headers = [_JSON_CT]
    if retry_after_s is not None:
        ms = max(1, int(retry_after_s * 1000))
        headers.append(_header("retry-after-ms", str(ms)))
        headers.append(_header("retry-after", str(max(1, -(-ms // 1000)))))
    if should_retry is not None:
        headers.append(_header("x-should-retry", "true" if should_retry else "false"))
    for key, value in (extra_headers or {}).items():
        headers.append(_header(key, value))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=headers),
        body=error_body(message, code, err_type, status, param),
        details=f"sluice_{code}",
    ))


def retry_asked(resp: pb.ProcessingResponse) -> float | None:
    """An immediate answer that tells the client to retry (`x-should-retry: true`): its retry-after in seconds (0
    without one); None for any other answer. The gateway then makes that retry free of the retry budget
    (budgets/credits.py)."""
    asked, after = False, 0.0
    for h in resp.immediate_response.headers.set_headers:
        if h.header.key == "x-should-retry":
            asked = h.header.raw_value == b"true"
        elif h.header.key == "retry-after-ms":
            after = int(h.header.raw_value) / 1000
    return after if asked else None


RETRY_REFUSED_NOTE = ("; do not retry now: this tenant's retries are over its retry budget, and a retry would be "
                      "refused (retry_budget_exceeded)")


def forbid_retry(resp: pb.ProcessingResponse) -> bool:
    """Turn an immediate answer's `x-should-retry: true` into false, and say why in its error message; True if it
    asked for a retry. For a refusal whose retry the retry budget would refuse (budgets/retry.py)."""
    ir = resp.immediate_response
    for h in ir.headers.set_headers:
        if h.header.key == "x-should-retry" and h.header.raw_value == b"true":
            h.header.raw_value = b"false"
            body = orjson.loads(ir.body)
            body["error"]["message"] += RETRY_REFUSED_NOTE
            ir.body = orjson.dumps(body)
            return True
    return False


@lru_cache(maxsize=4096)
def pin_metadata(pins: str) -> struct_pb2.Struct:
    """`{"envoy.lb": {"x-gateway-destination-endpoint": "ip:port,ip:port"}}`, cached per pin list
    (a pool of N replicas has at most N*(N-1) ordered pairs)."""
    s = struct_pb2.Struct()
    s.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_KEY].string_value = pins
    return s


@lru_cache(maxsize=256)
def _pool_header(cluster: str) -> base_pb2.HeaderValueOption:
    return _header(POOL_HEADER, cluster)


def forward(cluster: str, pins: str, *, upstream_timeout_ms: int | None = None,
            remove_headers: tuple[str, ...] = ()) -> pb.ProcessingResponse:
    """Let the request through, pinned: the pool header selects the cluster (route cache cleared so the route
    is chosen again), the dynamic metadata gives override_host the ordered replica list. Without a client
    deadline the whole answer is the same for every request of a pin list: built once and reused."""
    if upstream_timeout_ms is None:
        return _forward_cached(cluster, pins, remove_headers)
    return _forward(cluster, pins, upstream_timeout_ms, remove_headers)


@lru_cache(maxsize=4096)
def _forward_cached(cluster: str, pins: str, remove_headers: tuple[str, ...]) -> pb.ProcessingResponse:
    return _forward(cluster, pins, None, remove_headers)


def _forward(cluster: str, pins: str, upstream_timeout_ms: int | None,
             remove_headers: tuple[str, ...]) -> pb.ProcessingResponse:
    set_headers = [_pool_header(cluster)]
    if upstream_timeout_ms is not None:
        set_headers.append(_header("x-envoy-upstream-rq-timeout-ms", str(upstream_timeout_ms)))
    mutation = pb.HeaderMutation(set_headers=set_headers, remove_headers=remove_headers)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=mutation, clear_route_cache=True)), dynamic_metadata=pin_metadata(pins))


def hold(seconds: float) -> pb.ProcessingResponse:
    """Ask Envoy to wait longer for the answer to the current message (sent once per held request)."""
    return pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(
        seconds=int(seconds), nanos=int((seconds - int(seconds)) * 1e9)))
