"""Replicas by name: real getaddrinfo in a private mount namespace (hosts_ns.py) for what names resolve to, and
a controllable lookup for timing (a resolver that hangs)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from extproc.discovery import DNS, HOST, STATIC, BadReplicaEntry, EndpointDiff, ReplicaSource, parse_replica_entry
from extproc.discovery.dns import DnsDiscovery
from tests.waiting import wait_for_async

from .hosts_ns import HostsNamespace

ROOT = Path(__file__).resolve().parents[2]


class Driver:
    """dns_driver.py inside the namespace: one JSON command, one JSON answer."""

    def __init__(self, ns: HostsNamespace, pools: dict[str, list[Any]], remove_after: int = 2) -> None:
        argv = [sys.executable, "-m", "tests.discovery.dns_driver", json.dumps(pools), str(remove_after)]
        self.proc = subprocess.Popen(ns.command(argv), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert json.loads(self._line()) == {"ready": True}

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"driver exited with {self.proc.poll()}"
        return line

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def refresh(self) -> dict[str, Any]:
        return self.ask("refresh")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def ns(tmp_path: Path) -> HostsNamespace:
    return HostsNamespace(tmp_path)


@pytest.fixture
def drivers() -> Iterator[list[Driver]]:
    made: list[Driver] = []
    yield made
    for d in made:
        d.close()


def diff(pool: str, added: list[str] = (), removed: list[str] = (), initial: bool = False) -> dict[str, Any]:
    return {"pool": pool, "added": list(added), "removed": list(removed), "initial": initial}


def test_the_namespace_resolves_test_names_and_leaves_the_machine_alone(ns, drivers):
    ns.set_hosts({"pool.test": ["127.0.0.2", "127.0.0.3"]})
    d = Driver(ns, {})
    drivers.append(d)
    assert d.ask("lookup pool.test") == {"ips": ["127.0.0.2", "127.0.0.3"]}
    assert d.ask("lookup gone.test") == {"ips": []}  # files only: not found
    ns.nsswitch("files dns")
    assert d.ask("lookup gone.test") == {"error": socket.EAI_AGAIN}  # nobody on 127.0.0.1:53
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo("pool.test", 80)  # this process (outside the namespace) never saw the name


def test_names_become_replicas_and_follow_the_answers(ns, drivers):
    ns.set_hosts({"pool.test": ["127.0.0.2", "127.0.0.3", "127.0.0.4"], "one.test": ["127.0.0.6", "127.0.0.5"]})
    d = Driver(ns, {"m": [{"dns": "pool.test:8000"}, "one.test:9000", "127.0.0.9:7000"]})
    drivers.append(d)
    first = d.refresh()
    # every address of the dns: name, the first (numeric order) of the one-replica name, the fixed address
    assert first["diffs"] == [diff("m", ["127.0.0.2:8000", "127.0.0.3:8000", "127.0.0.4:8000", "127.0.0.5:9000",
                                         "127.0.0.9:7000"], initial=True)]
    assert d.refresh()["diffs"] == []  # nothing changed: nothing reported

    ns.set_hosts({"pool.test": ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.7"], "one.test": ["127.0.0.5"]})
    assert d.refresh()["diffs"] == [diff("m", ["127.0.0.7:8000"])]  # added at once

    ns.set_hosts({"pool.test": ["127.0.0.3", "127.0.0.4", "127.0.0.7"], "one.test": ["127.0.0.5"]})
    assert d.refresh()["diffs"] == []  # missing once: kept
    assert d.refresh()["diffs"] == [diff("m", removed=["127.0.0.2:8000"])]  # missing twice: removed

    # the one-replica name keeps its address while the answer still holds it, whatever else it returns
    ns.set_hosts({"pool.test": ["127.0.0.3", "127.0.0.4", "127.0.0.7"], "one.test": ["127.0.0.1", "127.0.0.5"]})
    assert d.refresh()["diffs"] == []


def test_a_resolver_outage_keeps_every_last_good_address(ns, drivers):
    ns.set_hosts({"pool.test": ["127.0.0.2", "127.0.0.3"]})
    d = Driver(ns, {"m": [{"dns": "pool.test:8000"}]})
    drivers.append(d)
    d.refresh()
    ns.nsswitch("files dns")
    ns.set_hosts({})  # the name now goes to a nameserver that never answers
    for _ in range(4):  # however long it lasts (rule 1)
        out = d.refresh()
        assert out["diffs"] == [] and out["held"] == {"m": True}
        assert out["snapshot"] == {"m": ["127.0.0.2:8000", "127.0.0.3:8000"]}
    ns.set_hosts({"pool.test": ["127.0.0.3", "127.0.0.4"]})  # back, with a changed answer
    assert d.refresh()["diffs"] == [diff("m", ["127.0.0.4:8000"])]
    assert d.refresh()["diffs"] == [diff("m", removed=["127.0.0.2:8000"])]
    assert d.refresh()["held"] == {"m": False}


def test_a_name_that_vanishes_never_empties_the_pool(ns, drivers):
    ns.set_hosts({"a.test": ["127.0.0.2"], "b.test": ["127.0.0.3"]})
    d = Driver(ns, {"only": [{"dns": "a.test:8000"}], "mixed": [{"dns": "a.test:8000"}, {"dns": "b.test:8000"}]})
    drivers.append(d)
    d.refresh()
    ns.set_hosts({"b.test": ["127.0.0.3"]})  # a.test: NXDOMAIN-like "not found"
    d.refresh()
    out = d.refresh()
    # a pool with another name loses the vanished name's address; a pool with only that name keeps it (rule 3)
    assert out["diffs"] == [diff("mixed", removed=["127.0.0.2:8000"])]
    assert out["snapshot"] == {"only": ["127.0.0.2:8000"], "mixed": ["127.0.0.3:8000"]}
    assert out["held"] == {"only": True, "mixed": False}
    ns.set_hosts({"a.test": ["127.0.0.4"], "b.test": ["127.0.0.3"]})
    out = d.refresh()
    assert out["diffs"] == [diff("only", ["127.0.0.4:8000"], ["127.0.0.2:8000"]),
                            diff("mixed", ["127.0.0.4:8000"])]
    assert out["held"] == {"only": False, "mixed": False}


class ScriptedLookup:
    """Answers per name from a dict; `hang` names never answer (a resolver stuck in a thread)."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str]] = {}
        self.hang: set[str] = set()
        self.calls: dict[str, int] = {}

    async def __call__(self, host: str) -> list[str]:
        self.calls[host] = self.calls.get(host, 0) + 1
        if host in self.hang:
            await asyncio.sleep(3600)  # the hung resolver: never answers within the test
        return self.answers.get(host, [])


async def test_a_hanging_lookup_times_out_is_not_stacked_and_keeps_the_addresses():
    lookup = ScriptedLookup()
    lookup.answers["slow.test"] = ["10.0.0.1", "10.0.0.2"]
    discovery = DnsDiscovery({"m": [ReplicaSource(DNS, "slow.test", 80)]}, timeout_s=0.05, lookup=lookup)
    seen: list[EndpointDiff] = []
    discovery.listeners.append(seen.append)
    await discovery.refresh()
    assert seen == [EndpointDiff("m", ("10.0.0.1:80", "10.0.0.2:80"), (), True)]
    lookup.hang.add("slow.test")
    for _ in range(3):
        assert await discovery.refresh() == []
    assert lookup.calls["slow.test"] == 2  # the hung lookup is not started again while it runs
    assert discovery.held("m") and discovery.snapshot()["m"] == {"10.0.0.1:80", "10.0.0.2:80"}
    await discovery.stop()


async def test_background_rounds_report_to_listeners_and_reload_keeps_entries():
    lookup = ScriptedLookup()
    lookup.answers["a.test"] = ["10.0.0.1"]
    discovery = DnsDiscovery({"m": [ReplicaSource(DNS, "a.test", 80)]}, interval_s=0.02, lookup=lookup)
    seen: list[EndpointDiff] = []
    discovery.listeners.append(seen.append)
    assert [d.added for d in await discovery.start()] == [("10.0.0.1:80",)]
    lookup.answers["a.test"] = ["10.0.0.1", "10.0.0.3"]
    await wait_for_async(lambda: len(seen) >= 2, 1.0, 0.01)
    assert seen[1] == EndpointDiff("m", ("10.0.0.3:80",), (), False)
    discovery.set_sources({"m": [ReplicaSource(DNS, "a.test", 80), ReplicaSource(STATIC, "10.0.0.9", 81)],
                           "n": [ReplicaSource(STATIC, "10.0.1.1", 80)]})
    diffs = await discovery.refresh()
    assert EndpointDiff("m", ("10.0.0.9:81",), (), False) in diffs
    assert EndpointDiff("n", ("10.0.1.1:80",), (), True) in diffs
    await discovery.stop()


@pytest.mark.parametrize("entry, expected", [
    ("10.0.0.1:8000", ReplicaSource(STATIC, "10.0.0.1", 8000)),
    ("[fd00::1]:8000", ReplicaSource(STATIC, "fd00::1", 8000)),
    ("vllm-0.vllm.ns.svc.cluster.local:8000", ReplicaSource(HOST, "vllm-0.vllm.ns.svc.cluster.local", 8000)),
    ("replica:8000", ReplicaSource(HOST, "replica", 8000)),
    ({"dns": "vllm.ns.svc:8000"}, ReplicaSource(DNS, "vllm.ns.svc", 8000)),
])
def test_replica_entries_parse(entry, expected):
    src = parse_replica_entry(entry)
    assert src == expected
    assert parse_replica_entry({"dns": src.entry[5:]} if src.kind == DNS else src.entry) == src


@pytest.mark.parametrize("entry", ["10.0.0.1", "host:0", "host:70000", "bad_host!:80", {"dns": "10.0.0.1:80"},
                                   {"dns": "a:80", "x": 1}, {"srv": "a:80"}, 8000, "[nonsense]:80", "-a.b:80"])
def test_bad_replica_entries_are_refused_with_the_entry_named(entry):
    with pytest.raises(BadReplicaEntry, match=r"pools\[0\]\.replicas"):
        parse_replica_entry(entry, "pools[0].replicas")
