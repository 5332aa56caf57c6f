"""Prefill work: a prompt's cost grows with the position of each token it computes (attention), the speed is
measured in that unit, the lane and the backlog follow it, and an end cuts the backlog (P2, P3, PX; issue 16, real
P3: a 6,500-token prompt landed in the unconfined normal lane)."""

import pytest

from extproc.admission.placement import PRIOR_PROMPT_TOKENS, Placer
from extproc.admission.policy import AdmissionPolicy
from extproc.admission.scheduler import Scheduler
from extproc.request import LLMRequest
from extproc.routing.pool import Pool, Replica
from extproc.routing.scrape import ScrapedState

SHORT, NORMAL, LONG = 0, 1, 2
KNEE = 1024.0


def scheduler(n: int = 2) -> Scheduler:
    pool = Pool(model="m", cluster="pool-m", replicas=[Replica(address=f"10.0.0.{i}:8000", pool="m")
                                                       for i in range(n)])
    policy = AdmissionPolicy(ttft_target_s=0.5, prefill_tokens_per_s=10_000, prefill_knee_tokens=KNEE)
    return Scheduler(pool, policy, Placer(pool, policy))


def req(prompt: int) -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=prompt,
                      max_output_tokens=8)


def work(prompt: float, cached: float = 0.0) -> float:
    return (prompt - cached) * (2 * KNEE + prompt + cached) / (2 * KNEE + PRIOR_PROMPT_TOKENS)


def test_a_prompts_work_grows_with_the_position_of_its_tokens():
    p = scheduler().placer
    assert p.prefill_work(PRIOR_PROMPT_TOKENS) == PRIOR_PROMPT_TOKENS  # the configured speed's own prompt size
    assert p.prefill_work(6_500) == pytest.approx(work(6_500)) and p.prefill_work(6_500) > 2.7 * 6_500
    assert p.prefill_work(500) < 500  # short prompts prefill faster per token than the configured speed
    # a cached follow-up computes 500 tokens, each attending to the 4,000 before it: 3.4x a cold 500-token prompt
    assert p.prefill_work(4_500, 4_000) == pytest.approx(work(4_500, 4_000))
    assert p.prefill_work(4_500, 4_000) > 3.4 * p.prefill_work(500)
    assert p.prefill_work(4_000, 4_000) == 0.0
    p.policy.prefill_knee_tokens = 0  # linear: plain uncached tokens
    assert p.prefill_work(6_500, 500) == 6_000


def learn_on_short_prompts(s: Scheduler) -> None:
    """Both engines prefill 400-token prompts (placed here) at 13,000 tokens/s while queued (a saturated interval)."""
    for r in s.pool.replicas:
        for _ in range(2):
            s.placer.commit(r, req(400), SHORT, 0.9)
    for at, total in ((1.0, 0.0), (1.2, 2_600.0)):
        for r in s.pool.replicas:
            r.on_scrape(ScrapedState(scraped_at=at, waiting=2, prompt_tokens_total=total))
        s.on_scrape(at)


def test_a_long_prompt_is_in_the_long_lane_though_the_speed_was_learned_on_short_ones():
    s = scheduler()
    learn_on_short_prompts(s)
    # 13,000 tokens/s of 400-token prompts is 13,000 x work(400) / 400 work/s, averaged into the configured speed
    assert s.placer.rate == pytest.approx(0.5 * 10_000 + 0.5 * 13_000 * work(400) / 400)
    long_prompt = req(2_800)  # 0.215 s at the token speed learned: under the normal lane's 0.25 s bound
    assert s.policy.lane_for(long_prompt.prompt_tokens / 13_000) == NORMAL
    assert s.placer.prefill_s(2_800) == pytest.approx(work(2_800) / s.placer.rate)  # 0.43 s
    assert s.policy.lane_for(s.placer.prefill_s(2_800)) == LONG
    assert s.submit(long_prompt, 1.3).lane == LONG
    assert s.policy.lane_for(s.placer.prefill_s(400)) == SHORT


def test_the_backlog_charges_work_and_an_end_cuts_it():
    """P3: a 6,500-token prompt charged as plain tokens read as drained after 0.65 s of its 2 s prefill. Its work
    keeps its replica busy as long as it is; and when a request ends, everything placed before it was prefilled."""
    s = scheduler(n=1)
    p, r = s.placer, s.pool.replicas[0]
    long_req, short_req = req(6_500), req(300)
    p.commit(r, long_req, LONG, 0.0)
    p.commit(r, short_req, SHORT, 0.0)
    assert p.backlog(r, 0.0) == pytest.approx(work(6_500) + work(300))
    assert p.backlog(r, 1.0) == pytest.approx(work(6_500) + work(300) - 10_000)  # 1.9 s predicted, 0.9 s left
    p.release(r, long_req, LONG, r.scrape_epoch, now=1.0)  # it ended: only the short one placed after it is left
    assert p.backlog(r, 1.0) == pytest.approx(work(300))
    p.release(r, short_req, SHORT, r.scrape_epoch, now=1.0)
    assert p.backlog(r, 1.0) == 0.0 and r.inflight_prefill_work == 0.0
