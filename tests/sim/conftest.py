"""Fixtures: start simulators in the test's event loop (loopback, ephemeral ports), stop them after."""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest_asyncio

from extproc.sim import SimConfig, SimServer, start_sim

StartSim = Callable[..., Awaitable[SimServer]]


@pytest_asyncio.fixture
async def sim_factory() -> AsyncIterator[StartSim]:
    started: list[SimServer] = []

    async def start(**kw: Any) -> SimServer:
        kw.setdefault("port", 0)
        sim = await start_sim(SimConfig(**kw))
        started.append(sim)
        return sim

    yield start
    for sim in started:
        await sim.stop()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


def chat_body(prompt: str = "hello there", max_tokens: int | None = 8, stream: bool = False,
              **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "sim-model", "messages": [{"role": "user", "content": prompt}],
                            "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update(extra)
    return body


def words(n_tokens: int) -> str:
    """A prompt of about ``n_tokens`` tokens for the simulator's tokenizer (one per word)."""
    return " ".join(["word"] * n_tokens)
