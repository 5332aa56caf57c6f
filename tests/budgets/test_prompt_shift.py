"""Prompt cost shift (P10): detected once, right numbers and capacity, bounded state, fed by Budgets.settle."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from extproc.budgets import Budgets, PromptShiftTracker
from extproc.budgets.policy import PromptShiftPolicy
from extproc.config import parse_section

from .conftest import req

FP_OLD, FP_NEW = 0x1234ABCD, 0x0BADF00D


def cap(model: str, prompt: float) -> float:
    """A pool of 10,000 prompt tokens/s, prefill-bound."""
    return {"llama": 10000.0}.get(model, 0.0) / prompt


def test_shift_detected_once_with_numbers(caplog: pytest.LogCaptureFixture) -> None:
    t = PromptShiftTracker(PromptShiftPolicy(), cap)
    before = REGISTRY.get_sample_value("sluice_prompt_shift_events_total", {"app": "agent-x"}) or 0
    for _ in range(30):
        assert t.observe("agent-x", "llama", FP_OLD, 2000, 500) is None
    caplog.set_level(logging.WARNING, logger="sluice.budgets.prompt_shift")
    events = [t.observe("agent-x", "llama", FP_NEW, 25000, 4000) for _ in range(30)]
    fired = [e for e in events if e is not None]
    assert len(fired) == 1 and events[6] is fired[0]  # once the median moved (3rd) and stayed moved 5 requests
    e = fired[0]
    assert e["app"] == "agent-x" and e["model"] == "llama"
    assert e["old_tokens_per_request"] == 2500.0 and e["new_tokens_per_request"] == 29000.0
    assert e["old_prompt_tokens"] == 2000.0 and e["new_completion_tokens"] == 4000.0
    assert e["old_fingerprint"] == "1234abcd" and e["new_fingerprint"] == "0badf00d"
    # capacity at each prompt size: the pool's prompt tokens/s over prompt tokens per request
    assert e["old_capacity_rps"] == pytest.approx(5.0) and e["new_capacity_rps"] == pytest.approx(10000 / 25000)
    assert REGISTRY.get_sample_value("sluice_prompt_shift_events_total", {"app": "agent-x"}) - before == 1
    recs = [r for r in caplog.records if getattr(r, "event", None) == "prompt_shift"]
    assert len(recs) == 1
    assert recs[0].app == "agent-x" and recs[0].new_tokens_per_request == 29000.0 and "0badf00d" in recs[0].getMessage()
    snap = {s["app"]: s for s in t.snapshot()}["agent-x"]
    assert snap["shift_events"] == 1 and snap["baseline_tokens_per_request"] == 29000.0
    assert snap["recent_tokens_per_request"] == 29000.0 and not snap["shifting"]
    assert snap["fingerprints"][0]["fingerprint"] == "0badf00d"
    assert REGISTRY.get_sample_value("sluice_prompt_cost_tokens_per_request",
                                     {"app": "agent-x", "kind": "total"}) == 29000.0


def test_moderate_shift_old_number_not_contaminated() -> None:
    t = PromptShiftTracker(PromptShiftPolicy(), cap)
    for _ in range(25):
        t.observe("a", "llama", 1, 2000, 500)
    events = [t.observe("a", "llama", 2, 3000, 500) for _ in range(20)]   # +40 %
    fired = [e for e in events if e]
    assert len(fired) == 1
    assert fired[0]["old_tokens_per_request"] == 2500.0 and fired[0]["new_tokens_per_request"] == 3500.0


def test_noise_and_short_spikes_do_not_alert() -> None:
    t = PromptShiftTracker(PromptShiftPolicy(), cap)
    for i in range(200):  # +-20 % around 2500
        assert t.observe("calm", "llama", 7, 2000 + (400 if i % 2 else -400), 500) is None
    for _ in range(4):   # a spike shorter than sustain_requests
        assert t.observe("calm", "llama", 7, 20000, 500) is None
    for _ in range(50):
        assert t.observe("calm", "llama", 7, 2000, 500) is None


def test_unknown_completion_uses_running_mean() -> None:
    t = PromptShiftTracker(PromptShiftPolicy(baseline_requests=5), None)
    for _ in range(5):
        t.observe("a", "m", 1, 1000, 200)
    t.observe("a", "m", 1, 1000, None)
    s = t.snapshot()[0]
    assert s["recent_completion_tokens"] == 200.0 and s["capacity_rps"] is None


def test_state_is_bounded() -> None:
    t = PromptShiftTracker(PromptShiftPolicy(max_apps=3, max_fingerprints_per_app=2, baseline_requests=2,
                                             sustain_requests=2), cap)
    for i in range(10):
        for fp in range(5):
            t.observe(f"app-{i}", "llama", fp, 100, 10)
    snap = {s["app"]: s for s in t.snapshot()}
    assert set(snap) == {"app-0", "app-1", "app-2", "other"}
    assert snap["other"]["requests"] == 35
    assert all(len(s["fingerprints"]) == 2 for s in snap.values())
    # `other` mixes apps: it never alerts
    for _ in range(10):
        assert t.observe("app-9", "llama", 1, 100000, 10) is None


@pytest.mark.asyncio
async def test_budgets_settle_feeds_completed_requests_only() -> None:
    b = Budgets(parse_section("budgets", {"prompt_shift": {"baseline_requests": 3, "sustain_requests": 2}}), cap)
    await b.start()
    for _ in range(3):
        c = await b.admit(req(2000, 500, model="llama", app="rag"))
        await b.settle(c, completed=True, prompt_tokens=2000, completion_tokens=500)
    for _ in range(5):  # aborted requests with big prompts do not count
        c = await b.admit(req(50000, 500, model="llama", app="rag"))
        await b.settle(c, completed=False, prompt_tokens=None, completion_tokens=None)
    s = {x["app"]: x for x in b.snapshot()["prompt_shift"]}["rag"]
    assert s["requests"] == 3 and s["shift_events"] == 0
    for _ in range(2):  # completed, usage unknown: the estimate of the prompt counts
        c = await b.admit(req(12000, 500, model="llama", app="rag", prefix_key=99))
        await b.settle(c, completed=True, prompt_tokens=None, completion_tokens=None)
    s = {x["app"]: x for x in b.snapshot()["prompt_shift"]}["rag"]
    assert s["shift_events"] == 1 and s["last_event"]["new_tokens_per_request"] == 12500.0
    assert s["last_event"]["new_capacity_rps"] == pytest.approx(10000 / 12000)
    await b.close()


@pytest.mark.asyncio
async def test_capacity_gauge_follows_the_admitted_requests_before_any_completes() -> None:
    """P10: after the prompt change no request of the new prompt completed for 7 s (the pool was overloaded by
    them); a gauge fed by completions kept the old prompt's capacity (2.08 requests/s against a true 1.17)."""
    sizes: list[float] = []

    def capacity(model: str, prompt: float) -> float:
        sizes.append(prompt)
        return 10000.0 / prompt

    b = Budgets(parse_section("budgets", {"prompt_shift": {"baseline_requests": 3, "sustain_requests": 5}}), capacity)
    await b.start()
    for _ in range(8):
        c = await b.admit(req(1000, 48, model="llama", app="p10"))
        await b.settle(c, completed=True, prompt_tokens=1000, completion_tokens=48)
    gauge = {"app": "p10"}
    assert REGISTRY.get_sample_value("sluice_prompt_capacity_requests_per_second", gauge) == pytest.approx(10.0)
    for _ in range(5):  # the new prompt: admitted, none completed yet
        await b.admit(req(5500, 48, model="llama", app="p10"))
    assert REGISTRY.get_sample_value("sluice_prompt_capacity_requests_per_second", gauge) == pytest.approx(
        10000 / 5500)
    assert sizes[-1] == 5500.0
    s = {x["app"]: x for x in b.snapshot()["prompt_shift"]}["p10"]
    assert s["capacity_rps"] == pytest.approx(10000 / 5500)
    await b.close()


@pytest.mark.asyncio
async def test_a_change_of_estimate_units_is_not_a_prompt_shift() -> None:
    """The token calibration's first window rescales every estimate at once (1.58x on real engines) and starts a
    new epoch: the app's baseline is learned again in it, not compared across it. A request estimated before the
    change and completed after it is left out; a real change of the app's prompts later is still seen."""
    b = Budgets(parse_section("budgets", {"prompt_shift": {"baseline_requests": 5, "sustain_requests": 3}}), cap)
    await b.start()

    async def serve(prompt: int, units: int, n: int) -> None:
        for _ in range(n):  # streamed without usage: the estimate is the cost
            c = await b.admit(req(prompt, 100, model="llama", app="chat", prompt_units=units))
            await b.settle(c, completed=True, prompt_tokens=None, completion_tokens=100)

    def state() -> dict:
        return {x["app"]: x for x in b.snapshot()["prompt_shift"]}["chat"]

    await serve(8000, 0, 10)  # raw heuristic, epoch 0: a baseline of 8,100
    assert state()["baseline_tokens_per_request"] == 8100.0
    late = await b.admit(req(8000, 100, model="llama", app="chat", prompt_units=0))
    await serve(5100, 1, 10)  # the same prompts in the engine's units: no event, a new baseline
    assert state()["shift_events"] == 0 and state()["baseline_tokens_per_request"] == 5200.0
    await b.settle(late, completed=True, prompt_tokens=None, completion_tokens=100)  # epoch 0, completed late
    assert state()["recent_tokens_per_request"] == 5200.0
    await serve(10200, 1, 5)  # the app's prompts double: one event, against the relearned baseline
    s = state()
    assert s["shift_events"] == 1 and s["last_event"]["old_tokens_per_request"] == 5200.0
    await b.close()
