"""Run a benchmark's coroutine on the event loop the sidecar uses: uvloop when installed (extproc/cli.py), or the
one named by the benchmark's `--loop`."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")
LOOPS = ("uvloop", "asyncio")


def default_loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(coro: Coroutine[Any, Any, T], loop: str | None = None) -> tuple[T, str]:
    """(the coroutine's result, the loop's name); `loop` None: `default_loop()`."""
    name = loop or default_loop()
    if name == "uvloop":
        import uvloop
        return uvloop.run(coro), name
    return asyncio.run(coro), name
