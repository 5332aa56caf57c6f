"""Shared by the tests that drive the Gateway's state machine: every state change they cause must be one the
table in extproc/stream.py allows."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

from extproc.stream import TRANSITIONS, State, Stream


@contextlib.contextmanager
def only_legal_transitions() -> Iterator[Counter[tuple[State, State]]]:
    """Record every `Stream.move` (from, to) while the block runs; fail at the end if any is not in TRANSITIONS.
    (An illegal move also raises where it happens; the record proves the moves were made and checked.)"""
    seen: Counter[tuple[State, State]] = Counter()
    original = Stream.move

    def move(self: Stream, to: State) -> None:
        seen[(self.state, to)] += 1
        original(self, to)

    Stream.move = move  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Stream.move = original  # type: ignore[method-assign]
    illegal = sorted(f"{a.label}->{b.label}" for a, b in seen if b not in TRANSITIONS[a])
    assert not illegal, f"illegal transitions: {illegal}"
    assert seen, "no transition happened"
