"""The `x-sim-deadline` probe: tokens made after a still-connected client's deadline count as late tokens.

The benchmark's P4 counts the ghost load of connections kept open past their deadline on the replica side; the
count must be exact (every token after the deadline, none before) and must not double-count ghost tokens.
"""

from __future__ import annotations

import time

from .conftest import chat_body


async def _stream(http, sim, headers: dict[str, str], max_tokens: int) -> int:
    async with http.post(sim.url + "/v1/chat/completions", headers=headers,
                         json=chat_body(max_tokens=max_tokens, stream=True)) as r:
        assert r.status == 200
        body = await r.read()
    return body.count(b'"content":') - 1  # minus the role event


async def test_tokens_after_a_past_deadline_are_all_late(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20)
    got = await _stream(http, sim, {"x-sim-deadline": f"{time.time() - 1.0:.3f}"}, 12)
    assert got == 12
    st = sim.state()["counters"]
    assert st["late_tokens"] == 12 and st["ghost_tokens"] == 0


async def test_no_late_tokens_before_the_deadline_or_without_one(sim_factory, http) -> None:
    sim = await sim_factory(time_scale=20)
    await _stream(http, sim, {"x-sim-deadline": f"{time.time() + 3600:.3f}"}, 12)
    await _stream(http, sim, {}, 12)
    await _stream(http, sim, {"x-sim-deadline": "soon"}, 12)  # unparsable: ignored, not an error
    st = sim.state()["counters"]
    assert st["late_tokens"] == 0 and st["generation_tokens"] == 36
