"""A request that ran out of its client's own time is the client's doing, not a replica error (P4, P5).

The sidecar sets Envoy's route timeout to the time the client's deadline leaves (`x-stainless-read-timeout`,
`x-sluice-deadline-ms`), so under load Envoy ends requests with "upstream request timeout" at the moment the client
gives up. Counted as replica errors, those put every replica of an overloaded pool in DEGRADED for `error_rate`
(both replicas in P4, P4n and on real engines in P5), quartering the capacity placement uses while the pool was
only busy. The access log carries the deadline headers (xds.py), and health counts such a timeout as it counts a
client that hung up."""

from __future__ import annotations

import yaml
from envoy.data.accesslog.v3 import accesslog_pb2 as al

from extproc.accesslog import AccessLogReceiver, client_deadline_passed
from extproc.config import policy_from_dict
from extproc.gateway import Gateway
from extproc.xds import DEADLINE_HEADERS, render

A, B = "10.9.0.1:8000", "10.9.0.2:8000"
MODEL = "dl-m"


def _gateway() -> tuple[Gateway, AccessLogReceiver]:
    gw = Gateway(policy_from_dict({"pools": [{"model": MODEL, "replicas": [A, B]}]}))
    receiver = AccessLogReceiver({p.cluster: p.model for p in gw.pools.values()})
    gw.attach_access_log(receiver)
    return gw, receiver


def _entry(replica: str, *, timed_out: bool, deadline_header: str | None) -> al.HTTPAccessLogEntry:
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
        entry.request.request_headers[deadline_header] = "1.5"
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
    assert client_deadline_passed(entry)
    assert not client_deadline_passed(_entry(B, timed_out=True, deadline_header=None))
    assert not client_deadline_passed(_entry(B, timed_out=False, deadline_header="x-sluice-deadline-ms"))
    gw, receiver = _gateway()
    before = _count(receiver, "timeout")
    receiver.handle(entry)
    assert _count(receiver, "timeout") == before + 1


def _count(receiver: AccessLogReceiver, outcome: str) -> float:
    from extproc import metrics as m
    return m.REQUESTS.labels(MODEL, outcome)._value.get()  # type: ignore[attr-defined]


def test_envoy_logs_the_deadline_headers_with_every_entry(tmp_path):
    paths = render(policy_from_dict({"pools": [{"model": MODEL, "replicas": [A, B]}]}), tmp_path, "sluice")
    hcm = yaml.safe_load(paths["lds"].read_text())["resources"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    logs = [a["typed_config"] for a in hcm["access_log"] if a["name"] == "envoy.access_loggers.http_grpc"]
    assert len(logs) == 1 and logs[0]["additional_request_headers_to_log"] == list(DEADLINE_HEADERS)
