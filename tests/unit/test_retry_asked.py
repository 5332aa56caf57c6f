"""`responses.retry_asked`: which immediate answers tell the client to retry, and after how long (the gateway makes
their retries free of the retry budget, budgets/credits.py)."""

from extproc import responses as R


def test_a_retryable_refusal_gives_its_retry_after():
    resp = R.immediate(429, "shed", "queue_timeout", retry_after_s=0.75, should_retry=True)
    assert R.retry_asked(resp) == 0.75
    assert R.retry_asked(R.immediate(503, "down", "pool_unavailable", should_retry=True)) == 0.0


def test_final_and_plain_answers_ask_for_no_retry():
    assert R.retry_asked(R.immediate(429, "no", "retry_budget_exceeded", retry_after_s=10, should_retry=False)) is None
    assert R.retry_asked(R.immediate(400, "bad", "invalid_request")) is None
