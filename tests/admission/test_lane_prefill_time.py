"""The lane of a prompt follows its predicted prefill time, which slows for prompts larger than those the pool's
speed was learned with (issue 16, real P3: a 6,500-token prompt landed in the unconfined normal lane)."""

import math

from extproc.admission.policy import AdmissionPolicy
from extproc.admission.placement import Placer
from extproc.admission.scheduler import Scheduler
from extproc.request import LLMRequest
from extproc.routing.pool import Pool, Replica
from extproc.routing.scrape import ScrapedState

SHORT, NORMAL, LONG = 0, 1, 2


def scheduler() -> Scheduler:
    pool = Pool(model="m", cluster="pool-m", replicas=[Replica(address=f"10.0.0.{i}:8000", pool="m")
                                                       for i in range(2)])
    policy = AdmissionPolicy(ttft_target_s=0.5, prefill_tokens_per_s=10_000)
    return Scheduler(pool, policy, Placer(pool, policy))


def learn_on_short_prompts(s: Scheduler) -> None:
    """Both engines prefill 400-token prompts at 13,000 tokens/s while queued (a saturated interval: averaged into
    the configured 10,000, 11,500)."""
    for r in s.pool.replicas:
        r.place(416, 400)
    for at, total in ((1.0, 0.0), (1.2, 2_600.0)):
        for r in s.pool.replicas:
            r.on_scrape(ScrapedState(scraped_at=at, waiting=2, prompt_tokens_total=total))
        s.on_scrape(at)


def req(prompt: int) -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=prompt,
                      max_output_tokens=8)


def test_a_long_prompt_is_in_the_long_lane_though_the_speed_was_learned_on_short_ones():
    s = scheduler()
    learn_on_short_prompts(s)
    assert abs(s.placer.rate - 11_500) < 1 and s.placer.rate_prompt == 400
    long_prompt = req(2_800)  # 0.243 s at the learned speed: under the normal lane's 0.25 s bound
    assert s.policy.lane_for(long_prompt.prompt_tokens / s.placer.rate) == NORMAL
    assert s.policy.lane_for(s.placer.prefill_s(long_prompt.prompt_tokens)) == LONG
    assert s.placer.prefill_s(2_800) == 2_800 / s.placer.rate * math.sqrt(2_800 / 400)
    assert s.submit(long_prompt, 1.3).lane == LONG


def test_prompts_no_larger_than_the_measured_ones_keep_the_learned_speed():
    s = scheduler()
    assert s.placer.prefill_s(3_200) == 3_200 / 10_000  # nothing measured: the configured speed, unscaled
    learn_on_short_prompts(s)
    for prompt in (60, 400):
        assert s.placer.prefill_s(prompt) == prompt / s.placer.rate
    assert s.policy.lane_for(s.placer.prefill_s(400)) == SHORT
