"""Retry budget (P5) on both stores: share cap with floor, window slide, detection, duplicates in flight (409)."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from extproc.budgets import BudgetExceeded, Budgets, OriginalInFlight
from extproc.budgets.keys import ident
from extproc.budgets.retry import PROMISE_GRACE_S
from extproc.config import parse_section

from .conftest import req

T0 = 1_000_000.0  # a window boundary for 10 s and 60 s windows: fraction 0


@pytest.mark.asyncio
async def test_share_cap_with_floor(make_budgets) -> None:
    b = await make_budgets()
    # A quiet pool: only the floor (3 retries per window) applies.
    for _ in range(2):
        await b.admit(req(model="quiet"), now=T0)
    admitted = 0
    with pytest.raises(BudgetExceeded) as exc:
        for _ in range(10):
            await b.admit(req(model="quiet", retry_count=1), now=T0)
            admitted += 1
    assert admitted == 3
    e = exc.value
    assert (e.status, e.code, e.should_retry) == (429, "retry_budget_exceeded", False)
    assert "tenant acme" in e.message and e.retry_after_s == 10.0
    assert ("x-should-retry", "false") in e.headers()

    # A busy pool: 100 first attempts, then retries while retries + 1 <= 0.1 * (admitted + 1): exactly 11.
    for _ in range(100):
        await b.admit(req(model="busy", tenant="t1"), now=T0 + 1)
    labels = {"pool": "busy", "reason": "budget"}
    before = REGISTRY.get_sample_value("sluice_budget_retries_rejected_total", labels) or 0
    admitted = 0
    for _ in range(30):
        try:
            await b.admit(req(model="busy", tenant="t1", retry_count=2), now=T0 + 1)
            admitted += 1
        except BudgetExceeded as e:
            assert e.code == "retry_budget_exceeded"
    assert admitted == 11
    after = REGISTRY.get_sample_value("sluice_budget_retries_rejected_total", labels)
    assert after - before == 19


@pytest.mark.asyncio
async def test_a_tenant_cannot_spend_another_tenants_retries(make_budgets) -> None:
    """Issue #19, finding 3: ten retries from one tenant made another tenant's first retry a 429 (the pool-wide
    cap). Each tenant's first `floor` retries now pass whatever the others did; past them its own share applies."""
    b = await make_budgets()
    refused = 0
    for _ in range(10):
        try:
            await b.admit(req(tenant="noisy", retry_count=1), now=T0)
        except BudgetExceeded as e:
            assert "tenant noisy" in e.message
            refused += 1
    assert refused == 7  # the noisy tenant's floor of 3 passed
    for _ in range(3):  # the quiet tenant's first retries, with no first attempts of its own in the window
        assert (await b.admit(req(tenant="quiet", retry_count=1), now=T0 + 0.5)).is_retry
    with pytest.raises(BudgetExceeded, match="tenant quiet"):
        await b.admit(req(tenant="quiet", retry_count=1), now=T0 + 0.5)


@pytest.mark.asyncio
async def test_pool_cap_applies_past_a_tenants_floor(make_budgets) -> None:
    """Past its floor a tenant's retry must fit the pool's share too: floors of many tenants count against it.
    Five tenants spend their floors (15 retries); a busy tenant with 100 first attempts then gets its own floor
    (3), and its next retry, within its own share (4 <= 0.1 x 104), is refused by the pool's (19 > 0.1 x 119)."""
    b = await make_budgets()
    for t in range(5):
        for _ in range(3):
            await b.admit(req(tenant=f"t{t}", retry_count=1), now=T0)
    for _ in range(100):
        await b.admit(req(tenant="busy"), now=T0)
    for _ in range(3):
        await b.admit(req(tenant="busy", retry_count=1), now=T0)
    with pytest.raises(BudgetExceeded, match="pool m") as exc:
        await b.admit(req(tenant="busy", retry_count=1), now=T0)
    assert exc.value.status == 429 and not exc.value.should_retry


@pytest.mark.asyncio
async def test_window_slides(make_budgets) -> None:
    b = await make_budgets(retry={"floor": 2, "max_share": 0.0})
    for _ in range(2):
        await b.admit(req(retry_count=1), now=T0)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(retry_count=1), now=T0 + 9.9)
    # Half a window later the previous window still weighs 0.5 * 2 = 1 retry: one more fits the floor of 2.
    await b.admit(req(retry_count=1), now=T0 + 15)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(retry_count=1), now=T0 + 15)
    # Two windows later everything has decayed.
    await b.admit(req(retry_count=1), now=T0 + 30)
    await b.admit(req(retry_count=1), now=T0 + 30)


@pytest.mark.asyncio
async def test_tenant_share_is_separate_from_pool(make_budgets) -> None:
    b = await make_budgets(retry={"floor": 1, "max_share": 0.1})
    for _ in range(200):  # tenant "big" makes the pool busy
        await b.admit(req(tenant="big"), now=T0)
    # tenant "small" has no admitted traffic of its own: the pool share would allow ~20, its own share allows 1
    await b.admit(req(tenant="small", retry_count=1), now=T0)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(tenant="small", retry_count=1), now=T0)
    assert "tenant small" in exc.value.message


@pytest.mark.asyncio
async def test_detection_by_key_fingerprint_and_request_id(make_budgets) -> None:
    b = await make_budgets(retry={"use_fingerprint": True})
    first = await b.admit(req(idempotency_key="idem-1"), now=T0)
    assert not first.is_retry
    await b.settle(first, completed=False, prompt_tokens=None, completion_tokens=None, now=T0 + 1)
    again = await b.admit(req(idempotency_key="idem-1"), now=T0 + 2)
    assert again.is_retry

    body = b"\x01" * 16
    c1 = await b.admit(req(body=body), now=T0)
    await b.settle(c1, completed=True, prompt_tokens=100, completion_tokens=5, now=T0 + 1)
    assert (await b.admit(req(body=body), now=T0 + 2)).is_retry
    # the same body from another tenant is not a retry of it
    assert not (await b.admit(req(body=body, tenant="someone-else"), now=T0 + 2)).is_retry

    c2 = await b.admit(req(request_id="rid-7"), now=T0)
    await b.settle(c2, completed=True, prompt_tokens=1, completion_tokens=1, now=T0)
    assert (await b.admit(req(request_id="rid-7"), now=T0 + 1)).is_retry
    assert not (await b.admit(req(), now=T0 + 1)).is_retry


@pytest.mark.asyncio
async def test_duplicate_in_flight_is_409_and_charges_nothing(make_budgets) -> None:
    b = await make_budgets(tasks={"max_calls": 2}, retry={"use_fingerprint": True, "duplicate_wait_s": 0})
    body = b"\x02" * 16
    running = await b.admit(req(body=body, task_id="t-1"), now=T0)
    before = REGISTRY.get_sample_value("sluice_budget_retries_rejected_total",
                                       {"pool": "m", "reason": "duplicate_in_flight"}) or 0
    for _ in range(3):
        with pytest.raises(BudgetExceeded) as exc:
            await b.admit(req(body=body, task_id="t-1", retry_count=1), now=T0 + 1)
        e = exc.value
        assert (e.status, e.code, e.should_retry, e.retry_after_s) == (409, "duplicate_in_flight", False, None)
        assert "request body" in e.message
    assert REGISTRY.get_sample_value("sluice_budget_retries_rejected_total",
                                     {"pool": "m", "reason": "duplicate_in_flight"}) - before == 3
    # the three 409s charged no task call: the task's second call still fits max_calls=2
    await b.admit(req(task_id="t-1"), now=T0 + 1)
    # same idempotency key in flight -> 409 too
    await b.admit(req(idempotency_key="k-9"), now=T0)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(idempotency_key="k-9"), now=T0)
    assert exc.value.status == 409 and "idempotency key" in exc.value.message
    # once the original finished, the duplicate is an ordinary (admitted) retry
    await b.settle(running, completed=False, prompt_tokens=None, completion_tokens=None, now=T0 + 2)
    c = await b.admit(req(body=body, task_id="t-2"), now=T0 + 3)
    assert c.is_retry


@pytest.mark.asyncio
async def test_rejected_request_leaves_no_marker(make_budgets) -> None:
    b = await make_budgets(tasks={"max_calls": 1})
    await b.admit(req(task_id="full"), now=T0)
    body = b"\x03" * 16
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(body=body, task_id="full"), now=T0)
    assert exc.value.code == "task_budget_exceeded"
    # had the refused request left an in-flight marker this would be a 409; had it left a seen marker, a retry
    c = await b.admit(req(body=body, task_id="other"), now=T0)
    assert not c.is_retry


@pytest.mark.asyncio
async def test_fingerprint_detection_can_be_disabled(make_budgets) -> None:
    b = await make_budgets(retry={"use_fingerprint": False})
    body = b"\x04" * 16
    await b.admit(req(body=body), now=T0)
    c = await b.admit(req(body=body), now=T0)  # identical concurrent bodies are fine then
    assert not c.is_retry


@pytest.mark.asyncio
async def test_duplicate_waits_for_an_original_that_just_ended(make_budgets) -> None:
    """Issue #19, finding 6: a client that resends its request id right after a complete response used to get 409
    (the original's end reaches the sidecar with Envoy's access log, up to 100 ms later). The resend now waits up
    to `duplicate_wait_s` for the original to end: admitted as its retry; a duplicate of a request still running
    is refused after that wait, and only once counted."""
    b = await make_budgets(retry={"duplicate_wait_s": 0.4})
    original = await b.admit(req(request_id="rid-w"), now=T0)

    async def end_original_soon() -> None:
        await asyncio.sleep(0.1)
        await b.settle(original, completed=True, now=T0 + 0.1)

    ender = asyncio.ensure_future(end_original_soon())
    t0 = time.monotonic()
    again = await b.admit(req(request_id="rid-w"), now=T0 + 0.01)
    waited = time.monotonic() - t0
    await ender
    assert again.is_retry and 0.08 < waited < 0.35, waited
    before = REGISTRY.get_sample_value("sluice_budget_retries_rejected_total",
                                       {"pool": "m", "reason": "duplicate_in_flight"}) or 0
    t0 = time.monotonic()
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(request_id="rid-w"), now=T0 + 1)  # `again` is still in flight
    assert exc.value.status == 409 and time.monotonic() - t0 >= 0.4
    assert REGISTRY.get_sample_value("sluice_budget_retries_rejected_total",
                                     {"pool": "m", "reason": "duplicate_in_flight"}) - before == 1


@pytest.mark.asyncio
async def test_sync_admit_hands_a_duplicate_to_the_async_wait() -> None:
    b = Budgets(parse_section("budgets", {"retry": {"duplicate_wait_s": 0.2}}))
    original = b.admit_sync(req(request_id="rid-s"), now=T0)
    with pytest.raises(OriginalInFlight) as pending:
        b.admit_sync(req(request_id="rid-s"), now=T0)
    asyncio.get_running_loop().call_later(0.05, lambda: b.settle_sync(original, completed=True, now=T0))
    assert (await b.admit_when_ended(req(request_id="rid-s"), pending.value)).is_retry


async def _retries_admitted(b: Budgets, n: int, **kw: object) -> int:
    """How many of `n` SDK retries (x-stainless-retry-count 1) the budgets admit."""
    admitted = 0
    for _ in range(n):
        try:
            await b.admit(req(retry_count=1, **kw), now=T0)  # type: ignore[arg-type]
            admitted += 1
        except BudgetExceeded as e:
            assert e.code == "retry_budget_exceeded"
    return admitted


@pytest.mark.asyncio
async def test_a_retry_the_gateway_asked_for_is_not_charged(make_budgets) -> None:
    """Real PX: 21 requests shed with x-should-retry: true, and 15 of their SDK retries refused as a retry storm
    (x-should-retry: false), lost. A refusal before any replica saw the request now grants its tenant one free retry;
    retries beyond the refusals are charged as before (floor 3), so a storm stays capped."""
    b = await make_budgets(retry={"credit_refused": True})
    labels = {"pool": "credited"}
    before = REGISTRY.get_sample_value("sluice_budget_retries_credited_total", labels) or 0
    for _ in range(10):
        b.refused(req(model="credited"), retry_after_s=0.5)
    assert await _retries_admitted(b, 20, model="credited") == 10 + 3
    assert REGISTRY.get_sample_value("sluice_budget_retries_credited_total", labels) - before == 10
    # another tenant cannot use acme's credits: its floor only
    for _ in range(5):
        b.refused(req(model="credited", tenant="acme"), retry_after_s=0.5)
    assert await _retries_admitted(b, 10, model="credited", tenant="other") == 3
    assert await _retries_admitted(b, 10, model="credited") == 5  # acme's five, its floor spent already


@pytest.mark.asyncio
async def test_credits_are_off_by_default(make_budgets) -> None:
    b = await make_budgets()
    for _ in range(10):
        b.refused(req(model="strict"), retry_after_s=0.5)
    assert await _retries_admitted(b, 20, model="strict") == 3


@pytest.mark.asyncio
async def test_a_credited_retry_still_meets_the_duplicate_check(make_budgets) -> None:
    """The credit frees the retry from the share, not from the 409 for a duplicate still in flight."""
    b = await make_budgets(retry={"duplicate_wait_s": 0.0, "credit_refused": True})
    await b.admit(req(model="dup", request_id="same"), now=T0)
    b.refused(req(model="dup"), retry_after_s=0.5)
    with pytest.raises(BudgetExceeded) as exc:
        await b.admit(req(model="dup", request_id="same", retry_count=1), now=T0)
    assert exc.value.code == "duplicate_in_flight"


@pytest.mark.asyncio
async def test_whether_a_retry_would_be_refused_is_read_without_charging(make_budgets) -> None:
    """`Budgets.retry_refused`: the gateway asks it before telling a refused client to retry. It reads the share's
    formula (the tenant's floor of 3, then 10 % of admitted) and charges nothing; with Redis, on the shared
    counts its last admit returned."""
    b = await make_budgets()
    first = req(model="peek")
    await b.admit(first, now=T0)
    for _ in range(3):
        assert not b.retry_refused(first, now=T0)
        await b.admit(req(model="peek", retry_count=1), now=T0)
    for _ in range(5):  # asking changes nothing
        assert b.retry_refused(first, now=T0)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(model="peek", retry_count=1), now=T0)
    assert not b.retry_refused(req(model="peek", tenant="other"), now=T0)  # another tenant is within its floor
    assert not b.retry_refused(first, now=T0 + 20)  # the window has passed


@pytest.mark.asyncio
async def test_a_refusal_told_to_retry_counts_in_the_next_refusals_reads(make_budgets) -> None:
    """Every refusal of a burst read the same room, so all were told to retry and most of their retries were then
    refused (real PX at its full length: 51 of 120 failed calls). A 429 that says retry promises that retry: it
    counts in later reads until it arrives (and takes its promise), so only as many are told to retry as the
    tenant's budget will admit (its floor of 3 here); the others hear at once not to."""
    b = await make_budgets()
    first = req(model="promise")
    await b.admit(first, now=T0)
    mono = time.monotonic()
    told = [b.promise_retry(first, 0.5, now=T0, mono=mono) for _ in range(5)]
    assert told == [True, True, True, False, False]
    assert b.promise_retry(first, None, now=T0, mono=mono)  # a 429 that says not to retry promises nothing
    tenant = ident(first.tenant)
    assert b.retry.pending(tenant, mono) == 3
    for _ in range(3):  # the promised retries come: each takes its promise and is admitted
        await b.admit(req(model="promise", retry_count=1), now=T0)
    assert b.retry.pending(tenant, time.monotonic()) == 0
    assert not b.promise_retry(first, 0.5, now=T0)  # the floor is spent by the retries themselves now
    with pytest.raises(BudgetExceeded):
        await b.admit(req(model="promise", retry_count=1), now=T0)


@pytest.mark.asyncio
async def test_with_redis_the_read_sees_another_sidecars_retries_from_its_own_last_admit(make_budgets) -> None:
    """Two sidecars share one Redis. Sidecar A admits the tenant's floor of retries; sidecar B has not seen them
    until its own next admit returns the shared counts, and from then on tells no client to retry. In memory each
    sidecar reads only its own counts."""
    a, b = await make_budgets(), await make_budgets()
    first = req(model="shared")
    await b.admit(first, now=T0)
    await a.admit(req(model="shared"), now=T0)
    for _ in range(3):
        await a.admit(req(model="shared", retry_count=1), now=T0)
    assert a.retry_refused(first, now=T0)
    assert not b.retry_refused(first, now=T0)  # B's last admit was before A's retries
    await b.admit(req(model="shared"), now=T0)
    assert b.retry_refused(first, now=T0) is (make_budgets.kind == "redis")
    assert b.promise_retry(first, 0.5, now=T0) is (make_budgets.kind == "memory")


@pytest.mark.asyncio
async def test_a_promise_not_kept_expires_after_its_retry_after_and_a_grace() -> None:
    """A client told to retry may never come back (it gave up): its promise holds the room only until its
    retry-after + PROMISE_GRACE_S. (The memory store's read: the promises are the same with Redis.)"""
    b = Budgets(parse_section("budgets", {}))
    first = req(model="unkept")
    await b.admit(first, now=T0)
    assert all(b.promise_retry(first, 1.0, now=T0, mono=50.0) for _ in range(3))
    assert not b.promise_retry(first, 1.0, now=T0, mono=50.0 + 1.0 + PROMISE_GRACE_S - 0.01)
    assert b.promise_retry(first, 1.0, now=T0, mono=50.0 + 1.0 + PROMISE_GRACE_S + 0.01)


@pytest.mark.asyncio
async def test_with_credits_a_refused_request_is_always_told_to_retry(make_budgets) -> None:
    """With `credit_refused`, the refusal itself earns the retry a credit (credits.py): it is never refused."""
    b = await make_budgets(retry={"credit_refused": True})
    for _ in range(3):
        await b.admit(req(model="credited", retry_count=1), now=T0)
    with pytest.raises(BudgetExceeded):
        await b.admit(req(model="credited", retry_count=1), now=T0)
    assert not b.retry_refused(req(model="credited"), now=T0)
