"""Envoy learns discovered replicas through file-based EDS: one `eds-<cluster>.yaml` per pool cluster in the xDS
directory Envoy already watches for LDS/CDS.

Why files and not ADS served by the sidecar: the sidecar already renders LDS/CDS files there (extproc/xds.py) and
Envoy already watches that directory, so EDS adds one file per pool and no new protocol. An ADS server would add a
gRPC xDS implementation (versions, nonces, ACK/NACK, reconnects) to the sidecar and a second control path that must
agree with the files; with `sidecar.workers > 1` one process would still have to own it. Files are written by the
process that owns the xDS directory (worker 0), atomically (temp file + rename: Envoy's watched directory never
sees half a file).

Verified with Envoy 1.40 (tests/discovery/test_eds_envoy.py): an address first written to the EDS file is pinnable
through override_host at once; a pin to an address Envoy does not know falls through to the next entry of the pin
list, then to the fallback policy; a request in flight on an address removed from the file completes.

Envoy needs the bootstrap's `node` id and cluster for path-based EDS (render_bootstrap sets them). `sluice render`
writes a pool's first EDS file (its fixed addresses) only when there is none yet; the sidecar rewrites it with every
discovery change (extproc/endpoints.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from envoy_data_plane.envoy.config.cluster.v3 import ClusterEdsClusterConfig
from envoy_data_plane.envoy.config.core.v3 import Address, ApiVersion, ConfigSource, PathConfigSource, \
    SocketAddress, WatchedDirectory
from envoy_data_plane.envoy.config.endpoint.v3 import ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints

from extproc.xds_files import discovery_doc, write_atomic


def split_address(address: str) -> tuple[str, int]:
    """`ip:port` / `[ipv6]:port` -> (ip, port)."""
    host, _, port = address.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def eds_path(xds_dir: str | Path, cluster: str) -> Path:
    return Path(xds_dir) / f"eds-{cluster}.yaml"


def eds_cluster_config(xds_dir: str | Path, cluster: str) -> ClusterEdsClusterConfig:
    """What a pool's cluster (type EDS) says instead of a load_assignment: read endpoints from its file in the
    watched `xds_dir` (the directory as Envoy sees it, e.g. a container's mount point)."""
    source = ConfigSource(
        path_config_source=PathConfigSource(path=str(eds_path(xds_dir, cluster)),
                                            watched_directory=WatchedDirectory(path=str(xds_dir))),
        resource_api_version=ApiVersion.V3)
    return ClusterEdsClusterConfig(eds_config=source)


def load_assignment(cluster: str, addresses: Iterable[str]) -> ClusterLoadAssignment:
    endpoints = []
    for address in sorted(addresses):
        ip, port = split_address(address)
        endpoints.append(LbEndpoint(endpoint=Endpoint(
            address=Address(socket_address=SocketAddress(address=ip, port_value=port)))))
    return ClusterLoadAssignment(cluster_name=cluster, endpoints=[LocalityLbEndpoints(lb_endpoints=endpoints)])


def write_eds(out_dir: str | Path, cluster: str, addresses: Iterable[str]) -> Path:
    """Write (atomically) the cluster's endpoints; Envoy applies the file within milliseconds of the rename."""
    path = eds_path(out_dir, cluster)
    write_atomic(path, discovery_doc([load_assignment(cluster, addresses)]))
    return path
