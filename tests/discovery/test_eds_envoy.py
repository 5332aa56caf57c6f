"""File-based EDS with the real Envoy 1.40: a replica first written to the EDS file is pinnable through the
override_host policy sluice renders, and a replica removed from it finishes its request in flight.

The pin comes from a request header copied into `envoy.lb` metadata by Envoy's header_to_metadata filter: the
test stands in for the sidecar's answer without needing one (the product never lets a client pin)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from extproc.discovery.eds import eds_cluster_config, write_eds
from extproc.xds import DESTINATION_KEY, LB_NAMESPACE, _pool_lb_policy, _to_dict
from tests.waiting import wait_for

from .envoy_harness import Backend, Envoy, hcm, listener, ports, request

pytestmark = pytest.mark.integration

PIN = "x-test-pin"
CLUSTER = "pool-m"


def _bootstrap(xds: Path, listen: int, admin: int) -> dict:
    pin_to_metadata = {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [{"header": PIN, "remove": True, "on_header_present": {
            "metadata_namespace": LB_NAMESPACE, "key": DESTINATION_KEY, "type": "STRING"}}]}}
    cluster = {"name": CLUSTER, "type": "EDS", "connect_timeout": "1s",
               "eds_cluster_config": _to_dict(eds_cluster_config(xds, CLUSTER)),
               "load_balancing_policy": _to_dict(_pool_lb_policy("sluice"))}
    return {"node": {"id": "test", "cluster": "test"},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
            "static_resources": {"listeners": [listener("l", listen, hcm("t", CLUSTER, [pin_to_metadata]))],
                                 "clusters": [cluster]}}


@pytest.fixture
def backends():
    made = [Backend(slow_s=2.0) for _ in range(3)]
    yield made
    for b in made:
        b.close()


def test_an_address_added_by_eds_is_pinnable_and_a_removed_one_finishes_its_request(tmp_path, backends):
    a, b, c = (x.address for x in backends)
    listen, admin = ports(2)
    write_eds(tmp_path, CLUSTER, [a])
    envoy = Envoy(tmp_path, _bootstrap(tmp_path, listen, admin))
    assert envoy.validate().returncode == 0, envoy.validate().stderr
    envoy.start(admin)
    try:
        # Envoy does not know b yet: the pin is skipped, the fallback policy serves from a.
        assert {request(listen, headers={PIN: b})[2] for _ in range(3)} == {a}

        write_eds(tmp_path, CLUSTER, [a, b])
        assert wait_for(lambda: request(listen, headers={PIN: b})[2] == b, 5.0, 0.02), \
            "the EDS update never made b pinnable"
        assert all(request(listen, headers={PIN: b})[2] == b for _ in range(5))
        # An unknown first entry of a pin list is skipped for the next one.
        assert request(listen, headers={PIN: f"{c},{b}"})[2] == b

        # A request in flight on a when a leaves the EDS file still completes, on a.
        slow: dict[str, tuple] = {}
        worker = threading.Thread(target=lambda: slow.setdefault("r", request(listen, "/slow", {PIN: a})))
        worker.start()
        assert backends[0].slow_started.wait(5.0), "the slow request never reached a"
        write_eds(tmp_path, CLUSTER, [b])
        # a is gone: its pin falls back to b
        assert wait_for(lambda: request(listen, headers={PIN: a})[2] == b, 5.0, 0.02), \
            "the EDS removal never took effect"
        worker.join(10)
        assert slow["r"][0] == 200 and slow["r"][2] == a
    finally:
        envoy.stop()
