"""What the placer learns from the engines' own numbers: the KV they hold (P13), how many requests they run (P12),
their decode time per token (P5), and lanes by predicted prefill seconds (P3)."""

import pytest

from extproc.admission.decode_time import DecodeTime
from extproc.admission.placement import CONCURRENCY, KV_FULL, PROBE_BASE, QUEUE_FULL, UNSCRAPED_CONCURRENCY
from extproc.admission.queue import Waiter
from extproc.admission.scheduler import Placement, Scheduler, Shed
from extproc.admission.seq_cap import CONFIRM, SeqCap
from extproc.config import PoolConfig, parse_section
from extproc.admission.placement import Placer
from extproc.request import LLMRequest
from extproc.routing.pool import DEGRADED, Pool, Replica
from extproc.routing.scrape import ScrapedState

from .placing import placer


def req(prompt: int = 200, out: int = 1500, stream: bool = True, timeout: float | None = None) -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=stream, prompt_tokens=prompt,
                      max_output_tokens=out, client_timeout_s=timeout)


def scrape(r: Replica, at: float, **engine: float) -> None:
    r.on_scrape(ScrapedState(scraped_at=at, **engine))


# ---- KV: what the engine holds, not a lifetime reservation (P13) --------------------------------------------

def test_a_footprint_counts_in_full_until_the_engine_reports_it_then_what_it_holds_plus_what_is_to_come():
    p = placer(n=1, kv_capacity_tokens=20_000, kv_margin=0.1)  # 18,000 usable
    r = p.pool.replicas[0]
    r.max_num_seqs = 256
    scrape(r, 0.5)
    for i in range(10):  # 10 streams of 200 + 1,500: 17,000 tokens once each has decoded its output
        p.commit(r, req(), 0, 0.0)
    assert p.kv_held(r, 0.0) == 17_000
    assert p.why_not(r, req(), 0, 0.0, 2.0) == KV_FULL  # an 11th footprint does not fit before the engine says
    # the engine reports what it holds: the prompts and the tokens decoded so far, 10 x 300
    scrape(r, 1.0, kv_usage=3_000 / 20_000, running=10)
    assert p.kv_held(r, 1.0) == pytest.approx(3_000)
    # ... but its streams will still decode their outputs (kv_growth.py): a 12th long one would not fit then,
    assert p.kv_committed(r, 1.0) > 18_000 - req().total_tokens
    assert p.why_not(r, req(), 0, 1.0, 2.0) == KV_FULL
    # while a short one, gone long before, does
    assert p.why_not(r, req(out=50), 0, 1.0, 2.0) is None
    # between scrapes, what the running requests decode is counted too (10 streams x 0.2 s / 0.02 s per token)
    assert p.kv_held(r, 1.2) == pytest.approx(3_000 + 10 * 0.2 / p.decode_s)


def test_requests_waiting_in_the_engine_count_though_not_in_its_kv_yet():
    p = placer(n=1, kv_capacity_tokens=20_000)
    r = p.pool.replicas[0]
    scrape(r, 0.1)
    for _ in range(4):
        p.commit(r, req(prompt=1000, out=1000), 0, 0.0)
    scrape(r, 0.5, kv_usage=0.1, running=2, waiting=2)
    assert p.kv_held(r, 0.5) == pytest.approx(2_000 + 2 * 2_000)


def test_without_engine_numbers_the_reservations_stand():
    p = placer(n=1, kv_capacity_tokens=20_000)
    r = p.pool.replicas[0]
    p.commit(r, req(), 0, 0.0)
    assert p.kv_held(r, 5.0) == 1_700


def test_slow_streams_hold_what_they_will_decode_and_normal_requests_still_pass():
    """P13: 100 slow streams of 200 + 1,500 tokens on two replicas of 65,536 (58,982 usable): by the engines, the
    prompts and what was decoded so far; by what they will still decode, about 34 per replica fit (the engine
    would preempt the rest before they end). A normal request after them, which ends long before them, is placed:
    the slow streams' far future does not hold it back."""
    s = scheduler(n=2, kv_capacity_tokens=65_536)
    for r in s.pool.replicas:
        r.max_num_seqs = 256
    placed = 0
    for i in range(100):
        now = 1.0 + 0.02 * i
        if i % 10 == 0:  # a scrape every 0.2 s: each stream holds its prompt and 100 decoded tokens so far
            for r in s.pool.replicas:
                scrape(r, now, kv_usage=r.inflight_requests * 300 / 65_536, running=r.inflight_requests)
        if s._try_place(req(), 0, now) is not None:
            placed += 1
    assert 2 * 30 <= placed <= 2 * 35
    assert isinstance(s.submit(req(prompt=300, out=200), 3.0), Placement)


# ---- how many requests an engine runs (P12) ------------------------------------------------------------------

def test_the_sequence_cap_is_learned_when_requests_wait_at_a_steady_running_count():
    r, cap = Replica(address="a:1", pool="m"), SeqCap()
    for i in range(CONFIRM - 1):
        scrape(r, 1.0 + i, running=64, waiting=5, kv_usage=0.3)
        cap.update([r])
    assert r.max_num_seqs == 0  # not yet confirmed
    scrape(r, 1.0 + CONFIRM, running=64, waiting=3, kv_usage=0.3)
    cap.update([r])
    assert r.max_num_seqs == 64
    scrape(r, 10.0, running=80, waiting=0, kv_usage=0.3)  # ran more: 64 was not the cap
    cap.update([r])
    assert r.max_num_seqs == 0


def test_waits_for_kv_or_at_varying_counts_do_not_teach_a_cap():
    r, cap = Replica(address="a:1", pool="m"), SeqCap()
    for i, running in enumerate((10, 12, 11, 14, 13)):  # a step's token budget, not a cap
        scrape(r, 1.0 + i, running=running, waiting=2, kv_usage=0.3)
        cap.update([r])
    for i in range(5):  # waiting for KV blocks at a steady count
        scrape(r, 10.0 + i, running=20, waiting=4, kv_usage=0.97)
        cap.update([r])
    assert r.max_num_seqs == 0


def test_concurrency_follows_the_engine_cap_not_a_fixed_number():
    p = placer(n=1, kv_capacity_tokens=10_000_000, prefill_tokens_per_s=1e9)
    r = p.pool.replicas[0]
    r.max_num_seqs = 4096
    scrape(r, 1.0, running=500, waiting=0)
    for _ in range(200):  # 700 requests at once: far past the old fixed 64, well within the engine
        assert p.why_not(r, req(prompt=20, out=400), 0, 1.0, 2.0) is None
        p.commit(r, req(prompt=20, out=400), 0, 1.0)
    scrape(r, 1.2, running=4096, waiting=2)
    assert p.why_not(r, req(prompt=20, out=400), 0, 1.2, 2.0) == CONCURRENCY


def test_an_unknown_cap_grows_by_doubling_per_scrape():
    p = placer(n=1, kv_capacity_tokens=10_000_000, prefill_tokens_per_s=1e9)
    r = p.pool.replicas[0]
    scrape(r, 1.0, running=0)
    n = 0
    while p.why_not(r, req(prompt=20, out=400), 0, 1.0, 2.0) is None:
        p.commit(r, req(prompt=20, out=400), 0, 1.0)
        n += 1
    assert n == PROBE_BASE
    scrape(r, 1.2, running=30, waiting=0)
    n = 0
    while p.why_not(r, req(prompt=20, out=400), 0, 1.2, 2.0) is None:
        p.commit(r, req(prompt=20, out=400), 0, 1.2)
        n += 1
    assert n == 30



def _fill_interval(p, r, at: float, finish: bool) -> int:
    """Place short requests until the unknown-cap probe says stop; `finish`: each ends before the next scrape."""
    n = 0
    while p.why_not(r, req(prompt=20, out=4), 0, at, 2.0) is None and n < 10_000:
        growth = p.commit(r, req(prompt=20, out=4), 0, at)
        if finish:
            p.release(r, req(prompt=20, out=4), 0, r.scrape_epoch, growth)
        else:
            r.answered(24, 20)  # the engine took it in and answered: it shows it, or it ended there
        n += 1
    return n


def test_an_unknown_cap_lets_short_requests_double_per_interval():
    """Short requests end before any scrape sees them (the engine shows ~2 running): the interval's placements,
    finished ones included, double per scrape; an interval in which the engine's queue was full halves the
    allowance rather than restarting it."""
    p = placer(n=1, kv_capacity_tokens=10_000_000, prefill_tokens_per_s=1e9)
    r = p.pool.replicas[0]
    scrape(r, 1.0, running=2, waiting=0)
    # placements that are still in flight at the next scrape count against the interval's allowance
    assert _fill_interval(p, r, 1.0, finish=False) == PROBE_BASE
    allowed = []
    for i in range(4):
        scrape(r, 1.2 + 0.2 * i, running=2, waiting=0)
        allowed.append(_fill_interval(p, r, 1.2 + 0.2 * i, finish=False))
    assert allowed == [2 * PROBE_BASE, 4 * PROBE_BASE, 8 * PROBE_BASE, 16 * PROBE_BASE]
    scrape(r, 2.2, running=40, waiting=3)  # the engine queues past max_waiting: nothing more goes there
    assert _fill_interval(p, r, 2.2, finish=False) == 0
    scrape(r, 2.4, running=2, waiting=0)  # one full interval halves what it remembers, not restarts from 8
    assert _fill_interval(p, r, 2.4, finish=False) == 16 * PROBE_BASE


def test_a_replica_without_metrics_and_an_explicit_limit_count_own_requests():
    p = placer(n=1, kv_capacity_tokens=10_000_000, prefill_tokens_per_s=1e9)
    r = p.pool.replicas[0]
    for _ in range(UNSCRAPED_CONCURRENCY):
        p.commit(r, req(prompt=20, out=20), 0, 0.0)
    assert p.why_not(r, req(prompt=20, out=20), 0, 0.0, 2.0) == CONCURRENCY
    q = placer(n=1, kv_capacity_tokens=10_000_000, prefill_tokens_per_s=1e9, max_concurrency_per_replica=2)
    r = q.pool.replicas[0]
    scrape(r, 1.0)
    q.commit(r, req(prompt=20, out=20), 0, 0.0)
    q.commit(r, req(prompt=20, out=20), 0, 0.0)
    assert q.why_not(r, req(prompt=20, out=20), 0, 0.0, 2.0) == CONCURRENCY


# ---- decode time per token (P5) ------------------------------------------------------------------------------

def test_decode_time_is_the_pools_token_weighted_inter_token_latency():
    rs = [Replica(address=f"a:{i}", pool="m") for i in range(3)]
    d = DecodeTime(0.02)
    assert d.update(rs) == 0.02  # nothing measured: the configured start value
    scrape(rs[0], 1.0, itl_s=0.005, itl_count_recent=300)
    scrape(rs[1], 1.0, itl_s=0.008, itl_count_recent=100)
    scrape(rs[2], 1.0, itl_s=0.5, itl_count_recent=100)
    rs[2].state = DEGRADED  # a sick replica's slowness is health's business
    assert d.update(rs) == pytest.approx((0.005 * 300 + 0.008 * 100) / 400)
    for r in rs:  # an idle window: the last measurement stands
        scrape(r, 2.0, itl_s=0.0, itl_count_recent=0)
    assert d.update(rs) == pytest.approx(0.00575)
    scrape(rs[0], 3.0, itl_s=1e-6, itl_count_recent=1000)  # bounded to a factor 10 of the configured value
    assert d.update(rs) == pytest.approx(0.002)


def test_a_decode_time_no_newer_window_confirms_stops_deciding_deadlines():
    """Real P5: measured while both engines ran at a third of their speed, ~50 ms per token refused every
    non-streaming request with a 0.75 s deadline, after the engines had recovered too: refusals decode nothing,
    so no newer measurement came. After STALE_S without one, deadlines plan with the fastest speed within the
    bounds again (placement.answer_decode_s), and the first answers measure the engines anew."""
    from extproc.admission.decode_time import STALE_S

    r = Replica(address="a:0", pool="m")
    d = DecodeTime(0.02)
    assert not d.current(0.0)  # nothing measured yet
    scrape(r, 1.0, itl_s=0.05, itl_count_recent=200)
    d.update([r], 1.0)
    assert d.current(1.0 + STALE_S) and d.value == pytest.approx(0.05)
    scrape(r, 1.2, itl_s=0.0, itl_count_recent=0)  # refused traffic: nothing decodes
    d.update([r], 1.0 + STALE_S + 0.1)
    assert not d.current(1.0 + STALE_S + 0.1)
    p = placer(n=1)
    p.decode_s, p.decode_measured = d.value, d.current(1.0 + STALE_S + 0.1)
    assert p.answer_decode_s(req(out=48, stream=False)) == pytest.approx(48 * 0.02 / 10)


def test_a_non_streaming_answer_is_planned_at_the_learned_decode_time():
    p = placer(n=1)
    p.decode_s, p.decode_measured = 0.006, True
    assert p.answer_decode_s(req(out=48, stream=False)) == pytest.approx(0.288)
    # a client giving up after 1.5 s: 75 % of it, less the answer's decode, is what its first token may take
    assert p.ttft_limit_s(req(out=48, stream=False, timeout=1.5), 0.0) == pytest.approx(1.125 - 0.288)


# ---- lanes in predicted prefill seconds (P3, issue 16) ---------------------------------------------------------

def test_lanes_follow_predicted_prefill_seconds_relative_to_the_target():
    pol = parse_section("admission", {"ttft_target_s": 1.0})
    assert [pol.lane_for(t) for t in (0.05, 0.1, 0.3, 0.5, 0.6, 5.0)] == [0, 0, 1, 1, 2, 2]
    # the same 7,000-token prompt is long on a slow engine and normal on a fast one
    slow = placer(n=2, prefill_tokens_per_s=8_000, ttft_target_s=1.0)
    fast = placer(n=2, prefill_tokens_per_s=40_000, ttft_target_s=1.0)
    assert slow.policy.lane_for(slow.prefill_s(7_000)) == 2  # 0.875 s: more than half the target
    assert fast.policy.lane_for(fast.prefill_s(7_000)) == 1  # 0.175 s


# ---- the queue wait follows the SLO (P1f) ----------------------------------------------------------------------

def scheduler(n: int = 1, **admission: object) -> Scheduler:
    pool = Pool.from_config(PoolConfig(model="m", replicas=[f"10.0.0.{i}:8000" for i in range(n)]))
    # prefill time linear in the prompt (knee 0): these tests count plain tokens (the size model: test_prefill_work.py)
    policy = parse_section("admission", {"kv_capacity_tokens": 100_000, "prefill_knee_tokens": 0, **admission})
    return Scheduler(pool, policy, Placer(pool, policy))


async def test_the_default_wait_is_the_slo_less_the_requests_own_prefill():
    s = scheduler(ttft_target_s=1.0, prefill_tokens_per_s=10_000)
    # 1 s - 0.2 s of its own prefill - REFILL_S (0.1 s) of another's it may land behind
    assert s._wait_budget(req(prompt=2_000), 0.0) == pytest.approx(0.7)
    # a prompt whose prefill takes most of the SLO may still wait about half of it (it is served, not refused)
    assert s._wait_budget(req(prompt=20_000), 0.0) == pytest.approx(0.4)
    assert scheduler(max_wait_s=7.0)._wait_budget(req(), 0.0) == 7.0  # an explicit wait stands


async def test_a_request_that_cannot_start_within_the_slo_is_shed_at_once_with_retry_after():
    s = scheduler(ttft_target_s=1.0, prefill_tokens_per_s=10_000, max_concurrency_per_replica=1)
    first = s.submit(req(prompt=100, out=10), 0.0)
    assert isinstance(first, Placement)
    for t in (0.1, 0.2, 0.3, 0.4):  # one release every 0.1 s... then one request in flight takes 1 s
        s.drain[s.meter[0]].tick(t)
    waiting = [s.submit(req(prompt=100, out=10), 0.4) for _ in range(3)]
    assert all(isinstance(w, Waiter) for w in waiting)
    with pytest.raises(Shed) as exc:
        for _ in range(20):
            s.submit(req(prompt=100, out=10), 0.4)
    assert exc.value.status == 429 and exc.value.should_retry and exc.value.retry_after_s > 0


# ---- requests the engine has not taken in yet (issue 16: a real vLLM's API server) ---------------------------

def test_requests_the_engine_has_not_answered_nor_counted_stay_in_the_count_after_a_scrape():
    """A real vLLM counts a request once its API server has parsed and tokenized it: a scrape in between shows it
    nowhere. Those requests still count as placed (KV, sequences) and as queued at the engine (queue limit,
    score) until the engine answers them; a request it answered and counts is not counted twice."""
    p = placer(n=2, prefill_tokens_per_s=1e9)
    busy, idle = p.pool.replicas
    for r in p.pool.replicas:
        scrape(r, 1.0)
    for _ in range(3):
        p.commit(busy, req(prompt=400, out=16), 0, 1.0)
    scrape(busy, 1.2)  # none of the three taken in yet: the engine shows nothing
    scrape(idle, 1.2)
    assert busy.placed_since_scrape_requests == 3 and busy.engine_queue() == 3
    assert p.kv_held(busy, 1.2) == 3 * 416
    assert p.why_not(busy, req(prompt=400, out=16), 0, 1.2, 2.0) == QUEUE_FULL  # max_waiting_per_replica 2
    assert p.choose(req(prompt=400, out=16), 0, 1.2)[0] is idle
    busy.answered(416, 400)  # the engine took one in and answered it; the next scrape shows it running
    scrape(busy, 1.4, running=1)
    assert busy.placed_since_scrape_requests == 2 and busy.engine_queue() == 2
    busy.answered(416, 400)
    busy.answered(416, 400)
    scrape(busy, 1.6, running=3)
    assert busy.placed_since_scrape_requests == 0 and busy.engine_queue() == 0


def test_a_non_streaming_request_the_engine_counts_is_not_carried():
    """No response headers until its answer is whole: while the engine shows it running, it is counted once."""
    p = placer(n=1, prefill_tokens_per_s=1e9)
    r = p.pool.replicas[0]
    scrape(r, 1.0)
    p.commit(r, req(prompt=400, out=300, stream=False), 0, 1.0)
    scrape(r, 1.2, running=1, kv_usage=0.004)
    assert r.placed_since_scrape_requests == 0 and r.engine_queue() == 0


# ---- the in-flight term: each sequence counts, however little KV it holds ----------------------------------
@pytest.mark.parametrize("scrape_after", [4, 7, 10])
def test_equal_requests_spread_when_a_scrape_lands_mid_burst(scrape_after: int):
    """Twelve equal requests over three equal replicas, one replica scraped mid-burst: the engine shows its
    requests' prompts only (their outputs are still to come), while the others count full footprints placed since
    their scrapes. By KV alone the scraped replica looked emptier and took a fifth request ([3, 4, 5] in a CI run
    of the e2e spread test); counting the requests in flight against the sequences a replica may run keeps 4 each."""
    p = placer(n=3, kv_capacity_tokens=65_536)
    for r in p.pool.replicas:
        scrape(r, 0.5, kv_block_tokens=128)
    for i in range(12):
        now = 1.0 + 0.01 * i
        if i == scrape_after:
            first = p.pool.replicas[0]
            n = first.inflight_requests
            scrape(first, now, running=n, kv_usage=n * 256 / 65_536, kv_block_tokens=128)
        q = req(prompt=190, out=400)
        pins = p.choose(q, 0, now)
        p.commit(pins[0], q, 0, now)
    assert [r.inflight_requests for r in p.pool.replicas] == [4, 4, 4]


def test_the_kv_score_does_not_depend_on_when_each_replica_was_scraped():
    # two replicas with the same three long streams: one scraped after they started (its report shows their prompts
    # only), one not yet. The score's KV term counts what each will hold, so both score alike; counting only what
    # the report shows made the freshly scraped one look emptier by three outputs, and a burst piled onto it.
    p = placer(n=2, kv_capacity_tokens=65_536)
    read, unread = p.pool.replicas
    for r in (read, unread):
        r.max_num_seqs = 64
        scrape(r, 0.01)
        for _ in range(3):
            p.commit(r, req(prompt=200, out=1500), 0, 0.02)
    scrape(read, 0.5, kv_usage=3 * 200 / 65_536, running=3)
    new = req(prompt=200, out=1500)
    one_request = p.policy.score_inflight_weight / 64  # what one more request in flight adds to a score
    assert abs(p.score(read, new, 0.5) - p.score(unread, new, 0.5)) < one_request / 2


def test_a_request_caught_waiting_while_the_engine_has_room_is_not_a_queue_place():
    p = placer(n=1, kv_capacity_tokens=65_536)
    r = p.pool.replicas[0]
    for _ in range(3):
        p.commit(r, req(prompt=200, out=100), 0, 0.0)
    # the page caught the third between its arrival and the engine's next step: slots and KV free
    scrape(r, 0.1, kv_usage=0.01, running=2, waiting=1)
    assert p.queue_ahead(r) == 0
    # at its sequence cap the engine cannot start it: a new request queues behind it
    r.max_num_seqs = 2
    assert p.queue_ahead(r) == 1
    # nor when its KV is full, whatever the slots
    r.max_num_seqs = 64
    scrape(r, 0.2, kv_usage=0.95, running=2, waiting=1)
    assert p.queue_ahead(r) == 1
