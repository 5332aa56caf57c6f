"""A pool whose replicas come and go (discovery's EndpointDiffs applied by the Fleet): a new replica joins in slow
start, a removed one takes no new request and leaves only when its requests in flight are done, an address that
comes back before its drain ended is taken back, and a source's first report is the pool's whole set. Driven
through the Gateway where a request's life matters, so the release path that ends a drain is the real one."""

from __future__ import annotations

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import REGISTRY

from extproc.config import policy_from_dict
from extproc.discovery import EndpointDiff
from extproc.fleet import Fleet
from extproc.gateway import Gateway
from extproc.routing.pool import HEALTHY, RECOVERING
from extproc.stream import Stream

POOL = "disc-m"
A, B, C = "10.7.0.1:8000", "10.7.0.2:8000", "10.7.0.3:8000"


def _policy(**extra: object):
    return policy_from_dict({"pools": [{"model": POOL, "replicas": [{"dns": "vllm.test:8000"}]}],
                             "admission": {"kv_capacity_tokens": 60000}, **extra})


def _fleet_with(*addresses: str, **extra: object) -> Fleet:
    fleet = Fleet(_policy(**extra))
    assert fleet.pools[POOL].replicas == []  # names are resolved at run time: the pool starts empty
    fleet.apply_endpoint_diff(EndpointDiff(POOL, added=addresses, initial=True))
    return fleet


def _weight_gauge(address: str) -> float | None:
    return REGISTRY.get_sample_value("sluice_replica_weight", {"pool": POOL, "replica": address})


def test_the_first_report_is_the_starting_set_at_full_weight():
    fleet = _fleet_with(A, B)
    assert [(r.address, r.state, r.weight) for r in fleet.pools[POOL].replicas] == [(A, HEALTHY, 1.0),
                                                                                    (B, HEALTHY, 1.0)]
    assert fleet.endpoints(POOL) == [A, B]


def test_a_new_replica_joins_in_slow_start_and_ramps_to_healthy():
    fleet = _fleet_with(A)
    fleet.apply_endpoint_diff(EndpointDiff(POOL, added=(C,)))
    c = fleet.pools[POOL].by_address(C)
    steps = fleet.routing.health.slow_start_steps
    assert (c.state, c.weight) == (RECOVERING, steps[0]) and c.state_reason.startswith("discovered")
    assert _weight_gauge(C) == steps[0]
    health = fleet.health[POOL]
    done = {"pool": POOL, "replica": C, "from": RECOVERING, "to": HEALTHY, "reason": "slow_start_done"}
    before = REGISTRY.get_sample_value("sluice_replica_health_transitions_total", done) or 0
    t = c.state_since
    weights = []
    for i in range(1, len(steps)):  # one step per slow_start_step_s of healthy TTFT (no samples: healthy)
        health.tick(t + i * fleet.routing.health.slow_start_step_s + 0.01)
        weights.append(c.weight)
    assert weights == [*steps[1:-1], 1.0] and c.state == HEALTHY
    assert REGISTRY.get_sample_value("sluice_replica_health_transitions_total", done) == before + 1


def test_with_health_off_a_new_replica_joins_at_full_weight():
    fleet = _fleet_with(A, routing={"health": {"enabled": False}})
    fleet.apply_endpoint_diff(EndpointDiff(POOL, added=(C,)))
    c = fleet.pools[POOL].by_address(C)
    assert (c.state, c.weight) == (HEALTHY, 1.0)


def _body(n: int) -> bytes:
    return orjson.dumps({"model": POOL, "max_tokens": 5, "stream": True,
                         "messages": [{"role": "user", "content": f"hello {n}"}]})


async def _forward(gw: Gateway, n: int) -> Stream:
    st = gw.open_stream()
    gw.on_request_headers(st, pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")])))
    answer = await gw.on_request_body(st, pb.HttpBody(body=_body(n), end_of_stream=True))
    assert answer.HasField("request_body"), answer
    return st


def _pinned(st: Stream) -> str:
    return st.placement.replica.address


async def test_a_removed_replica_drains_its_requests_then_leaves_the_pool():
    gw = Gateway(_policy())
    fleet = gw.fleet
    fleet.apply_endpoint_diff(EndpointDiff(POOL, added=(A, B), initial=True))
    streams = [await _forward(gw, n) for n in range(6)]
    on_a = [st for st in streams if _pinned(st) == A]
    assert on_a and len(on_a) < len(streams)
    fleet.apply_endpoint_diff(EndpointDiff(POOL, removed=(A,)))
    a = fleet.pools[POOL].by_address(A)
    assert a.retired and a.draining and not a.routable
    assert fleet.endpoints(POOL) == [B]  # Envoy forgets it at once; its requests in flight finish anyway
    later = [await _forward(gw, n) for n in range(6, 10)]
    assert {_pinned(st) for st in later} == {B}  # nothing new goes to A
    for st in on_a[:-1]:
        gw.close(st)
    assert fleet.pools[POOL].by_address(A) is a  # one request still in flight: A stays
    assert _weight_gauge(A) is not None
    gw.close(on_a[-1])  # its last request ends: A leaves, its series with it
    assert fleet.pools[POOL].by_address(A) is None
    assert _weight_gauge(A) is None and a not in gw.gauges.counted
    assert REGISTRY.get_sample_value("sluice_inflight_requests", {"pool": POOL, "replica": A}) is None
    for st in streams + later:
        gw.close(st)
    assert fleet.pools[POOL].inflight_requests == 0


async def test_an_address_back_before_its_drain_ended_is_taken_back_in_slow_start():
    gw = Gateway(_policy())
    fleet = gw.fleet
    fleet.apply_endpoint_diff(EndpointDiff(POOL, added=(A,), initial=True))
    st = await _forward(gw, 1)
    fleet.apply_endpoint_diff(EndpointDiff(POOL, removed=(A,)))
    a = fleet.pools[POOL].by_address(A)
    assert a.retired
    fleet.apply_endpoint_diff(EndpointDiff(POOL, added=(A,)))
    assert fleet.pools[POOL].by_address(A) is a and not a.retired and not a.draining
    assert a.state == RECOVERING and a.inflight_requests == 1  # same object: its accounting carried over
    gw.close(st)
    assert fleet.pools[POOL].by_address(A) is a and a.inflight_requests == 0


def test_a_first_report_after_a_reload_retires_what_it_does_not_list():
    fleet = _fleet_with(A, B)
    fleet.apply_endpoint_diff(EndpointDiff(POOL, added=(B, C), initial=True))
    pool = fleet.pools[POOL]
    assert pool.by_address(A) is None  # nothing in flight: it left at once
    assert [r.address for r in pool.replicas] == [B, C]
    assert pool.by_address(C).state == HEALTHY  # a starting set: no slow start


def test_a_confined_lane_follows_the_pool_size():
    lanes = [{"name": "short", "max_prefill_of_target": 0.25},
             {"name": "long", "max_prefill_of_target": 1e9, "max_replica_share": 0.5}]
    fleet = _fleet_with(A, B, admission={"kv_capacity_tokens": 60000, "lanes": lanes})
    placer = fleet.placers[POOL]
    assert placer._lane_caps == [0, 1]
    fleet.apply_endpoint_diff(EndpointDiff(POOL, added=(C, "10.7.0.4:8000")))
    assert placer._lane_caps == [0, 2]
    assert all(len(r.lane_inflight) == 2 for r in fleet.pools[POOL].replicas)
    assert all(r.kv_capacity_tokens == 60000 for r in fleet.pools[POOL].replicas)


def test_a_diff_for_a_pool_removed_by_a_reload_is_ignored():
    fleet = _fleet_with(A)
    fleet.apply_endpoint_diff(EndpointDiff("no-such-pool", added=(C,)))
    assert [r.address for r in fleet.pools[POOL].replicas] == [A]
