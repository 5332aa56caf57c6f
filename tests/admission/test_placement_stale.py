"""Placement on replicas whose metrics are stale (issue 16): a busy vLLM answers /metrics in seconds now and then,
so a serving replica with stale metrics is placed on cautiously, not refused; one never scraped, or one health
has already degraded, is not placed on blind."""

from extproc.admission.placement import STALE, STALE_WEIGHT
from extproc.request import LLMRequest
from extproc.routing.pool import DEGRADED, RECOVERING
from extproc.routing.scrape import ScrapedState

from .placing import place, placer

NORMAL = 1


def req(prompt: int = 2_000, out: int = 16) -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=prompt,
                      max_output_tokens=out)


def stale_after(p, seconds: float) -> None:
    p.is_fresh = lambda r, now: now - r.engine.scraped_at <= seconds


def test_a_stale_serving_replica_takes_half_its_share_and_comes_last():
    p = placer(2, max_concurrency_per_replica=8)
    a, b = p.pool.replicas
    for r in (a, b):
        r.on_scrape(ScrapedState(scraped_at=10.0))
    stale_after(p, 1.0)
    a.on_scrape(ScrapedState(scraped_at=11.5))      # a fresh at 12.0, b's metrics 2 s old
    assert p.weight(a, 12.0) == 1.0 and p.weight(b, 12.0) == STALE_WEIGHT
    assert place(p, req(), NORMAL, 12.0) is a       # the fresh replica first (score penalty)
    a.weight = 0.0                                  # a out of the way: b still takes work ...
    placed = 0
    while p.choose(req(), NORMAL, 12.0) is not None:
        p.commit(b, req(), NORMAL, 12.0)
        placed += 1
    assert placed == 4                              # ... up to STALE_WEIGHT x its 8 requests
    assert p.usable(b, 12.0)


def test_stale_and_never_scraped_or_degraded_is_refused():
    p = placer(2)
    a, b = p.pool.replicas
    stale_after(p, 1.0)
    assert p.why_not(a, req(), NORMAL, 5.0, 2.0) == STALE      # never scraped: nothing known
    for r in (a, b):
        r.on_scrape(ScrapedState(scraped_at=3.0))
    a.state, a.weight = DEGRADED, 0.25
    b.state, b.weight = RECOVERING, 0.25
    assert p.why_not(a, req(), NORMAL, 5.0, 2.0) == STALE      # degraded (e.g. unreachable): not blind
    assert p.why_not(b, req(), NORMAL, 5.0, 2.0) is None       # recovering: cautiously
    assert p.weight(b, 5.0) == 0.25 * STALE_WEIGHT
