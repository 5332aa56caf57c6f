"""A small bounded HTTP load generator (aiohttp) shared by the benchmarks.

Closed loop (`closed_loop`): C workers each send back-to-back requests, for gateway overhead. Open-loop replay
with fixed arrival times lives with the scenarios. Every loop is bounded by a request count and a deadline.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass
class Result:
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def count(self) -> int:
        return len(self.latencies_s)

    @property
    def rps(self) -> float:
        return self.count / self.wall_s if self.wall_s else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no data."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[k]


def chat_body(model: str, max_tokens: int = 1, content: str = "ping", stream: bool = False) -> bytes:
    return orjson.dumps({"model": model, "max_tokens": max_tokens, "stream": stream,
                         "messages": [{"role": "user", "content": content}]})


async def closed_loop(url: str, body: bytes, concurrency: int, total: int, deadline_s: float = 120.0,
                      warmup: int = 20) -> Result:
    """`total` requests from `concurrency` workers, keep-alive connections; latency per request."""
    res = Result()
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(warmup):
            async with session.post(url, data=body, headers=headers) as resp:
                await resp.read()
        remaining = total
        stop_at = time.monotonic() + deadline_s

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0 and time.monotonic() < stop_at:
                remaining -= 1
                t0 = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        await resp.read()
                        res.statuses[resp.status] = res.statuses.get(resp.status, 0) + 1
                        if resp.status != 200:
                            res.errors += 1
                            continue
                except aiohttp.ClientError:
                    res.errors += 1
                    continue
                res.latencies_s.append(time.perf_counter() - t0)

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        res.wall_s = time.perf_counter() - t_start
    return res
