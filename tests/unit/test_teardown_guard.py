"""tests/teardown_guard.py: a teardown that never ends (a task that swallows its cancellation, left on
pytest-asyncio's loop) ends the pytest run with status 1, the test named, within the limit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STUBBORN = '''
import asyncio

async def stubborn():
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # swallowed: the loop's teardown waits for this task for ever

async def test_leaves_a_stubborn_task():
    asyncio.get_running_loop().create_task(stubborn())
'''


def test_a_hung_teardown_ends_the_run_naming_the_test(tmp_path: Path) -> None:
    (tmp_path / "test_stubborn.py").write_text(STUBBORN)
    env = dict(os.environ, SLUICE_TEARDOWN_LIMIT_S="1", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.teardown_guard",
         "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function",
         "--rootdir", str(tmp_path), str(tmp_path / "test_stubborn.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stdout + done.stderr
    assert "test_stubborn.py::test_leaves_a_stubborn_task: teardown still running after 1 s" in done.stderr
    assert "stubborn" in done.stderr  # the stacks name the task's coroutine
    assert took < 30
