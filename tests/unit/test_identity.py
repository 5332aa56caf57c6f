"""API keys -> tenants, auth, per-tenant open-stream limits, bounded labels."""

import json

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


# ---- keys in the environment: any key bytes (issue #19, finding 4) ----------------------------------------------
def test_env_keys_split_at_the_last_equals_sign(monkeypatch):
    """Base64 padding: `c2VjcmV0LWtleQ==delta` used to be split at the first `=` (the key `c2VjcmV0LWtleQ` under a
    tenant named `=delta`). Now at the last: keys may contain `=`, tenants may not."""
    monkeypatch.setenv("TEST_KEYS", "c2VjcmV0LWtleQ==delta, c2VjcmV0LWtleQ===gamma ,plain=acme , a key = with space ")
    ident = Identity(TenantPolicy(auth=True, keys_env="TEST_KEYS"))
    assert ident.tenant_for("c2VjcmV0LWtleQ=", "") == "delta"
    assert ident.tenant_for("c2VjcmV0LWtleQ==", "") == "gamma"
    assert ident.tenant_for("plain", "") == "acme"
    assert ident.tenant_for("a key", "") == "with space"
    for wrong in ("c2VjcmV0LWtleQ", "c2VjcmV0LWtleQ=delta"):
        with pytest.raises(UnknownKey):
            ident.tenant_for(wrong, "")


def test_env_keys_as_json_take_any_character(monkeypatch):
    keys = {"k,with,commas": "t1", "k=with=equals==": "t2", "k with spaces": "t3", "ключ-🔑": "t4", 'q"uote': "t5"}
    monkeypatch.setenv("TEST_KEYS", json.dumps(keys))
    ident = Identity(TenantPolicy(auth=True, keys_env="TEST_KEYS"))
    for key, tenant in keys.items():
        assert ident.tenant_for(key, "") == tenant
    # what head.py makes of the client's header bytes (latin-1 of the UTF-8): the same key
    assert ident.tenant_for("ключ-🔑".encode().decode("latin-1"), "") == "t4"
    with pytest.raises(UnknownKey):
        ident.tenant_for("k", "")


@pytest.mark.parametrize("raw", ['{"k": 5}', '{"k": ""}', "{not json", '{"": "t"}'])
def test_env_keys_invalid_json_is_a_start_error_that_shows_no_key(monkeypatch, raw):
    monkeypatch.setenv("TEST_KEYS", raw)
    with pytest.raises(ValueError, match="TEST_KEYS") as exc:
        Identity(TenantPolicy(keys_env="TEST_KEYS"))
    assert '"k"' not in str(exc.value)


def test_env_keys_skipped_entries_are_logged_without_the_key(monkeypatch, caplog):
    monkeypatch.setenv("TEST_KEYS", "sk-good=acme,sk-secret-no-tenant=,=lonely")
    ident = Identity(TenantPolicy(keys_env="TEST_KEYS"))
    assert ident.tenant_for("sk-good", "") == "acme"
    assert "entry 2" in caplog.text and "entry 3" in caplog.text and "sk-secret" not in caplog.text
