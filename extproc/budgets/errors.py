"""The exceptions budgets raise at admission: a refusal, carrying everything the server needs for its immediate
response; and the one case that is not decided yet (a duplicate whose original may have just ended)."""

from __future__ import annotations

import math
from typing import Any


class BudgetExceeded(Exception):
    """A request refused by a budget. Nothing was charged for it.

    Attributes:
      status: HTTP status: 429 (budget exhausted) or 409 (duplicate of a request still in flight).
      code: machine-readable code: retry_budget_exceeded, duplicate_in_flight, task_budget_exceeded,
        tenant_token_limit.
      message: human-readable, names the limit (e.g. "task t-42 exceeded max_calls=20").
      retry_after_s: seconds after which a retry can succeed (Retry-After), or None.
      should_retry: value for `x-should-retry` (the openai / Stainless SDKs obey it).
      limit: which limit refused the request (max_calls, max_tokens, ..., pool, tenant, tokens_per_minute).
      err_type: OpenAI-style error `type` for the response body.
    """

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None,
                 should_retry: bool = False, limit: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.limit = limit

    @property
    def err_type(self) -> str:
        return "conflict_error" if self.status == 409 else "rate_limit_error"

    def headers(self) -> list[tuple[str, str]]:
        """Response headers: `retry-after` (whole seconds, rounded up) when known, and `x-should-retry`."""
        out = [("x-should-retry", "true" if self.should_retry else "false")]
        if self.retry_after_s is not None:
            out.append(("retry-after", str(max(1, math.ceil(self.retry_after_s)))))
        return out

    def __repr__(self) -> str:
        return (f"BudgetExceeded(status={self.status}, code={self.code!r}, message={self.message!r}, "
                f"retry_after_s={self.retry_after_s}, should_retry={self.should_retry})")


class OriginalInFlight(Exception):
    """Not a refusal yet (raised by `Budgets.admit_sync` only): an identity of the request belongs to a request
    still counted in flight, which may have ended already (the end of a detached request reaches the sidecar with
    Envoy's access log, up to its flush interval after the client saw it). `Budgets.admit_when_ended` decides."""

    def __init__(self, op: Any, result: Any) -> None:
        super().__init__("an identity of this request is still in flight")
        self.op = op          # ops.AdmitOp, to run again
        self.result = result  # ops.AdmitResult of the first try (DUPLICATE)
