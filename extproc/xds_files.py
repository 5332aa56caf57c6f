"""Envoy's file-based xDS on disk: typed envoy-data-plane objects to the YAML Envoy reads, written atomically.

Shared by the renderer of sluice's own Envoy (xds.py), the EDS files of replicas found by name
(discovery/eds.py) and the Gateway API shape (xds_epp.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import betterproto2
import yaml
from envoy_data_plane.google.protobuf import Any as PbAny

# betterproto2 mangles a few proto field names (digits inside a word); Envoy wants the proto's own.
_FIELD_FIXUPS = {"consecutive_5_xx": "consecutive_5xx", "enforcing_consecutive_5_xx": "enforcing_consecutive_5xx"}


def _fix_names(node: Any) -> Any:
    if isinstance(node, dict):
        return {_FIELD_FIXUPS.get(k, k): _fix_names(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_names(v) for v in node]
    return node


def to_dict(msg: Any) -> dict[str, Any]:
    """Proto field names (snake_case), which Envoy's YAML loader accepts like the JSON names."""
    return _fix_names(msg.to_dict(casing=betterproto2.Casing.SNAKE))


def discovery_doc(resources: list[Any]) -> dict[str, Any]:
    """A DiscoveryResponse as Envoy's file-based xDS expects it."""
    return {"resources": [to_dict(PbAny.pack(r)) for r in resources]}


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write via temp file + rename: Envoy's watched directory must never see a half-written file. World-readable
    (0644): Envoy may run as another user (its container image's `envoy` user reading a shared volume)."""
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(f"# Rendered by sluice from the policy file; do not edit by hand.\n{text}")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
