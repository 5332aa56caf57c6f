"""Fixtures for the operations layer: an in-process Gateway with its admin API on a free loopback port."""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import pytest
import yaml

from extproc.admin.service import start_admin_server
from extproc.config import load_policy
from extproc.gateway import Gateway
from extproc.request import LLMRequest
from extproc.supervisor import free_ports

ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "pools": [{"model": "m", "replicas": ["10.0.0.1:8000", "10.0.0.2:8000"]}],
    "admission": {"kv_capacity_tokens": 10000, "max_concurrency_per_replica": 1},
}


def write_policy(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def req(prompt: int = 10, output: int = 10, model: str = "m") -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model=model, stream=True, prompt_tokens=prompt,
                      max_output_tokens=output)


class AdminEnv:
    def __init__(self, gateway: Gateway, address: str, policy_path: Path) -> None:
        self.gateway, self.address, self.policy_path = gateway, address, policy_path

    def argv(self, *args: str) -> list[str]:
        return ["--admin", self.address, *args]


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    return write_policy(tmp_path / "policy.yaml", BASE)


@pytest.fixture
async def admin(policy_file: Path) -> AsyncIterator[AdminEnv]:
    gw = Gateway(load_policy(policy_file))
    port = free_ports(1)[0]
    server = await start_admin_server(gw, "127.0.0.1", port, policy_file)
    try:
        yield AdminEnv(gw, f"127.0.0.1:{port}", policy_file)
    finally:
        await server.stop(0)
