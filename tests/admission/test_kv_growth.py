"""The KV requests in flight will still grow into (kv_growth.py): each request's expected output still to decode,
own and the other sidecars', counted against the KV a replica has while a new request would run (PG, P9)."""

from typing import Callable

import pytest

from extproc.admission.kv_growth import COMPACT_MIN, KvGrowth
from extproc.admission.placement import KV_FULL, Placer
from extproc.config import PoolConfig, parse_section
from extproc.request import LLMRequest
from extproc.routing.pool import Pool
from extproc.routing.scrape import ScrapedState

from .placing import placer

D = 0.01  # decode seconds per token in these tests


def req(prompt: int = 400, out: int = 700) -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=prompt,
                      max_output_tokens=out)


def test_remaining_output_falls_as_time_passes_and_ends_at_the_predicted_end():
    g = KvGrowth()
    a = g.add(first_token_at=1.0, output_tokens=100, decode_s=D)  # decodes 1.0 .. 2.0
    g.add(first_token_at=1.5, output_tokens=300, decode_s=D)      # decodes 1.5 .. 4.5
    assert g.remaining(1.0) == pytest.approx(100 + 300)           # before its first token: its whole output
    assert g.remaining(1.5) == pytest.approx(50 + 300)
    assert g.remaining(2.0) == pytest.approx(250)
    assert g.remaining(4.5) == 0.0 and len(g) == 0                # both predicted ended: popped
    b = g.add(first_token_at=5.0, output_tokens=200, decode_s=D)
    g.remove(a)                                                   # gone already: nothing changes
    assert g.remaining(5.5) == pytest.approx(150)
    g.remove(b)                                                   # its stream ended early
    assert g.remaining(5.5) == 0.0


def test_within_a_horizon_only_what_is_decoded_before_it_counts():
    g = KvGrowth()
    g.add(0.0, 1000, D)  # 10 s of decode
    g.add(0.0, 50, D)    # 0.5 s
    assert g.within(0.0, 1.0) == pytest.approx(100 + 50)
    g.add(0.5, 200, D)   # starts in 0.5 s: 50 of its 200 tokens within the next second, all 200 within 3 s
    assert g.within(0.0, 1.0) == pytest.approx(100 + 50 + 50)
    assert g.within(0.0, 3.0) == pytest.approx(300 + 50 + 200)
    assert g.within(0.0, 100.0) == pytest.approx(g.remaining(0.0)) == pytest.approx(1250)


def test_removed_entries_do_not_pile_up():
    g = KvGrowth()
    for _ in range(10 * COMPACT_MIN):
        g.remove(g.add(0.0, 10_000, D))  # streams that end long before their predicted end
    assert len(g) <= 2 * COMPACT_MIN + 2 and g.remaining(1.0) == pytest.approx(0.0)


def long_pool(n_sidecars: int, replicas: int = 3, capacity: int = 11_008) -> list[Placer]:
    """One Placer per sidecar, each with its own view of the same `replicas` replicas (PG: 3 gateways, one pool)."""
    out = []
    for _ in range(n_sidecars):
        pool = Pool.from_config(PoolConfig(model="m", replicas=[f"10.0.0.{i}:8000" for i in range(replicas)]))
        p = Placer(pool, parse_section("admission", {"kv_capacity_tokens": capacity, "prefill_tokens_per_s": 40_000,
                                                     "decode_s_per_token": D}))
        for r in pool.replicas:
            r.max_num_seqs = 256
            r.on_scrape(ScrapedState(scraped_at=1.0, kv_usage=0.0))
        out.append(p)
    return out


def share(placers: list[Placer], now: float) -> None:
    """What the shared view does (fleet.local_view / on_shared_view): each sidecar sees the others' load."""
    for me in placers:
        for i, r in enumerate(me.pool.replicas):
            others = [(p.pool.replicas[i], p) for p in placers if p is not me]
            r.note_shared(sum(o.inflight_tokens for o, _ in others), sum(o.inflight_requests for o, _ in others),
                          sum(p.own_growth(o, now) for o, p in others),
                          sum(o.inflight_tokens - o.inflight_prompt_tokens for o, _ in others))


def burst(placers: list[Placer], n: int, shared: bool,
          on_arrival: Callable[[float], None] | None = None) -> list[int]:
    """`n` long generations arriving round robin over the sidecars within 0.3 s, no scrape in between (the engines
    would show their prompts only); returns the requests placed per replica, all sidecars together. `shared`: the
    shared view refreshed before each arrival; `on_arrival(now)`: called before each (a view on its own clock)."""
    for i in range(n):
        now = 1.0 + 0.3 * i / n
        if shared:
            share(placers, now)
        if on_arrival is not None:
            on_arrival(now)
        p = placers[i % len(placers)]
        pins = p.choose(req(), 0, now)
        if pins is not None:
            p.commit(pins[0], req(), 0, now)
    return [sum(p.pool.replicas[i].inflight_requests for p in placers) for i in range(3)]


def test_shared_sidecars_place_only_what_the_pools_kv_holds_at_full_length():
    """PG: 3 gateways, 3 replicas whose KV holds 10 generations of 400 + 700 tokens at their full length (9 within
    the 10 % margin). Sharing their growth, the sidecars place 9 per replica together; each alone places its own
    9 per replica, three times what fits (the engines would preempt)."""
    assert burst(long_pool(3), 75, shared=True) == [9, 9, 9]
    independent = burst(long_pool(3), 75, shared=False)
    assert sum(independent) > 2 * 27


def test_after_a_scrape_the_output_still_to_decode_counts_not_only_the_prompt_held():
    p = placer(n=1, kv_capacity_tokens=11_000, decode_s_per_token=D)  # 9,900 usable
    r = p.pool.replicas[0]
    r.max_num_seqs = 256
    r.on_scrape(ScrapedState(scraped_at=0.5))
    for _ in range(8):
        p.commit(r, req(), 0, 1.0)
        r.answered(req().total_tokens, req().prompt_tokens)  # streaming: the engine took it in
    r.on_scrape(ScrapedState(scraped_at=1.1, kv_usage=8 * 410 / 11_000, running=8))  # prompts + 10 tokens each
    assert p.kv_held(r, 1.1) == pytest.approx(3_280)
    assert p.kv_committed(r, 1.1) == pytest.approx(3_280 + 8 * (p.growth[r].remaining(1.1) / 8), rel=1e-6)
    assert p.why_not(r, req(prompt=1_500), 0, 1.1, 5.0) == KV_FULL  # a 9th: 1,500 + its output by their ends
    assert p.why_not(r, req(out=30), 0, 1.1, 5.0) is None        # a short one ends well before that
    later = 1.0 + 8 * 400 / 10_000 + 700 * D  # the last prefilled after the others (10,000 tokens/s): all ended
    r.on_scrape(ScrapedState(scraped_at=later, kv_usage=0.0))
    assert p.own_growth(r, later) == 0.0 and p.why_not(r, req(), 0, later, 5.0) is None


def test_a_released_request_stops_growing_and_a_moved_one_grows_where_it_went():
    p = placer(n=2, decode_s_per_token=D)
    a, b = p.pool.replicas
    g = p.commit(a, req(), 0, 0.0)
    assert p.own_growth(a, 0.0) == pytest.approx(p.lifetime_s(a, req(), 0.0, 0) / D, rel=0.1)
    epoch, moved = p.move(a, b, req(), 0, 0, g)
    assert p.own_growth(a, 0.0) == 0.0 and p.own_growth(b, 1.0) == pytest.approx(g.end / D - 1.0 / D)
    p.release(b, req(), 0, epoch, moved)
    assert p.own_growth(b, 1.0) == 0.0 and b.inflight_requests == 0


def test_the_others_growth_counts_within_the_new_requests_lifetime():
    p = placer(n=1, kv_capacity_tokens=11_000, decode_s_per_token=D)
    r = p.pool.replicas[0]
    r.max_num_seqs = 256
    r.note_shared(8 * 1100, 8, growth=8 * 690)               # 8 long ones of another gateway, still to decode ...
    r.on_scrape(ScrapedState(scraped_at=1.0, kv_usage=0.3))  # ... placed before the scrape: 3,300 held
    assert p.why_not(r, req(), 0, 1.0, 5.0) == KV_FULL
    assert p.why_not(r, req(out=20), 0, 1.0, 5.0) is None    # within 0.2 s they decode at most 8 x 20 tokens
    r.note_shared(0, 0)                                      # Redis lost: own view only
    assert p.why_not(r, req(), 0, 1.0, 5.0) is None


def test_a_long_generation_another_gateway_placed_since_the_scrape_counts_its_footprint_once():
    """PG: between scrapes, the other sidecar's request counts its prompt (not yet in the scraped KV) plus its
    output in the growth term, 400 + 700 tokens like one's own; counting its whole footprint beside its growth
    made each of the others' placements since the scrape 1,800 tokens, and the replica looked fuller by 700 per
    request (a burst of the other gateways' placements queued and shed this gateway's requests)."""
    a, b = long_pool(2, replicas=1)
    ra, rb = a.pool.replicas[0], b.pool.replicas[0]
    b.commit(rb, req(), 0, 1.0)
    share([a, b], 1.0)
    a.commit(ra, req(), 0, 1.0)
    share([a, b], 1.0)
    assert a.kv_committed(ra, 1.0) == pytest.approx(b.kv_committed(rb, 1.0)) == pytest.approx(2 * 1100)
    assert a.kv_held(ra, 1.0) == pytest.approx(2 * 1100)  # held: both footprints in full, as reserved


def test_what_a_scrape_does_not_show_of_the_requests_placed_before_it_is_still_to_come():
    """unshown(s): the prompts and the output the ledger expects the requests placed before the scrape to hold, less
    what it showed; one placed after it, or ended, is not in the sum; an engine ahead of the ledger shows more."""
    g = KvGrowth()
    g.add(1.2, 240, D, 3240, prompt=3000, placed=1.0)  # predicted: first token at 1.2, 30 decoded by 1.5
    g.add(1.2, 240, D, 3240, prompt=3000, placed=1.0)
    ended = g.add(1.2, 240, D, 3240, prompt=3000, placed=1.0)
    g.remove(ended)
    g.add(2.0, 240, D, 3240, prompt=3000, placed=1.6)  # placed after the scrape: counted whole elsewhere
    assert g.unshown(1.5, held=4280.0) == pytest.approx(2 * (3000 + 30) - 4280)
    assert g.unshown(1.5, held=7000.0) == 0.0


def test_a_long_prompt_half_prefilled_at_the_scrape_does_not_let_a_third_in():
    """P9 with a cache of 76 blocks of 128 tokens (9,728; 8,755 within the margin): two long generations placed
    together, prefilling chunk by chunk, show 4,280 of their 6,000 prompt tokens at the next scrape. Counting only
    what it showed, a third fitted beside them (9,720 tokens at their full length: the engine preempts)."""
    p = placer(n=1, kv_capacity_tokens=9_728, decode_s_per_token=D, prefill_tokens_per_s=40_000)
    r = p.pool.replicas[0]
    r.max_num_seqs = 256
    r.on_scrape(ScrapedState(scraped_at=0.5))
    for _ in range(2):
        p.commit(r, req(3000, 240), 0, 1.0)
        r.answered(req(3000, 240).total_tokens, 3000)
    r.on_scrape(ScrapedState(scraped_at=1.6, kv_usage=4280 / 9_728, running=2))
    assert p.why_not(r, req(3000, 240), 0, 1.6, 60.0) == KV_FULL
    r.on_scrape(ScrapedState(scraped_at=1.7, kv_usage=(6000 + 2 * 30) / 9_728, running=2))  # all of it shown
    assert p.why_not(r, req(300, 24), 0, 1.7, 60.0) is None                               # a short one fits


def test_a_request_placed_while_the_page_was_on_its_way_counts_once():
    """The page counts what was placed before it was asked for: a request placed after that counts whole as placed
    since the scrape, not again as what the page did not show."""
    p = placer(n=1, kv_capacity_tokens=9_728, decode_s_per_token=D, prefill_tokens_per_s=40_000)
    r = p.pool.replicas[0]
    r.max_num_seqs = 256
    r.on_scrape(ScrapedState(scraped_at=0.5))
    p.commit(r, req(3000, 240), 0, 1.0)
    r.answered(req(3000, 240).total_tokens, 3000)
    r.scrape_sent()
    r.scrape_asking_since = 1.05                    # the page was asked for at 1.05 (test clock)
    p.commit(r, req(3000, 240), 0, 1.1)             # on its way: the page cannot count this one
    r.on_scrape(ScrapedState(scraped_at=1.2, kv_usage=2000 / 9_728, running=1))
    assert r.placed_since_scrape_prompt_tokens == 3000
    # the page's 2,000, the one placed since it whole, what the page did not show of the first one's prompt (not
    # decoding yet at 1.05), and the output both are still to decode
    assert p.kv_committed(r, 1.2) == pytest.approx(2000 + 3000 + (3000 - 2000) + p.own_growth(r, 1.2))
