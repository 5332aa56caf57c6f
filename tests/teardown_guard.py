"""A pytest plugin: a test whose teardown hangs ends the run at once, naming the test and printing every
thread's stack, instead of holding CI until its own limit.

Why a plugin of our own: pytest-timeout's limit (`timeout` in pyproject.toml) does not cover the teardown of
pytest-asyncio's event loop. That teardown cancels the tasks a test left behind and waits for them to end; a task
that swallows its cancellation (a client library stuck in its connection pool, seen once in the full suite in
tests/routing/test_shared_load.py) keeps it waiting for ever, and neither of pytest-timeout's methods fires.

Every test's teardown runs under a watchdog thread: past TEARDOWN_LIMIT_S (environment
`SLUICE_TEARDOWN_LIMIT_S`), it writes the test's id and all stacks to stderr and exits the process with status 1.
Loaded by tests/conftest.py; tests/unit/test_teardown_guard.py runs it on a teardown that hangs.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from typing import Generator

import pytest

# Longer than any teardown the suite means to have (stopping Envoy, sidecars, a vLLM engine: seconds).
TEARDOWN_LIMIT_S = float(os.environ.get("SLUICE_TEARDOWN_LIMIT_S", "120"))


def _abort(config: pytest.Config, nodeid: str) -> None:
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture()  # the process ends here: write to the real stderr, not the capture
    sys.stderr.write(f"\n{nodeid}: teardown still running after {TEARDOWN_LIMIT_S:g} s; every thread's stack:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    watchdog = threading.Timer(TEARDOWN_LIMIT_S, _abort, args=(item.config, item.nodeid))
    watchdog.daemon = True
    watchdog.start()
    try:
        return (yield)
    finally:
        watchdog.cancel()
