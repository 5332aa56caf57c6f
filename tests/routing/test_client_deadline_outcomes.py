"""A request that ran out of its client's own time is the client's doing, not a replica error (P4, P5).

The sidecar sets Envoy's route timeout to the time the client's deadline leaves (`x-stainless-read-timeout`,
`x-sluice-deadline-ms`), so under load Envoy ends requests with "upstream request timeout" at the moment the client
gives up. Counted as replica errors, those put every replica of an overloaded pool in DEGRADED for `error_rate`
(both replicas in P4, P4n and on real engines in P5), quartering the capacity placement uses while the pool was
only busy. The access log carries the deadline headers (xds.py), and health counts such a timeout as it counts a
client that hung up."""

from __future__ import annotations

import orjson
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.accesslog import AccessLogReceiver, client_deadline_passed
from extproc.config import policy_from_dict
from extproc.gateway import Gateway
from extproc.xds import DEADLINE_HEADERS, READ_TIMEOUT_HEADER, render

A, B = "10.9.0.1:8000", "10.9.0.2:8000"
MODEL = "dl-m"


def _gateway() -> tuple[Gateway, AccessLogReceiver]:
    gw = Gateway(policy_from_dict({"pools": [{"model": MODEL, "replicas": [A, B]}]}))
    receiver = AccessLogReceiver({p.cluster: p.model for p in gw.pools.values()})
    gw.attach_access_log(receiver)
    return gw, receiver


def _entry(replica: str, *, timed_out: bool, deadline_header: str | None, value: str = "1.5") -> al.HTTPAccessLogEntry:
    entry = al.HTTPAccessLogEntry()
    common = entry.common_properties
    common.upstream_cluster = f"pool-{MODEL}"
    host, port = replica.split(":")
    common.upstream_remote_address.socket_address.address = host
    common.upstream_remote_address.socket_address.port_value = int(port)
    if timed_out:
        common.response_flags.upstream_request_timeout = True
        entry.response.response_code.value = 504
    else:
        entry.response.response_code.value = 200
    if deadline_header is not None:
        entry.request.request_headers[deadline_header] = value
    return entry


def test_a_timeout_at_the_clients_own_deadline_is_not_a_replica_error():
    gw, receiver = _gateway()
    tracker = gw.fleet.health[MODEL]
    a = gw.pools[MODEL].by_address(A)
    for header in DEADLINE_HEADERS:
        receiver.handle(_entry(A, timed_out=True, deadline_header=header))
    receiver.handle(_entry(A, timed_out=False, deadline_header=DEADLINE_HEADERS[0]))
    assert tracker.error_counts(a) == (1, 0)  # the two deadline timeouts are the clients': not counted at all
    receiver.handle(_entry(A, timed_out=True, deadline_header=None))  # a route timeout nobody asked for
    assert tracker.error_counts(a) == (2, 1)


def test_the_outcome_metric_still_says_timeout():
    """Operators still see how the request ended: only health reads it as the client's."""
    entry = _entry(B, timed_out=True, deadline_header="x-sluice-deadline-ms")
    assert client_deadline_passed(entry, 0.0)
    assert not client_deadline_passed(_entry(B, timed_out=True, deadline_header=None), 0.0)
    assert not client_deadline_passed(_entry(B, timed_out=False, deadline_header="x-sluice-deadline-ms"), 0.0)
    gw, receiver = _gateway()
    before = _count(receiver, "timeout")
    receiver.handle(entry)
    assert _count(receiver, "timeout") == before + 1


async def test_the_operators_route_timeout_stays_when_the_clients_deadline_is_longer():
    """`gateway.request_timeout_s` 60 s: the openai SDK's default 600 s read timeout must not lift it (the header
    the sidecar sets replaces the route's timeout), and a timeout there is the operator's limit, which health
    counts; a client deadline under it is set and, when it passes, is the client's."""
    gw = Gateway(policy_from_dict({"pools": [{"model": MODEL, "replicas": [A, B]}],
                                   "gateway": {"request_timeout_s": 60}}))
    assert await _upstream_timeout_ms(gw, "600") is None
    assert 29_000 <= await _upstream_timeout_ms(gw, "30") <= 30_000
    assert not client_deadline_passed(_entry(A, timed_out=True, deadline_header=READ_TIMEOUT_HEADER, value="600"),
                                      60.0)
    assert client_deadline_passed(_entry(A, timed_out=True, deadline_header=READ_TIMEOUT_HEADER, value="30"), 60.0)


async def _upstream_timeout_ms(gw: Gateway, read_timeout: str) -> int | None:
    st = gw.open_stream()
    gw.on_request_headers(st, pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
        base_pb2.HeaderValue(key=READ_TIMEOUT_HEADER, raw_value=read_timeout.encode())])))
    body = orjson.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    answer = await gw.on_request_body(st, pb.HttpBody(body=body, end_of_stream=True))
    gw.close(st)
    set_headers = answer.request_body.response.header_mutation.set_headers
    values = [int(h.header.raw_value or h.header.value) for h in set_headers
              if h.header.key == "x-envoy-upstream-rq-timeout-ms"]
    return values[0] if values else None


def _count(receiver: AccessLogReceiver, outcome: str) -> float:
    from extproc import metrics as m
    return m.REQUESTS.labels(MODEL, outcome)._value.get()  # type: ignore[attr-defined]


def test_envoy_logs_the_deadline_headers_with_every_entry(tmp_path):
    paths = render(policy_from_dict({"pools": [{"model": MODEL, "replicas": [A, B]}]}), tmp_path, "sluice")
    hcm = yaml.safe_load(paths["lds"].read_text())["resources"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    logs = [a["typed_config"] for a in hcm["access_log"] if a["name"] == "envoy.access_loggers.http_grpc"]
    assert len(logs) == 1 and logs[0]["additional_request_headers_to_log"] == list(DEADLINE_HEADERS)
