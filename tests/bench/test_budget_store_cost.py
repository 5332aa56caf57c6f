"""`python -m bench.budget_store_cost` at a tiny size: a redis-server of its own per Redis store, the three stores
taking turns, every fresh request admitted, and each server's command counts telling the stores apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import budget_store_cost
from tests.tools import tool


async def test_three_stores_side_by_side() -> None:
    tool("redis-server")  # fails, saying how to install it, when missing
    res = await budget_store_cost.measure(admits=40, warmup=5, max_seconds=20.0)
    stores = res["stores"]
    assert list(stores) == ["redis", "redis-noretry", "memory"]
    assert res["fallbacks"] == {"redis": 0, "redis-noretry": 0, "memory": 0}
    for name, s in stores.items():
        assert s["admits"] == 40 and s["refused"] == 0, name
        assert 0 < s["p50_us"] <= s["p99_us"] and s["admits_per_s"] > 0, name
    # one admit script and one settle script per request on Redis; nothing at all for the memory store
    assert stores["redis"]["redis_commands_per_admit_settle"]["evalsha"] == 2
    assert stores["redis-noretry"]["redis_commands_per_admit_settle"]["evalsha"] == 2
    assert stores["memory"]["redis_commands_per_admit_settle"] == {}
    # the retry share charges the pool's and the tenant's admitted windows; without it nothing is counted
    assert stores["redis"]["redis_commands_per_admit_settle"]["incr"] == 2
    assert "incr" not in stores["redis-noretry"]["redis_commands_per_admit_settle"]


def test_main_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool("redis-server")
    out = tmp_path / "cost.json"
    assert budget_store_cost.main(["--admits", "20", "--warmup", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["command"].startswith("python -m bench.budget_store_cost --admits 20")
    assert set(res["stores"]) == {"redis", "redis-noretry", "memory"}
    assert "redis-noretry" in capsys.readouterr().out
