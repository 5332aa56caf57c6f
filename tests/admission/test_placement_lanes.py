"""Placement of a confined lane (long prompts): its share of replicas counts prefills, not requests held (P3, P7)."""

from extproc.admission.placement import LANE, LANE_ACTIVE_S
from extproc.request import LLMRequest

from .placing import place, placer

LONG, SHORT = 2, 0  # lane indices of the default lanes (short <= 1,024 < normal <= 8,192 < long, share 0.5)


def req(prompt: int, out: int = 16) -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=prompt,
                      max_output_tokens=out)


def test_a_long_prompt_waits_rather_than_stack_behind_a_long_prefill():
    p = placer()
    p.note_lane(SHORT, 0.0)  # short requests come too: the confinement protects them
    a = place(p, req(10_000), LONG, 0.0)
    b = place(p, req(10_000), LONG, 0.0)
    assert a is not b
    # half of the 4 replicas are prefilling a long prompt: the third waits in the queue (the old rule stacked it
    # on a or b, so the same half of the pool ended up holding every long context)
    assert p.choose(req(10_000), LONG, 0.5) is None
    assert p.last_reasons == {LANE: 4}
    # short requests still have the other half, free of long prefills
    assert place(p, req(300), SHORT, 0.5) not in (a, b)


def test_long_contexts_spread_over_every_replica_once_their_prefill_ends():
    """P7: a long context still decoding on a replica no longer confines the lane to that replica."""
    p = placer()
    held = {place(p, req(10_000), LONG, 0.0), place(p, req(10_000), LONG, 0.0)}
    # 1.5 s later both prefills are done but both requests still run (KV held): the next long prompts go to the
    # replicas without one (the old rule counted requests in flight and kept them on the same two)
    c = place(p, req(10_000), LONG, 1.5)
    d = place(p, req(10_000), LONG, 1.5)
    assert {c, d}.isdisjoint(held) and c is not d


def test_a_request_ended_before_its_predicted_prefill_end_frees_the_share():
    p = placer()
    p.note_lane(SHORT, 0.0)
    r1, r2 = req(10_000), req(10_000)
    a = place(p, r1, LONG, 0.0)
    place(p, r2, LONG, 0.0)
    assert p.choose(req(10_000), LONG, 0.1) is None
    p.release(a, r1, LONG, a.scrape_epoch)  # the client left during the prefill
    assert a.lane_prefill_until[LONG] == 0.0
    assert p.choose(req(10_000), LONG, 0.1) is not None


def test_the_confinement_holds_only_while_a_smaller_lane_is_active():
    """PX: when every request is a long prompt (cold system prompts), no smaller request needs the replicas kept free
    of long prefills: all of them prefill long prompts. Once a short request comes, the share holds again, for
    LANE_ACTIVE_S after the latest one."""
    p = placer()
    placed = {place(p, req(10_000), LONG, 0.0) for _ in range(4)}
    assert len(placed) == 4  # every replica, none idle for requests that do not come
    p = placer()
    p.note_lane(SHORT, 0.0)
    place(p, req(10_000), LONG, 0.0)
    place(p, req(10_000), LONG, 0.0)
    assert p.choose(req(10_000), LONG, 0.1) is None  # a short request came 0.1 s ago: half stays free
    assert p.choose(req(10_000), LONG, 0.1 + LANE_ACTIVE_S) is not None  # none since LANE_ACTIVE_S


def test_unconfined_lanes_are_never_held_back():
    p = placer(n=2)
    for _ in range(4):  # four 5,000-token prompts at once (normal lane, no replica share)
        assert p.choose(req(5_000), 1, 0.0) is not None
        place(p, req(5_000), 1, 0.0)
