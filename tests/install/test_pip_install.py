"""The newcomer's path: `pip install .` (a plain, non-editable install) into a new venv, then, from an empty
directory, `sluice check` on the built-in default policy, `sluice init`, and `sluice up` serving the openai SDK.

The install resolves every dependency as a user's would (pip's cache and the configured index). The demo's own
ports (8080, 9901, ...) may be taken on a shared machine, so `sluice up` runs the file `sluice init` wrote with
its ports moved to free ones; `sluice check` covers the built-in default itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import yaml

from extproc.supervisor import free_ports
from tests.integration.test_sluice_up import _wait_banner

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "extproc", "bench")  # what `pip install .` reads (as the Dockerfile)


@pytest.fixture(scope="module")
def sluice_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`sluice` of a new venv into which the project was pip-installed from a copy of its sources."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(ROOT / name, src / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(src)], capture_output=True, text=True,
                             timeout=540)
    assert install.returncode == 0, install.stdout + install.stderr
    return venv / "bin" / "sluice"


def test_check_from_an_empty_directory_uses_the_built_in_policy(sluice_bin: Path, tmp_path: Path):
    out = subprocess.run([str(sluice_bin), "check"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    site = sluice_bin.parent.parent / "lib"
    assert f"policy {site}" in out.stdout and "extproc/default_policy.yaml: OK" in out.stdout, out.stdout
    assert "envoy --mode validate: OK" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_init_then_up_from_an_empty_directory_serves_the_openai_sdk(sluice_bin: Path, tmp_path: Path):
    work, state = tmp_path / "work", tmp_path / "state"
    work.mkdir()
    init = subprocess.run([str(sluice_bin), "init"], capture_output=True, text=True, timeout=60, cwd=work)
    assert init.returncode == 0, init.stderr
    policy = yaml.safe_load((work / "sluice.yaml").read_text())
    gw, admin, grpc, metrics, sidecar_admin, *replicas = free_ports(8)
    policy["gateway"].update(port=gw, admin_port=admin)
    policy["sidecar"].update(grpc_port=grpc, metrics_port=metrics, admin_port=sidecar_admin)
    policy["pools"][0]["replicas"] = [f"127.0.0.1:{p}" for p in replicas]
    (work / "sluice.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))

    proc = subprocess.Popen([str(sluice_bin), "up"], cwd=work, env=dict(os.environ, XDG_STATE_HOME=str(state)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        banner = _wait_banner(proc)
        assert f"http://127.0.0.1:{gw}/v1" in banner and str(work / "sluice.yaml") in banner, banner
        run_dir = state / "sluice" / f"up-{gw}"
        assert str(run_dir) in banner and (run_dir / "envoy" / "bootstrap.yaml").is_file()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key="x", max_retries=0, timeout=30)
        answer = client.chat.completions.create(model="sim-model", max_tokens=8,
                                                messages=[{"role": "user", "content": "hello"}])
        assert answer.choices[0].message.content and answer.usage.completion_tokens == 8
        assert [p.name for p in work.iterdir()] == ["sluice.yaml"]  # nothing written into the user's directory
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
