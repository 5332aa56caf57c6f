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
