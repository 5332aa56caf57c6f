"""A request KV keeps off every replica until after its wait budget is refused at once and for good (429
`kv_committed`, x-should-retry false, retry-after = when KV frees): neither the queue nor the SDK's prompt retry can
start it within the SLO (PG: a burst of long generations on a pool whose KV they fill for seconds)."""

import math

import pytest

from extproc.admission.kv_growth import Growth, KvGrowth
from extproc.admission.placement import Placer
from extproc.admission.queue import Waiter
from extproc.admission.scheduler import Placement, Scheduler, Shed
from extproc.config import PoolConfig, parse_section
from extproc.request import LLMRequest
from extproc.routing.pool import Pool
from extproc.routing.scrape import ScrapedState

D = 0.01        # decode seconds per token: a 700-token output decodes in 7 s
CAP = 11_000    # KV tokens per replica: 9,900 within the 10 % margin, 9 generations of 400 + 700 tokens


def req(prompt: int = 400, out: int = 700) -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=prompt,
                      max_output_tokens=out)


def scheduler(n: int = 1, kv_usage: float = 0.0) -> Scheduler:
    """Shipped defaults but for the KV size, a 0.5 s target and decode speed; every replica scraped at t=1."""
    pool = Pool.from_config(PoolConfig(model="m", replicas=[f"10.0.0.{i}:8000" for i in range(n)]))
    policy = parse_section("admission", {"kv_capacity_tokens": CAP, "prefill_tokens_per_s": 40_000,
                                         "decode_s_per_token": D, "ttft_target_s": 0.5,
                                         "prefill_knee_tokens": 0})  # prefill linear in the prompt: plain tokens
    s = Scheduler(pool, policy, Placer(pool, policy))
    for r in pool.replicas:
        r.max_num_seqs = 256
        r.on_scrape(ScrapedState(scraped_at=1.0, kv_usage=kv_usage))
    return s


def test_the_ledger_lists_each_requests_end_and_the_kv_it_frees_soonest_first():
    g = KvGrowth()
    g.add(1.0, 700, D, tokens=1_100)   # ends at 8.0
    g.add(0.5, 100, D, tokens=400)     # ends at 1.5
    gone = g.add(0.0, 50, D, tokens=80)
    g.remove(gone)
    assert g.ends(1.0) == [(pytest.approx(1.5), 400), (pytest.approx(8.0), 1_100)]
    assert g.ends(2.0) == [(pytest.approx(8.0), 1_100)]  # the short one ended


async def test_a_long_generation_the_kv_cannot_hold_until_after_its_wait_budget_is_refused_at_once_for_good():
    s = scheduler()
    placed = [s.submit(req(), 1.0) for _ in range(9)]
    assert all(isinstance(p, Placement) for p in placed)  # 9 x 1,100 = the replica's KV within the margin
    first_end = min(p.growth.end for p in placed)
    with pytest.raises(Shed) as exc:
        s.submit(req(), 1.0)
    assert (exc.value.status, exc.value.code, exc.value.should_retry) == (429, "kv_committed", False)
    assert exc.value.retry_after_s == pytest.approx(first_end - 1.0)  # when the first of them frees its 1,100
    assert first_end - 1.0 > 7.0 and s.queued_total() == 0
    assert isinstance(s.submit(req(out=20), 1.0), Placement)  # a short one ends before the KV fills up


async def test_kv_that_frees_within_the_wait_budget_leaves_the_request_to_the_queue():
    s = scheduler()
    for _ in range(8):
        s.submit(req(), 1.0)
    short = s.submit(req(out=10, prompt=6_400), 1.0)  # ends 0.1 s after its first token, with 6,410 tokens
    assert isinstance(short, Placement)
    # 8 x 400 + 6,400 held now, their growth and a 400-token prompt more pass the 9,900: it fits after that end
    assert s.placer.kv_free_s(req(), 1.0) == pytest.approx(short.growth.end - 1.0)
    assert short.growth.end - 1.0 < s._wait_budget(req(), 1.0)
    assert isinstance(s.submit(req(), 1.0), Waiter)  # it waits for that end, as before


async def test_a_long_generation_fits_where_the_short_ones_free_their_kv_before_its_output_needs_it():
    """8 generations of 400 + 700 and a short one of 1,000 + 10 in flight: together they will hold 9,810 of the
    9,900, but the short one ends 0.1 s after its first token, long before the others' outputs grow into its
    1,010. A 9th long generation needs its 1,100 beside at most 8,800 at any moment: it is placed now (the upper
    bound without the ends, 10,910, made it wait for that end)."""
    s = scheduler()
    for _ in range(8):
        s.submit(req(), 1.0)
    short = s.submit(req(out=10, prompt=1_000), 1.0)
    assert isinstance(short, Placement)
    p, r = s.placer, s.pool.replicas[0]
    lifetime = p.lifetime_s(r, req(), 1.0, p.prefill_work(400))
    assert p.kv_committed(r, 1.0, lifetime) + 1_100 > 9_900                      # without the ends: no room
    assert p.kv_committed(r, 1.0, lifetime, frees=True) + 1_100 <= 9_900 + 1e-6  # with them: room
    assert p.kv_peak(r, req(), 1.0, p.prefill_work(400)) <= p.kv_committed(r, 1.0, lifetime, frees=True)
    assert p.kv_free_s(req(), 1.0) is None
    assert isinstance(s.submit(req(), 1.0), Placement)
    with pytest.raises(Shed):
        s.submit(req(), 1.0)  # a 10th does not fit at the peak either


def test_the_peak_counts_growth_until_each_end_frees_what_that_request_holds():
    g = KvGrowth()
    g.add(0.0, 100, D, tokens=600, prompt=500)    # decodes 0..1 s, freed 1.5 s from now (END_SLACK)
    g.add(0.0, 400, D, tokens=500, prompt=100)    # decodes 0..4 s, freed at 6 s
    assert g.within(0.0, 2.0) == pytest.approx(100 + 200)
    # just before the first is freed: 100 + 150 grown; then 600 freed, and the second grows 50 more by 2 s
    assert g.peak_within(0.0, 2.0) == pytest.approx(250)
    assert g.peak_within(0.0, 0.5) == pytest.approx(100)  # nothing freed within: as within
    assert g.peak_within(0.0, 8.0) == pytest.approx(250)  # 500 grown - 600 freed before the second's free
    late = KvGrowth()
    late.add(3.0, 100, D, tokens=150, prompt=50)  # starts decoding within the horizon, ends after it
    assert late.peak_within(0.0, 3.5) == pytest.approx(50) == late.within(0.0, 3.5)


def test_the_request_being_placed_grows_beside_them_from_its_first_token():
    g = KvGrowth()
    g.add(0.0, 100, D, tokens=600, prompt=500)           # decodes 0..1 s, its 600 freed at 1.5 s
    joining = Growth(0.5, 300, D)                         # decodes 0.5..3.5 s: the horizon is its lifetime
    # before the free: 100 + 100 of its own; at the horizon: 300 of its own - 600 freed + 100 grown
    assert g.peak_within(0.0, 3.5, joining) == pytest.approx(200)
    assert g.peak_within(0.0, 3.5) == pytest.approx(100)
    assert KvGrowth().peak_within(0.0, 3.5, joining) == pytest.approx(300)  # alone: its whole output by its end


def test_the_waiters_ahead_take_the_kv_left_first():
    s = scheduler()
    for _ in range(8):
        s.submit(req(), 1.0)
    p = s.placer
    assert p.kv_free_s(req(), 1.0) is None  # room for one more now ...
    ends = p.growth[p.pool.replicas[0]].ends(1.0)
    assert p.kv_free_s(req(), 1.0, ahead=1, ahead_tokens=1_100) == pytest.approx(ends[0][0] - 1.0)  # ... not 2


async def test_a_full_pool_of_the_other_gateways_requests_is_known_through_the_shared_view():
    """PG: the other gateways' 6 long generations per replica, published through Redis, and this sidecar's 3 fill
    the KV for seconds: the 10th is refused for good. Without the shared view the same engine numbers show KV held
    by requests this sidecar does not know, which may end any moment: no such refusal."""
    shared = scheduler(n=1)
    r = shared.pool.replicas[0]
    r.note_shared(6 * 1_100, 6, growth=6 * 690, output=6 * 700)
    r.on_scrape(ScrapedState(scraped_at=1.0, kv_usage=6 * 410 / CAP, running=6))
    assert all(isinstance(shared.submit(req(), 1.0), Placement) for _ in range(3))
    with pytest.raises(Shed) as exc:
        shared.submit(req(), 1.0)
    assert exc.value.code == "kv_committed" and exc.value.retry_after_s > 5.0

    independent = scheduler(n=1)
    r = independent.pool.replicas[0]
    r.on_scrape(ScrapedState(scraped_at=1.0, kv_usage=0.75, running=6))  # 8,250 held by requests it never placed
    assert all(isinstance(independent.submit(req(), 1.0), Placement) for _ in range(1))
    assert independent.placer.kv_free_s(req(), 1.0) == 0.0
    assert isinstance(independent.submit(req(), 1.0), Waiter)


def test_nothing_known_frees_enough_is_an_unbounded_wait():
    s = scheduler(kv_usage=0.0)
    r = s.pool.replicas[0]
    assert s.placer._kv_freed_after(r, 1.0, 500.0) == math.inf  # no request in flight frees anything


def test_the_waiters_ahead_fill_the_roomiest_replicas_one_by_one_then_as_a_level():
    a, b = scheduler(n=2).pool.replicas
    room = Placer._room_behind
    assert room(1, 1_100, {a: 1_100, b: 1_100}) == {a: 0.0, b: 1_100}  # a whole request on one replica
    assert room(3, 30, {a: 100, b: 0}) == {a: 70.0, b: 0}
    assert room(65, 65, {a: 100, b: 0}) == {a: 35.0, b: 0}            # many: lowered as a level
    assert room(100, 1_000, {a: 100, b: 50}) == {a: -425.0, b: -425.0}


async def test_a_waiter_whose_budget_ends_while_kv_stays_committed_is_told_when_kv_frees():
    s = scheduler()
    placed = [s.submit(req(), 1.0) for _ in range(9)]
    w = Waiter(req=req(), lane=0, priority=0, tenant="", deadline=1.4, enqueued=1.0)
    shed = s.expired(w, 1.4)
    assert (shed.code, shed.should_retry) == ("kv_committed", False)
    assert shed.retry_after_s == pytest.approx(min(p.growth.end for p in placed) - 1.4)
    lone = scheduler()
    lone.submit(req(), 1.0)
    assert lone.expired(w, 1.4).code == "queue_timeout"  # not KV: the queue's answer, retryable


async def test_a_request_that_ends_before_the_kv_frees_for_the_queued_one_goes_first():
    """EASY backfilling (scheduler `_backfill`): the next queued request waits for KV alone, so a request that
    will have ended before that KV frees takes nothing it waits for and may go first; one that would still run
    then waits its turn (PG: the burst's long generations held every short chat behind them)."""
    s = scheduler()
    for _ in range(8):
        s.submit(req(), 1.0)
    short = s.submit(req(out=10, prompt=6_400), 1.0)  # 9,600 held now; 6,410 free 0.1 s after its start
    head = s.submit(req(), 1.0)
    assert isinstance(short, Placement) and isinstance(head, Waiter)  # waits for the short one's KV
    assert s.kv_held_until[head.lane] == pytest.approx(short.growth.end)
    tiny = s.submit(req(prompt=50, out=5), 1.0)  # 55 tokens, ends after 0.05 s: before the head could start
    assert isinstance(tiny, Placement)
    late = s.submit(req(prompt=50, out=60), 1.0)  # would still decode when the KV frees: behind the head
    assert isinstance(late, Waiter)
    assert s.queues[head.lane].behind(head, 8) == [late]
    assert s.kick(1.0) == 0 and not late.future.done()  # a kick does not let it pass either
