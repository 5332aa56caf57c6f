"""Auth and per-tenant stream limits through the real gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from extproc.supervisor import Stack
from tests.waiting import wait_for_async

from .conftest import make_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("auth")
    keys = Path(tmp) / "keys.yaml"
    keys.write_text("sk-acme: acme\nsk-globex: globex\n")
    with make_stack(tmp, {"tenants": {"auth": True, "keys_file": str(keys), "keys_env": "",
                                      "max_streams_per_tenant": 2}}) as s:
        yield s


def client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)


def test_missing_or_unknown_key_is_401(auth_stack: Stack):
    async def run() -> None:
        async with client(auth_stack, "sk-nope") as c:
            with pytest.raises(openai.AuthenticationError) as exc:
                await c.chat.completions.create(model="sim-model", max_tokens=2,
                                                messages=[{"role": "user", "content": "x"}])
            assert exc.value.code == "invalid_api_key"
        async with client(auth_stack, "sk-acme") as c:
            out = await c.chat.completions.create(model="sim-model", max_tokens=2,
                                                  messages=[{"role": "user", "content": "x"}])
            assert out.choices[0].message.content
    asyncio.run(run())


def test_tenant_stream_limit_rejects_cleanly_and_spares_other_tenants(auth_stack: Stack):
    async def one(c: openai.AsyncOpenAI) -> str:
        try:
            await c.chat.completions.create(model="sim-model", max_tokens=150,
                                            messages=[{"role": "user", "content": "x"}])
            return "ok"
        except openai.RateLimitError as exc:
            assert exc.code == "tenant_stream_limit"
            assert exc.response.headers.get("retry-after")
            return "limited"

    async def acme_at_its_limit() -> bool:
        open_streams = await asyncio.to_thread(metric_sum, auth_stack.metrics_url, "sluice_tenant_open_streams",
                                               tenant="acme")
        return open_streams >= 2

    async def run() -> tuple[list[str], list[str]]:
        async with client(auth_stack, "sk-acme") as acme, client(auth_stack, "sk-globex") as globex:
            acme_results = asyncio.gather(*(one(acme) for _ in range(5)))
            await wait_for_async(acme_at_its_limit)  # globex arrives while acme holds its two streams
            globex_results = asyncio.gather(*(one(globex) for _ in range(2)))
            return await acme_results, await globex_results

    from .conftest import metric_sum, wait_for

    # the previous test's request holds its slot until Envoy's access log reports its end (up to one flush, 10 ms)
    assert wait_for(lambda: metric_sum(auth_stack.metrics_url, "sluice_tenant_open_streams") == 0)
    acme, globex = asyncio.run(run())
    assert acme.count("ok") == 2 and acme.count("limited") == 3
    assert globex == ["ok", "ok"]


@pytest.fixture(scope="module")
def metered_stack(tmp_path_factory: pytest.TempPathFactory):
    with make_stack(tmp_path_factory.mktemp("metered"), {"streaming": {"sample_rate": 0.0,
                                                                        "metered_tenants": ["gold"]}}) as s:
        yield s


def test_metered_tenant_requests_are_observed(metered_stack: Stack):
    from .conftest import metric_sum, wait_for

    url = metered_stack.metrics_url
    c = openai.OpenAI(base_url=metered_stack.base_url + "/v1", api_key="x", max_retries=0,
                      default_headers={"x-sluice-tenant": "gold"})
    chunks = list(c.chat.completions.create(model="sim-model", max_tokens=25, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "word " * 400}]))
    assert chunks[-1].usage.completion_tokens == 25
    # the estimator's prompt count vs the replica's: within 30% for plain English
    assert wait_for(lambda: metric_sum(url, "sluice_prompt_estimate_ratio_count") == 1)
    ratio = metric_sum(url, "sluice_prompt_estimate_ratio_sum")
    assert 0.7 < ratio < 1.3, ratio
    out = c.chat.completions.create(model="sim-model", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert out.usage.completion_tokens == 5
    assert wait_for(lambda: metric_sum(url, "sluice_observed_requests_total") == 2)
    assert metric_sum(url, "sluice_observed_ttft_seconds_count") == 1  # streaming only
    # an unmetered tenant is not observed
    c2 = openai.OpenAI(base_url=metered_stack.base_url + "/v1", api_key="x", max_retries=0)
    c2.chat.completions.create(model="sim-model", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert metric_sum(url, "sluice_observed_requests_total") == 2


@pytest.fixture(scope="module")
def capped_stack(tmp_path_factory: pytest.TempPathFactory):
    with make_stack(tmp_path_factory.mktemp("capped"), {"sidecar": {"max_open_requests": 3},
                                                        "budgets": {"retry": {"credit_refused": True}}}) as s:
        yield s


def test_open_request_cap_rejects_excess_cleanly(capped_stack: Stack):
    """P12: beyond the sidecar's open-request cap, requests get a clean 429 (and the connection is released),
    while the admitted ones keep streaming."""
    import httpx

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=capped_stack.base_url, timeout=30) as http:
            async def one() -> int:
                body = {"model": "sim-model", "max_tokens": 200, "messages": [{"role": "user", "content": "x"}]}
                r = await http.post("/v1/chat/completions", json=body)
                if r.status_code == 429:
                    assert r.json()["error"]["code"] == "gateway_at_capacity"
                    assert r.headers["x-should-retry"] == "true"
                return r.status_code
            return await asyncio.gather(*(one() for _ in range(8)))

    statuses = asyncio.run(run())
    assert statuses.count(200) >= 3 and statuses.count(429) >= 1
    assert set(statuses) <= {200, 429}


def test_the_retries_of_refused_requests_are_admitted_beyond_the_retry_floor(capped_stack: Stack):
    """With `budgets.retry.credit_refused` (this stack's policy): a request refused at the open-request cap
    (x-should-retry: true) reached no replica, and its SDK retry (`x-stainless-retry-count: 1`) is not charged to the retry budget, whose floor (3 per window) would otherwise
    refuse the fourth retry with retry_budget_exceeded."""
    import httpx

    body = {"model": "sim-model", "max_tokens": 200, "messages": [{"role": "user", "content": "x"}]}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=capped_stack.base_url, timeout=30) as http:
            async def one() -> int:
                return (await http.post("/v1/chat/completions", json=body)).status_code
            return await asyncio.gather(*(one() for _ in range(10)))

    refused = asyncio.run(burst()).count(429)
    assert refused >= 2
    retry = {"x-stainless-retry-count": "1"}
    with httpx.Client(base_url=capped_stack.base_url, timeout=30) as http:
        codes = [http.post("/v1/chat/completions", json={**body, "max_tokens": 4}, headers=retry).status_code
                 for _ in range(refused + 3)]  # one free retry per refusal, then the tenant's floor of 3
    assert codes == [200] * (refused + 3), codes


@pytest.fixture(scope="module")
def capped_default_stack(tmp_path_factory: pytest.TempPathFactory):
    with make_stack(tmp_path_factory.mktemp("capped-default"), {"sidecar": {"max_open_requests": 3}}) as s:
        yield s


def test_a_refused_client_is_not_told_to_retry_what_its_retry_budget_would_refuse(capped_default_stack: Stack):
    """At the shipped defaults (no retry credits): a refusal at the open-request cap tells the client to retry
    while its tenant's retries fit the retry budget, counting the retries already asked for (the first refusals of
    a burst promise theirs), and not to (x-should-retry: false, and why) once they would be refused as
    retry_budget_exceeded. The openai SDK, with its 2 retries, then raises at once: the sidecar sees one attempt
    per refused call."""
    import httpx

    from .conftest import metric_sum

    stack = capped_default_stack
    body = {"model": "sim-model", "max_tokens": 200, "messages": [{"role": "user", "content": "x"}]}

    async def burst_answers() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(8)))

    refused = [r for r in asyncio.run(burst_answers()) if r.status_code == 429]
    told = [r for r in refused if r.headers["x-should-retry"] == "true"]
    assert len(refused) > 3 and len(told) == 3  # the tenant's floor: 3 retries per 10 s window
    assert all("retry_budget_exceeded" in r.json()["error"]["message"] for r in refused if r not in told)
    # The tenant's retries: its floor of 3 per 10 s window fits, the fourth is refused as a retry storm.
    retry = {"x-stainless-retry-count": "1"}
    with httpx.Client(base_url=stack.base_url, timeout=30) as http:
        codes = [http.post("/v1/chat/completions", json={**body, "max_tokens": 4}, headers=retry).status_code
                 for _ in range(4)]
    assert codes == [200, 200, 200, 429], codes

    cap = {"status": "429", "reason": "gateway_at_capacity"}
    before = metric_sum(stack.metrics_url, "sluice_rejections_total", **cap)

    async def sdk_burst() -> list[openai.RateLimitError]:
        c = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=2)

        async def one() -> openai.RateLimitError | None:
            try:
                await c.chat.completions.create(model="sim-model", max_tokens=200,
                                                messages=[{"role": "user", "content": "x"}])
            except openai.RateLimitError as e:
                return e
            return None
        return [e for e in await asyncio.gather(*(one() for _ in range(8))) if e is not None]

    errors = asyncio.run(sdk_burst())
    assert errors
    for e in errors:
        assert e.code == "gateway_at_capacity" and e.response.headers["x-should-retry"] == "false"
        assert "do not retry now" in e.message and "retry_budget_exceeded" in e.message
    assert metric_sum(stack.metrics_url, "sluice_rejections_total", **cap) - before == len(errors)
