"""Admin API (status, drain, undrain, reload) and the CLI functions, against an in-process Gateway + admin server.

The CLI functions are blocking (sync gRPC), so they run in a thread while the server runs on the test's loop.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from extproc import opscli, top
from extproc.admin import admin_pb2 as pb
from extproc.admin import admin_pb2_grpc as pb_grpc
from extproc.admin.client import AdminClient, AdminError, admin_addresses
from extproc.admin.service import start_admin_server
from extproc.admission.queue import Waiter
from extproc.admission.scheduler import Placement
from extproc.config import policy_from_dict
from extproc.gateway import Gateway
from extproc.routing.health import HealthTracker
from extproc.routing.policy import HealthPolicy
from extproc.routing.pool import EJECTED, HEALTHY, RECOVERING
from extproc.supervisor import free_ports

from .conftest import BASE, AdminEnv, req, write_policy


async def call(fn, *args):
    return await asyncio.to_thread(fn, *args)


async def aio_stub(address: str) -> tuple[grpc.aio.Channel, pb_grpc.AdminStub]:
    ch = grpc.aio.insecure_channel(address)
    return ch, pb_grpc.AdminStub(ch)


async def test_status_reports_replicas_lanes_and_queues(admin: AdminEnv):
    gw = admin.gateway
    sched = gw.schedulers["m"]
    placed = [sched.submit(req(), time.monotonic()) for _ in range(2)]
    assert all(isinstance(p, Placement) for p in placed)
    held = sched.submit(req(), time.monotonic())
    assert isinstance(held, Waiter)
    r0 = gw.pools["m"].replicas[0]
    r0.engine.kv_usage, r0.engine.running, r0.engine.waiting, r0.engine.ttft_p95_s = 0.42, 3, 1, 0.25
    r0.engine.scraped_at = time.monotonic() - 0.5

    ch, stub = await aio_stub(admin.address)
    async with ch:
        st = await stub.Status(pb.StatusRequest())
    assert [p.model for p in st.pools] == ["m"]
    pool = st.pools[0]
    assert pool.inflight_requests == 2 and pool.queued == 1
    by_addr = {r.address: r for r in pool.replicas}
    assert set(by_addr) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    r = by_addr["10.0.0.1:8000"]
    assert (r.state, r.weight, r.draining, r.routable) == (HEALTHY, 1.0, False, True)
    assert r.kv_usage == pytest.approx(0.42) and (r.running, r.waiting) == (3, 1)
    assert r.ttft_p95_s == pytest.approx(0.25) and 0.4 < r.scrape_age_s < 5
    assert r.inflight_requests == 1 and r.inflight_tokens == 20
    assert by_addr["10.0.0.2:8000"].scrape_age_s == -1  # never scraped
    lanes = {lane.name: lane for lane in pool.lanes}
    assert list(lanes) == ["short", "normal", "long"]
    assert lanes["short"].queued == 1 and lanes["short"].inflight_requests == 2
    assert dict(lanes["short"].queued_by_priority) == {"interactive": 1}
    assert lanes["long"].max_queue == 200
    assert pool.admitted_total >= 2
    held.future.cancel()
    sched.abandon(held)


async def test_status_unknown_pool_is_not_found(admin: AdminEnv):
    ch, stub = await aio_stub(admin.address)
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Status(pb.StatusRequest(pool="nope"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in exc.value.details()


async def test_drain_stops_new_traffic_and_undrain_slow_starts(admin: AdminEnv, capsys):
    gw = admin.gateway
    target = gw.pools["m"].replicas[0]
    assert await call(opscli.main_drain, admin.argv("10.0.0.1:8000")) == 0
    assert "10.0.0.1:8000 drained" in capsys.readouterr().out
    assert target.draining and not target.routable
    assert REGISTRY.get_sample_value("sluice_replica_draining", {"pool": "m", "replica": "10.0.0.1:8000"}) == 1
    # new requests avoid the drained replica
    placed = gw.schedulers["m"].submit(req(), time.monotonic())
    assert isinstance(placed, Placement) and placed.replica.address == "10.0.0.2:8000"
    assert all(p.address != "10.0.0.1:8000" for p in placed.pins)
    # a second drain says so, and changes nothing
    assert await call(opscli.main_drain, admin.argv("10.0.0.1:8000")) == 0
    assert "already drained" in capsys.readouterr().out

    assert await call(opscli.main_undrain, admin.argv("10.0.0.1:8000")) == 0
    out = capsys.readouterr().out
    assert "undrained: recovering at weight 0.1" in out
    assert not target.draining and target.state == RECOVERING and target.weight == pytest.approx(0.1)
    assert target.routable
    assert REGISTRY.get_sample_value("sluice_replica_draining", {"pool": "m", "replica": "10.0.0.1:8000"}) == 0
    assert REGISTRY.get_sample_value("sluice_replica_state",
                                     {"pool": "m", "replica": "10.0.0.1:8000", "state": "recovering"}) == 1


async def test_undrain_uses_the_slow_start_steps_of_the_policy(tmp_path):
    path = write_policy(tmp_path / "p.yaml", {**BASE, "routing": {"health": {"slow_start_steps": [0.2, 0.6, 1.0]}}})
    from extproc.config import load_policy

    gw = Gateway(load_policy(path))
    port = free_ports(1)[0]
    server = await start_admin_server(gw, "127.0.0.1", port, path)
    try:
        ch, stub = await aio_stub(f"127.0.0.1:{port}")
        async with ch:
            await stub.Drain(pb.DrainRequest(replica="10.0.0.2:8000"))
            resp = await stub.Undrain(pb.DrainRequest(replica="10.0.0.2:8000", pool="m"))
        assert resp.changed and resp.pool == "m"
        assert resp.replica.state == RECOVERING and resp.replica.weight == pytest.approx(0.2)
    finally:
        await server.stop(0)


async def test_undrain_goes_through_the_health_tracker(admin: AdminEnv):
    """With a HealthTracker attached, undrain is a tracker transition: the slow-start timer restarts, so the
    replica holds the first step for a full slow_start_step_s before advancing."""
    gw = admin.gateway
    pool = gw.pools["m"]
    policy = HealthPolicy(slow_start_steps=(0.1, 0.5, 1.0), slow_start_step_s=5.0)
    tracker = HealthTracker(pool, policy)
    gw.fleet.health["m"] = tracker
    r = pool.replicas[1]
    r.engine.scraped_at = time.monotonic()
    tracker.tick(time.monotonic() - 100)  # long healthy: its step timer is old
    ch, stub = await aio_stub(admin.address)
    async with ch:
        await stub.Drain(pb.DrainRequest(replica=r.address))
        resp = await stub.Undrain(pb.DrainRequest(replica=r.address))
    assert resp.replica.state == RECOVERING and resp.replica.weight == pytest.approx(0.1)
    now = time.monotonic()
    tracker.tick(now + 1.0)
    assert r.state == RECOVERING and r.weight == pytest.approx(0.1)  # not advanced at once
    tracker.tick(now + 5.5)
    assert r.weight == pytest.approx(0.5)
    assert REGISTRY.get_sample_value("sluice_replica_health_transitions_total", {
        "pool": "m", "replica": r.address, "from": HEALTHY, "to": RECOVERING, "reason": "undrain"}) >= 1


async def test_undrain_leaves_an_unreachable_replica_to_health(admin: AdminEnv):
    gw = admin.gateway
    r = gw.pools["m"].replicas[0]
    r.state, r.weight = EJECTED, 0.0
    r.engine.scrape_failures = 7
    ch, stub = await aio_stub(admin.address)
    async with ch:
        await stub.Drain(pb.DrainRequest(replica=r.address))
        resp = await stub.Undrain(pb.DrainRequest(replica=r.address))
    assert resp.changed and not r.draining
    assert r.state == EJECTED and r.weight == 0.0  # recovers through health once it answers scrapes


async def test_drain_unknown_replica_fails_clearly(admin: AdminEnv, capsys):
    assert await call(opscli.main_drain, admin.argv("10.9.9.9:1")) == 1
    err = capsys.readouterr().err
    assert "10.9.9.9:1" in err and "not in any pool" in err and "10.0.0.1:8000" in err
    ch, stub = await aio_stub(admin.address)
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Drain(pb.DrainRequest(replica=""))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_status_cli_text_and_json(admin: AdminEnv, capsys):
    admin.gateway.pools["m"].replicas[1].draining = True
    assert await call(opscli.main_status, admin.argv()) == 0
    out = capsys.readouterr().out
    assert "pool m (cluster pool-m)" in out
    row = next(line for line in out.splitlines() if "10.0.0.2:8000" in line)
    assert "healthy" in row and "yes" in row
    assert "lane short" in out and "lane long" in out

    assert await call(opscli.main_status, admin.argv("--json")) == 0
    data = json.loads(capsys.readouterr().out)
    status = data["sidecars"][0]["status"]
    assert data["sidecars"][0]["admin"] == admin.address
    reps = {r["address"]: r for r in status["pools"][0]["replicas"]}
    assert reps["10.0.0.2:8000"]["draining"] is True and reps["10.0.0.1:8000"]["draining"] is False
    assert reps["10.0.0.1:8000"]["inflight_tokens"] == 0  # 64-bit integers are numbers, not strings
    assert status["pools"][0]["lanes"][2]["max_queue"] == 200


async def test_status_cli_unreachable_sidecar(capsys):
    port = free_ports(1)[0]
    rc = await call(opscli.main_status, ["--admin", f"127.0.0.1:{port}", "--timeout", "0.5"])
    assert rc == 1
    assert "unreachable" in capsys.readouterr().err


async def test_reload_via_admin_valid_then_invalid(admin: AdminEnv, capsys):
    gw = admin.gateway
    errors_before = REGISTRY.get_sample_value("sluice_policy_reloads_total", {"result": "error"}) or 0.0
    write_policy(admin.policy_path, {**BASE, "pools": [{"model": "m", "replicas": ["10.0.0.1:8000",
                                                                                    "10.0.0.3:8000"]}]})
    assert await call(opscli.main_reload, admin.argv()) == 0
    out = capsys.readouterr().out
    assert "reloaded" in out and "10.0.0.3:8000" in out
    assert [r.address for r in gw.pools["m"].replicas] == ["10.0.0.1:8000", "10.0.0.3:8000"]
    assert REGISTRY.get_sample_value("sluice_policy_last_reload_success") == 1

    good = gw.policy
    admin.policy_path.write_text("pools:\n  - model: m\n    replicas: [not-an-address]\n")
    assert await call(opscli.main_reload, admin.argv()) == 1
    err = capsys.readouterr().err
    assert "REJECTED" in err and "not-an-address" in err and "is not host:port" in err
    assert gw.policy is good  # the old policy stays in force
    assert REGISTRY.get_sample_value("sluice_policy_reloads_total", {"result": "error"}) == errors_before + 1
    assert REGISTRY.get_sample_value("sluice_policy_last_reload_success") == 0

    ch, stub = await aio_stub(admin.address)
    async with ch:
        st = await stub.Status(pb.StatusRequest())
    assert st.last_reload.trigger == "admin" and not st.last_reload.ok and "not-an-address" in st.last_reload.error


async def test_reload_hook_is_used(policy_file):
    calls = []

    def hook(trigger: str):
        from extproc.reload import ReloadResult

        calls.append(trigger)
        return ReloadResult(True, ["hooked"], "", str(policy_file), time.time(), trigger)

    gw = Gateway(policy_from_dict(BASE))
    port = free_ports(1)[0]
    server = await start_admin_server(gw, "127.0.0.1", port, policy_file, on_reload=hook)
    try:
        resp = await asyncio.to_thread(lambda: AdminClient(f"127.0.0.1:{port}").reload())
    finally:
        await server.stop(0)
    assert calls == ["admin"] and list(resp.changes) == ["hooked"]


async def test_admin_server_port_taken_raises(admin: AdminEnv):
    port = int(admin.address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match="cannot listen"):
        await start_admin_server(admin.gateway, "127.0.0.1", port, None)


async def test_top_once_prints_one_frame(admin: AdminEnv, capsys):
    gw = admin.gateway
    r0 = gw.pools["m"].replicas[0]
    r0.engine.kv_usage, r0.engine.ttft_p95_s = 0.5, 0.123
    gw.pools["m"].replicas[1].draining = True
    assert await call(top.main, admin.argv("--once")) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # --once: plain text
    row0 = next(line for line in out.splitlines() if "10.0.0.1:8000" in line)
    assert "healthy" in row0 and "[#####.....]" in row0 and "0.123s" in row0
    row1 = next(line for line in out.splitlines() if "10.0.0.2:8000" in line)
    assert " D " in row1
    assert "short" in out and "queued 0" in out


async def test_top_refreshes_in_place_with_rates(admin: AdminEnv, monkeypatch):
    import io

    from extproc.admission import metrics as am

    class Term(io.StringIO):
        def isatty(self) -> bool:
            return True

    shed = am.SHED.labels("m", "short", "queue_full")
    real_snapshot = top.snapshot
    frames = []

    def snapshot_then_shed(clients, pool):
        out = real_snapshot(clients, pool)
        frames.append(out)
        if len(frames) == 1:
            shed.inc(5)  # 5 sheds between the first and the second frame
        return out

    monkeypatch.setattr(top, "snapshot", snapshot_then_shed)
    buf = Term()
    rc = await asyncio.to_thread(top.run, [admin.address], 0.2, False, "", 2.0, 2, buf, False)
    text = buf.getvalue()
    assert rc == 0 and len(frames) == 2
    assert text.count("\x1b[H") == 2 and "\x1b[?25l" in text and text.endswith("\x1b[?25h")
    first, second = text.split("\x1b[H")[1:]
    assert "(totals)" in first  # first frame: no rate yet
    m = re.search(r"shed (\d+\.\d)/s \((\d+)%\)", second)
    assert m and float(m.group(1)) > 0 and m.group(2) == "100", second  # nothing admitted: all shed
    assert "\x1b[K" in second  # every line clears its remnant


def test_top_frame_marks_unreachable_sidecar():
    frame = top.render_frame([("127.0.0.1:1", "connection refused")], top.Rates(), 0.0, 1.0)
    assert "UNREACHABLE" in frame and "127.0.0.1:1" in frame


def test_admin_addresses_cover_every_worker():
    policy = policy_from_dict({**BASE, "sidecar": {"workers": 3, "grpc_port": 41000, "metrics_port": 42000,
                                                   "admin_port": 43000}})
    assert admin_addresses(policy.sidecar) == ["127.0.0.1:43000", "127.0.0.1:43001", "127.0.0.1:43002"]


def test_cli_functions_need_a_valid_explicit_policy(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: []\n")
    assert opscli.main_status(["--config", str(bad)]) == 2
    assert "invalid policy" in capsys.readouterr().err
    assert opscli.main_drain([]) == 2  # REPLICA missing: argparse usage error


def test_client_error_names_the_address():
    port = free_ports(1)[0]
    with AdminClient(f"127.0.0.1:{port}", timeout_s=0.3) as c:
        with pytest.raises(AdminError) as exc:
            c.status()
    assert f"127.0.0.1:{port}" in str(exc.value) and exc.value.code == grpc.StatusCode.UNAVAILABLE
