"""The Scraper against real local aiohttp servers on loopback: success, timeout, refused, recovery, rounds."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from extproc.config import PoolConfig
from extproc.routing.policy import RoutingPolicy
from extproc.routing.pool import Pool
from extproc.routing.scrape import Scraper
from tests.waiting import wait_for_async

from .pages import sglang_page, vllm_page

pytestmark = pytest.mark.timeout(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeReplica:
    """One /metrics endpoint whose behaviour a test switches: ok, slow (hangs), status, page."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.page = vllm_page(running=3, waiting=1, kv=0.25, gen=100, ttft=[0.2] * 4, blocks=500)
        self.mode = "ok"
        self.status = 500
        self.requests = 0
        self.peers: set[tuple] = set()
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def handler(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.peers.add(request.transport.get_extra_info("peername"))
        if self.mode == "slow":
            try:
                await asyncio.wait_for(self.release.wait(), 5)
            except asyncio.TimeoutError:
                pass
        if self.mode == "status":
            return web.Response(status=self.status, text="no")
        return web.Response(body=self.page, content_type="text/plain")

    async def start(self) -> "FakeReplica":
        app = web.Application()
        app.router.add_get("/metrics", self.handler)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        self.release = asyncio.Event()


@pytest.fixture
async def replicas():
    made: list[FakeReplica] = []

    async def make(start: bool = True, port: int | None = None) -> FakeReplica:
        r = FakeReplica(port)
        made.append(r)
        return await r.start() if start else r

    yield make
    for r in made:
        await r.stop()


def make_scraper(addresses: list[str], style: str = "vllm", **policy) -> tuple[Pool, Scraper]:
    pool = Pool.from_config(PoolConfig(model=f"m-{uuid.uuid4().hex[:8]}", replicas=addresses, metrics_style=style))
    kw = {"scrape_interval_s": 0.05, "scrape_timeout_s": 0.3, "window_s": 5.0}
    kw.update(policy)
    return pool, Scraper([pool], RoutingPolicy(**kw))


def sample(name: str, pool: Pool, replica: str | None = None) -> float | None:
    labels = {"pool": pool.model}
    if replica is not None:
        labels["replica"] = replica
    return REGISTRY.get_sample_value(name, labels)


async def test_scrape_once_fills_engine_state_and_calls_listeners(replicas):
    fake = await replicas()
    pool, scraper = make_scraper([fake.address])
    calls = []
    scraper.listeners.append(lambda: calls.append(scraper.rounds))
    try:
        before = time.monotonic()
        assert await scraper.scrape_once() == 1
        r = pool.replicas[0]
        e = r.engine
        assert before <= e.scraped_at <= time.monotonic()
        assert (e.running, e.waiting, e.kv_usage, e.scrape_failures) == (3, 1, 0.25, 0)
        assert e.kv_capacity_tokens == 8000 and r.kv_capacity_tokens == 8000  # on_scrape copied it
        assert calls == [1]
        assert scraper.is_fresh(r) and scraper.scrapes_ok == 1
        assert sample("sluice_replica_running", pool, fake.address) == 3.0
        assert sample("sluice_replica_kv_usage", pool, fake.address) == 0.25
        assert sample("sluice_scrape_duration_seconds_count", pool) == 1.0
        age = sample("sluice_replica_scrape_age_seconds", pool, fake.address)
        assert age is not None and 0 <= age < 5
    finally:
        await scraper.stop()


async def test_windowed_values_over_successive_scrapes(replicas):
    fake = await replicas()
    pool, scraper = make_scraper([fake.address])
    try:
        fake.page = vllm_page(running=2, gen=1000, ttft=[0.2] * 10)
        await scraper.scrape_once()
        await asyncio.sleep(0.2)  # time between the two scrapes: the rates are differenced over it
        fake.page = vllm_page(running=2, gen=1500, ttft=[0.2] * 10 + [8.0] * 10)
        await scraper.scrape_once()
        e = pool.replicas[0].engine
        assert e.ttft_count_window == 10
        assert 5.0 < e.ttft_p95_s <= 10.0   # only the 10 new (slow) first tokens count
        assert e.generation_tps == pytest.approx(500 / e.window_span_s)
    finally:
        await scraper.stop()


async def test_timeout_is_a_failure_and_the_old_state_goes_stale(replicas):
    fake = await replicas()
    pool, scraper = make_scraper([fake.address], scrape_timeout_s=0.2, stale_after_s=0.25)
    r = pool.replicas[0]
    try:
        assert await scraper.scrape_once() == 1
        scraped_at = r.engine.scraped_at
        fake.mode = "slow"
        t0 = time.monotonic()
        assert await scraper.scrape_once() == 0
        assert time.monotonic() - t0 < 1.0         # bounded by the timeout, not the replica
        assert r.engine.scrape_failures == 1
        assert r.engine.scraped_at == scraped_at   # not refreshed
        assert r.engine.running == 3               # last known numbers kept
        assert not scraper.is_fresh(r, scraped_at + 0.3)
        assert scraper.is_fresh(r, scraped_at + 0.2)
        assert sample("sluice_scrape_failures_total", pool, fake.address) == 1.0
        fake.mode = "ok"
        fake.release.set()
        assert await scraper.scrape_once() == 1
        assert r.engine.scrape_failures == 0 and r.engine.scraped_at > scraped_at
    finally:
        await scraper.stop()


async def test_connection_refused_counts_failures_until_the_replica_comes_back(replicas):
    fake = await replicas(start=False)           # nothing listens on its port yet
    pool, scraper = make_scraper([fake.address])
    r = pool.replicas[0]
    try:
        assert await scraper.scrape_once() == 0
        assert await scraper.scrape_once() == 0
        assert r.engine.scrape_failures == 2 and r.engine.scraped_at == 0.0
        assert not scraper.is_fresh(r)
        assert scraper.scrapes_failed == 2
        await fake.start()
        assert await scraper.scrape_once() == 1
        assert r.engine.scrape_failures == 0 and scraper.is_fresh(r)
        assert sample("sluice_scrape_failures_total", pool, fake.address) == 2.0
    finally:
        await scraper.stop()


async def test_crash_and_restart_on_the_same_port_is_seen_as_a_restart(replicas):
    fake = await replicas()
    pool, scraper = make_scraper([fake.address])
    r = pool.replicas[0]
    try:
        fake.page = vllm_page(gen=90_000, ttft=[0.1] * 40)
        await scraper.scrape_once()
        await fake.stop()
        assert await scraper.scrape_once() == 0
        fake.page = vllm_page(gen=12, ttft=[0.1])  # a fresh engine: counters from zero
        await fake.start()
        assert await scraper.scrape_once() == 1
        assert getattr(r.engine, "restarted") is True
        assert await scraper.scrape_once() == 1
        assert getattr(r.engine, "restarted") is False
    finally:
        await scraper.stop()


async def test_non_200_and_pages_without_engine_metrics_fail(replicas):
    fake = await replicas()
    pool, scraper = make_scraper([fake.address])
    r = pool.replicas[0]
    try:
        fake.mode = "status"
        assert await scraper.scrape_once() == 0
        fake.mode = "ok"
        fake.page = b"# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.0\n"
        assert await scraper.scrape_once() == 0
        assert r.engine.scrape_failures == 2
        fake.page = sglang_page(running=5)        # an SGLang page for a vLLM pool is not an engine page either
        assert await scraper.scrape_once() == 0
    finally:
        await scraper.stop()


async def test_sglang_pool(replicas):
    fake = await replicas()
    fake.page = sglang_page(running=6, waiting=2, usage=0.5)
    pool, scraper = make_scraper([fake.address], style="sglang")
    try:
        assert await scraper.scrape_once() == 1
        e = pool.replicas[0].engine
        assert (e.running, e.waiting, e.kv_usage) == (6, 2, 0.5)
    finally:
        await scraper.stop()


async def test_one_connection_is_reused_across_scrapes(replicas):
    fake = await replicas()
    pool, scraper = make_scraper([fake.address])
    try:
        for _ in range(5):
            assert await scraper.scrape_once() == 1
        assert fake.requests == 5
        assert len(fake.peers) == 1
    finally:
        await scraper.stop()


async def test_loop_scrapes_all_replicas_concurrently_and_a_hung_one_delays_no_one(replicas):
    good, other, hung = await replicas(), await replicas(), await replicas()
    hung.mode = "slow"
    pool, scraper = make_scraper([good.address, other.address, hung.address], scrape_interval_s=0.05,
                                 scrape_timeout_s=2.0)
    rounds = []
    scraper.listeners.append(lambda: rounds.append(time.monotonic()))
    try:
        await scraper.start()
        await asyncio.sleep(0.6)  # the loop runs for 0.6 s with one replica hung for 2 s: the others' rounds go on
        now = time.monotonic()
        g, o, h = pool.replicas
        assert scraper.is_fresh(g, now) and now - g.engine.scraped_at < 0.2
        assert scraper.is_fresh(o, now)
        assert h.engine.scraped_at == 0.0
        assert len(rounds) >= 6                   # rounds keep their pace (0.05 s) while one scrape hangs
        assert good.requests >= 6 and hung.requests == 1  # no second scrape piles onto the hung one
        t0 = time.monotonic()
    finally:
        await scraper.stop()
    assert time.monotonic() - t0 < 1.0            # stop cancels the hung scrape


async def test_listener_errors_do_not_stop_the_loop(replicas):
    fake = await replicas()
    pool, scraper = make_scraper([fake.address])
    seen = []

    def broken() -> None:
        raise RuntimeError("boom")

    scraper.listeners += [broken, lambda: seen.append(1)]
    try:
        await scraper.start()
        await wait_for_async(lambda: len(seen) >= 3)
        assert len(seen) >= 3
    finally:
        await scraper.stop()


async def test_replicas_added_and_removed_at_run_time(replicas):
    a, b = await replicas(), await replicas()
    pool, scraper = make_scraper([a.address])
    try:
        await scraper.scrape_once()
        pool.replicas.append(type(pool.replicas[0])(address=b.address, pool=pool.model))
        assert await scraper.scrape_once() == 2
        assert pool.replicas[1].engine.running == 3
        assert sample("sluice_replica_running", pool, a.address) == 3.0
        del pool.replicas[0]
        assert await scraper.scrape_once() == 1
        assert sample("sluice_replica_running", pool, a.address) is None  # its series are dropped
    finally:
        await scraper.stop()


async def test_scraper_and_health_tracker_crash_then_recover_enters_slow_start(replicas):
    from extproc.routing.health import HealthTracker
    from extproc.routing.pool import EJECTED, HEALTHY, RECOVERING

    a, b = await replicas(), await replicas()
    pool, scraper = make_scraper([a.address, b.address])
    tracker = HealthTracker(pool, scraper.policy.health)
    scraper.listeners.append(tracker.on_scrape_round)
    ra, rb = pool.replicas
    try:
        a.page = vllm_page(gen=50_000, ttft=[0.1] * 30)
        await scraper.scrape_once()
        assert ra.state == HEALTHY
        await a.stop()                            # crash
        for _ in range(5):
            await scraper.scrape_once()
        assert ra.state == EJECTED and not ra.routable and rb.state == HEALTHY
        a.page = vllm_page(gen=3, ttft=[])        # restarted engine
        await a.start()
        await scraper.scrape_once()
        assert ra.state == RECOVERING and ra.weight == 0.1
    finally:
        await scraper.stop()
