"""Security properties end to end (issue #10, part 5): API keys and tenants, headers only the gateway may set,
listeners on loopback, no prompt text or keys in logs and metrics, bounded label cardinality."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import yaml

from extproc.config import is_loopback, policy_from_dict
from extproc.supervisor import Stack
from extproc.xds import render

from .conftest import (MODEL, EchoReplica, assert_openai_error, assert_settled, chat, echo_stack, metric_sum,
                       raw_http, running_stack, scrape, wait_for)

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
CHAT = "/v1/chat/completions"


# ---- API keys -> tenants ---------------------------------------------------------------------------------------
KEYS_ENV = f"SLUICE_TEST_KEYS_{uuid.uuid4().hex[:8]}"
# keys given in the environment (issue #19, finding 4): base64 padding, a non-ASCII key
ENV_KEYS = "c2VjcmV0LWtleQ===delta, ключ-7=unicode"


@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("auth")
    keys = Path(tmp) / "keys.yaml"
    keys.write_text("sk-acme-5f2c9: acme\nsk-globex-77aa1: globex\n")
    os.environ[KEYS_ENV] = ENV_KEYS  # the sidecar process inherits it at start
    try:
        with running_stack(tmp, {"tenants": {"auth": True, "keys_file": str(keys), "keys_env": KEYS_ENV}}) as s:
            del os.environ[KEYS_ENV]
            yield s
    finally:
        os.environ.pop(KEYS_ENV, None)


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer sk-nope", "Basic c2stYWNtZQ==",
                                           "Bearer sk-acme-5f2c9x", "Bearer SK-ACME-5F2C9", "sk-acme-5f2c",
                                           "Bearer  sk-acme-5f2c9"])
def test_missing_or_unknown_key_is_401(auth_stack: Stack, authorization: str | None) -> None:
    headers = {"authorization": authorization} if authorization is not None else {}
    resp = httpx.post(auth_stack.base_url + CHAT, json=chat(), headers=headers, timeout=10)
    err = assert_openai_error(resp, 401, "invalid_api_key")
    assert err["type"] == "authentication_error"


def test_key_decides_the_tenant_not_the_header(auth_stack: Stack) -> None:
    with httpx.Client(base_url=auth_stack.base_url, timeout=10) as http:
        for key in ("sk-acme-5f2c9", "sk-globex-77aa1"):
            # the bare key (no "Bearer ") is accepted too; a tenant header cannot re-assign the request
            for auth in (f"Bearer {key}", key):
                resp = http.post(CHAT, json=chat(), headers={"authorization": auth, "x-sluice-tenant": "evil"})
                assert resp.status_code == 200, resp.text
    tenants = {dict(lbls).get("tenant") for (name, lbls) in scrape(auth_stack.metrics_url)
               if name == "sluice_tenant_open_streams"}
    assert {"acme", "globex"} <= tenants and "evil" not in tenants, tenants


def test_keys_from_the_environment_with_padding_and_unicode(auth_stack: Stack) -> None:
    """`c2VjcmV0LWtleQ===delta` is the base64 key `c2VjcmV0LWtleQ==` for tenant delta (it used to be split at the
    first `=`); a UTF-8 key is matched on the bytes the client sends."""
    resp = httpx.post(auth_stack.base_url + CHAT, json=chat(), timeout=10,
                      headers={"authorization": "Bearer c2VjcmV0LWtleQ=="})
    assert resp.status_code == 200, resp.text
    for wrong in ("c2VjcmV0LWtleQ", "c2VjcmV0LWtleQ="):
        assert_openai_error(httpx.post(auth_stack.base_url + CHAT, json=chat(), timeout=10,
                                       headers={"authorization": f"Bearer {wrong}"}), 401, "invalid_api_key")
    body = json.dumps(chat()).encode()
    ct = (b"content-type", b"application/json")
    resp = raw_http(auth_stack.base_url, CHAT, body, [ct, (b"authorization", "Bearer ключ-7".encode())])
    assert resp.status_code == 200, resp.text
    tenants = {dict(lbls).get("tenant") for (name, lbls) in scrape(auth_stack.metrics_url)
               if name == "sluice_tenant_open_streams"}
    assert {"delta", "unicode"} <= tenants and "=delta" not in tenants, tenants


def test_a_tenants_retries_leave_another_tenants_first_retry(auth_stack: Stack) -> None:
    """Issue #19, finding 3: after one tenant's ten retries, another tenant's first retry got 429
    `retry_budget_exceeded` (the cap was pool-wide). Now the noisy tenant is refused at its own share, and the
    other tenant (the base64 key with `==` padding, through the openai SDK) retries as if alone."""
    with httpx.Client(base_url=auth_stack.base_url, timeout=10) as http:
        codes = [http.post(CHAT, json=chat(), headers={"authorization": "Bearer sk-acme-5f2c9",
                                                       "x-stainless-retry-count": "1"}).status_code
                 for _ in range(10)]
    assert 200 in codes and 429 in codes and set(codes) == {200, 429}, codes
    client = openai.OpenAI(base_url=auth_stack.base_url + "/v1", api_key="c2VjcmV0LWtleQ==", max_retries=0)
    done = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                          extra_headers={"x-stainless-retry-count": "1"})
    assert done.choices[0].finish_reason in ("stop", "length")
    assert_settled(auth_stack)


NO_KEY_PROBES = {  # name -> (method, path, body, content-type): each answer Envoy or the sidecar would give
    "list_models": ("GET", "/v1/models", None, None),
    "bad_json": ("POST", CHAT, b"{bad", "application/json"),
    "unknown_model": ("POST", CHAT, json.dumps({**chat(), "model": "gpt-nope"}).encode(), "application/json"),
    "unknown_endpoint_post": ("POST", "/v1/embeddings", b'{"model":"m","input":"x"}', "application/json"),
    "unknown_endpoint_get": ("GET", "/admin", None, None),
    "wrong_content_type": ("POST", CHAT, json.dumps(chat()).encode(), "text/plain"),
    "no_body": ("GET", CHAT, None, None),
}
WITH_KEY = {"list_models": 200, "bad_json": 400, "unknown_model": 404, "unknown_endpoint_post": 404,
            "unknown_endpoint_get": 404, "wrong_content_type": 415, "no_body": 400}


@pytest.mark.parametrize("name", list(NO_KEY_PROBES))
def test_auth_comes_before_any_other_answer(auth_stack: Stack, name: str) -> None:
    """Issue #19, finding 7: with keys required, a request without a valid key learns nothing else (the model list,
    which paths exist, how its body is judged): 401 first. With a valid key, the usual answer."""
    method, path, body, ctype = NO_KEY_PROBES[name]
    headers = {"content-type": ctype} if ctype else {}
    with httpx.Client(base_url=auth_stack.base_url, timeout=10) as http:
        for auth in (None, "Bearer sk-nope"):
            h = {**headers, **({"authorization": auth} if auth else {})}
            assert_openai_error(http.request(method, path, content=body, headers=h), 401, "invalid_api_key")
        resp = http.request(method, path, content=body, headers={**headers, "authorization": "Bearer sk-acme-5f2c9"})
    assert resp.status_code == WITH_KEY[name], (name, resp.status_code, resp.text[:200])
    if resp.status_code == 200:
        assert [m["id"] for m in resp.json()["data"]] == [MODEL]
    else:
        assert_openai_error(resp, WITH_KEY[name])


def test_api_keys_never_reach_logs_or_metrics(auth_stack: Stack) -> None:
    httpx.post(auth_stack.base_url + CHAT, json=chat(), headers={"authorization": "Bearer sk-leak-probe-9931"},
               timeout=10)
    metrics = httpx.get(auth_stack.metrics_url, timeout=5).text
    logs = "".join(p.read_text(errors="replace") for p in (auth_stack.run_dir / "logs").glob("*.log"))
    for secret in ("sk-acme-5f2c9", "sk-globex-77aa1", "sk-leak-probe-9931", "c2VjcmV0LWtleQ", "ключ"):
        assert secret not in metrics and secret not in logs


# ---- a plain stack: pinning headers, loopback, no prompt text, cardinality ----------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A quick prompt-shift detector, so a shift event (which logs) happens during the leak test. The token
    # calibration is off: its warm-up follows the engines' counts at whichever scrape catches them, and a new
    # calibration epoch between the leak test's short and long prompts made the detector learn its baseline again
    # from the long ones (no event, about 1 run in 8); the calibration's epochs have their own tests
    # (tests/budgets/test_prompt_shift.py, tests/admission/test_token_calibration.py).
    with running_stack(tmp_path_factory.mktemp("sec"), {"budgets": {"prompt_shift": {
            "baseline_requests": 3, "sustain_requests": 2, "threshold": 0.3}},
            "admission": {"calibrate_prompt_tokens": False}}) as s:
        yield s


def test_client_cannot_pick_replica_or_cluster(stack: Stack) -> None:
    """A client-sent destination naming a dead address, or a pool header naming a missing cluster, would fail the
    request if Envoy used them. They are ignored (and stripped / overwritten by the sidecar)."""
    pool = stack.policy.default_pool.replicas
    headers = {"x-gateway-destination-endpoint": "127.0.0.1:1", "x-sluice-pool": "pool-nope"}
    with httpx.Client(base_url=stack.base_url, timeout=10, headers=headers) as http:
        for _ in range(6):
            resp = http.post(CHAT, json=chat())
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-sim-replica"] in pool


def test_listeners_bind_loopback_by_default(stack: Stack, tmp_path: Path) -> None:
    defaults = policy_from_dict({"pools": [{"model": "m", "replicas": ["10.0.0.1:8000"]}]})
    assert is_loopback(defaults.gateway.admin_host) and is_loopback(defaults.sidecar.metrics_host)
    assert is_loopback(defaults.sidecar.host) and is_loopback(defaults.gateway.host)
    boot = yaml.safe_load(render(defaults, tmp_path / "envoy")["bootstrap"].read_text())
    assert is_loopback(boot["admin"]["address"]["socket_address"]["address"])
    # and the running processes listen on loopback only (every TCP LISTEN socket they own)
    for name in ("envoy", "sidecar[0]"):
        pid = stack.child(name).proc.pid
        listening = _listening(pid)
        assert listening, name
        assert all(is_loopback(host) for host, _port in listening), (name, listening)
    ports = {port for _h, port in _listening(stack.child("envoy").proc.pid)}
    assert stack.policy.gateway.admin_port in ports
    ports = {port for _h, port in _listening(stack.child("sidecar[0]").proc.pid)}
    assert {stack.policy.sidecar.metrics_port, stack.policy.sidecar.grpc_port} <= ports


def _listening(pid: int) -> list[tuple[str, int]]:
    """(host, port) of the TCP sockets in LISTEN state owned by `pid` (from /proc)."""
    import ipaddress
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if width == 8:
                host = str(ipaddress.IPv4Address(raw[::-1]))
            else:
                v6 = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                host = str(v6.ipv4_mapped or v6)
            out.append((host, int(hexport, 16)))
    return out


def test_no_prompt_text_in_logs_or_metrics(stack: Stack) -> None:
    marker = f"PROMPT-MARKER-{uuid.uuid4().hex}"
    system = f"You are {marker}. " * 40
    with httpx.Client(base_url=stack.base_url, timeout=15) as http:
        for i in range(6):  # short prompts, then long ones with the marker system prompt: a prompt-shift event
            content = "hi" if i < 3 else f"{marker} " * 300
            msgs = [{"role": "system", "content": system if i >= 3 else "s"}, {"role": "user", "content": content}]
            assert http.post(CHAT, json={"model": MODEL, "max_tokens": 3, "messages": msgs},
                             headers={"x-sluice-app": "leakapp"}).status_code == 200
        with http.stream("POST", CHAT, json=chat(content=marker, max_tokens=5, stream=True)) as resp:
            list(resp.iter_lines())
        http.post("/v1/completions", json={"model": MODEL, "prompt": marker, "max_tokens": 2})
        # rejected ones too: the marker as the model name, in a broken body, with an oversized deadline header
        http.post(CHAT, json={"model": marker, "messages": [{"role": "user", "content": marker}]})
        http.post(CHAT, content=f'{{"model":"{MODEL}","messages":[{{"content":"{marker}"'.encode(),
                  headers={"content-type": "application/json"})
        http.post(CHAT, json=chat(content=marker), headers={"x-sluice-deadline-ms": "inf"})
        envoy_stats = http.get(stack.admin_url + "/stats/prometheus").text
    assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_prompt_shift_events_total") >= 1, 5)
    metrics = httpx.get(stack.metrics_url, timeout=5).text
    logs = "".join(p.read_text(errors="replace") for p in (stack.run_dir / "logs").glob("sidecar*.log"))
    assert "prompt cost shift" in logs  # the shift was logged ...
    assert marker not in logs           # ... by fingerprint, not text
    assert marker not in metrics and marker not in envoy_stats


def test_label_cardinality_is_bounded(stack: Stack) -> None:
    """Hundreds of distinct tenant and app header values: metric series stay bounded, the rest become `other`."""
    def one(i: int) -> int:
        return httpx.post(stack.base_url + CHAT, json=chat(max_tokens=1), timeout=15,
                          headers={"x-sluice-tenant": f"tenant-{i}-{uuid.uuid4().hex[:6]}",
                                   "x-sluice-app": f"app-{i}-{uuid.uuid4().hex[:6]}"}).status_code

    def send(first: int, n: int) -> None:
        with cf.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(one, range(first, first + n)))
        assert codes.count(200) == n, {c: codes.count(c) for c in set(codes)}

    send(0, 300)
    samples = scrape(stack.metrics_url)
    # caps: tenants.label_tenants (50) for the tenant gauge, 256 tenants in the budget counters
    # (budgets/tenants.py), prompt_shift.max_apps (64) for every per-app series; +1 "other", +1 "default"
    known = {"sluice_tenant_open_streams": ("tenant", 50), "sluice_budget_tenant_tokens_total": ("tenant", 256),
             "sluice_prompt_cost_tokens_per_request": ("app", 64), "sluice_prompt_shift_ratio": ("app", 64)}
    for name in {n for (n, lbls) in samples if {"tenant", "app"} & set(dict(lbls))}:
        label, cap = known.get(name, ("tenant" if any(n == name and "tenant" in dict(lbls)
                                                      for (n, lbls) in samples) else "app", 256))
        values = {dict(lbls)[label] for (n, lbls) in samples if n == name}
        assert len(values) <= cap + 2, (name, len(values))
        assert "other" in values, name
    # once the caps are reached, new tenants and apps add no series at all
    send(1000, 60)
    assert set(scrape(stack.metrics_url)) == set(samples)
    assert_settled(stack)


# ---- headers only the gateway may set never reach the replica ---------------------------------------------
def test_client_routing_headers_never_reach_the_replica(tmp_path: Path) -> None:
    client_headers = {"x-envoy-upstream-rq-timeout-ms": "1", "x-envoy-upstream-rq-per-try-timeout-ms": "1",
                      "x-envoy-max-retries": "7", "x-envoy-retry-on": "5xx,reset", "x-envoy-retry-grpc-on": "cancelled",
                      "x-envoy-hedge-on-per-try-timeout": "true", "x-envoy-force-trace": "1",
                      "x-gateway-destination-endpoint": "10.1.2.3:80", "x-sluice-pool": "pool-nope"}
    with EchoReplica(delay_s=0.3) as echo:
        stack = echo_stack(tmp_path, echo)
        with stack:
            resp = httpx.post(stack.base_url + CHAT, json=chat(), headers=client_headers, timeout=10)
            # a 1 ms timeout from the client would have cut this 300 ms request
            assert resp.status_code == 200, resp.text
            seen = echo.seen[-1]
            for name in client_headers:
                if name == "x-sluice-pool":
                    assert seen.get(name) == stack.policy.default_pool.cluster  # the sidecar's value
                else:
                    assert name not in seen, (name, seen)
            # the gateway's own deadline header still works: the sidecar sets the upstream timeout
            resp = httpx.post(stack.base_url + CHAT, json=chat(), headers={"x-sluice-deadline-ms": "100"}, timeout=10)
            assert resp.status_code in (429, 504), resp.text
