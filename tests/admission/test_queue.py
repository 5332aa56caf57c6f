"""Fair queue: strict priority, token-weighted fair share across tenants, removal."""

from extproc.admission.queue import FairQueue, VirtualClock, Waiter, work_ahead
from extproc.request import LLMRequest


def waiter(tenant: str, tokens: int = 100, prio: int = 0, t: float = 0.0) -> Waiter:
    req = LLMRequest(request_id="", endpoint="chat", model="m", stream=False, prompt_tokens=tokens,
                     max_output_tokens=0 or 1, tenant=tenant)
    return Waiter(req=req, lane=0, priority=prio, tenant=tenant, deadline=99.0, enqueued=t)


def drain(q: FairQueue, n: int) -> list[str]:
    out = []
    for _ in range(n):
        w = q.peek()
        assert w is not None
        q.pop(w)
        out.append(w.tenant)
    return out


def test_flooding_tenant_does_not_starve_quiet_one():
    q = FairQueue(3, {})
    for i in range(50):
        q.push(waiter("flood", t=i))
    for i in range(5):
        q.push(waiter("quiet", t=100 + i))
    first_ten = drain(q, 10)
    assert first_ten.count("quiet") == 5  # alternates while both are backlogged


def test_weights_give_proportional_share():
    q = FairQueue(3, {"gold": 3.0})
    for i in range(40):
        q.push(waiter("gold", t=i))
        q.push(waiter("bronze", t=i))
    first = drain(q, 20)
    assert first.count("gold") == 15 and first.count("bronze") == 5


def test_token_weighted_not_request_weighted():
    q = FairQueue(3, {})
    for i in range(20):
        q.push(waiter("heavy", tokens=1000, t=i))
        q.push(waiter("light", tokens=100, t=i))
    first = drain(q, 11)
    assert first.count("light") >= 9  # ten light requests cost what one heavy one does


def test_priority_is_strict():
    q = FairQueue(3, {})
    q.push(waiter("a", prio=2))
    q.push(waiter("b", prio=1))
    q.push(waiter("c", prio=0))
    assert drain(q, 3) == ["c", "b", "a"]


def test_idle_tenant_earns_no_credit():
    q = FairQueue(3, {})
    for i in range(10):
        q.push(waiter("busy", t=i))
    drain(q, 10)
    # "late" was idle all along; it re-enters at the virtual clock, not at zero
    for i in range(5):
        q.push(waiter("late", t=20 + i))
        q.push(waiter("busy", t=20 + i))
    first = drain(q, 4)
    # without the virtual clock "late" (counter 0) would take all four; with it, it gets its fair turn
    assert first.count("late") in (2, 3)


def test_remove_and_evict():
    q = FairQueue(3, {})
    a, b, c = waiter("a", prio=0), waiter("b", prio=2, t=1), waiter("c", prio=2, t=2)
    for w in (a, b, c):
        q.push(w)
    assert q.lowest_priority_newest(below=0) is c
    assert q.remove(b) and not q.remove(b)
    assert len(q) == 2
    assert q.lowest_priority_newest(below=2) is None


def test_ahead_of_counts_the_fair_share_not_the_whole_backlog():
    q = FairQueue(2, {})
    for i in range(50):
        q.push(waiter("flood", t=i))
    assert q.ahead_of("quiet", 0) == 1  # one flood request per quiet one: not behind all 50
    assert q.ahead_of("flood", 0) == 50
    q.push(waiter("quiet", t=60))
    assert q.ahead_of("quiet", 0) == 1 + 2
    assert q.ahead_of("quiet", 1) == 51  # a lower priority waits behind every higher one


def test_work_ahead_follows_the_virtual_start_tags_and_matches_the_dispatch_order():
    """What work_ahead counts ahead of a new request is what the queue dispatches before it: start-time fair
    queueing by virtual start tags (each request here charges 101 tokens)."""
    q = FairQueue(2, {})
    for i in range(20):
        q.push(waiter("flood", t=i))
    assert drain(q, 6) == ["flood"] * 6  # served alone: the clock follows it (505), its next tag is 606
    q.push(waiter("quiet", t=30))  # enters at the clock: tags 505, 606
    q.push(waiter("quiet", t=31))
    # a third quiet request would start at 707: its own two, and the flood's 606 and 707, go first
    assert q.work_ahead("quiet", 0) == (4, 400)
    q.push(waiter("quiet", t=32))
    assert drain(q, 5) == ["quiet", "flood", "quiet", "flood", "quiet"]
    # weights: a tenant of weight 3 advances a third as fast, so more of its requests go ahead of a new one
    g = FairQueue(2, {"gold": 3.0})
    for i in range(10):
        g.push(waiter("gold", t=i))
    assert g.work_ahead("plain", 0) == (1, 100)
    g.push(waiter("plain", t=20))
    assert g.work_ahead("plain", 0) == (1 + 4, 500)  # gold's tags 0, 33.7, 67.3, 101: four at or before 101
    assert drain(g, 5).count("gold") == 4


def test_work_ahead_across_queues_sharing_a_virtual_clock_counts_a_tenant_once():
    """The lanes sharing the pool are one fair order: a flood split over two of them is one sequence of start tags,
    so a quiet request waits behind one flood request, not one per lane."""
    shared = VirtualClock()
    short, normal = FairQueue(2, {}, shared), FairQueue(2, {}, shared)
    for i in range(3):
        short.push(waiter("flood", t=2 * i))
        normal.push(waiter("flood", t=2 * i + 1))
    assert work_ahead([short, normal], "quiet", 0) == (1, 100)
    assert short.work_ahead("quiet", 0) == normal.work_ahead("quiet", 0) == (1, 100)
    assert work_ahead([short, normal], "flood", 0) == (6, 600)
