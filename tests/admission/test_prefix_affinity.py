"""Prefix-aware placement: requests sharing a prefix go where the engines' own hit counters confirm it cached,
while that replica has headroom, and spill over when it does not."""

import random

import pytest

from extproc.admission.placement import KV_FULL
from extproc.admission.placement import Placer
from extproc.admission.prefix_affinity import (HOME_CACHE_SHARE, HOME_STAY, MIN_EVIDENCE, OLDER_HOLDER,
                                              PrefixAffinity, home_term, reusable_tokens)
from extproc.request import PREFIX_LADDER, PREFIX_STEP, LLMRequest, prefix_chain
from extproc.routing.pool import Replica
from extproc.routing.scrape import ScrapedState

from .placing import place, placer

SYSTEM = "".join(random.Random(7).choice("abcdefgh ") for _ in range(16_000))  # about 4,000 tokens
OTHER = "".join(random.Random(8).choice("abcdefgh ") for _ in range(16_000))  # another app's system prompt
LEVEL = max(level for level in PREFIX_LADDER if level <= len(SYSTEM))  # the longest level SYSTEM covers


def req(system: str = SYSTEM, user: str = "hello", out: int = 16) -> LLMRequest:
    text = system + "\n" + user
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=len(text) // 4,
                      max_output_tokens=out, prefix_chain=prefix_chain(text), prompt_chars=len(text))


def scrape(r: Replica, at: float, hits: float, **engine: float) -> None:
    r.on_scrape(ScrapedState(scraped_at=at, prefix_hits_total=hits, prefix_queries_total=hits, **engine))


def test_prompts_sharing_their_start_share_the_levels_up_to_it():
    a, b = prefix_chain(SYSTEM + "one"), prefix_chain(SYSTEM + "two")
    shared = sum(1 for level in PREFIX_LADDER if level <= len(SYSTEM))
    assert a[:shared] == b[:shared] and len(a) == len(b) == shared + (PREFIX_LADDER[shared] <= len(SYSTEM) + 4)
    assert prefix_chain("x" + SYSTEM)[0] != a[0]
    assert prefix_chain("short prompt") == ()


def test_nothing_is_assumed_before_the_counters_confirm():
    aff = PrefixAffinity()
    r = Replica(address="a:1", pool="m")
    aff.record(r, req(), 0.0, 0.0)
    assert aff.cached_tokens(req(user="again")) == {}  # placed there, but no engine said it hits
    again = req(user="again")
    assert aff.predicted_tokens(r, again) == pytest.approx(LEVEL * again.prompt_tokens / again.prompt_chars)


def confirmed(aff: PrefixAffinity, r: Replica, rounds: int = 3, share: float = 1.0) -> None:
    """Place enough prefix-sharing requests on `r`, its engine hitting `share` of what was predicted."""
    hits = 0.0
    for k in range(rounds):
        predicted = 0.0
        while predicted < MIN_EVIDENCE:
            q = req(user=f"u{k}-{predicted}")
            p = aff.predicted_tokens(r, q)
            aff.record(r, q, p, 0.0)
            aff.release(r, q)  # it ran and ended before the scrape
            predicted += max(p, 100.0)
        hits += share * predicted
        scrape(r, 1.0 + k, hits)
        aff.on_scrape([r])


def confirmed_pool(n: int = 2, home: int = 0) -> tuple[Placer, Replica]:
    """`n` scraped replicas prefilling 10,000 tokens/s against a 1 s target, the prefix confirmed on replica
    `home` (returned with the placer)."""
    p = placer(n=n, prefill_tokens_per_s=10_000, ttft_target_s=1.0)
    for r in p.pool.replicas:
        scrape(r, 0.5, 0.0)
    p.prefix.on_scrape(p.pool.replicas)
    confirmed(p.prefix, p.pool.replicas[home])
    return p, p.pool.replicas[home]


def test_confidence_follows_the_engines_hits():
    aff, r = PrefixAffinity(), Replica(address="a:1", pool="m")
    scrape(r, 0.5, 0.0)
    aff.on_scrape([r])
    confirmed(aff, r)
    assert aff.confidence(r) > 0.8
    q = req(user="new question")
    assert aff.cached_tokens(q)[r] == pytest.approx(aff.confidence(r) * LEVEL * q.prompt_tokens / q.prompt_chars)


def test_an_engine_without_prefix_caching_never_gets_affinity():
    aff, r = PrefixAffinity(), Replica(address="a:1", pool="m")
    scrape(r, 0.5, 0.0)
    aff.on_scrape([r])
    confirmed(aff, r, share=0.0)
    assert aff.confidence(r) == 0.0 and aff.cached_tokens(req(user="x")) == {}


def test_a_restarted_engine_has_an_empty_cache():
    aff, r = PrefixAffinity(), Replica(address="a:1", pool="m")
    scrape(r, 0.5, 0.0)
    aff.on_scrape([r])
    confirmed(aff, r)
    scrape(r, 10.0, 0.0)  # the counter went down
    aff.on_scrape([r])
    assert aff.confidence(r) == 0.0


def test_requests_sharing_a_prefix_go_where_it_is_cached_and_spill_when_it_is_busy():
    p, home = confirmed_pool(n=3, home=1)  # a 4,000-token prompt prefills in 0.4 s
    for r in p.pool.replicas:
        r.prefill_backlog = 0.0
    # an idle pool: the replica holding the prefix computes only the new tail
    q1 = req(user="q1")
    first = p.choose(q1, 1, 10.0)
    assert first[0] is home
    p.commit(home, q1, 1, 10.0)
    # only the uncached part was charged (the longest level it shares, LEVEL of its 16,006 characters)
    assert home.prefill_backlog < 0.4 * q1.prompt_tokens
    # a hot prefix: its replica's backlog grows with every request, and once its predicted TTFT passes what an
    # uncached prefill elsewhere costs, the prefix spills to another replica, which then holds it too
    # (each adds its uncached tail, under one ladder step, and its footprint to the KV term of the score)
    homes = []
    for i in range(60):
        q = req(user=f"q{i + 2}")
        pins = p.choose(q, 1, 10.0)
        assert pins is not None
        p.commit(pins[0], q, 1, 10.0)
        homes.append(pins[0])
        if pins[0] is not home:
            break
    assert len(homes) > 5 and all(h is home for h in homes[:5]) and homes[-1] is not home
    spilled = next(h for h in homes if h is not home)
    assert p.prefix.predicted_tokens(spilled, req(user="later")) > 0


def test_placing_by_load_alone_lets_the_counters_find_the_prefix():
    """Confidence 0 everywhere: the first placements go by load; the replicas they landed on remember the prefix,
    and the hits their engines count make the prediction true."""
    p = placer(n=2, prefill_tokens_per_s=10_000, ttft_target_s=1.0)
    for r in p.pool.replicas:
        scrape(r, 0.5, 0.0)
    p.prefix.on_scrape(p.pool.replicas)
    landed = []
    for i in range(6):
        q = req(user=f"q{i}")
        pins = p.choose(q, 1, 1.0 + i)
        p.commit(pins[0], q, 1, 1.0 + i)
        landed.append(pins[0])
    hits = {r: p.prefix.tally[r.address].predicted for r in p.pool.replicas}
    for r in p.pool.replicas:
        scrape(r, 8.0, hits[r])
    p.prefix.on_scrape(p.pool.replicas)
    assert any(p.prefix.confidence(r) > 0 for r in set(landed))


def test_a_prefix_placed_on_two_replicas_counts_in_full_only_where_it_went_last():
    """Equal credit on both would let load alone alternate the prefix's requests between them, each caching every
    prefix and evicting the others'; the latest holder keeps it until it spills over."""
    aff = PrefixAffinity()
    a, b = Replica(address="a:1", pool="m"), Replica(address="b:1", pool="m")
    for r in (a, b):
        scrape(r, 0.5, 0.0)
    aff.on_scrape([a, b])
    confirmed(aff, a)
    confirmed(aff, b)
    aff.record(a, req(user="latest"), 0.0, 5.0)
    cached = aff.cached_tokens(req(user="next"))
    assert cached[a] == pytest.approx(cached[b] / OLDER_HOLDER * aff.confidence(a) / aff.confidence(b))
    assert cached[a] > cached[b] > 0


@pytest.mark.parametrize("margin, stays", [(0.8, True), (1.2, False)])
def test_a_prefix_leaves_its_home_only_for_a_replica_better_by_more_than_the_home_term(margin: float, stays: bool):
    """A move computes the prefix again elsewhere and evicts another prefix there, a cost that falls on later
    requests: the home keeps its prefix's requests against a replica whose score is better by less than the home
    term (HOME_STAY x the share of the prompt cached at home, for a prefix of a tenth of the KV), and loses them
    beyond it."""
    p = placer(n=2, prefill_tokens_per_s=10_000, ttft_target_s=2.0, kv_capacity_tokens=20_000)
    home, other = p.pool.replicas
    for r in p.pool.replicas:
        scrape(r, 0.5, 0.0)
    p.prefix.on_scrape(p.pool.replicas)
    confirmed(p.prefix, home)
    home.prefill_backlog = other.prefill_backlog = 0.0
    q = req(user="next")
    cached = p.cached_tokens(q)
    assert set(cached) == {home} and p.prefix.home(q) is home
    assert cached[home] > HOME_CACHE_SHARE * 20_000  # about 3,900 of its 4,000 tokens
    term = HOME_STAY * cached[home] / q.prompt_tokens
    assert home_term(cached[home], q.prompt_tokens, home.kv_capacity_tokens) == pytest.approx(term)

    def raw(r: Replica) -> float:  # the score without the home term
        return p.score(r, q, 10.0, 1, p.prefill_work(q.prompt_tokens, cached.get(r, 0.0)))

    # home's backlog makes `other` better than home by `margin` x the home term, before the term
    home.prefill_backlog, home.prefill_at = (raw(other) - raw(home) + margin * term) * p.rate * 2.0, 10.0
    assert raw(other) == pytest.approx(raw(home) - margin * term)
    assert p.why_not(home, q, 1, 10.0, 2.0) is None  # it fits: only the score decides
    assert (p.choose(q, 1, 10.0)[0] is home) is stays


def test_the_home_term_is_in_proportion_to_the_prefixs_size_against_the_cache():
    """A copy of a prefix evicts about its own size of other prefixes from the replica it moves to: a tenth of the
    KV or more is a whole move, a block of a templated one-liner next to nothing."""
    assert home_term(3_000, 3_200, 20_000) == pytest.approx(HOME_STAY * 3_000 / 3_200)
    assert home_term(128, 150, 100_000) == pytest.approx(HOME_STAY * 128 / 150 * 128 / 10_000)
    assert home_term(1_000, 2_000, 20_000) == pytest.approx(HOME_STAY * 0.5 * 0.5)
    assert home_term(0, 150, 100_000) == home_term(100, 0, 100_000) == 0.0
    assert home_term(3_000, 3_200, 0) == pytest.approx(HOME_STAY * 3_000 / 3_200)  # capacity unknown


def test_a_prefix_is_held_while_a_request_carrying_it_is_in_flight():
    """Requests in flight sharing a prefix share its KV blocks; once they end the blocks are idle, which vLLM counts
    as free, so nothing is held."""
    aff, a, b = PrefixAffinity(), Replica(address="a:1", pool="m"), Replica(address="b:1", pool="m")
    for r in (a, b):
        scrape(r, 0.5, 0.0)
    aff.on_scrape([a, b])
    confirmed(aff, a)
    confirmed(aff, b)
    assert aff.held_tokens(req(user="next")) == {}
    first = req(user="in flight")
    aff.record(a, first, aff.predicted_tokens(a, first), 5.0)
    q = req(user="next")
    held = aff.held_tokens(q)
    assert set(held) == {a}
    assert held[a] == pytest.approx(aff.confidence(a) * LEVEL * q.prompt_tokens / q.prompt_chars)
    assert aff.held_tokens(req(system=OTHER)) == {}
    aff.release(a, first)
    assert aff.held_tokens(q) == {} and aff.held == {}


def test_a_replica_near_its_kv_limit_takes_more_of_a_prefix_its_requests_hold():
    """The KV gate counts a prefix held by requests in flight once: the replica holding it keeps taking its requests
    (their tails and outputs fit), while a prompt of another prefix, or the same one on another replica, does not."""
    p, home = confirmed_pool()  # KV 100,000 tokens, limit 90,000
    other = p.pool.replicas[1]
    first = req(user="first")
    assert p.choose(first, 1, 10.0)[0] is home
    p.commit(home, first, 1, 10.0)
    epoch = home.scrape_epoch
    for r in p.pool.replicas:  # both engines near full, `first` running on home
        scrape(r, 10.5, 0.0, kv_usage=0.87, running=int(r is home))
    q = req(user="second")
    assert q.total_tokens > 3_000 and p.why_not(other, q, 1, 11.0, 1.0) == KV_FULL
    assert p.choose(q, 1, 11.0) == [home]
    assert p.choose(req(system=OTHER), 1, 11.0) is None and p.last_reasons == {KV_FULL: 2}
    p.release(home, first, 1, epoch)  # it ended: its prefix is idle, counted free by the engine
    assert p.choose(q, 1, 11.0) is None


def test_hits_counted_a_scrape_after_their_placement_still_confirm_the_prediction():
    """Requests placed just before a scrape are predicted in that window and hit in the next: the surplus carries
    over, so an engine hitting every prediction, half of them a window late, keeps full confidence however the
    windows' sizes vary."""
    aff, r = PrefixAffinity(), Replica(address="a:1", pool="m")
    scrape(r, 0.5, 0.0)
    aff.on_scrape([r])
    hits, late = 0.0, 0.0
    for k in range(12):
        predicted = 0.0
        for n in range(1 if k % 2 else 3):
            q = req(user=f"u{k}-{n}")
            aff.record(r, q, 3000.0, 0.0)
            aff.release(r, q)
            predicted += 3000.0
        hits += late + predicted / 2  # the engine counts half of them now, the rest at the next scrape
        late = predicted / 2
        scrape(r, 1.0 + k, hits)
        aff.on_scrape([r])
    assert aff.confidence(r) > 0.95


def test_the_longest_shared_level_misses_at_most_one_step_of_the_shared_text():
    """A cached prompt's uncached part is its tail plus at most PREFIX_STEP characters (about one KV block), not
    a share of the whole prompt: a 24,000-character system prompt shared up to its end is matched to within 512
    characters, so its cached tail stays a short prefill."""
    for shared in (700, 5_000, 24_000, 30_000):
        base = SYSTEM * 2
        a, b = prefix_chain(base[:shared] + "A" * 600), prefix_chain(base[:shared] + "B" * 600)
        common = sum(1 for x, y in zip(a, b) if x == y)
        assert PREFIX_LADDER[common - 1] <= shared < PREFIX_LADDER[common - 1] + PREFIX_STEP
    steps = [b - a for a, b in zip(PREFIX_LADDER, PREFIX_LADDER[1:])]
    assert max(steps[:60]) <= PREFIX_STEP and len(PREFIX_LADDER) < 400


def test_confidence_is_the_hit_share_over_many_windows_not_the_last_one():
    """One window whose predictions the engine has not counted yet (or an evicted prefix) does not drop the
    confidence that every earlier window confirmed: it is the ratio of decayed sums of hits and predictions."""
    aff, r = PrefixAffinity(), Replica(address="a:1", pool="m")
    scrape(r, 0.5, 0.0)
    aff.on_scrape([r])
    hits = 0.0
    for k in range(8):
        q = req(user=f"u{k}")
        aff.record(r, q, 4000.0, 0.0)
        aff.release(r, q)
        hits += 4000.0
        scrape(r, 1.0 + k, hits)
        aff.on_scrape([r])
    assert aff.confidence(r) == pytest.approx(1.0)
    q = req(user="missed")
    aff.record(r, q, 4000.0, 0.0)  # the engine finds none of it
    scrape(r, 10.0, hits)
    aff.on_scrape([r])
    assert 0.8 < aff.confidence(r) < 0.95  # one miss among nine predictions of equal size (the latest weighs most)
    for k in range(40):  # an engine that stopped caching: the confidence follows it down
        aff.record(r, req(user=f"v{k}"), 4000.0, 0.0)
        scrape(r, 11.0 + k, hits)
        aff.on_scrape([r])
    assert aff.confidence(r) < 0.05


def test_an_older_holder_is_predicted_the_share_of_its_prefix_it_is_credited():
    """A replica that is not a prefix's latest holder is predicted OLDER_HOLDER of it cached, as placement credits
    it: a full prediction there, missed when its cache evicted the prefix, would lower its confidence in its own
    prefixes too."""
    aff = PrefixAffinity()
    a, b = Replica(address="a:1", pool="m"), Replica(address="b:1", pool="m")
    aff.record(b, req(user="first"), 0.0, 1.0)
    aff.record(a, req(user="latest"), 0.0, 2.0)
    q = req(user="next")
    assert aff.predicted_tokens(a, q) > 0
    assert aff.predicted_tokens(b, q) == pytest.approx(OLDER_HOLDER * aff.predicted_tokens(a, q))


def test_requests_placed_since_the_scrape_count_a_prefix_they_share_once():
    """Until the next scrape shows it, the engine's KV is what it reported plus what was placed since: a request
    whose prefix is held by one in flight adds only the rest, so a burst of one app's requests between two
    scrapes does not read as several copies of its system prompt (which refused the prefix's holder as KV full
    and spilled the app to the other replica, PX). Ending leaves the counters as they were."""
    p, home = confirmed_pool()
    first, second = req(user="first"), req(user="second")
    assert p.choose(first, 1, 10.0)[0] is home
    p.commit(home, first, 1, 10.0)
    before = home.placed_since_scrape_prompt_tokens
    assert before == first.prompt_tokens and first.prefix_held == 0
    assert p.choose(second, 1, 10.0)[0] is home
    p.commit(home, second, 1, 10.0)
    added = home.placed_since_scrape_prompt_tokens - before
    assert second.prefix_held > 0.9 * LEVEL / 4 and added == second.prompt_tokens - second.prefix_held < 200
    p.release(home, second, 1, home.scrape_epoch)
    p.release(home, first, 1, home.scrape_epoch)
    assert home.placed_since_scrape_prompt_tokens == home.placed_since_scrape_tokens == 0


def test_a_prefix_is_reused_in_whole_blocks_and_never_to_the_prompts_last_token():
    assert reusable_tokens(300.0, 1000, 128) == 256
    assert reusable_tokens(100.0, 1000, 128) == 0  # shorter than a block: nothing shared
    assert reusable_tokens(256.0, 256, 128) == 128  # the whole prompt: its last token is computed
    assert reusable_tokens(300.5, 1000, 0) == 300.5  # no block size exported: to the token (SGLang)
    assert reusable_tokens(50.0, 1, 16) == 0


TEMPLATE = "".join(random.Random(9).choice("abcdefgh ") for _ in range(600))  # a templated one-liner, ~150 tokens


def warm_pool(n: int, block: int = 128) -> Placer:
    """`n` idle equal replicas (64 sequences each) whose engines' counters confirmed prefix caching."""
    p = placer(n=n, max_concurrency_per_replica=64)
    for r in p.pool.replicas:
        scrape(r, 0.5, 0.0, kv_block_tokens=block)
    p.prefix.on_scrape(p.pool.replicas)
    for r in p.pool.replicas:
        confirmed(p.prefix, r)
        r.prefill_backlog = 0.0
    assert all(r.kv_block_tokens == block for r in p.pool.replicas)
    return p


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("prompt", ["identical", "templated"])
def test_equal_short_prompts_spread_over_idle_equal_replicas(n: int, prompt: str):
    """A replica running one copy of a short prompt holds little KV, and the prefix block its copy holds makes the
    next copy a little cheaper there: without the in-flight term every copy went to the first replica while the
    others sat idle. Each sequence takes a decode slot, so equal requests spread."""
    p = warm_pool(n)
    placed = {r: 0 for r in p.pool.replicas}
    for i in range(4 * n):
        q = req(system=TEMPLATE, user="" if prompt == "identical" else f"row {i}")
        placed[place(p, q, 0, 10.0)] += 1
    assert sorted(placed.values()) == [4] * n, placed


def test_a_long_shared_prefix_still_goes_where_it_is_held_beside_idle_replicas():
    """Sharing a 4,000-token prefix saves far more prefill than a few sequences cost: its requests stay on the
    replica that holds it while it has headroom (PX), and spill once its sequences outweigh the saving."""
    p = warm_pool(3)
    home = p.pool.replicas[1]
    earlier = req(system=OTHER, user="earlier")
    p.prefix.record(home, earlier, 0.0, 5.0)  # it ran there and ended: cached, idle
    p.prefix.release(home, earlier)
    place_on = []
    for i in range(40):
        place_on.append(place(p, req(system=OTHER, user=f"question {i}"), 1, 10.0))
        if place_on[-1] is not home:
            break
    assert len(place_on) > 8 and all(r is home for r in place_on[:-1]) and place_on[-1] is not home


def test_the_lane_and_the_placement_share_one_prefix_lookup_while_nothing_changes(monkeypatch):
    """`lane_prefill_s` and the `choose` that follows it ask the prefix state the same question: it is answered
    once (the hot path), and asked again as soon as a placement or a scrape could change the answer."""
    p, home = confirmed_pool()
    calls = []
    lookup = p.prefix.cached_tokens
    monkeypatch.setattr(p.prefix, "cached_tokens", lambda q: calls.append(q) or lookup(q))
    q = req(user="q")
    lane_s = p.lane_prefill_s(q)
    assert lane_s < 0.1 * p.prefill_s(q.prompt_tokens)  # its prefix is cached at home: the lane of its tail
    assert p.choose(q, 1, 10.0)[0] is home
    assert len(calls) == 1
    p.commit(home, q, 1, 10.0)  # a placement moves the prefix state: the next question is answered afresh
    p.choose(q, 1, 10.0)
    assert len(calls) == 2
    p.prefix.on_scrape(p.pool.replicas)  # so does a scrape
    p.lane_prefill_s(q)
    assert len(calls) == 3
    other = req(user="other")  # another request never gets the first one's answer
    p.lane_prefill_s(other)
    assert calls[-1] is other
