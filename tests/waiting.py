"""Waiting in tests: poll a condition until it holds or a deadline passes; never sleep a fixed time and hope.

    assert wait_for(lambda: metric_sum(url, "sluice_inflight_requests") == 0, 5)
    assert await wait_for_async(lambda: len(seen) == 1)

Both return the condition's last value (truthy once it held), so the caller's `assert` says what it waited for;
the condition is evaluated once more at the deadline. `wait_for_async` also takes a condition that returns an
awaitable (e.g. `lambda: asyncio.to_thread(scrape, url)`) and awaits it.

A sleep whose length is itself the test's subject is not a wait for a condition and stays a sleep, with a comment
saying why: pacing a load, a fake replica's latency, a window in which something must NOT happen.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float = 5.0, interval: float = 0.05) -> T:
    """Call `pred` every `interval` seconds until it returns something truthy or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


async def wait_for_async(pred: Callable[[], T | Awaitable[T]], timeout: float = 5.0, interval: float = 0.005) -> Any:
    """`wait_for` for the event loop: sleeps with asyncio.sleep, so the code under test runs in between."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if inspect.isawaitable(value):
            value = await value
        if value or time.monotonic() >= deadline:
            return value
        await asyncio.sleep(interval)
