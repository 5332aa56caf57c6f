"""The pools' replicas at run time: the discovery sources a policy asks for, their changes applied to the Fleet, and
Envoy told through its EDS files.

    policy ─► DnsDiscovery (every pool with a name entry)      ─┐ EndpointDiff per pool
           └► KubernetesDiscovery (a pool's InferencePool)     ─┴► Fleet.apply_endpoint_diff (slow start, drain)
                                                                └► eds-<cluster>.yaml (worker 0, with an xDS dir)

The first resolution happens in `start`, before the sidecar takes traffic or scrapes, so the starting replicas are
known (and written for Envoy) when it becomes ready. A reload hands the new entries to the running sources
(`on_reload`): a pool that stays keeps its replicas, and the next round reports what changed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from extproc.discovery import EndpointDiff
from extproc.discovery.eds import write_eds

if TYPE_CHECKING:
    from extproc.config import Policy, PoolConfig
    from extproc.discovery.dns import DnsDiscovery, Lookup
    from extproc.fleet import Fleet

log = logging.getLogger("sluice.endpoints")


def _named(policy: Policy) -> dict[str, list[Any]]:
    """The pools DNS discovery follows: those with a name entry and no InferencePool, with their entries."""
    return {p.model: p.sources for p in policy.pools if p.discovered and p.discovery.kubernetes is None}


class Endpoints:
    """Discovery for one sidecar process. `xds_out`: the directory Envoy watches, where worker 0 keeps the EDS
    files of the pools found at run time (None: another process writes them, or Envoy is not sluice's own)."""

    def __init__(self, fleet: Fleet, policy: Policy, xds_out: str | Path | None = None,
                 lookup: Lookup | None = None) -> None:
        self.fleet = fleet
        self.policy = policy
        self.xds_out = Path(xds_out) if xds_out is not None else None
        self.lookup = lookup  # name -> addresses; None: the system resolver (tests pass their own)
        self.dns: DnsDiscovery | None = None
        self.kubernetes: dict[str, Any] = {}  # pool -> KubernetesDiscovery

    @property
    def active(self) -> bool:
        return self.dns is not None or bool(self.kubernetes)

    @property
    def known(self) -> bool:
        """Has every source reported at least once (the pools' endpoints are known, possibly empty)?"""
        return all(source.snapshot_known for source in self.kubernetes.values())

    def failure_mode(self, model: str) -> str | None:
        """The InferencePool's own failureMode when the pool follows one (None: not known)."""
        k8s = self.kubernetes.get(model)
        spec = getattr(k8s, "spec", None)
        return getattr(spec, "failure_mode", None)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every source the policy needs and apply their first reports."""
        named = _named(self.policy)
        if named:
            self._start_dns(named)
            assert self.dns is not None
            await self.dns.start()  # its listeners applied the first report
        for pool in self.policy.pools:
            if pool.discovery.kubernetes is not None:
                await self._start_kubernetes(pool)

    def _start_dns(self, named: dict[str, list[Any]]) -> None:
        from extproc.discovery.dns import DnsDiscovery

        # One resolver for every pool: the first named pool's settings (they are per pool in the policy file so
        # a pool reads as a whole; one interval for the process keeps the lookups of a round together).
        first = next(p for p in self.policy.pools if p.model in named).discovery
        self.dns = DnsDiscovery(named, interval_s=first.interval_s, timeout_s=first.timeout_s,
                                remove_after=first.remove_after, lookup=self.lookup)
        self.dns.listeners.append(self.apply)

    async def _start_kubernetes(self, pool: PoolConfig) -> None:
        from extproc.discovery.kubernetes import KubernetesDiscovery

        k = pool.discovery.kubernetes
        assert k is not None
        source = KubernetesDiscovery(pool.model, k.namespace, k.inference_pool, watch_timeout_s=k.watch_timeout_s)
        source.listeners.append(self.apply)
        self.kubernetes[pool.model] = source
        if await source.start() is None:
            log.warning("pool %s: the Kubernetes API did not answer yet; the pool starts empty", pool.model)

    async def stop(self) -> None:
        if self.dns is not None:
            await self.dns.stop()
            self.dns = None
        for source in self.kubernetes.values():
            await source.stop()
        self.kubernetes.clear()

    async def on_reload(self, policy: Policy) -> None:
        """A reload's policy: the name entries of every pool go to the resolver (a pool that stays keeps its
        replicas; the round that follows reports the changes), InferencePool sources start or stop."""
        self.policy = policy
        named = _named(policy)
        if named and self.dns is None:
            self._start_dns(named)
            assert self.dns is not None
            await self.dns.start()
        elif self.dns is not None:
            self.dns.set_sources(named)
            await self.dns.refresh()
        wanted = {p.model: p for p in policy.pools if p.discovery.kubernetes is not None}
        for model in [m for m in self.kubernetes if m not in wanted]:
            await self.kubernetes.pop(model).stop()
        for model, pool in wanted.items():
            if model not in self.kubernetes:
                await self._start_kubernetes(pool)
        self.write_all()

    # ---- applying a report ---------------------------------------------------------------------------------
    def apply(self, diff: EndpointDiff) -> None:
        """One pool's change: the Fleet first (new replicas in slow start, removed ones draining), then Envoy's
        EDS file (an address Envoy does not know yet is skipped for the pin list's next entry, so the order is
        safe either way)."""
        self.fleet.apply_endpoint_diff(diff)
        pool = self.fleet.pools.get(diff.pool)
        if pool is not None:
            self._write(pool.cluster, pool.model)

    def eds_endpoints(self) -> dict[str, list[str]]:
        """cluster -> the addresses Envoy should know, for every pool found at run time."""
        return {p.cluster: self.fleet.endpoints(p.model) for p in self.policy.pools if p.discovered}

    def write_all(self) -> None:
        for pool in self.policy.pools:
            if pool.discovered:
                self._write(pool.cluster, pool.model)

    def _write(self, cluster: str, model: str) -> None:
        if self.xds_out is None:
            return
        try:
            write_eds(self.xds_out, cluster, self.fleet.endpoints(model))
        except OSError:
            log.exception("writing Envoy's EDS file for %s into %s failed", cluster, self.xds_out)
