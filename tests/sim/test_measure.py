"""The live-engine measurements' arithmetic (extproc/sim/measure.py), on arrival times given by hand."""

from __future__ import annotations

import pytest

from extproc.sim.measure import batch_rate


def test_batch_rate_is_the_batchs_tokens_from_the_first_send_to_the_last_token() -> None:
    # two streams of 11 tokens sent at 0.0 and 0.05, first tokens at 0.1 and 0.2, last ones at 1.1 and 1.2:
    # 22 tokens in 1.2 s
    a = [0.1 + i * 0.1 for i in range(11)]
    b = [0.2 + i * 0.1 for i in range(11)]
    assert batch_rate([0.0, 0.05], [a, b]) == pytest.approx(22 / 1.2)


def test_streams_read_in_one_lump_do_not_make_the_rate_unbounded() -> None:
    # the client (or a busy API server) delivered every token of both streams at 0.95 and 0.96: a rate over each
    # stream's own first-to-last span divides by ~0 (the calibration once reported 225,817 tokens/s for 4 streams)
    lumps = [[0.95] * 11, [0.96] * 11]
    assert batch_rate([0.0, 0.0], lumps) == pytest.approx(22 / 0.96)


def test_a_batch_whose_last_stream_starts_as_the_others_end_did_not_form() -> None:
    from extproc.sim.measure import batch_formed

    together = [_steady(0.02, 0.01, 100), _steady(0.03, 0.01, 100)]      # both decode from 0.02-0.03 s on
    assert batch_formed([0.0, 0.0], together)
    # the second stream's first token at 1.0 s on a 2.0 s span (measured on vLLM-CPU: a burst's last stream
    # waiting for the others): the sample is a batch of one for half its span
    late = [_steady(0.02, 0.01, 100), _steady(1.0, 0.01, 100)]
    assert not batch_formed([0.0, 0.0], late)
    assert not batch_formed([0.0, 0.0], [_steady(0.02, 0.01, 100), []])  # a stream without a token
    assert not batch_formed([], [])


def test_no_tokens_is_no_rate() -> None:
    assert batch_rate([], []) == 0.0
    assert batch_rate([1.0], [[]]) == 0.0


def _steady(start: float, step: float, n: int) -> list[float]:
    return [start + i * step for i in range(n)]


def test_a_stream_that_stops_while_the_others_move_is_a_stall() -> None:
    from extproc.sim.measure import stall_start

    mine = _steady(0.0, 0.01, 50) + _steady(0.7, 0.01, 20)   # stops at 0.49 for 0.21 s: preempted
    other = _steady(0.0, 0.01, 70)                           # keeps decoding through it
    assert stall_start(mine, after=0.05, others=[other]) == pytest.approx(0.49)


def test_every_stream_stopping_at_once_is_the_client_not_a_preemption() -> None:
    from extproc.sim.measure import stall_start

    # a client descheduled for 0.2 s reads nothing from any stream; the preemption comes later, at 1.0
    mine = _steady(0.0, 0.01, 30) + _steady(0.5, 0.01, 51) + _steady(1.3, 0.01, 10)
    other = _steady(0.0, 0.01, 30) + _steady(0.5, 0.01, 90)
    assert stall_start(mine, after=0.05) == pytest.approx(0.29)        # without the others: the hiccup
    assert stall_start(mine, after=0.05, others=[other]) == pytest.approx(1.0)
