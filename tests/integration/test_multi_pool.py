"""Two models, two pools: the sidecar's pool header selects the cluster (route re-chosen after the body)."""

from __future__ import annotations

import openai
import pytest

from extproc.config import policy_from_dict
from extproc.supervisor import Stack, with_free_ports

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_pools(tmp_path_factory: pytest.TempPathFactory):
    policy = with_free_ports(policy_from_dict({
        "pools": [{"model": "alpha", "replicas": ["127.0.0.1:1"]},
                  {"model": "beta", "replicas": ["127.0.0.1:2", "127.0.0.1:3"]}],
        "simulator": {"enabled": True, "preset": "tiny-cpu"},
    }))
    s = Stack(policy, run_dir=tmp_path_factory.mktemp("pools"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


def test_each_model_is_served_by_its_own_pool(two_pools: Stack):
    c = openai.OpenAI(base_url=two_pools.base_url + "/v1", api_key="x", max_retries=0)
    alpha = set(two_pools.policy.pools[0].replicas)
    beta = set(two_pools.policy.pools[1].replicas)
    for model, expected in (("alpha", alpha), ("beta", beta), ("alpha", alpha), ("beta", beta)):
        raw = c.chat.completions.with_raw_response.create(model=model, max_tokens=2,
                                                          messages=[{"role": "user", "content": "x"}])
        assert raw.headers["x-sim-replica"] in expected, (model, raw.headers["x-sim-replica"])
        assert raw.parse().model == model
    assert {m.id for m in c.models.list().data} == {"alpha", "beta"}
