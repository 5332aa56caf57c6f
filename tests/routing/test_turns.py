"""Several gateways between two shared views (routing/turns.py): each fills only its share of a replica's headroom,
the places that do not divide go to one sidecar at a time, and together they never fill more than the view left
(PG: two gateways took a replica's last place in the same interval and the engine preempted)."""

from __future__ import annotations

import pytest

from extproc.admission.placement import KV_SHARE, Placer
from extproc.admission.queue import Waiter
from extproc.admission.scheduler import Placement, Scheduler
from extproc.routing.turns import TURN_INTERVALS, TURN_WAIT_INTERVALS, Turns
from tests.admission.test_kv_committed import req as kv_req, scheduler
from tests.admission.test_kv_growth import burst, long_pool, share

IDS = ("a", "b", "c")
INTERVAL_S = 0.1
PERIOD_MS = TURN_INTERVALS * INTERVAL_S * 1000


def turns_of(ids: tuple[str, ...] = IDS, view_ms: float = 10 * PERIOD_MS + 200, pool: str = "m") -> list[Turns]:
    """One Turns per sidecar, all with a view read at `view_ms` on Redis' clock (arriving at monotonic 0) in which
    every sidecar has requests in flight in `pool`."""
    out = []
    for me in ids:
        t = Turns(me, INTERVAL_S)
        t.update(view_ms, {pool: set(ids) - {me}}, mono=0.0)
        out.append(t)
    return out


def test_alone_or_without_a_view_a_sidecar_may_fill_the_whole_headroom():
    t = Turns("a", INTERVAL_S)
    assert t.gateways("m") == 1 and t.allowance("m", 0, 1000.0, 400.0, 0.0) == 1000.0
    t.update(5000.0, {"m": set()}, mono=0.0)  # peers without requests in flight in the pool do not count
    assert t.gateways("m") == 1
    t.update(5000.0, {"m": {"b"}}, mono=0.0)
    assert t.gateways("m") == 2 and t.gateways("other") == 1
    t.clear()                                   # Redis lost
    assert t.gateways("m") == 1 and t.allowance("m", 0, 1000.0, 400.0, 0.0) == 1000.0


@pytest.mark.parametrize("replica", [0, 1, 2, 7])
def test_one_sidecar_holds_a_replicas_turn_and_the_allowances_add_up_to_whole_places(replica):
    ts = turns_of()
    holders = [t.sidecar_id for t in ts if t.holds_turn("m", replica, 0.0)]
    assert len(holders) == 1
    f = 1100.0
    for places, expected in ((1, [1, 0, 0]), (4, [2, 1, 1]), (9, [3, 3, 3]), (10, [4, 3, 3])):
        headroom = places * f + 7.0  # a few tokens over whole places
        taken = sorted((int(t.allowance("m", replica, headroom, f, 0.0) // f) for t in ts), reverse=True)
        assert taken == expected and sum(taken) == places

def test_what_the_kv_margin_holds_from_every_other_sidecar_is_free_to_take():
    """A short request near a full replica: three gateways may each place 550 tokens of an 11,000-token replica's
    10 % margin between two views (the margin holds 2 x 550 from the other two); a long one is not free."""
    ts = turns_of(view_ms=21 * PERIOD_MS)  # early in a period: nobody holds the turn yet
    margin = 1100.0
    assert all(t.allowance("m", 0, 500.0, 332.0, 0.0, margin) == 550.0 for t in ts)
    assert all(t.allowance("m", 0, 500.0, 1100.0, 0.0, margin) < 1100.0 for t in ts)
    assert all(t.allowance("m", 0, 3300.0, 332.0, 0.0, margin) == 1100.0 for t in ts)  # the share is more


def test_the_turn_moves_with_the_period_and_every_sidecar_holds_some_replica():
    replicas = [0, 1, 2]
    seen: dict[int, set[str]] = {r: set() for r in replicas}
    for period in range(10, 16):
        ts = turns_of(view_ms=period * PERIOD_MS + TURN_WAIT_INTERVALS * INTERVAL_S * 1000)
        for r in replicas:
            holders = [t.sidecar_id for t in ts if t.holds_turn("m", r, 0.0)]
            assert len(holders) == 1
            seen[r].add(holders[0])
        held = {t.sidecar_id for t in ts for r in replicas if t.holds_turn("m", r, 0.0)}
        assert held == set(IDS)  # 3 sidecars, 3 replicas: each holds one replica's turn in each period
    assert all(s == set(IDS) for s in seen.values())


def test_a_new_holder_waits_until_its_view_can_show_the_previous_holders_last_placements():
    r = 0
    start = 20 * PERIOD_MS
    early = turns_of(view_ms=start + 0.5 * INTERVAL_S * 1000)    # read 50 ms into the period
    assert not any(t.holds_turn("m", r, 0.0) for t in early)
    assert all(t.allowance("m", r, 1100.0, 1100.0, 0.0) < 1100.0 for t in early)  # nobody takes the last place
    ready = turns_of(view_ms=start + TURN_WAIT_INTERVALS * INTERVAL_S * 1000)
    assert sum(t.holds_turn("m", r, 0.0) for t in ready) == 1
    # the period's end on the local clock since that view: the turn is gone until a fresh view of the next one
    assert not any(t.holds_turn("m", r, PERIOD_MS / 1000) for t in ready)


def burst_between_views(placers: list[Placer], turns: list[Turns] | None, n: int = 75) -> list[int]:
    """`n` long generations arriving round robin over three sidecars within 0.3 s (test_kv_growth's `burst`), each
    sidecar's shared view refreshed every INTERVAL_S (as shared_load.py does), not before each placement."""
    for p, t in zip(placers, turns or ()):
        p.turns = t
    views: list[int] = []

    def refresh(now: float) -> None:
        interval = int(now / INTERVAL_S)
        if views and views[-1] == interval:
            return
        views.append(interval)
        share(placers, now)
        for t in turns or ():
            t.update(now * 1000, {"m": set(IDS) - {t.sidecar_id}}, mono=now)

    return burst(placers, n, shared=False, on_arrival=refresh)


def test_between_two_views_three_gateways_fill_no_more_than_the_replicas_kv_holds():
    """PG's race: 3 gateways, 3 replicas whose KV holds 9 long generations each within the margin. With views
    0.1 s apart and no share, the gateways together place more than that (the engines preempt); with the shares
    and turns they fill the pool to its 27 places and not one more."""
    blind = burst_between_views(long_pool(3), None)
    assert sum(blind) > 27
    placed = burst_between_views(long_pool(3), turns_of())
    assert max(placed) <= 9 and sum(placed) == 27


def one_place_left(holder: bool) -> tuple[Scheduler, Turns]:
    """A scheduler whose one replica has room for one more long generation (8 of 9 placed), as one of three
    gateways placing in the pool: the one holding the replica's turn or not."""
    s = scheduler()
    for _ in range(8):
        assert isinstance(s.submit(kv_req(), 1.0), Placement)
    view_ms = 30 * PERIOD_MS + 200  # period 30: sidecar index 30 % 3 = 0 holds rank 0's turn
    me = IDS[0] if holder else IDS[1]
    t = Turns(me, INTERVAL_S)
    t.update(view_ms, {"m": set(IDS) - {me}}, mono=1.0)
    s.placer.turns = t
    s.pool.replicas[0].note_shared(0, 0)  # a new view: nothing placed since
    return s, t


def test_a_gateway_without_the_turn_leaves_the_last_place_and_says_why():
    s, _ = one_place_left(holder=False)
    r = s.pool.replicas[0]
    assert s.placer.why_not(r, kv_req(), 0, 1.0, 5.0) == KV_SHARE
    held, _ = one_place_left(holder=True)
    assert held.placer.why_not(held.pool.replicas[0], kv_req(), 0, 1.0, 5.0) is None
    s.placer.turns = None  # alone: the place is its own
    assert s.placer.why_not(r, kv_req(), 0, 1.0, 5.0) is None


async def test_a_short_request_goes_before_a_long_one_waiting_for_its_turn():
    """EASY backfilling over a head that waits for the gateway's turn, not for KV: a short chat that ends within
    the longest wait for the turn goes first; the head waits, queued, for the turn."""
    s, t = one_place_left(holder=False)
    head = s.submit(kv_req(), 1.0)
    assert isinstance(head, Waiter)
    assert s.kv_held_until[head.lane] == pytest.approx(1.0 + t.turn_wait_s("m"))
    assert isinstance(s.submit(kv_req(prompt=300, out=32), 1.0), Placement)
