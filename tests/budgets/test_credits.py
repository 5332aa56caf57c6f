"""Retry credits (budgets/credits.py): one per refusal, per tenant, until its retry-after + the grace."""

from extproc.budgets.credits import MAX_PER_TENANT, MAX_RETRY_AFTER_S, MAX_TENANTS, RetryCredits


def test_a_credit_lasts_its_retry_after_plus_the_grace():
    c = RetryCredits(grace_s=10.0)
    c.grant("a", 0.0, 2.0)
    assert not c.take("a", 12.5)  # expired at 12
    c.grant("a", 0.0, 2.0)
    assert c.take("a", 11.9)
    assert not c.take("a", 11.9)  # one retry per refusal


def test_the_earliest_expiring_credit_goes_first_and_long_retry_afters_are_clamped():
    c = RetryCredits(grace_s=1.0)
    c.grant("a", 0.0, 1000.0)  # the SDK waits out at most 60 s: expires at 61
    c.grant("a", 0.0, 1.0)     # expires at 2
    assert c.take("a", 1.5)
    assert c.held("a", 1.5) == 1
    assert c.take("a", MAX_RETRY_AFTER_S + 0.5)
    assert not c.take("a", 0.0)


def test_tenants_are_apart_and_memory_is_bounded():
    c = RetryCredits(grace_s=10.0)
    c.grant("a", 0.0, 1.0)
    assert not c.take("b", 0.5)
    for _ in range(MAX_PER_TENANT + 5):
        c.grant("a", 0.0, 1.0)
    assert c.held("a", 0.5) == MAX_PER_TENANT
    for i in range(MAX_TENANTS + 1):
        c.grant(f"t{i}", 0.0, 1.0)
    assert c.held("a", 0.5) == 0  # the least recently refused tenant was forgotten
    assert c.held(f"t{MAX_TENANTS}", 0.5) == 1
