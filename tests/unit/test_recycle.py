"""The recycling decision and the handover sequence of `sluice up` (extproc/restarts.py `Recycler`), with a fake clock,
fake RSS readings and tiny shell processes standing in for sidecar workers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from extproc.restarts import RecyclePolicy, Recycler, read_rss_mb, replacement_of, should_recycle
from extproc.supervisor import Child

# A stand-in worker: with `--take-over FILE` in its argv it writes FILE (serving), then sleeps; SIGUSR2 ends it.
WORKER = ('while [ $# -gt 0 ] && [ "$1" != --take-over ]; do shift; done; '
          '[ $# -gt 1 ] && echo $$ > "$2"; exec sleep 30')
BROKEN = "exit 3"


@pytest.mark.parametrize("rss, first, limit, expected", [
    (600, 100, 512, True),    # grew past the limit
    (500, 100, 512, False),   # under it
    (512, 100, 512, False),   # at it
    (600, 100, 0, False),     # 0 = never
    (600, 520, 512, False),   # already over when fresh: a replacement would be too
    (600, 512, 512, True),
])
def test_should_recycle(rss: float, first: float, limit: float, expected: bool) -> None:
    assert should_recycle(rss, first, limit) is expected


def test_read_rss_mb() -> None:
    mine = read_rss_mb(os.getpid())
    assert mine is not None and 1 < mine < 10_000
    assert read_rss_mb(2**22 + 12345) is None


def test_replacement_keeps_argv_and_adds_or_replaces_take_over(tmp_path: Path) -> None:
    old = Child("sidecar[0]", ["py", "-m", "extproc.cli", "serve", "--worker", "0"], tmp_path / "sidecar-0.log",
                "http://x/ready", env={"A": "1"})
    new, ready = replacement_of(old)
    assert ready == tmp_path / "sidecar-0.ready"
    assert new.argv == [*old.argv, "--take-over", str(ready)] and new.log_path == old.log_path
    assert new.name == old.name and new.ready_url == old.ready_url and new.env == {"A": "1"}
    again, _ = replacement_of(new)
    assert again.argv == new.argv  # a replacement's own replacement: one --take-over


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _worker(tmp_path: Path, script: str = WORKER) -> Child:
    return Child("sidecar[0]", ["sh", "-c", script, "sh"], tmp_path / "logs" / "sidecar-0.log", "http://x/ready")


def _until(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _recycler(rss: dict[int, float], clock: Clock, lines: list[str], limit: float = 150) -> Recycler:
    return Recycler(RecyclePolicy(limit_mb=limit, check_s=10.0, ready_timeout_s=30.0), dict(os.environ),
                    lines.append, clock=clock, rss_of=lambda pid: rss.get(pid, 100.0))


def test_a_grown_worker_is_replaced_then_signalled_and_the_check_waits_for_the_replacement(tmp_path: Path) -> None:
    clock, lines, rss = Clock(), [], {}
    old = _worker(tmp_path)
    old.start()
    children = [old]
    r = _recycler(rss, clock, lines)
    try:
        r.tend(children)                      # first sight: its fresh RSS; the first check is one interval away
        assert r.first_mb == {old.proc.pid: 100.0}
        clock.now += 10
        r.tend(children)                      # 100 MB: under the limit
        assert not r.starting
        rss[old.proc.pid] = 200.0
        clock.now += 5
        r.tend(children)                      # not due yet
        assert not r.starting
        clock.now += 5
        r.tend(children)                      # over: the replacement starts
        assert "sidecar[0]" in r.starting and children[0] is old and r.recycles == 0
        new = r.starting["sidecar[0]"].new
        assert new.argv[-2] == "--take-over"
        assert _until(lambda: (r.tend(children), children[0] is new)[1])  # serving: it takes the old one's place
        assert r.recycles == 1 and not r.starting
        assert _until(lambda: (r.tend(children), not r.leaving)[1])      # SIGUSR2 ended the old one
        assert old.proc.returncode is not None and new.alive()
        assert any("recycled at RSS 200.0 MB" in ln for ln in lines), lines
        assert any("left" in ln and "after handing over" in ln for ln in lines), lines
        # the replacement's fresh RSS is read as it takes over, its first check one interval later: no second recycle
        assert new.proc.pid in r.first_mb
        clock.now += 5
        r.tend(children)
        clock.now += 5
        r.tend(children)
        assert not r.starting and r.recycles == 1
    finally:
        r.stop()
        for c in children + [old]:
            c.stop(2)


def test_a_fresh_worker_over_the_limit_is_reported_not_recycled(tmp_path: Path) -> None:
    clock, lines = Clock(), []
    old = _worker(tmp_path)
    old.start()
    r = _recycler({}, clock, lines, limit=50)
    try:
        for _ in range(4):
            r.tend([old])
            clock.now += 10
        assert not r.starting and r.recycles == 0
        assert sum("when fresh" in ln for ln in lines) == 1, lines
    finally:
        old.stop(2)


def test_a_replacement_that_fails_leaves_the_worker_and_backs_off(tmp_path: Path) -> None:
    clock, lines, rss = Clock(), [], {}
    old = _worker(tmp_path)
    old.start()
    children = [old]
    r = _recycler(rss, clock, lines)
    try:
        r.tend(children)
        clock.now += 10
        r.tend(children)
        rss[old.proc.pid] = 200.0
        old.argv = ["sh", "-c", BROKEN, "sh"]  # its replacement (same argv) exits at once
        clock.now += 10
        r.tend(children)
        h = r.starting["sidecar[0]"]
        assert _until(lambda: not h.new.alive())
        r.tend(children)
        assert not r.starting and children[0] is old and old.alive() and r.recycles == 0
        assert r.failures == {"sidecar[0]": 1} and r.next_check["sidecar[0]"] == clock.now + 20
        assert any("its replacement exited (code 3)" in ln for ln in lines), lines
    finally:
        r.stop()
        old.stop(2)


def test_off_by_default_at_zero(tmp_path: Path) -> None:
    clock, lines = Clock(), []
    old = _worker(tmp_path)
    r = _recycler({}, clock, lines, limit=0)
    r.tend([old])
    assert not r.next_check and not lines


def test_grpc_port_check_sees_any_listener_even_one_sharing_its_port() -> None:
    """The ext_proc socket is bound with SO_REUSEPORT (a replacement shares it); a normal start still refuses a
    taken port, a sluice worker's included, by a plain bind first."""
    import socket

    from extproc.ports import port_is_free as grpc_port_free
    from extproc.supervisor import free_ports

    port = free_ports(1)[0]
    assert grpc_port_free("127.0.0.1", port)
    for reuseport in (False, True):
        with socket.socket() as s:
            if reuseport:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            assert not grpc_port_free("127.0.0.1", port)
    assert grpc_port_free("127.0.0.1", port)
