"""Who is calling: API keys mapped to tenants, and the per-tenant limits that depend only on identity.

Keys come from a file (YAML mapping `key: tenant`) and/or an environment variable, in one of two forms:
  - `key1=tenant-a,key2=tenant-b`: each entry is split at its LAST `=`, so a key may contain `=` (base64 padding:
    `c2VjcmV0LWtleQ===delta` is the key `c2VjcmV0LWtleQ==` for tenant `delta`) and a tenant may not; entries and
    both sides are stripped of spaces, an entry without a key or a tenant is skipped (with a warning that never
    shows the entry);
  - a JSON object `{"key": "tenant", ...}` (the value starts with `{`): any key, with `,`, `=`, spaces or any
    Unicode character.
A key is compared as the bytes the client sent (UTF-8 for a non-ASCII key). Only SHA-256 digests of keys are kept
in memory, and a presented key is hashed before it is looked up: the lookup's timing can depend only on the digest,
and matching a digest prefix tells an attacker nothing about the key (no character-by-character comparison of
secrets). Keys are never logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
import yaml

from extproc.schema import non_negative, require

log = logging.getLogger("sluice.identity")


@dataclass
class TenantPolicy:
    """The `tenants:` section: who is calling, and how many requests each tenant may hold open."""

    auth: bool = False                 # true: a known API key is required (401 otherwise)
    keys_file: str = ""                # YAML file {api_key: tenant}
    keys_env: str = "SLUICE_API_KEYS"  # environment variable with more keys: "key=tenant,key=tenant" (split at
                                       # the last "=": keys may hold "=", tenants may not) or a JSON object
                                       # {"key": "tenant"} for keys with "," or any other character
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
    """A configured key's digest: of its UTF-8 bytes, which is what a client sends for a non-ASCII key."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _presented_digest(key: str) -> bytes:
    """A presented key's digest: of the header's own bytes (extproc/head.py decodes header values as latin-1,
    which round-trips every byte)."""
    try:
        raw = key.encode("latin-1")
    except UnicodeEncodeError:  # not from a header: a str of any characters
        raw = key.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).digest()


def parse_keys_env(raw: str, name: str = "keys_env") -> dict[str, str]:
    """The keys of the environment variable's value (the forms are in the module docstring)."""
    raw = raw.strip()
    if raw.startswith("{"):
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"tenants.keys_env {name}: not a valid JSON object ({exc.msg}, "
                             f"position {exc.pos})") from None  # type: ignore[attr-defined]
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v
                                                 for k, v in data.items()):
            raise ValueError(f"tenants.keys_env {name}: expected a JSON object of non-empty \"key\": \"tenant\"")
        return data
    keys: dict[str, str] = {}
    for i, item in enumerate(raw.split(",")):
        key, sep, tenant = item.rpartition("=")
        key, tenant = key.strip(), tenant.strip()
        if sep and key and tenant:
            keys[key] = tenant
        elif item.strip():
            log.warning("tenants.keys_env %s: entry %d is not key=tenant; skipped", name, i + 1)
    return keys


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
        if self.policy.keys_env:
            keys.update(parse_keys_env(os.environ.get(self.policy.keys_env, ""), self.policy.keys_env))
        return keys

    def tenant_for(self, api_key: str | None, header_tenant: str) -> str:
        """The tenant of a request. Raises UnknownKey when auth is on and the key is missing or unknown."""
        if api_key:
            digest = _presented_digest(api_key)
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
