"""Gauges that read the sidecar's own accounting when Prometheus scrapes, bound once per replica or tenant.

The hot path never does gauge arithmetic for in-flight counts: a replica's `sluice_inflight_requests` /
`_tokens` read `Replica.inflight_requests` / `.inflight_tokens` at scrape time, bound at its first placement.
Open streams per tenant are counted in one labelled child per bounded tenant label (`Identity.label`), cached
so the label lookup happens once per tenant."""

from __future__ import annotations

from typing import Any, Callable

from extproc import metrics as m
from extproc.routing.pool import Replica


class LiveGauges:
    """The per-replica and per-tenant gauge children the gateway updates or binds."""

    def __init__(self, tenant_label: Callable[[str], str]) -> None:
        self.tenant_label = tenant_label  # the current identity policy's bounded label (replaced on reload)
        self._tenant_open: dict[str, Any] = {}
        self.counted: set[Replica] = set()  # replicas whose in-flight series are bound

    def tenant_open_streams(self, tenant: str) -> Any:
        """The `sluice_tenant_open_streams` child of the tenant's label."""
        label = self.tenant_label(tenant)
        g = self._tenant_open.get(label)
        if g is None:
            g = self._tenant_open[label] = m.TENANT_OPEN_STREAMS.labels(label)
        return g

    def count_replica(self, r: Replica) -> None:
        """Bind the replica's in-flight series to its own accounting (once: at its first placement)."""
        if r not in self.counted:
            self.counted.add(r)
            m.INFLIGHT_REQUESTS.labels(r.pool, r.address).set_function(lambda: r.inflight_requests)
            m.INFLIGHT_TOKENS.labels(r.pool, r.address).set_function(lambda: r.inflight_tokens)

    def forget_replica(self, r: Replica) -> None:
        """A replica left its pool (reload, discovery): its in-flight series go with it."""
        if r in self.counted:
            self.counted.discard(r)
            for gauge in (m.INFLIGHT_REQUESTS, m.INFLIGHT_TOKENS):
                try:
                    gauge.remove(r.pool, r.address)
                except KeyError:
                    pass
