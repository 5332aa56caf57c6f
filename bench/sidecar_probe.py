"""`python -m bench.sidecar_probe OUT serve ...`: run `sluice serve` (extproc.cli) with a SIGUSR1 handler that writes
the process's Python-level state to OUT as JSON, for benches that must tell a Python leak from native growth.

What it writes: gc-tracked objects (total and the 25 most common types), asyncio tasks alive, Python's traced heap
(tracemalloc, when started with `-X tracemalloc`), and the per-request state of each Gateway: its open streams and
requests, tenant stream counts, the InFlight maps (live and detached request ids) and queue depths. The handler runs
between bytecodes on the main thread (the event loop's), so it reads a consistent state; a bench stack passes it as
`Stack.sidecar_wrapper`.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import signal
import sys
import tracemalloc
from pathlib import Path
from typing import Any


def gateway_state(gw: Any) -> dict[str, int]:
    """Per-request state of one extproc.gateway.Gateway: all 0 once nothing is open."""
    return {"open_streams": gw.open_streams,
            "open_requests": gw.open_requests,
            "tenant_open_streams": sum(gw.identity.open_streams.values()),
            "tenant_entries": len(gw.identity.open_streams),
            "inflight_live": len(gw.inflight.live),
            "inflight_detached": len(gw.inflight.detached),
            "queued": sum(len(q) for s in gw.schedulers.values() for q in s.queues)}


def snapshot() -> dict[str, Any]:
    from extproc.gateway import Gateway

    gc.collect()
    objects = gc.get_objects()
    by_type = collections.Counter(type(o).__qualname__ for o in objects)
    out: dict[str, Any] = {
        "gc_objects": len(objects),
        "top_types": dict(by_type.most_common(25)),
        "asyncio_tasks": sum(1 for o in objects if isinstance(o, asyncio.Task) and not o.done()),
        "gateways": [gateway_state(o) for o in objects if isinstance(o, Gateway)],
    }
    if tracemalloc.is_tracing():
        out["tracemalloc_bytes"] = tracemalloc.get_traced_memory()[0]
    return out


def main(argv: list[str]) -> int:
    out = Path(argv[0])

    def dump(_signum: int, _frame: object) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(snapshot()))
        tmp.replace(out)  # the reader never sees half a file

    signal.signal(signal.SIGUSR1, dump)
    from extproc.cli import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
