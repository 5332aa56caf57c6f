"""The tenant share of prefill (P1f): the dominant tenant may prefill on only part of the pool while another
tenant is active, so a quiet tenant's prompt finds a replica free of the flood's prefill."""

import pytest

from extproc.admission.placement import TENANT, Placer
from extproc.config import parse_section
from extproc.request import LLMRequest
from extproc.routing.pool import Replica

from . import placing

NORMAL = 1  # lane of 2,000-token prompts in the default lanes (a 2,000-token prompt prefills in 0.2 s)


def placer(n: int = 4, **admission: object) -> Placer:
    """A placer with the tenant share on at 0.5 (the default, 1.0, is off; see test_share_is_off_by_default)."""
    return placing.placer(n, **{"tenant_prefill_share": 0.5, **admission})


def req(tenant: str, prompt: int = 2_000) -> LLMRequest:
    return LLMRequest(request_id="", endpoint="chat", model="m", stream=True, prompt_tokens=prompt,
                      max_output_tokens=16, tenant=tenant)


def place(p: Placer, r: LLMRequest, now: float) -> Replica:
    p.note_tenant(r.tenant, now)
    assert not p.tenant_full(r.tenant, now)
    return placing.place(p, r, NORMAL, now)


def flood_until_held(p: Placer, now: float) -> list[Replica]:
    """Place the flood's 2,000-token prompts at `now` until the placer refuses one; where each went."""
    placed = []
    while True:
        q = req("flood")
        p.note_tenant("flood", now, q.prompt_tokens)
        pins = p.choose(q, NORMAL, now)
        if pins is None:
            return placed
        p.commit(pins[0], q, NORMAL, now)
        placed.append(pins[0])


def test_a_tenant_alone_is_never_limited():
    p = placer()
    used = {place(p, req("solo"), 0.01 * i) for i in range(4)}
    assert len(used) == 4  # every replica prefilling the same tenant: nobody else is waiting for one


def test_the_flooding_tenant_is_held_at_its_share_and_the_quiet_one_is_not():
    p = placer()  # share 0.5 of 4 replicas: the flood prefills on at most 2
    place(p, req("quiet"), 0.0)  # the quiet tenant was seen (and its prefill ends at 0.2 s)
    flood = set()
    for i in range(6):  # the flood sends most of the recent requests
        p.note_tenant("flood", 0.3 + 0.01 * i)
    flood.add(place(p, req("flood"), 0.36))
    flood.add(place(p, req("flood"), 0.36))
    assert len(flood) == 2
    assert p.tenant_full("flood", 0.37)  # at its share: its next prompt waits in the queue
    assert not p.tenant_full("quiet", 0.37)
    # the quiet tenant's prompt lands on a replica free of the flood's prefill, and starts at once
    assert place(p, req("quiet"), 0.37) not in flood
    # once the flood's prefills are predicted to have ended, it may start again
    assert not p.tenant_full("flood", 0.36 + 0.41)


def test_a_quiet_tenant_is_not_held_even_at_the_share_count():
    p = placer(n=3)  # share 0.5 of 3 replicas: one replica
    for i in range(10):
        p.note_tenant("flood", 0.01 * i)
    place(p, req("quiet"), 0.1)
    # the quiet tenant prefills on one replica (the share count) but sends few of the requests: not held
    assert not p.tenant_full("quiet", 0.11)


def test_share_one_turns_it_off():
    p = placer(tenant_prefill_share=1.0)
    p.note_tenant("quiet", 0.0)
    for i in range(4):
        place(p, req("flood"), 0.01 * (i + 1))
    assert not p.tenant_full("flood", 0.05)


def test_another_tenant_idle_for_a_while_no_longer_limits():
    p = placer()
    p.note_tenant("quiet", 0.0)
    for i in range(4):
        p.note_tenant("flood", 5.0 + 0.01 * i)
    held = {place(p, req("flood"), 5.05) for _ in range(4)}
    assert len(held) == 4  # quiet's last request is 5 s old: the flood is alone and uses the whole pool


def test_a_tenant_that_spread_before_it_dominated_waits_until_it_is_back_within_its_share():
    p = placer()  # share 0.5 of 4: two replicas
    for i in range(4):  # quiet first, then the flood's first requests land before it is the dominant tenant
        p.note_tenant("quiet", 0.001 * i)
    spread = {place(p, req("flood"), 0.01 + 0.001 * i) for i in range(3)}
    assert len(spread) == 3
    for i in range(10):
        p.note_tenant("flood", 0.02 + 0.001 * i)
    # prefilling on 3 replicas, over its share of 2: it may not even queue behind its own prefills
    assert p.choose(req("flood", prompt=100), NORMAL, 0.05) is None
    assert not p.tenant_full("quiet", 0.05)


def test_share_is_off_by_default() -> None:
    """Holding a dominant tenant costs its throughput (P1f), so it is opt-in."""
    assert parse_section("admission", {}).tenant_prefill_share == 1.0


def test_the_dominant_tenant_waits_for_a_replica_whose_prefill_has_drained():
    """The default (tenant_backlog_share 0): while another tenant is active, the dominant one is placed only on a
    replica with no predicted prefill backlog, one prompt at a time; its next prompts wait in the fair queue, where
    a quiet tenant's request goes first. A quiet prompt then waits behind at most one of the flood's prompts, not
    behind the flood's queue in the engine (a FIFO)."""
    assert parse_section("admission", {}).tenant_backlog_share == 0.0
    p = placing.placer(n=2)
    p.note_tenant("quiet", 0.0, 100)
    placed = flood_until_held(p, 0.01)
    assert len(set(placed)) == 2 and len(placed) == 2  # one prompt (0.2 s of prefill) per replica
    assert p.last_reasons == {TENANT: 2}
    quiet = p.choose(req("quiet"), NORMAL, 0.02)
    assert quiet is not None and p.backlog(quiet[0], 0.02) <= 2_000  # behind at most one flood prompt
    assert p.choose(req("flood"), NORMAL, 0.2) is None  # 100 tokens of each prompt still to prefill
    assert p.choose(req("flood"), NORMAL, 0.22) is not None  # drained: the next one may start


def test_a_tenant_backlog_share_lets_the_dominant_tenant_queue_behind_that_much_prefill():
    """tenant_backlog_share 0.25 of the 2 s target (0.5 s, 5,000 tokens): the flood keeps the replica's queue
    filled up to that, and a quiet prompt waits behind at most about that much of the flood's prefill."""
    p = placing.placer(n=1, tenant_backlog_share=0.25)
    p.note_tenant("quiet", 0.0, 100)
    r = p.pool.replicas[0]
    flood = len(flood_until_held(p, 0.01))
    assert flood == 3 and p.last_reasons == {TENANT: 1}  # 0, 2,000 and 4,000 tokens ahead; 6,000 is too many
    assert p.choose(req("quiet"), NORMAL, 0.01) == [r]  # the prefill gate's own limit (2 s) leaves room for it
    assert p.choose(req("flood"), NORMAL, 0.2) == [r]  # 0.19 s later 4,100 tokens are left: the flood may add one


def test_a_tenant_alone_fills_the_whole_prefill_budget():
    p = placing.placer(n=1)
    for i in range(10):
        q = req("solo")
        p.note_tenant("solo", 0.0, q.prompt_tokens)
        pins = p.choose(q, NORMAL, 0.0)
        assert pins is not None
        p.commit(pins[0], q, NORMAL, 0.0)  # up to the 2 s target: 20,000 tokens


def test_tenant_backlog_share_one_turns_it_off():
    p = placing.placer(n=1, tenant_backlog_share=1.0)
    p.note_tenant("quiet", 0.0, 100)
    for _ in range(6):
        q = req("flood")
        p.note_tenant("flood", 0.01, q.prompt_tokens)
        pins = p.choose(q, NORMAL, 0.01)
        assert pins is not None
        p.commit(pins[0], q, NORMAL, 0.01)


def test_tenant_backlog_share_accepts_zero_and_rejects_outside_zero_to_one():
    assert parse_section("admission", {"tenant_backlog_share": 0}).tenant_backlog_share == 0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="admission.tenant_backlog_share"):
            parse_section("admission", {"tenant_backlog_share": bad})
