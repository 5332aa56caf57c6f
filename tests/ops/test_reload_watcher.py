"""PolicyWatcher: reload on file change and on SIGHUP; an invalid policy is rejected and the old one stays."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from extproc.config import load_policy
from extproc.gateway import Gateway
from extproc.reload import PolicyWatcher, ReloadResult, reload_policy, restart_notes
from tests.waiting import wait_for_async as wait_until

from .conftest import BASE, write_policy

TWO = {**BASE, "pools": [{"model": "m", "replicas": ["10.0.0.1:8000", "10.0.0.3:8000"]}]}


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def addresses(gw: Gateway) -> list[str]:
    return [r.address for r in gw.pools["m"].replicas]


async def test_file_change_reloads(policy_file: Path):
    gw = Gateway(load_policy(policy_file))
    seen: list[ReloadResult] = []
    ok_before = sample("sluice_policy_reloads_total", result="ok")
    w = PolicyWatcher(policy_file, gw, on_change=seen.append, interval_s=0.05, settle_s=0.02)
    await w.start(sighup=False)
    try:
        write_policy(policy_file, TWO)
        assert await wait_until(lambda: addresses(gw) == ["10.0.0.1:8000", "10.0.0.3:8000"])
    finally:
        await w.stop()
    assert len(seen) == 1 and seen[0].ok and seen[0].trigger == "file_change"
    assert any("10.0.0.3:8000" in c for c in seen[0].changes)
    assert sample("sluice_policy_reloads_total", result="ok") == ok_before + 1
    assert sample("sluice_policy_last_reload_success") == 1
    assert sample("sluice_policy_last_reload_timestamp_seconds") == pytest.approx(time.time(), abs=10)


async def test_invalid_file_is_rejected_and_old_policy_stays(policy_file: Path, caplog):
    gw = Gateway(load_policy(policy_file))
    good = gw.policy
    seen: list[ReloadResult] = []
    errors_before = sample("sluice_policy_reloads_total", result="error")
    w = PolicyWatcher(policy_file, gw, on_change=seen.append, interval_s=0.05, settle_s=0.02)
    await w.start(sighup=False)
    try:
        with caplog.at_level(logging.ERROR, logger="sluice.reload"):
            policy_file.write_text(yaml.safe_dump({**BASE, "admission": {"kv_margin": 3}}))
            assert await wait_until(lambda: len(seen) == 1)
        assert not seen[0].ok and "kv_margin" in seen[0].error
        assert gw.policy is good and addresses(gw) == ["10.0.0.1:8000", "10.0.0.2:8000"]
        assert sample("sluice_policy_reloads_total", result="error") == errors_before + 1
        assert sample("sluice_policy_last_reload_success") == 0
        line = next(r.getMessage() for r in caplog.records if r.name == "sluice.reload")
        assert "rejected" in line and "previous policy stays in force" in line and "kv_margin" in line
        # fixing the file applies it and clears the failure
        write_policy(policy_file, TWO)
        assert await wait_until(lambda: len(seen) == 2)
        assert seen[1].ok and addresses(gw)[1] == "10.0.0.3:8000"
        assert sample("sluice_policy_last_reload_success") == 1
    finally:
        await w.stop()


async def test_yaml_syntax_error_is_rejected(policy_file: Path):
    gw = Gateway(load_policy(policy_file))
    policy_file.write_text("pools: [\n")
    result = reload_policy(policy_file, gw, trigger="sighup")
    assert not result.ok and "invalid YAML" in result.error and str(policy_file) in result.error
    assert addresses(gw) == ["10.0.0.1:8000", "10.0.0.2:8000"]


async def test_sighup_reloads(policy_file: Path):
    gw = Gateway(load_policy(policy_file))
    seen: list[ReloadResult] = []
    w = PolicyWatcher(policy_file, gw, on_change=seen.append, interval_s=60.0)  # polling out of the picture
    await w.start(sighup=True)
    try:
        # never send SIGHUP without our handler: it would end the test process
        assert w._sighup, "the watcher installed no SIGHUP handler in the test's event loop"
        write_policy(policy_file, TWO)
        os.kill(os.getpid(), signal.SIGHUP)
        assert await wait_until(lambda: len(seen) == 1)
    finally:
        await w.stop()
    assert seen[0].trigger == "sighup" and seen[0].ok
    assert addresses(gw) == ["10.0.0.1:8000", "10.0.0.3:8000"]


async def test_touch_without_change_does_not_reload(policy_file: Path):
    gw = Gateway(load_policy(policy_file))
    seen: list[ReloadResult] = []
    w = PolicyWatcher(policy_file, gw, on_change=seen.append, interval_s=0.05, settle_s=0.02)
    await w.start(sighup=False)
    try:
        st = policy_file.stat()
        os.utime(policy_file, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
        await asyncio.sleep(0.3)  # six polls of an unchanged file: the window in which no reload may happen
        assert seen == []
        write_policy(policy_file, TWO)  # a real change is still noticed after the touch
        assert await wait_until(lambda: len(seen) == 1)
    finally:
        await w.stop()


async def test_reload_rerenders_envoy_xds(policy_file: Path, tmp_path: Path):
    gw = Gateway(load_policy(policy_file))
    out = tmp_path / "envoy"
    w = PolicyWatcher(policy_file, gw, xds_out=out, xds_dir="/etc/envoy")
    write_policy(policy_file, TWO)
    result = w.reload("admin")
    assert result.ok and any("re-rendered" in c for c in result.changes)
    cds = (out / "cds.yaml").read_text()
    assert "10.0.0.3" in cds and "10.0.0.2" not in cds
    assert "/etc/envoy/lds.yaml" in (out / "bootstrap.yaml").read_text()


async def test_restart_only_changes_are_reported(policy_file: Path):
    gw = Gateway(load_policy(policy_file))
    write_policy(policy_file, {**BASE, "sidecar": {"grpc_port": 50071},
                               "gateway": {"max_downstream_connections": 500}})
    result = reload_policy(policy_file, gw)
    assert result.ok
    text = "; ".join(result.changes)
    assert "sidecar.grpc_port changed (50051 -> 50071): takes effect after a restart" in text
    assert "gateway.max_downstream_connections" in text
    assert sample("sluice_policy_max_downstream_connections") == 500
    assert restart_notes(gw.policy, gw.policy) == []


async def test_reloaded_budgets_store_is_started(policy_file: Path, monkeypatch):
    from extproc.budgets import Budgets

    started = []

    async def fake_start(self) -> None:
        started.append(self)

    monkeypatch.setattr(Budgets, "start", fake_start)
    gw = Gateway(load_policy(policy_file))
    before = gw.budgets
    write_policy(policy_file, {**BASE, "budgets": {"retry": {"max_share": 0.25}}})
    result = reload_policy(policy_file, gw)
    assert result.ok and "budgets policy replaced" in result.changes
    await wait_until(lambda: started)  # the new store is started by a task on the loop
    assert gw.budgets is not before and started == [gw.budgets]
    # an unchanged budgets section starts nothing
    write_policy(policy_file, {**BASE, "budgets": {"retry": {"max_share": 0.25}}, "sidecar": {"grpc_port": 50071}})
    assert reload_policy(policy_file, gw).ok
    await asyncio.sleep(0.05)  # the window in which an unwanted start task would have run (above: at once)
    assert len(started) == 1


async def test_streaming_change_is_reported_as_restart_only(policy_file: Path):
    gw = Gateway(load_policy(policy_file))
    write_policy(policy_file, {**BASE, "streaming": {"sample_rate": 0.5}})
    result = reload_policy(policy_file, gw)
    assert result.ok and any(c.startswith("streaming: changed") for c in result.changes)
