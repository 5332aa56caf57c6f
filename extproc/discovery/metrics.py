"""Every Prometheus metric of the discovery package (default registry), names prefixed `sluice_`.

Series (labels):
  sluice_discovery_lookups_total{pool,result}   name lookups by result: ok, not_found (the name has no address),
                                                failed (resolver error), timeout. Kubernetes: list/watch calls.
  sluice_discovery_endpoints{pool}              addresses the pool's discovery currently reports.
  sluice_discovery_changes_total{pool,change}   addresses added / removed by discovery (change=added|removed).
  sluice_discovery_held{pool}                   1 while the pool keeps addresses it could not confirm (lookups
                                                failing, or an empty answer that would have left the pool with no
                                                replica): see dns.py for the rule.

Label children are resolved once per pool (`pool_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge

LOOKUPS = Counter("sluice_discovery_lookups_total",
                  "Discovery lookups (DNS names, Kubernetes list/watch) by result: ok, not_found, failed, timeout.",
                  ["pool", "result"])
ENDPOINTS = Gauge("sluice_discovery_endpoints", "Addresses the pool's discovery currently reports.", ["pool"])
CHANGES = Counter("sluice_discovery_changes_total", "Addresses added or removed by discovery.", ["pool", "change"])
HELD = Gauge("sluice_discovery_held",
             "1 while the pool keeps addresses discovery could not confirm (resolver failing, or an empty answer).",
             ["pool"])

OK, NOT_FOUND, FAILED, TIMEOUT = "ok", "not_found", "failed", "timeout"


@dataclass(slots=True)
class PoolMetrics:
    """The label children of one pool, resolved once."""

    lookups: dict[str, Counter]
    endpoints: Gauge
    added: Counter
    removed: Counter
    held: Gauge

    def report(self, count: int, added: int, removed: int, held: bool) -> None:
        self.endpoints.set(count)
        if added:
            self.added.inc(added)
        if removed:
            self.removed.inc(removed)
        self.held.set(1 if held else 0)


def pool_metrics(pool: str) -> PoolMetrics:
    return PoolMetrics(
        lookups={r: LOOKUPS.labels(pool, r) for r in (OK, NOT_FOUND, FAILED, TIMEOUT)},
        endpoints=ENDPOINTS.labels(pool),
        added=CHANGES.labels(pool, "added"),
        removed=CHANGES.labels(pool, "removed"),
        held=HELD.labels(pool),
    )
