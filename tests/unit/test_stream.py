"""The stream state machine's own rules (extproc/stream.py): the transition table, and holds taken in order."""

from __future__ import annotations

import pytest

from extproc.stream import TRANSITIONS, Hold, IllegalTransition, State, Stream


def test_every_state_is_reachable_from_new_and_only_terminal_states_have_no_exit():
    seen, todo = {State.NEW}, [State.NEW]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(State) == set(TRANSITIONS)
    assert {s for s, exits in TRANSITIONS.items() if not exits} == {State.DETACHED, State.CUT, State.DONE,
                                                                   State.REJECTED, State.PASSED}


def test_a_move_the_table_does_not_list_is_refused():
    st = Stream()
    st.move(State.HEADERS)
    with pytest.raises(IllegalTransition, match="headers -> done"):
        st.move(State.DONE)
    assert st.state is State.HEADERS
    st.move(State.REJECTED)
    with pytest.raises(IllegalTransition):
        st.move(State.FORWARDED)


def test_holds_are_taken_in_order_and_dropped_once():
    st = Stream()
    st.take(Hold.OPEN_REQUEST)
    st.take(Hold.BUDGET)
    with pytest.raises(IllegalTransition, match="TENANT_STREAM"):
        st.take(Hold.TENANT_STREAM)  # after BUDGET: out of order
    with pytest.raises(IllegalTransition):
        st.take(Hold.BUDGET)  # twice
    assert Hold.names(st.holds) == ["OPEN_REQUEST", "BUDGET"]
    assert st.drop(Hold.BUDGET) and not st.drop(Hold.BUDGET)
    st.take(Hold.WAITER)
    assert st.holds == Hold.OPEN_REQUEST | Hold.WAITER


def test_hold_bits_are_distinct_and_ordered_as_declared():
    bits = [v for k, v in vars(Hold).items() if k.isupper()]
    assert bits == sorted(bits) and all(b == 1 << i for i, b in enumerate(bits))
