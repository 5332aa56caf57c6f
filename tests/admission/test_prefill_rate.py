"""Prefill speed learned from saturated engines (P1): measurements, lower bounds, median, relaxation."""

from extproc.admission.prefill_rate import BOUND, PrefillRate
from extproc.routing.pool import DEGRADED, Replica
from extproc.routing.scrape import ScrapedState


def replicas(n: int = 3) -> list[Replica]:
    return [Replica(address=f"10.0.0.{i}:8000", pool="m") for i in range(n)]


def scrape(rs: list[Replica], at: float, total: float, waiting: int) -> None:
    for r in rs:
        r.on_scrape(ScrapedState(scraped_at=at, waiting=waiting, prompt_tokens_total=total))


def test_saturated_interval_measures_the_engine_speed():
    rs, pr = replicas(), PrefillRate(10_000)
    scrape(rs, 1.0, 0, waiting=3)
    assert pr.update(rs, 1.0) == 10_000  # nothing measured yet: the configured speed
    scrape(rs, 1.2, 5_000, waiting=2)  # 25,000/s: averaged in, at most x1.5 per scrape
    assert abs(pr.update(rs, 1.2) - 15_000) < 1
    scrape(rs, 1.4, 10_000, waiting=2)
    assert abs(pr.update(rs, 1.4) - 20_000) < 50  # (the previous value relaxed a little meanwhile)


def test_unsaturated_intervals_are_ignored():
    rs, pr = replicas(), PrefillRate(10_000)
    scrape(rs, 1.0, 0, waiting=0)
    pr.update(rs, 1.0)
    scrape(rs, 1.2, 400, waiting=0)  # only the work sent: says nothing about what could be done
    assert pr.update(rs, 1.2) == 10_000


def test_probes_upwards_while_the_engine_keeps_up_without_a_queue():
    rs, pr = replicas(), PrefillRate(10_000)
    scrape(rs, 1.0, 0, waiting=0)
    pr.update(rs, 1.0)
    scrape(rs, 1.2, 1_900, waiting=0)  # 9,500/s: the engine took all the gate allowed and queued nothing
    assert abs(pr.update(rs, 1.2) - 11_500) < 1


def test_a_drained_interval_only_raises_the_estimate():
    rs, pr = replicas(), PrefillRate(10_000)
    scrape(rs, 1.0, 0, waiting=2)
    pr.update(rs, 1.0)
    scrape(rs, 1.2, 1_000, waiting=0)  # 5,000/s: a lower bound below the configured speed
    assert pr.update(rs, 1.2) == 10_000
    scrape(rs, 1.4, 1_000, waiting=2)
    pr.update(rs, 1.4)
    scrape(rs, 1.6, 4_000, waiting=0)  # 15,000/s at least
    assert abs(pr.update(rs, 1.6) - 15_000) < 1


def test_slowest_healthy_replica_sets_the_pace_within_bounds():
    rs, pr = replicas(), PrefillRate(10_000)
    scrape(rs, 1.0, 0, waiting=2)
    pr.update(rs, 1.0)
    rs[0].on_scrape(ScrapedState(scraped_at=1.2, waiting=2, prompt_tokens_total=1e9))  # a bogus counter
    rs[1].on_scrape(ScrapedState(scraped_at=1.2, waiting=2, prompt_tokens_total=3_000))
    rs[2].on_scrape(ScrapedState(scraped_at=1.2, waiting=2, prompt_tokens_total=100))
    rs[2].state = DEGRADED  # a sick replica's speed is health's business
    assert abs(pr.update(rs, 1.2) - 12_500) < 1  # 15,000/s averaged in; the bogus one rose at most x1.5
    for k in range(2, 12):
        for r, total in ((rs[0], 1e9 * k), (rs[1], 3_000 * k)):
            r.on_scrape(ScrapedState(scraped_at=1.0 + 0.2 * k, waiting=2, prompt_tokens_total=total))
        pr.update(rs, 1.0 + 0.2 * k)
    assert pr.seen[rs[0].address].rate > BOUND * 10_000
    assert pr._relaxed(pr.seen[rs[0].address], 3.2) <= BOUND * 10_000


def test_a_larger_lane_in_flight_than_when_measured_falls_back_to_the_configured_speed():
    rs, pr = replicas(), PrefillRate(10_000)
    for r in rs:
        r.lane_inflight = [0, 1, 0]
    scrape(rs, 1.0, 0, waiting=2)
    pr.update(rs, 1.0)
    scrape(rs, 1.2, 5_000, waiting=2)
    assert pr.update(rs, 1.2) > 10_000
    rs[1].lane_inflight = [0, 1, 1]  # a long prompt now runs on one replica
    assert pr.update(rs, 1.2) == 10_000


def test_a_lane_keeps_the_speed_measured_with_it_in_flight_after_smaller_ones_are_measured():
    """Real PX on the engines: a speed measured with a long prompt in flight, then a higher one among smaller prompts,
    and the next long prompt put the pool back at the configured 10,000 for seconds (against the engines' ~25,000:
    the gate shed cold prompts the engines would have served in time). The replica keeps what it showed with the
    long lane in flight, relaxed as its own."""
    rs, pr = replicas(1), PrefillRate(10_000)
    rs[0].lane_inflight = [0, 0, 1]
    finished(rs, 1.0, 0.0, 0, 0)
    pr.update(rs, 1.0)
    finished(rs, 1.2, 0.25, 1, 3_500)  # 14,000/s with the long prompt in flight
    assert abs(pr.update(rs, 1.2) - 14_000) < 1
    rs[0].lane_inflight = [0, 1, 0]
    finished(rs, 1.4, 0.25, 1, 3_500)  # nothing finished: the long prompt's interval is over
    pr.update(rs, 1.4)
    finished(rs, 1.6, 0.45, 2, 7_500)  # 20,000/s among normal prompts
    assert abs(pr.update(rs, 1.6) - 20_000) < 1
    rs[0].lane_inflight = [0, 1, 1]  # the next long prompt: its lane's speed, not the configured one
    assert 13_900 < pr.update(rs, 1.6) < 14_000


def test_a_larger_lane_falls_back_to_a_peer_measured_with_it_in_flight():
    """The pool's replicas run on like hardware: a replica that now runs its first long prompt is paced by the
    speed its peer showed with one in flight, when that is slower than its own, not by the configured speed."""
    rs, pr = replicas(2), PrefillRate(10_000)
    rs[0].lane_inflight, rs[1].lane_inflight = [0, 0, 1], [0, 1, 0]
    scrape(rs, 1.0, 0, waiting=2)
    pr.update(rs, 1.0)
    rs[0].on_scrape(ScrapedState(scraped_at=1.2, waiting=2, prompt_tokens_total=4_000))  # 20,000/s: 15,000
    rs[1].on_scrape(ScrapedState(scraped_at=1.2, waiting=2, prompt_tokens_total=5_000))  # 25,000/s: 15,000
    pr.update(rs, 1.2)
    rs[0].on_scrape(ScrapedState(scraped_at=1.4, waiting=2, prompt_tokens_total=6_000))  # 10,000/s: 12,500
    rs[1].on_scrape(ScrapedState(scraped_at=1.4, waiting=2, prompt_tokens_total=10_000))  # 25,000/s: 20,000
    pr.update(rs, 1.4)
    rs[1].lane_inflight = [0, 1, 1]  # replica 1's first long prompt: replica 0's speed with one, the slower
    assert 12_000 < pr.update(rs, 1.4) < 12_500


def test_a_sick_or_departed_peer_paces_no_lane():
    """Only the replicas that pace the pool (healthy at full weight, not outliers) lend their speed to a peer
    running a lane for the first time: a degraded replica's speed is health's business, a departed one's is gone."""
    rs, pr = replicas(3), PrefillRate(10_000)
    rs[0].lane_inflight, rs[1].lane_inflight, rs[2].lane_inflight = [0, 0, 1], [0, 1, 0], [0, 0, 1]
    scrape(rs, 1.0, 0, waiting=2)
    pr.update(rs, 1.0)
    for at, totals in ((1.2, (3_000, 5_000, 4_000)), (1.4, (5_000, 10_000, 8_000))):
        for r, total in zip(rs, totals):  # replica 0 at 10,000-15,000/s, 1 at 25,000, 2 at 20,000: learned
            r.on_scrape(ScrapedState(scraped_at=at, waiting=2, prompt_tokens_total=total))
        pr.update(rs, at)
    slow, fast = pr._relaxed(pr.seen[rs[0].address], 1.4), pr._relaxed(pr.seen[rs[2].address], 1.4)
    assert slow < fast
    rs[1].lane_inflight = [0, 1, 1]  # replica 1's first long prompt: the slowest peer measured with one paces it
    assert abs(pr.update(rs, 1.4) - slow) < 1
    rs[0].state = DEGRADED
    assert abs(pr.update(rs, 1.4) - fast) < 1
    rs[0].state = rs[2].state
    assert abs(pr.update(rs[1:], 1.4) - fast) < 1  # replica 0 left the pool


def test_a_measurement_speaks_for_the_lanes_in_flight_when_its_interval_opened():
    """A finished request's prefill time is read after it left: the scrape that reports it may find nothing in
    flight, yet the speed was measured with that request's lane running."""
    rs, pr = replicas(1), PrefillRate(10_000)
    rs[0].lane_inflight = [0, 0, 1]
    finished(rs, 1.0, 0.0, 0, 0)
    pr.update(rs, 1.0)
    rs[0].lane_inflight = [0, 0, 0]
    finished(rs, 1.2, 0.2, 1, 3_000)  # the long prompt finished: 15,000/s at least
    assert pr.update(rs, 1.2) == 15_000
    rs[0].lane_inflight = [0, 0, 1]  # the next long prompt: the speed measured with one in flight holds
    assert pr.update(rs, 1.2) == 15_000


def test_relaxes_back_to_the_configured_speed():
    rs, pr = replicas(), PrefillRate(10_000)
    scrape(rs, 1.0, 0, waiting=2)
    pr.update(rs, 1.0)
    scrape(rs, 1.2, 6_000, waiting=2)
    assert pr.update(rs, 1.2) >= 15_000
    assert pr.update(rs, 301.2) < 10_100


def test_the_speed_is_measured_in_prefill_work_of_the_prompts_in_flight():
    """The engine counts tokens; the placer charges work (placement.py `prefill_work`). A saturated interval's tokens
    are converted by the work per token of this sidecar's requests in flight there, so the speed holds for every
    prompt size: 5,000 tokens in 0.2 s of 2,000-token prompts whose work is 1.5x their tokens is 37,500 work/s."""
    rs, pr = replicas(), PrefillRate(10_000)
    for r in rs:
        r.place(2_100, 2_000)
        r.inflight_prefill_new, r.inflight_prefill_work = 2_000.0, 3_000.0
    scrape(rs, 1.0, 0, waiting=2)
    pr.update(rs, 1.0)
    scrape(rs, 1.2, 5_000, waiting=2)
    assert pr.update(rs, 1.2) == min(10_000 * 1.5, 0.5 * 10_000 + 0.5 * 25_000 * 1.5)  # MAX_STEP caps a scrape
    for r in rs:  # heavy prompts now: their work is in the charge, the speed stays
        r.release(2_100, 2_000)
        r.place(25_100, 25_000)
    assert pr.update(rs, 1.2) == 15_000


def test_nothing_is_measured_while_a_long_prompt_is_in_flight():
    rs, pr = replicas(), PrefillRate(10_000, long_lane=2)
    for r in rs:
        r.lane_inflight = [0, 1, 1]
    scrape(rs, 1.0, 0, waiting=2)
    pr.update(rs, 1.0)
    scrape(rs, 1.2, 25_000, waiting=2)  # a 25,000-token prompt's prefill ended: one lump, not a speed
    assert pr.update(rs, 1.2) == 10_000
    for r in rs:
        r.lane_inflight = [0, 1, 0]  # it left before the next scrape: its lump is still in this interval
    scrape(rs, 1.4, 50_000, waiting=2)
    assert pr.update(rs, 1.4) == 10_000


def test_a_replica_back_from_an_outage_keeps_its_learned_speed():
    """P6: the engine that comes back runs on the same hardware. Forgetting its speed put the gate back at the
    configured 10,000 tokens/s against ~25,000 real while the outage's backlog waited. While every replica
    recovers, their speeds set the pool's; a sick (DEGRADED) replica is not measured."""
    from extproc.routing.pool import EJECTED, HEALTHY, RECOVERING

    rs, pr = replicas(), PrefillRate(10_000)
    scrape(rs, 1.0, 0, waiting=3)
    pr.update(rs, 1.0)
    scrape(rs, 1.2, 5_000, waiting=2)
    learned = pr.update(rs, 1.2)
    assert learned > 14_000
    for r in rs:
        r.state = EJECTED
    assert pr.update(rs, 1.3) == 10_000  # nothing serves: the configured speed (placement refuses anyway)
    for r in rs:
        r.state, r.weight = RECOVERING, 0.1
    assert abs(pr.update(rs, 1.4) - learned) < 200  # relaxed a little over 0.2 s, not forgotten
    for r in rs:
        r.state, r.weight = HEALTHY, 1.0
    assert abs(pr.update(rs, 1.5) - learned) < 300
    rs[0].state = DEGRADED
    scrape(rs, 1.7, 5_100, waiting=2)    # 500 tokens/s: the sick replica's measurement is not taken
    pr.update(rs, 1.7)
    assert pr.seen[rs[0].address].rate > 14_000


def test_a_replica_far_slower_than_its_healthy_peers_does_not_pace_the_pool():
    rs, pr = replicas(), PrefillRate(10_000)
    scrape(rs, 1.0, 0, waiting=3)
    pr.update(rs, 1.0)
    for k in range(1, 6):  # two engines prefill 15,000/s, one (half-dead, still HEALTHY) 750/s
        for r, speed in zip(rs, (15_000, 15_000, 750)):
            r.on_scrape(ScrapedState(scraped_at=1.0 + 0.2 * k, waiting=3, prompt_tokens_total=speed * 0.2 * k))
        pace = pr.update(rs, 1.0 + 0.2 * k)
    assert pr._relaxed(pr.seen[rs[2].address], 2.0) < 3_000       # it did learn the sick engine's speed
    assert pace > 14_000                                           # the pool goes at its healthy replicas' pace
    for k in range(1, 8):                                          # all slow together: that is the pool's pace
        for r, total in ((rs[0], 15_000 + 150 * k), (rs[1], 15_000 + 150 * k), (rs[2], 750 + 150 * k)):
            r.on_scrape(ScrapedState(scraped_at=2.0 + 0.2 * k, waiting=3, prompt_tokens_total=total))
        pace = pr.update(rs, 2.0 + 0.2 * k)
    assert pace < 3_000


def finished(rs: list[Replica], at: float, seconds: float, n: float, computed: float) -> None:
    """A scrape where the engines report finished requests' prefill sums and nothing queues (prompt counter flat)."""
    for r in rs:
        r.on_scrape(ScrapedState(scraped_at=at, waiting=0, prompt_tokens_total=0.0,
                                 prefill_seconds_total=seconds, prefilled_requests_total=n,
                                 prefill_computed_total=computed))


def test_finished_requests_prefill_times_raise_the_speed_without_any_queue():
    """Light load (real P7, PX): no engine ever queues, so no interval measures the engine. The requests it finished
    say how fast their own prefills went: 4 prompts of 3,000 computed tokens in 0.8 prefill seconds is at least
    4 x work(3,000) / 0.8 = 15,000 tokens/s with work linear (knee 0), and more with the attention term."""
    rs, pr = replicas(), PrefillRate(10_000)
    finished(rs, 1.0, 0.0, 0, 0)
    assert pr.update(rs, 1.0) == 10_000  # nothing finished yet
    finished(rs, 1.2, 0.8, 4, 12_000)
    assert abs(pr.update(rs, 1.2) - 15_000) < 1
    knee = PrefillRate(10_000, work=lambda n: n * (2_048 + n) / (2_048 + 1_024))
    finished(rs, 1.4, 0.8, 4, 12_000)
    knee.update(rs, 1.4)
    finished(rs, 1.6, 1.6, 8, 24_000)  # the same 4 requests again: 4 x 3,000 x 5,048 / 3,072 / 0.8 = 24,648/s,
    assert knee.update(rs, 1.6) == 15_000  # capped at x1.5 per scrape


def test_finished_requests_only_raise_the_speed_and_a_restart_measures_nothing():
    rs, pr = replicas(), PrefillRate(10_000)
    finished(rs, 1.0, 0.0, 0, 0)
    pr.update(rs, 1.0)
    finished(rs, 1.2, 2.0, 4, 12_000)  # 6,000/s: slower than assumed, but only a lower bound
    assert pr.update(rs, 1.2) == 10_000
    finished(rs, 1.4, 0.1, 1, 2_000)  # the counters went down (the engine restarted): no measurement
    assert pr.update(rs, 1.4) == 10_000
    finished(rs, 1.6, 0.2, 2, 4_000)  # measured from the restarted counters: 2 x 2,000 / 0.1 s
    assert pr.update(rs, 1.6) == 15_000


def test_finished_requests_hold_a_saturated_measurement_above_their_bound():
    rs, pr = replicas(), PrefillRate(10_000)
    for r in rs:
        r.on_scrape(ScrapedState(scraped_at=1.0, waiting=3, prompt_tokens_total=0.0, prefill_seconds_total=0.0,
                                 prefilled_requests_total=0.0, prefill_computed_total=0.0))
    pr.update(rs, 1.0)
    for r in rs:  # saturated at 2,500/s (averaged in: 6,250), while the finished requests ran at 9,000/s at least
        r.on_scrape(ScrapedState(scraped_at=1.2, waiting=3, prompt_tokens_total=500.0, prefill_seconds_total=0.5,
                                 prefilled_requests_total=3.0, prefill_computed_total=4_500.0))
    assert pr.update(rs, 1.2) == 9_000
