"""What observed responses (a sample, or every request of a metered tenant: streaming.py) teach the sidecar: each
app's output length, for requests that set no max_tokens (admission/output_length.py), and how the replicas'
prompt-token counts compare with the estimator's, per pool:

    estimate_ratio = 0.8 x estimate_ratio + 0.2 x (replica-reported prompt tokens / estimated prompt tokens)
"""

from __future__ import annotations

from extproc import metrics as m
from extproc.admission.output_length import OutputLengths
from extproc.request import LLMRequest
from extproc.streaming import ResponseObserver


class ObservedStats:
    def __init__(self) -> None:
        self.output_lengths = OutputLengths()  # per app: expected output of requests without max_tokens
        self.estimate_ratio: dict[str, float] = {}  # per pool: replica-counted / estimated prompt tokens

    def record(self, model: str, req: LLMRequest, obs: ResponseObserver) -> tuple[int | None, int | None]:
        """Count one observed response; returns the (prompt, completion) tokens it saw (None where unknown)."""
        m.OBSERVED_REQUESTS.labels(model).inc()
        ttft = obs.ttft_s
        if ttft is not None:
            m.OBSERVED_TTFT.labels(model).observe(ttft)
        completion = obs.completion_tokens
        if completion is not None and obs.done and not req.output_limited:
            self.output_lengths.observe(model, req.app, completion // max(1, req.n))
        prompt = obs.prompt_tokens
        if prompt is not None and req.prompt_tokens > 0:
            ratio = prompt / req.prompt_tokens
            m.PROMPT_ESTIMATE_RATIO.labels(model).observe(ratio)
            old = self.estimate_ratio.get(model)
            self.estimate_ratio[model] = ratio if old is None else 0.8 * old + 0.2 * ratio
        return prompt, completion
