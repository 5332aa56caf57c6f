"""Fixtures: a real redis-server (Debian package `redis-server`) on a free loopback port, and budget builders.

The server runs with `--save "" --appendonly no` and is killed by PID at teardown. Tests that kill / restart Redis
use `redis_proc` (their own server); the rest share one session server and isolate themselves by key prefix.
"""

from __future__ import annotations

import signal
import uuid
from typing import Any, AsyncIterator, Iterator

import pytest
import pytest_asyncio

import bench.redis_server
from extproc.budgets import BudgetPolicy, Budgets
from extproc.config import parse_section
from extproc.request import LLMRequest
from tests.tools import tool


class RedisProc(bench.redis_server.RedisProc):
    """bench/redis_server.py's server, the program found by tests.tools.tool: a test fails naming the package to
    install when it is missing."""

    def start(self) -> None:
        self.exe = tool("redis-server")
        super().start()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProc]:
    r = RedisProc()
    r.start()
    yield r
    r.kill()


@pytest.fixture
def redis_proc() -> Iterator[RedisProc]:
    """A private server for tests that kill or pause it."""
    r = RedisProc()
    r.start()
    yield r
    if r.proc is not None:
        try:
            r.signal(signal.SIGCONT)
        except ProcessLookupError:
            pass
    r.kill()


def policy(kind: str = "memory", url: str | None = None, prefix: str | None = None, **sections: Any) -> BudgetPolicy:
    """A BudgetPolicy on the given store kind; `sections` are `budgets:` sections (store overrides merged)."""
    d: dict[str, Any] = dict(sections)
    st = dict(d.pop("store", {}))
    st["kind"] = kind
    if kind == "redis":
        r = dict(st.get("redis", {}))
        r["url"] = url
        r["key_prefix"] = prefix or f"test-{uuid.uuid4().hex[:8]}:"
        st["redis"] = r
    d["store"] = st
    return parse_section("budgets", d)


@pytest_asyncio.fixture(params=["memory", "redis"])
async def make_budgets(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """make_budgets(**sections) -> started Budgets on the parametrized store (memory, or the session Redis).

    Budgets made by one test share a key prefix, i.e. they act as sidecars sharing one Redis."""
    made: list[Budgets] = []
    kind = request.param
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None

    async def make(capacity: Any = None, **sections: Any) -> Budgets:
        if kind == "redis":  # patient timeouts: these tests are about the algorithms, not the fallback, and at the
            # default 50 ms a stall of this shared machine fell back to the local share (test_fallback.py tests it)
            store = dict(sections.get("store", {}))
            store["redis"] = {"connect_timeout_s": 5.0, "socket_timeout_s": 5.0, **store.get("redis", {})}
            sections["store"] = store
        b = Budgets(policy(kind, url, prefix, **sections), capacity_rps=capacity)
        await b.start()
        made.append(b)
        return b

    make.kind = kind  # type: ignore[attr-defined]
    yield make
    for b in made:
        await b.close()


_seq = iter(range(1, 10**9))


def req(prompt: int = 100, out: int = 100, *, tenant: str = "acme", model: str = "m", task_id: str | None = None,
        body: bytes | None = None, **kw: Any) -> LLMRequest:
    """An LLMRequest with a unique body fingerprint and request id unless given."""
    n = next(_seq)
    return LLMRequest(request_id=kw.pop("request_id", f"req-{n}"), endpoint="chat", model=model, stream=False,
                      prompt_tokens=prompt, max_output_tokens=out, tenant=tenant, task_id=task_id,
                      body_fingerprint=body if body is not None else n.to_bytes(16, "big"), **kw)
