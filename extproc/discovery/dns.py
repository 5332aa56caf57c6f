"""Replicas by name: resolve the pools' `host:port` and `{dns: name:port}` entries on an interval and report each
pool's changes as an `EndpointDiff`.

Resolver: the system's `getaddrinfo`, run in a small thread pool of its own (the event loop never blocks, and a
resolver that hangs cannot starve the loop's default executor). It answers exactly as every other process in the
container: /etc/hosts, nsswitch, the search domains and `ndots` of resolv.conf, Docker's embedded DNS, cluster
DNS. TTLs are not needed because names are re-resolved every `interval_s` whatever the record says; honouring them
would even be wrong behind Docker's DNS, which answers with a TTL of 600 s while containers come and go.

Address family: when a name has IPv4 addresses only those are used (a dual-stack pod would otherwise count as two
replicas); a name with only IPv6 addresses gives IPv6 replicas.

The rule on resolver trouble (never lose replicas because DNS hiccuped):
  1. A lookup that fails or times out changes nothing: the name keeps its last good addresses (`held`).
  2. A successful answer adds new addresses at once. An address is removed only when `remove_after` consecutive
     successful answers no longer contain it (one flapping answer does not drain a replica).
  3. An answer of "no such name" / "no address" is a successful, empty answer (rule 2 applies), but a pool never
     drops to zero replicas through discovery: if applying the answers would leave it empty, it keeps its current
     set (`held`) until a name resolves again. With no address at all the pool could only answer 503; keeping the
     last known replicas lets health checking (scrapes, errors) decide whether they still serve.
A lookup still running from the previous round is not started again: it counts as a timeout.

`host:port` entries stand for one replica: the first address of the answer, kept while the name still returns it
(an answer that rotates its order does not move the replica).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import socket
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Mapping, Sequence

from extproc.discovery import (
    HOST,
    STATIC,
    DiffListener,
    EndpointDiff,
    ReplicaSource,
    diff_sets,
    format_address,
)
from extproc.discovery import metrics as dm

log = logging.getLogger("sluice.discovery.dns")

Lookup = Callable[[str], Awaitable[list[str]]]
"""Resolve a name to its IP addresses: [] when the name has none (NXDOMAIN, no data); raises on resolver errors."""

_NOT_FOUND = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def _ip_key(ip: str) -> tuple[int, int]:
    addr = ipaddress.ip_address(ip)
    return addr.version, int(addr)


def getaddrinfo_ips(host: str) -> list[str]:
    """Blocking: the name's addresses in numeric order, IPv4 only when it has any (see the module docstring)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NOT_FOUND:
            return []
        raise
    v4 = {info[4][0] for info in infos if info[0] == socket.AF_INET}
    chosen = v4 or {info[4][0] for info in infos if info[0] == socket.AF_INET6}
    return sorted(chosen, key=_ip_key)


class SystemResolver:
    """`getaddrinfo` on a thread pool of its own (`workers` threads: lookups of one round run side by side)."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sluice-dns")

    async def __call__(self, host: str) -> list[str]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, getaddrinfo_ips, host)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class _Answer:
    outcome: str                      # dm.OK, NOT_FOUND, FAILED, TIMEOUT
    ips: list[str] | None = None      # None: no usable answer (failed, timeout)


@dataclass(slots=True)
class _Entry:
    """What one name entry of one pool currently stands for."""

    addresses: frozenset[str] = frozenset()
    missing: dict[str, int] = field(default_factory=dict)  # address -> consecutive answers without it

    def apply(self, desired: set[str], remove_after: int) -> None:
        """Rule 2: add at once, remove after `remove_after` consecutive answers without the address."""
        for addr in desired:
            self.missing.pop(addr, None)
        keep = set(desired)
        for addr in self.addresses - desired:
            misses = self.missing.get(addr, 0) + 1
            if misses >= remove_after:
                self.missing.pop(addr, None)
            else:
                self.missing[addr] = misses
                keep.add(addr)
        self.addresses = frozenset(keep)


def _desired(src: ReplicaSource, ips: list[str], current: frozenset[str]) -> set[str]:
    """The addresses an entry should stand for, given a successful answer."""
    offered = [format_address(ip, src.port) for ip in ips]
    if src.kind != HOST:
        return set(offered)
    for addr in offered:  # a one-replica name keeps its address while the answer still holds it
        if addr in current:
            return {addr}
    return {offered[0]} if offered else set()


def _retrieve(task: asyncio.Future[list[str]]) -> None:
    if not task.cancelled():
        task.exception()


class DnsDiscovery:
    """Resolves every name entry of the given pools each `interval_s` and reports per-pool diffs to `listeners`
    (called on the event loop, in pool order). Use: `await start()` (resolves once before returning, so the first
    diffs are known before traffic), `stop()` at shutdown, `set_sources()` on a policy reload."""

    def __init__(self, pools: Mapping[str, Sequence[ReplicaSource]], *, interval_s: float = 5.0,
                 timeout_s: float = 2.0, remove_after: int = 2, lookup: Lookup | None = None) -> None:
        if interval_s <= 0 or timeout_s <= 0 or remove_after < 1:
            raise ValueError("interval_s and timeout_s must be > 0, remove_after >= 1")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.remove_after = remove_after
        self._own_resolver = lookup is None
        self._lookup: Lookup = lookup if lookup is not None else SystemResolver()
        self.listeners: list[DiffListener] = []
        self._sources: dict[str, tuple[ReplicaSource, ...]] = {}
        self._entries: dict[tuple[str, ReplicaSource], _Entry] = {}
        self._reported: dict[str, frozenset[str]] = {}
        self._held: dict[str, bool] = {}
        self._metrics: dict[str, dm.PoolMetrics] = {}
        self._inflight: dict[str, asyncio.Task[list[str]]] = {}
        self._task: asyncio.Task[None] | None = None
        self.set_sources(pools)

    # ---- configuration --------------------------------------------------------------------------------------
    def set_sources(self, pools: Mapping[str, Sequence[ReplicaSource]]) -> None:
        """Replace the entries (policy reload). Entries that stay keep their addresses; the next `refresh` reports
        what changed. A pool no longer listed is forgotten without a diff (its pool is gone)."""
        self._sources = {pool: tuple(srcs) for pool, srcs in pools.items()}
        live = {(pool, src) for pool, srcs in self._sources.items() for src in srcs}
        self._entries = {k: v for k, v in self._entries.items() if k in live}
        for gone in set(self._reported) - set(self._sources):
            del self._reported[gone]
            self._held.pop(gone, None)

    def snapshot(self) -> dict[str, frozenset[str]]:
        """The addresses last reported for each pool."""
        return dict(self._reported)

    def held(self, pool: str) -> bool:
        """Does the pool keep addresses discovery could not confirm (resolver failing, or an empty answer)?"""
        return self._held.get(pool, False)

    # ---- one round ------------------------------------------------------------------------------------------
    async def refresh(self) -> list[EndpointDiff]:
        """Resolve every name once, apply the rule, report and return the diffs (a pool's first report always,
        later ones only when something changed)."""
        hosts = sorted({s.host for srcs in self._sources.values() for s in srcs if s.kind != STATIC})
        answers = dict(zip(hosts, await asyncio.gather(*(self._resolve(h) for h in hosts))))
        diffs = [self._pool_round(pool, srcs, answers) for pool, srcs in self._sources.items()]
        diffs = [d for d in diffs if d is not None]
        for diff in diffs:
            for listener in self.listeners:
                listener(diff)
        return diffs

    def _pool_round(self, pool: str, sources: Iterable[ReplicaSource],
                    answers: Mapping[str, _Answer]) -> EndpointDiff | None:
        m = self._metrics.get(pool) or self._metrics.setdefault(pool, dm.pool_metrics(pool))
        addresses: set[str] = set()
        held = False
        for src in sources:
            if src.kind == STATIC:
                addresses.add(format_address(src.host, src.port))
                continue
            entry = self._entries.get((pool, src))
            if entry is None:
                entry = self._entries[(pool, src)] = _Entry()
            answer = answers[src.host]
            m.lookups[answer.outcome].inc()
            if answer.ips is None:
                held = held or bool(entry.addresses)  # rule 1
            else:
                entry.apply(_desired(src, answer.ips, entry.addresses), self.remove_after)
            addresses |= entry.addresses
        before = self._reported.get(pool)
        after = frozenset(addresses)
        if not after and before:  # rule 3
            after, held = before, True
        if held != self._held.get(pool, False):
            log.warning("pool %s: discovery %s", pool, "keeps addresses it cannot confirm" if held
                        else "confirms every address again")
        self._held[pool] = held
        self._reported[pool] = after
        diff = diff_sets(pool, before or frozenset(), after, initial=before is None)
        m.report(len(after), len(diff.added), len(diff.removed), held)
        if diff and before is not None:
            log.info("pool %s: discovery +%s -%s", pool, list(diff.added), list(diff.removed))
        return diff if diff or before is None else None

    async def _resolve(self, host: str) -> _Answer:
        task = self._inflight.get(host)
        if task is not None and not task.done():
            return _Answer(dm.TIMEOUT)  # the previous round's lookup is still running: do not stack another
        task = self._inflight[host] = asyncio.ensure_future(self._lookup(host))
        task.add_done_callback(_retrieve)  # a lookup abandoned after its timeout must not log "never retrieved"
        done, _ = await asyncio.wait((task,), timeout=self.timeout_s)
        if not done:
            return _Answer(dm.TIMEOUT)
        del self._inflight[host]
        exc = task.exception()
        if exc is not None:
            log.debug("lookup of %s failed: %r", host, exc)
            return _Answer(dm.FAILED)
        ips = task.result()
        return _Answer(dm.OK if ips else dm.NOT_FOUND, list(ips))

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> list[EndpointDiff]:
        """Resolve once (the starting sets), then keep re-resolving in the background. Returns the first diffs."""
        first = await self.refresh()
        self._task = asyncio.create_task(self._run(), name="sluice-dns-discovery")
        return first

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # a listener's bug must not stop discovery
                log.exception("discovery round failed")

    async def stop(self) -> None:
        task, self._task = self._task, None
        pending = [t for t in (task, *self._inflight.values()) if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        self._inflight.clear()
        if self._own_resolver:
            self._lookup.close()  # type: ignore[attr-defined]
