"""sluice as the endpoint picker of an InferencePool, end to end: the real Envoy configured the way Gateway API
implementations configure it for an InferencePool backend (extproc/xds_epp.py: an ORIGINAL_DST cluster routed by
the x-gateway-destination-endpoint header, the EPP as ext_proc, FailOpen to a cluster of the pool's endpoints or
FailClose 503), `sluice serve` in EPP mode as the picker, simulated vLLM replicas, and the official openai SDK:

  - chat (streaming and not) and completions get answers from a replica sluice picked;
  - the subset hint (here copied from a test header into `envoy.lb.subset_hint`, as a gateway's rule would set it)
    confines the pick; a hint with no eligible endpoint is the protocol's 503;
  - sluice sheds with 429 through the gateway;
  - the gRPC health service answers readiness on the ext_proc port;
  - the picker down: FailOpen keeps traffic flowing through the pool's own cluster, FailClose answers 503.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Iterator

import grpc
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import AsyncOpenAI

from extproc.config import policy_from_dict, policy_to_dict
from extproc.supervisor import Child, free_ports, http_ok
from extproc.xds_epp import FAIL_CLOSE, FAIL_OPEN, GatewayApiShape, render_gateway_api_bootstrap
from tests.discovery.envoy_harness import Envoy
from tests.integration.conftest import metric_sum, wait_for

pytestmark = pytest.mark.integration

SUBSET = "x-test-subset"
MAX_OPEN = 4  # the picker's open-request limit: a fifth concurrent request is shed with 429


class Setup:
    def __init__(self, tmp: Path) -> None:
        ports = free_ports(13)
        self.replicas = [f"127.0.0.1:{p}" for p in ports[:3]]
        sim_admin = ports[3:6]
        grpc_port, metrics_port, admin_port = ports[6:9]
        self.open_port, self.open_admin, self.closed_port, self.closed_admin = ports[9:13]
        self.epp_address = f"127.0.0.1:{grpc_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        logs = tmp / "logs"
        self.sims = [Child(f"sim {a}", [sys.executable, "-m", "extproc.sim", "--host", "127.0.0.1", "--port",
                                        a.split(":")[1], "--model", "sim-model", "--name", a, "--admin-port",
                                        str(adm), "--preset", "tiny-cpu"], logs / f"sim-{i}.log",
                           f"http://{a}/health")
                     for i, (a, adm) in enumerate(zip(self.replicas, sim_admin))]
        policy = policy_from_dict({
            "pools": [{"model": "sim-model", "replicas": self.replicas}],
            "sidecar": {"grpc_port": grpc_port, "metrics_port": metrics_port, "admin_port": admin_port,
                        "max_open_requests": MAX_OPEN},
            "simulator": {"enabled": False},
            "epp": {"enabled": True, "max_endpoints": 1, "failure_mode": "FailOpen"},
        })
        policy_file = tmp / "epp.yaml"
        policy_file.write_text(yaml.safe_dump(policy_to_dict(policy)))
        self.picker = Child("sluice epp", [sys.executable, "-m", "extproc.cli", "serve", "--config",
                                           str(policy_file)], logs / "epp.log", f"http://127.0.0.1:{metrics_port}/ready")
        self.envoys = {}
        for mode, port, admin in ((FAIL_OPEN, self.open_port, self.open_admin),
                                  (FAIL_CLOSE, self.closed_port, self.closed_admin)):
            workdir = tmp / mode
            workdir.mkdir()
            shape = GatewayApiShape(pool="sim-pool", listen_port=port, admin_port=admin,
                                    epp_address=self.epp_address, endpoints=self.replicas, failure_mode=mode,
                                    subset_hint_header=SUBSET)
            self.envoys[mode] = (Envoy(workdir, render_gateway_api_bootstrap(shape, policy)), admin)

    def start(self) -> None:
        for child in [*self.sims, self.picker]:
            child.start()
        for child in [*self.sims, self.picker]:
            assert wait_for(lambda: http_ok(child.ready_url), 30), f"{child.name}:\n{child.log_tail()}"
        for envoy, admin in self.envoys.values():
            envoy.start(admin)

    def stop(self) -> None:
        for envoy, _ in self.envoys.values():
            envoy.stop()
        for child in [self.picker, *self.sims]:
            child.stop()

    def client(self, mode: str = FAIL_OPEN, **headers: str) -> AsyncOpenAI:
        port = self.open_port if mode == FAIL_OPEN else self.closed_port
        return AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30,
                           default_headers=headers or None)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup(tmp_path_factory.mktemp("epp"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


async def _chat(client: AsyncOpenAI, stream: bool, max_tokens: int = 16) -> tuple[str, str]:
    """(text, the replica that served it) of one chat completion."""
    messages = [{"role": "user", "content": "hello from the gateway"}]
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(model="sim-model", messages=messages,
                                                                     max_tokens=max_tokens)
        return raw.parse().choices[0].message.content, raw.headers["x-sim-replica"]
    raw = await client.chat.completions.with_raw_response.create(model="sim-model", messages=messages,
                                                                 max_tokens=max_tokens, stream=True)
    text = ""
    async for chunk in raw.parse():
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return text, raw.headers["x-sim-replica"]


async def test_the_openai_sdk_through_the_gateway_api_shape_with_sluice_as_the_picker(setup: Setup):
    admitted = metric_sum(setup.metrics_url, "sluice_admitted_total")
    async with setup.client() as client:
        served = set()
        for stream in (False, True, False, True):
            text, replica = await _chat(client, stream)
            assert text and replica in setup.replicas
            served.add(replica)
        raw = await client.completions.with_raw_response.create(model="sim-model", prompt="once upon",
                                                                max_tokens=8)
        assert raw.parse().choices[0].text and raw.headers["x-sim-replica"] in setup.replicas
    assert metric_sum(setup.metrics_url, "sluice_admitted_total") == admitted + 5  # every request was sluice's pick
    # each request's end (its ext_proc stream closing: the gateway sends no access log) released its accounting
    assert wait_for(lambda: metric_sum(setup.metrics_url, "sluice_inflight_requests") == 0, 5)
    async with setup.client(FAIL_CLOSE) as client:  # the FailClose gateway works the same while sluice is up
        assert (await _chat(client, True))[0]


async def test_the_subset_hint_confines_the_pick_and_an_empty_one_is_a_503(setup: Setup):
    only = setup.replicas[2]
    async with setup.client(**{SUBSET: only}) as client:
        for stream in (True, False, True, False):
            assert (await _chat(client, stream))[1] == only
    two = f"{setup.replicas[1]},{setup.replicas[0]}"
    async with setup.client(**{SUBSET: two}) as client:
        assert {(await _chat(client, True))[1] for _ in range(4)} <= set(setup.replicas[:2])
    async with setup.client(**{SUBSET: "10.255.0.1:8000"}) as client:
        with pytest.raises(openai.APIStatusError) as err:
            await _chat(client, True)
    assert err.value.status_code == 503 and err.value.code == "pool_unavailable"


async def test_sluice_sheds_with_429_through_the_gateway(setup: Setup):
    async with setup.client() as client:
        results = await asyncio.gather(*(_chat(client, True, max_tokens=300) for _ in range(MAX_OPEN + 4)),
                                       return_exceptions=True)
    shed = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if isinstance(r, tuple)]
    assert shed and served and len(shed) + len(served) == len(results), results
    assert {e.code for e in shed} == {"gateway_at_capacity"} and all(e.status_code == 429 for e in shed)


async def test_the_grpc_health_service_says_ready(setup: Setup):
    async with grpc.aio.insecure_channel(setup.epp_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("readiness", "liveness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_the_picker_down_fails_open_or_closed_as_the_pool_says(setup: Setup):
    """Last in this module: it stops the picker."""
    setup.picker.stop()
    assert setup.picker.proc.returncode == 0, setup.picker.log_tail()
    async with setup.client(FAIL_OPEN) as client:
        served = [await _chat(client, stream) for stream in (True, False, True, False, True, False)]
    assert all(text for text, _ in served) and {r for _, r in served} <= set(setup.replicas)
    async with setup.client(FAIL_CLOSE) as client:
        with pytest.raises(openai.APIStatusError) as err:
            await _chat(client, True)
    assert err.value.status_code == 503
