"""API keys -> tenants, auth, per-tenant open-stream limits, bounded labels."""

import pytest

from extproc.config import parse_section
from extproc.identity import Identity, TenantPolicy, UnknownKey


def test_keys_from_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "keys.yaml"
    f.write_text("sk-file: acme\n")
    monkeypatch.setenv("TEST_KEYS", "sk-env=globex, junk ,=x")
    ident = Identity(TenantPolicy(auth=True, keys_file=str(f), keys_env="TEST_KEYS"))
    assert ident.tenant_for("sk-file", "") == "acme"
    assert ident.tenant_for("sk-env", "spoofed") == "globex"
    with pytest.raises(UnknownKey):
        ident.tenant_for("sk-wrong", "acme")
    with pytest.raises(UnknownKey):
        ident.tenant_for(None, "acme")


def test_keys_are_not_kept_in_clear(monkeypatch):
    monkeypatch.setenv("TEST_KEYS", "sk-secret-123=acme")
    ident = Identity(TenantPolicy(keys_env="TEST_KEYS"))
    assert "sk-secret-123" not in repr(ident.__dict__)


def test_auth_off_trusts_header_or_default():
    ident = Identity(TenantPolicy(keys_env=""))
    assert ident.tenant_for(None, "team-a") == "team-a"
    assert ident.tenant_for("anything", "") == "default"
    strict = Identity(TenantPolicy(keys_env="", trust_tenant_header=False))
    assert strict.tenant_for(None, "team-a") == "default"


def test_auth_without_keys_is_a_config_error():
    with pytest.raises(ValueError):
        Identity(TenantPolicy(auth=True, keys_env=""))


def test_stream_limits_per_tenant():
    ident = Identity(TenantPolicy(keys_env="", max_streams_per_tenant=2, stream_limits={"vip": 3}))
    assert ident.try_open("a") and ident.try_open("a") and not ident.try_open("a")
    ident.close("a")
    assert ident.try_open("a")
    assert all(ident.try_open("vip") for _ in range(3)) and not ident.try_open("vip")
    for _ in range(3):
        ident.close("vip")
    assert "vip" not in ident.open_streams


def test_labels_are_bounded():
    ident = Identity(TenantPolicy(keys_env="", label_tenants=2))
    assert [ident.label(t) for t in ("a", "b", "c", "a")] == ["a", "b", "other", "a"]


def test_policy_validation():
    with pytest.raises(ValueError, match="tenants.bogus: unknown field"):
        parse_section("tenants", {"bogus": 1})
    with pytest.raises(ValueError, match="tenants.max_streams_per_tenant"):
        parse_section("tenants", {"max_streams_per_tenant": -1})
