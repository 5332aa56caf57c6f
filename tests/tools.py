"""Programs the tests run besides the venv's (redis-server, promtool, ...): `make test` installs them (apt-get, as
root; TEST_TOOLS in the Makefile lists each with its Debian package). A missing one fails the test that needs it
with the command that installs it; it is never a reason to skip."""

from __future__ import annotations

import re
import shutil
from functools import cache
from pathlib import Path

import pytest

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


@cache
def packages() -> dict[str, str]:
    """command -> Debian package, from the Makefile's TEST_TOOLS (the one list `make test` installs from)."""
    text = MAKEFILE.read_text().replace("\\\n", " ")
    line = re.search(r"^TEST_TOOLS\s*:?=(.*)$", text, re.M)
    assert line, f"no TEST_TOOLS in {MAKEFILE}"
    return dict(entry.split(":", 1) for entry in line.group(1).split())


def tool(command: str) -> str:
    """The path of `command`; fails the calling test, saying how to install it, when it is not on PATH."""
    package = packages().get(command)
    assert package, f"{command} is not in the Makefile's TEST_TOOLS: add it there so that `make test` installs it"
    path = shutil.which(command)
    if path is None:
        pytest.fail(f"{command} is not installed: run `make test` as root (it installs it), or "
                    f"`apt-get install -y --no-install-recommends {package}`", pytrace=False)
    return path
