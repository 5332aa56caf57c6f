"""What the request headers say: the few headers the sidecar reads, each by one small reader, kept as a `Head`
until the body arrives; and the client-sent headers it strips from every forwarded request.

Header values arrive as raw bytes and are decoded as latin-1 (which never fails): a client's stray non-UTF-8 byte
must not break the ext_proc message or the request's governance. Every text field is cut to a bounded length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from envoy.config.core.v3 import base_pb2

from extproc.request import LLMRequest
from extproc.xds import DEADLINE_MS_HEADER, DESTINATION_KEY, POOL_HEADER, READ_TIMEOUT_HEADER

if TYPE_CHECKING:
    from extproc.epp import Subset

MAX_DEADLINE_S = 86400.0  # a client deadline beyond a day is no deadline

# Client-sent headers that would let a client decide what only the gateway may decide: removed from every
# forwarded request (removing an absent header is free; one constant tuple, no per-request work). The pool
# header is not listed: the sidecar always overwrites it.
STRIPPED_HEADERS = (DESTINATION_KEY, "x-envoy-upstream-rq-timeout-ms",
                    "x-envoy-upstream-rq-per-try-timeout-ms", "x-envoy-max-retries", "x-envoy-retry-on",
                    "x-envoy-retry-grpc-on", "x-envoy-retriable-status-codes", "x-envoy-retriable-header-names",
                    "x-envoy-hedge-on-per-try-timeout", "x-envoy-upstream-alt-stat-name", "x-envoy-force-trace",
                    "x-envoy-upstream-stream-duration-ms")


# What the sidecar adds to a forwarded request (responses.forward): the pool header and, with a client deadline,
# the upstream timeout. Removals only ever shrink the headers.
ADDED_HEADERS = (POOL_HEADER, "x-envoy-upstream-rq-timeout-ms")


@dataclass(frozen=True, slots=True)
class HeaderRoom:
    """Room for the sidecar's own headers within Envoy's header limits (gateway.max_request_headers and
    max_request_headers_kb). Envoy checks the request after the sidecar's header mutation against the same limits
    its codec applies to the client, and fails the request with a 503 (`header_mutation_result_exceeds_limit`) when
    it is over: a request within `added` headers or bytes of a limit passes the codec but could not take the
    mutation. Such a request gets the codec's answer (431) from the sidecar instead, before it is admitted:

        fits  iff  count + len(ADDED_HEADERS) <= max_count  and  size + added_bytes <= max_bytes

    where count and size (keys plus values, as Envoy counts) are those of the headers the sidecar received.
    """

    max_count: int
    max_bytes: int
    added_bytes: int

    @classmethod
    def for_limits(cls, max_count: int, max_kb: int, clusters: Iterable[str]) -> HeaderRoom:
        longest = max((len(c) for c in clusters), default=0)
        added = len(POOL_HEADER) + longest + len(ADDED_HEADERS[1]) + len(str(int(MAX_DEADLINE_S * 1000)))
        return cls(max_count, max_kb * 1024, added)

    def fits(self, headers: base_pb2.HeaderMap) -> bool:
        """The serialized size (computed in C) is an upper bound of keys plus values: the exact sum is only taken
        near the limit."""
        items = headers.headers
        if len(items) + len(ADDED_HEADERS) > self.max_count:
            return False
        room = self.max_bytes - self.added_bytes
        if headers.ByteSize() <= room:
            return True
        return sum(len(h.key) + max(len(h.raw_value), len(h.value)) for h in items) <= room


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
    deadline_sent: bool = False  # x-sluice-deadline-ms set client_timeout_s: the SDK's read timeout does not
    api_key: str | None = None  # never logged; mapped to a tenant by identity
    subset: Subset | None = None  # EPP mode: the gateway's subset hint (request metadata, not a header)

    def identify(self, req: LLMRequest, arrival: float) -> None:
        """Copy who sent the request, and under which limits, onto the parsed body."""
        req.tenant = self.tenant
        req.app = self.app
        req.task_id = self.task_id
        req.task_depth = self.task_depth
        req.priority = self.priority
        req.retry_count = self.retry_count
        req.idempotency_key = self.idempotency_key
        req.request_id = self.request_id
        req.client_timeout_s = self.client_timeout_s
        req.subset = self.subset
        req.arrival = arrival


def _float(raw: str) -> float | None:
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return min(value, MAX_DEADLINE_S * 1000)


def to_int(raw: str, default: int = 0) -> int:
    try:
        return int(raw)
    except ValueError:
        return default


def binding_deadline_s(client_timeout_s: float | None, route_timeout_s: float) -> float | None:
    """The client's deadline when it ends the request before the route's own timeout (`gateway.request_timeout_s`,
    0 = none), else None. Only then does the sidecar set Envoy's upstream timeout from it: the header replaces the
    route's timeout, and a longer deadline (the openai SDK sends 600 s by default) would lift the operator's."""
    if client_timeout_s is None:
        return None
    deadline = min(client_timeout_s, MAX_DEADLINE_S)
    return deadline if route_timeout_s <= 0 or deadline < route_timeout_s else None


def logged_deadline_s(headers: Mapping[str, str]) -> float | None:
    """The client's deadline from its deadline headers as Envoy's access log carries them, read as `read_head`
    reads them."""
    head = Head()
    for name in (READ_TIMEOUT_HEADER, DEADLINE_MS_HEADER):
        value = headers.get(name)
        if value is not None:
            HEADER_READERS[name](head, value)
    return head.client_timeout_s


def _set_timeout(head: Head, text: str) -> None:
    """The openai SDK's read timeout, the client's deadline unless it sent its own (x-sluice-deadline-ms), in
    whichever order the two headers come."""
    if not head.deadline_sent:
        head.client_timeout_s = _float(text)


def _set_deadline_ms(head: Head, text: str) -> None:
    """x-sluice-deadline-ms, in seconds; a value so small that it underflows to 0 s is no deadline, like 0 itself."""
    ms = _float(text)
    if ms is not None and ms / 1000.0 > 0:
        head.client_timeout_s = ms / 1000.0
        head.deadline_sent = True


def _set_retry_count(head: Head, text: str) -> None:
    head.retry_count = to_int(text)


def _set_task_depth(head: Head, text: str) -> None:
    head.task_depth = to_int(text)


def _setter(name: str, limit: int) -> Callable[[Head, str], None]:
    def set_field(head: Head, text: str) -> None:
        setattr(head, name, text[:limit])
    return set_field


def _set_authorization(head: Head, text: str) -> None:
    head.api_key = text[7:] if text[:7].lower() == "bearer " else text


# One reader per header the sidecar reads; the key is the header name.
HEADER_READERS: dict[str, Callable[[Head, str], None]] = {
    "x-stainless-retry-count": _set_retry_count,
    READ_TIMEOUT_HEADER: _set_timeout,
    DEADLINE_MS_HEADER: _set_deadline_ms,
    "x-sluice-tenant": _setter("tenant", 64),
    "x-sluice-app": _setter("app", 64),
    "x-sluice-task-id": _setter("task_id", 128),
    "x-sluice-task-depth": _set_task_depth,
    "x-sluice-priority": _setter("priority", 16),
    "idempotency-key": _setter("idempotency_key", 128),
    "authorization": _set_authorization,
}


def read_head(headers: Iterable[base_pb2.HeaderValue]) -> Head:
    """The few headers the sidecar reads, from their raw bytes."""
    head = Head()
    for h in headers:
        key = h.key
        if key == ":path":
            head.path = h.raw_value.decode("latin-1").split("?", 1)[0]
        elif key == "x-request-id":
            head.request_id = h.raw_value.decode("latin-1")
        else:
            reader = HEADER_READERS.get(key)
            if reader is not None:
                reader(head, h.raw_value.decode("latin-1"))
    return head
