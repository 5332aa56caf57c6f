"""Who is calling: API keys mapped to tenants, and the per-tenant limits that depend only on identity.

Keys come from a file (YAML mapping `key: tenant`) and/or an environment variable
(`key1=tenant-a,key2=tenant-b`). Only SHA-256 digests of keys are kept in memory, and a presented key is hashed
before it is looked up: the lookup's timing can depend only on the digest, and matching a digest prefix tells an
attacker nothing about the key (no character-by-character comparison of secrets). Keys are never logged.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
import yaml

from extproc.schema import non_negative, require


@dataclass
class TenantPolicy:
    """The `tenants:` section: who is calling, and how many requests each tenant may hold open."""

    auth: bool = False                 # true: a known API key is required (401 otherwise)
    keys_file: str = ""                # YAML file {api_key: tenant}
    keys_env: str = "SLUICE_API_KEYS"  # environment variable "key=tenant,key=tenant"
    trust_tenant_header: bool = True   # auth off: the x-sluice-tenant header names the tenant (else "default")
    max_streams_per_tenant: int = 0    # open requests per tenant in this sidecar; 0 = unlimited (P12)
    stream_limits: dict[str, int] = field(default_factory=dict)  # per-tenant overrides of max_streams_per_tenant
    label_tenants: int = 50            # distinct tenants shown as metric labels; the rest collapse to "other"

    def validate(self, path: str) -> None:
        non_negative(self, path, "max_streams_per_tenant")
        for tenant, v in self.stream_limits.items():
            require(v >= 0, f"{path}.stream_limits.{tenant}", f"must be >= 0, got {v!r}")
        require(self.label_tenants >= 1, f"{path}.label_tenants", "must be >= 1")


class UnknownKey(Exception):
    """Auth is on and the request carried no key, or one we do not know."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Identity:
    def __init__(self, policy: TenantPolicy) -> None:
        self.policy = policy
        self._tenants: dict[bytes, str] = {}
        for key, tenant in self._load_keys().items():
            self._tenants[_digest(key)] = tenant
        if policy.auth and not self._tenants:
            raise ValueError("tenants.auth is on but no API keys were found (keys_file / keys_env)")
        self.open_streams: dict[str, int] = {}
        self._labels: set[str] = set()

    def _load_keys(self) -> dict[str, str]:
        keys: dict[str, str] = {}
        if self.policy.keys_file:
            path = Path(self.policy.keys_file)
            try:
                data = yaml.safe_load(path.read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise ValueError(f"tenants.keys_file {path}: {exc}") from None
            if not isinstance(data, dict):
                raise ValueError(f"tenants.keys_file {path}: expected a mapping of api_key: tenant")
            keys.update({str(k): str(v) for k, v in data.items()})
        raw = os.environ.get(self.policy.keys_env, "") if self.policy.keys_env else ""
        for item in filter(None, (part.strip() for part in raw.split(","))):
            key, sep, tenant = item.partition("=")
            if sep and key and tenant:
                keys[key] = tenant
        return keys

    def tenant_for(self, api_key: str | None, header_tenant: str) -> str:
        """The tenant of a request. Raises UnknownKey when auth is on and the key is missing or unknown."""
        if api_key:
            digest = _digest(api_key)
            tenant = self._tenants.get(digest)
            if tenant is not None:
                return tenant
        if self.policy.auth:
            raise UnknownKey()
        if self.policy.trust_tenant_header and header_tenant:
            return header_tenant
        return "default"

    # ---- per-tenant open streams (P12) -----------------------------------------------------------------
    def stream_limit(self, tenant: str) -> int:
        return self.policy.stream_limits.get(tenant, self.policy.max_streams_per_tenant)

    def try_open(self, tenant: str) -> bool:
        limit = self.stream_limit(tenant)
        n = self.open_streams.get(tenant, 0)
        if limit and n >= limit:
            return False
        self.open_streams[tenant] = n + 1
        return True

    def close(self, tenant: str) -> None:
        n = self.open_streams.get(tenant, 0) - 1
        if n > 0:
            self.open_streams[tenant] = n
        else:
            self.open_streams.pop(tenant, None)

    def label(self, tenant: str) -> str:
        """Bounded metric label: the first `label_tenants` tenants seen keep their name, the rest are "other"."""
        if tenant in self._labels:
            return tenant
        if len(self._labels) < self.policy.label_tenants:
            self._labels.add(tenant)
            return tenant
        return "other"
