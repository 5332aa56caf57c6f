"""The Lua scripts are package data: a plain (non-editable) `pip install .` must ship them, and the Redis store
must load them from the installed package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_built_wheel_ships_the_lua_scripts_and_the_store_loads_them(tmp_path: Path) -> None:
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("extproc", "bench"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"extproc/budgets/lua/admit.lua", "extproc/budgets/lua/settle.lua"} <= names
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = ("import extproc.budgets.redis_store as r, sys; "
             "assert r.__file__.startswith(sys.argv[1]), r.__file__; "
             "assert 'redis.call' in r.SCRIPTS[0] and 'redis.call' in r.SCRIPTS[1]")
    run = subprocess.run([sys.executable, "-c", probe, str(site)], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
