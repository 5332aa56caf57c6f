"""Where a pool's replicas come from when they are not fixed `ip:port` entries: DNS names (`dns.py`) or the pods
an InferencePool selects (`kubernetes.py`). Every source reports the same thing, an `EndpointDiff` per pool, so
the gateway applies one kind of change whatever found it.

A replica entry of a pool, as the policy file writes it:

    "10.0.0.7:8000"                 a fixed address: never resolved, always present
    "vllm-a.internal:8000"          one replica reached by name: the first address the name resolves to
                                    (it stays that address while the name still returns it)
    {"dns": "vllm.svc:8000"}        every address the name resolves to (a headless Service, a compose
                                    service scaled to N)

Addresses are written the way Envoy names a host and `override_host` matches it: `ip:port`, `[ipv6]:port`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

STATIC, HOST, DNS = "static", "host", "dns"
SourceKind = Literal["static", "host", "dns"]

_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>\d{1,5})$")
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


class BadReplicaEntry(ValueError):
    """A replica entry of the policy that is not `host:port`, `[ipv6]:port` or `{dns: name:port}`."""


@dataclass(frozen=True, slots=True)
class ReplicaSource:
    """One replica entry of a pool: what to resolve (`host`), on which `port`, and how many addresses it stands
    for (`kind`: static = the address itself, host = one, dns = all)."""

    kind: SourceKind
    host: str
    port: int

    @property
    def entry(self) -> str:
        """The entry as the policy wrote it (for messages and `sluice status`)."""
        text = format_address(self.host, self.port) if self.kind == STATIC else f"{self.host}:{self.port}"
        return f"dns: {text}" if self.kind == DNS else text


@dataclass(frozen=True, slots=True)
class EndpointDiff:
    """What changed in one pool's replica set since the previous report: addresses to add and to remove, in a
    stable (sorted) order. `initial` is True for a source's first report, whose additions are the starting set
    (no slow start: nothing was serving before), False for later ones (new replicas ramp through slow start)."""

    pool: str
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    initial: bool = False

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


DiffListener = Callable[[EndpointDiff], None]


def format_address(ip: str, port: int) -> str:
    """`ip:port`, with an IPv6 address in brackets (as Envoy prints a host, so override_host matches it)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def diff_sets(pool: str, before: frozenset[str], after: frozenset[str], initial: bool = False) -> EndpointDiff:
    return EndpointDiff(pool, tuple(sorted(after - before)), tuple(sorted(before - after)), initial)


def is_ip(host: str) -> bool:
    """Is `host` an IP address literal (not a name to resolve)?"""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _valid_name(host: str) -> bool:
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in name.split("."))


def _split(text: str, where: str) -> tuple[str, int, bool]:
    """(host, port, bracketed v6) of `host:port` / `[v6]:port`, validated."""
    m = _HOST_PORT.match(text.strip())
    if not m:
        raise BadReplicaEntry(f"{where}: {text!r} is not host:port")
    port = int(m["port"])
    if not 1 <= port <= 65535:
        raise BadReplicaEntry(f"{where}: port {port} out of range 1..65535")
    if m["v6"] is not None:
        if not is_ip(m["v6"]):
            raise BadReplicaEntry(f"{where}: {m['v6']!r} is not an IPv6 address")
        return m["v6"], port, True
    return m["host"], port, False


def parse_replica_entry(entry: Any, where: str = "replicas") -> ReplicaSource:
    """One policy entry -> its ReplicaSource (raises BadReplicaEntry with `where` in the message)."""
    if isinstance(entry, dict):
        if set(entry) != {"dns"} or not isinstance(entry["dns"], str):
            raise BadReplicaEntry(f"{where}: a mapping entry must be {{dns: name:port}}, got {entry!r}")
        host, port, bracketed = _split(entry["dns"], where)
        if bracketed or is_ip(host):
            raise BadReplicaEntry(f"{where}: dns: wants a name, {entry['dns']!r} is an address")
        if not _valid_name(host):
            raise BadReplicaEntry(f"{where}: {host!r} is not a valid DNS name")
        return ReplicaSource(DNS, host, port)
    if not isinstance(entry, str):
        raise BadReplicaEntry(f"{where}: {entry!r} is neither host:port nor {{dns: name:port}}")
    host, port, bracketed = _split(entry, where)
    if bracketed or is_ip(host):
        return ReplicaSource(STATIC, host, port)
    if not _valid_name(host):
        raise BadReplicaEntry(f"{where}: {host!r} is not a valid DNS name")
    return ReplicaSource(HOST, host, port)


def needs_resolution(sources: list[ReplicaSource]) -> bool:
    """Does any entry name a host (so a resolver must run for this pool)?"""
    return any(s.kind != STATIC for s in sources)
