"""extproc/endpoints.py wires discovery to the Fleet and to Envoy's EDS files: the first resolution fills the pool
before traffic, a later change reaches the pool (slow start) and the EDS file, a reload's new entries reach the
running resolver. The resolver here is a stand-in (a dict); tests/discovery/test_names_e2e.py resolves for real."""

from __future__ import annotations

import yaml

from extproc.config import policy_from_dict
from extproc.endpoints import Endpoints
from extproc.fleet import Fleet
from extproc.routing.pool import HEALTHY, RECOVERING


class Names:
    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers

    async def __call__(self, host: str) -> list[str]:
        return list(self.answers.get(host, []))


def _policy(entries: list) -> object:
    return policy_from_dict({"pools": [{"model": "m", "replicas": entries, "discovery": {"remove_after": 1}},
                                       {"model": "fixed", "replicas": ["10.6.0.1:8000"]}]})


def _eds(tmp_path) -> list[str]:
    doc = yaml.safe_load((tmp_path / "eds-pool-m.yaml").read_text())
    eps = doc["resources"][0]["endpoints"][0].get("lb_endpoints", [])
    return sorted(f"{e['endpoint']['address']['socket_address']['address']}:"
                  f"{e['endpoint']['address']['socket_address']['port_value']}" for e in eps)


async def test_names_fill_the_pool_before_traffic_and_follow_changes(tmp_path):
    names = Names({"vllm.test": ["10.6.0.2", "10.6.0.3"]})
    policy = _policy([{"dns": "vllm.test:8000"}])
    fleet = Fleet(policy)
    endpoints = Endpoints(fleet, policy, tmp_path, lookup=names)
    await endpoints.start()
    try:
        pool = fleet.pools["m"]
        assert [(r.address, r.state) for r in pool.replicas] == [("10.6.0.2:8000", HEALTHY),
                                                                 ("10.6.0.3:8000", HEALTHY)]
        assert _eds(tmp_path) == ["10.6.0.2:8000", "10.6.0.3:8000"]
        assert not (tmp_path / "eds-pool-fixed.yaml").exists()  # a pool of fixed addresses stays STATIC
        assert endpoints.eds_endpoints() == {"pool-m": ["10.6.0.2:8000", "10.6.0.3:8000"]}

        names.answers["vllm.test"] = ["10.6.0.3", "10.6.0.4"]
        await endpoints.dns.refresh()
        assert pool.by_address("10.6.0.4:8000").state == RECOVERING
        assert pool.by_address("10.6.0.2:8000") is None  # nothing in flight: gone at once
        assert _eds(tmp_path) == ["10.6.0.3:8000", "10.6.0.4:8000"]

        # a reload adds a fixed address to the pool and a second name
        names.answers["other.test"] = ["10.6.0.9"]
        await endpoints.on_reload(_policy(["10.6.0.8:8000", {"dns": "vllm.test:8000"}, "other.test:9000"]))
        assert sorted(r.address for r in pool.replicas) == ["10.6.0.3:8000", "10.6.0.4:8000", "10.6.0.8:8000",
                                                            "10.6.0.9:9000"]
        assert _eds(tmp_path) == ["10.6.0.3:8000", "10.6.0.4:8000", "10.6.0.8:8000", "10.6.0.9:9000"]
    finally:
        await endpoints.stop()


async def test_a_policy_without_names_starts_no_resolver(tmp_path):
    policy = policy_from_dict({"pools": [{"model": "fixed", "replicas": ["10.6.0.1:8000"]}]})
    endpoints = Endpoints(Fleet(policy), policy, tmp_path)
    await endpoints.start()
    assert not endpoints.active and endpoints.known and list(tmp_path.iterdir()) == []
    await endpoints.stop()
