"""Chunked-prefill decode interference on P10's workload, offline: why P10's goodput bar is not met, and what a
gateway would need to meet it.

P10's published quick runs give every system the same SLO goodput after the prompt change (first token within 8 s
and the response completed). This module replays P10's arrivals on two simulated
engines (the preset's cost model, `extproc.sim.engine`, driven in simulated time: no gateway, no I/O, the same
result on every run) through a minimal gateway, one policy at a time:

  forward        every request goes to an engine at once, alternating (round robin)
  backlog <= X   a FIFO queue; the head goes to a replica whose unprefilled prompt time plus its own prefill is at
                 most X seconds, or that has none (sluice's prefill gate at a TTFT target of X), the one with the
                 fewest requests among them; a request that waited longer than the SLO less its own prefill is
                 refused
  in flight <= K the same queue and refusal; at most K requests in flight per replica

and counts, per class (`before` / `after` the change), the calls within the SLO, and the failed ones by kind:
first token later than the SLO, first token in time but unfinished when the window ends, no first token. The
window is the run's: the last arrival plus the drain.

What it shows (bench/results/decode-interference.json, docs/benchmarks.md): vLLM's scheduler (and the simulator's)
packs a step with every running request's next decode token and then prefill chunks up to
`max_num_batched_tokens`, so while prompts wait to be prefilled, every decode advances one token per step that
also prefills a whole chunk. A request whose first token comes in time then takes many seconds for its 48 tokens,
and the quick run's window (4 s after the last arrival) ends first. A gate on predicted prefill alone, at the
SLO's 8 s, keeps that interference: only a gate that leaves the decodes room (a smaller prefill backlog, or fewer
requests in flight) completes them.

    python -m bench.decode_interference [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.report import git_commit
from bench.scenarios import p10_prompt_change as p10
from extproc.sim.engine import Engine, Request, Step

REPLICAS = 2
BEFORE_PROMPT = 1000  # P10's prompt before the change (system 330 + knowledge 500 + user 170)


@dataclass(frozen=True)
class Window:
    """The arrivals replayed and when the count ends."""

    name: str
    phases: tuple[float, float]  # (change, last arrival) in seconds, as `S.phases`
    drain: float                 # seconds after the last arrival


@dataclass(frozen=True)
class Policy:
    """One gateway: where the queue's head may go now (None: anywhere, in turn), and whether it refuses a request
    that can no longer meet the SLO."""

    name: str
    admits: Callable[[Engine, float], bool] | None  # (replica, the request's own prefill s) -> may it go there now
    refuses_late: bool = True


@functools.lru_cache(maxsize=None)
def own_prefill_s(prompt: int) -> float:
    """The prompt's TTFT alone on an idle engine (bench.capacity `ttft_alone_s`)."""
    return p10.ttft_alone_s(p10.SPEC, prompt)


def unprefilled_s(e: Engine, per_token_s: float) -> float:
    """Seconds of prompt the engine has still to prefill (its waiting and running requests)."""
    return sum(max(0, r.prompt_len - r.num_computed) for r in (*e.waiting, *e.running)) * per_token_s


def policies() -> list[Policy]:
    per_token = own_prefill_s(p10.AFTER_PROMPT) / p10.AFTER_PROMPT

    def backlog(limit: float) -> Callable[[Engine, float], bool]:
        def admits(e: Engine, own: float) -> bool:
            queued = unprefilled_s(e, per_token)
            return queued == 0 or queued + own <= limit
        return admits

    def in_flight(k: int) -> Callable[[Engine, float], bool]:
        return lambda e, own: len(e.waiting) + len(e.running) < k

    slo = p10.SLO_TTFT_S
    return [Policy("forward", None, refuses_late=False),
            Policy(f"backlog <= {slo:g} s (the SLO)", backlog(slo)),
            Policy(f"backlog <= {slo / 2:g} s", backlog(slo / 2)),
            Policy("in flight <= 2", in_flight(2)),
            Policy("in flight <= 1", in_flight(1))]


def arrivals(window: Window) -> list[tuple[float, Request]]:
    """P10's arrivals (the scenario's own seeded draw) over the window's phases: (user's send, request)."""
    scenario = p10.S()
    scenario.phases = lambda quick: window.phases  # type: ignore[method-assign]
    return [(a.at, Request(f"r{i}", p10.AFTER_PROMPT if a.kind == "after" else BEFORE_PROMPT, p10.OUTPUT,
                           tag=a.kind))
            for i, a in enumerate(scenario.workload(True).arrivals)]


def replay(policy: Policy, window: Window) -> dict[str, dict[str, int]]:
    """Drive the engines and the gateway queue event by event until the window ends; count the outcomes."""
    end = window.phases[1] + window.drain
    engines = [p10.SPEC.engine() for _ in range(REPLICAS)]
    steps: list[Step | None] = [None] * REPLICAS
    reqs = arrivals(window)
    pending: deque[tuple[float, Request]] = deque(reqs)
    queue: deque[tuple[float, Request]] = deque()
    refused: set[str] = set()
    turn, now = 0, 0.0
    while now < end:
        while pending and pending[0][0] <= now:
            queue.append(pending.popleft())
        turn = _dispatch(policy, engines, queue, refused, now, turn)
        for i, e in enumerate(engines):
            if steps[i] is None:
                e.clock = max(e.clock, now)
                steps[i] = e.schedule()
        now = _next_event(engines, steps, pending, now, end)
        for i, e in enumerate(engines):
            s = steps[i]
            if s is not None and s.start + s.duration <= now:
                e.complete(s)
                steps[i] = None
    return _outcomes(reqs, refused)


def _dispatch(policy: Policy, engines: list[Engine], queue: deque[tuple[float, Request]], refused: set[str],
              now: float, turn: int) -> int:
    """Send the queue's head while the policy lets it go somewhere (refusing the ones past their wait); returns
    the round robin's next turn."""
    while queue:
        sent, r = queue[0]
        own = own_prefill_s(r.prompt_len)
        if policy.refuses_late and now - sent > p10.SLO_TTFT_S - own:
            refused.add(queue.popleft()[1].rid)
            continue
        if policy.admits is None:
            i, turn = turn % REPLICAS, turn + 1
        else:
            fits = [i for i, e in enumerate(engines) if policy.admits(e, own)]
            if not fits:
                return turn
            i = min(fits, key=lambda k: len(engines[k].waiting) + len(engines[k].running))
        engines[i].clock = max(engines[i].clock, now)
        engines[i].add(queue.popleft()[1], now)
    return turn


def _next_event(engines: list[Engine], steps: list[Step | None], pending: deque[tuple[float, Request]], now: float,
                end: float) -> float:
    """The next step end, arrival, or request reaching an engine's scheduler (after its frontend delay)."""
    times = [s.start + s.duration for s in steps if s is not None] + [end]
    if pending:
        times.append(pending[0][0])
    times += [t for e in engines if (t := e.next_ready_time()) is not None and t > now]
    return max(min(times), now + 1e-6)


def _outcomes(reqs: list[tuple[float, Request]], refused: set[str]) -> dict[str, dict[str, int]]:
    """Per class: calls, and each call's outcome, its first token timed from the user's send."""
    out: dict[str, dict[str, int]] = {}
    for sent, r in reqs:
        c = out.setdefault(r.tag, {"calls": 0, "within_slo": 0, "late_first_token": 0, "unfinished": 0,
                                   "no_first_token": 0, "refused": 0})
        c["calls"] += 1
        if r.rid in refused:
            c["refused"] += 1
        elif r.first_token_at is None:
            c["no_first_token"] += 1
        elif r.first_token_at - sent > p10.SLO_TTFT_S:
            c["late_first_token"] += 1
        elif not r.finish_reason:
            c["unfinished"] += 1
        else:
            c["within_slo"] += 1
    return out


def windows() -> list[Window]:
    quick, full = p10.S().phases(True), p10.S().phases(False)
    drain = p10.S().workload(True).drain
    return [Window(f"quick, as run ({quick[1]:g} s, drain {drain:g} s)", quick, drain),
            Window(f"quick, drain {drain + p10.SLO_TTFT_S:g} s", quick, drain + p10.SLO_TTFT_S),
            Window(f"change at {quick[0]:g} s, arrivals to 20 s, drain {drain + p10.SLO_TTFT_S:g} s",
                   (quick[0], 20.0), drain + p10.SLO_TTFT_S),
            Window(f"full ({full[1]:g} s, drain {drain:g} s)", full, drain)]


def table(results: dict[str, dict[str, dict[str, dict[str, int]]]]) -> str:
    """Markdown: per window and policy, the calls after the change within the SLO, and how the others failed."""
    lines = ["| window | policy | after: within SLO / calls | late first token | unfinished | no first token | "
             "refused | before: within SLO / calls |", "|---|---|---|---|---|---|---|---|"]
    for w, by_policy in results.items():
        for name, c in by_policy.items():
            a, b = c["after"], c["before"]
            lines.append(f"| {w} | {name} | {a['within_slo']} / {a['calls']} | {a['late_first_token']} | "
                         f"{a['unfinished']} | {a['no_first_token']} | {a['refused']} | "
                         f"{b['within_slo']} / {b['calls']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_interference", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the counts here")
    args = ap.parse_args(argv)
    results = {w.name: {pol.name: replay(pol, w) for pol in policies()} for w in windows()}
    print(table(results))
    if args.json:
        meta = {"commit": git_commit(), "preset": p10.SPEC.preset, "slo_ttft_s": p10.SLO_TTFT_S, "replicas": REPLICAS,
                "command": "python -m bench.decode_interference --json " + str(args.json)}
        args.json.write_text(json.dumps({"_meta": meta, "windows": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
