"""Requests carried across a scrape because the engine did not show them (Replica.on_scrape) leave the
since-scrape counters as earlier requests end, so the replica's count stays what is really there."""

from extproc.routing.pool import EngineState, Replica


def _replica_with(n: int) -> Replica:
    r = Replica(address="r:1", pool="p")
    for _ in range(n):
        r.place(1000, 800)
    return r


def test_a_scrape_carries_the_requests_the_engine_does_not_show():
    r = _replica_with(3)
    epoch = r.scrape_epoch
    r.on_scrape(EngineState(running=1, waiting=0))
    assert (r.unseen_requests, r.placed_since_scrape_requests) == (2, 2)
    assert r.placed_since_scrape_tokens == 2000 and r.placed_since_scrape_prompt_tokens == 1600
    assert r.engine_queue() == 2
    assert epoch != r.scrape_epoch


def test_requests_placed_before_the_scrape_that_end_leave_the_carry():
    """The simulator counts a request on arrival: the two it did not show had ended there, their releases still on
    their way. As they arrive the carry goes; it never goes below zero, and the third release changes nothing."""
    r = _replica_with(3)
    epoch = r.scrape_epoch
    r.on_scrape(EngineState(running=1, waiting=0))
    r.release(1000, 800, epoch)
    assert (r.unseen_requests, r.placed_since_scrape_requests, r.placed_since_scrape_tokens) == (1, 1, 1000)
    r.release(1000, 800, epoch)
    assert (r.unseen_requests, r.placed_since_scrape_requests, r.placed_since_scrape_tokens) == (0, 0, 0)
    r.release(1000, 800, epoch)
    assert (r.unseen_requests, r.placed_since_scrape_requests, r.placed_since_scrape_tokens) == (0, 0, 0)
    assert r.inflight_requests == 0 and r.placed_since_scrape_prompt_tokens == 0


def test_a_request_placed_after_the_scrape_leaves_only_its_own_count():
    r = _replica_with(2)
    r.on_scrape(EngineState(running=1, waiting=0))
    r.place(500, 100)
    r.release(500, 100, r.scrape_epoch)
    assert (r.unseen_requests, r.placed_since_scrape_requests, r.placed_since_scrape_tokens) == (1, 1, 1000)


def test_requests_placed_while_the_scrape_was_on_its_way_are_new_placements_not_a_queue():
    """The page was asked for before the third request was placed: the engine ran the two before it, and the third
    counts as placed since the scrape (its footprint, its count), not as a request the engine is slow to take in."""
    r = _replica_with(2)
    r.scrape_sent()
    r.place(1000, 800)
    during = r.scrape_epoch
    r.on_scrape(EngineState(running=2, waiting=0))
    assert (r.unseen_requests, r.engine_queue()) == (0, 0)
    assert (r.placed_since_scrape_requests, r.placed_since_scrape_tokens, r.placed_since_scrape_prompt_tokens) == \
        (1, 1000, 800)
    # it leaves the since-scrape counters when it ends (placed in the epoch the scrape was sent in)
    r.release(1000, 800, during)
    assert (r.placed_since_scrape_requests, r.placed_since_scrape_tokens, r.inflight_requests) == (0, 0, 2)


def test_a_request_placed_and_ended_while_the_scrape_was_on_its_way_is_not_counted_after_it():
    r = _replica_with(1)
    r.scrape_sent()
    r.place(1000, 800)
    r.release(1000, 800, r.scrape_epoch)
    r.on_scrape(EngineState(running=1, waiting=0))
    assert (r.placed_since_scrape_requests, r.placed_since_scrape_tokens, r.unseen_requests) == (0, 0, 0)


def test_a_failed_scrape_keeps_the_since_scrape_counters_of_the_last_good_one():
    r = _replica_with(0)
    r.on_scrape(EngineState(running=0, waiting=0))
    r.place(1000, 800)
    placed = r.scrape_epoch
    r.scrape_sent()  # this scrape fails: no on_scrape follows
    r.release(1000, 800, placed)
    assert (r.placed_since_scrape_requests, r.placed_since_scrape_tokens) == (0, 0)
