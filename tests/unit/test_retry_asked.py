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


def test_forbidding_a_retry_turns_the_header_and_says_why():
    """`responses.forbid_retry`: a refusal whose retry the retry budget would refuse says x-should-retry: false, and
    its OpenAI error message says why; the openai SDK then raises at once instead of retrying into a 429."""
    import orjson

    resp = R.immediate(429, "the queue is full; retry later", "queue_full", retry_after_s=0.5, should_retry=True)
    assert R.forbid_retry(resp)
    assert R.retry_asked(resp) is None
    headers = {h.header.key: h.header.raw_value for h in resp.immediate_response.headers.set_headers}
    assert headers["x-should-retry"] == b"false" and headers["retry-after-ms"] == b"500"
    error = orjson.loads(resp.immediate_response.body)["error"]
    assert error["code"] == "queue_full" and error["message"].endswith(R.RETRY_REFUSED_NOTE)
    assert "do not retry now" in error["message"]
    final = R.immediate(429, "no", "retry_budget_exceeded", retry_after_s=10, should_retry=False)
    before = final.SerializeToString()
    assert not R.forbid_retry(final) and final.SerializeToString() == before
    assert not R.forbid_retry(R.immediate(400, "bad", "invalid_request"))
