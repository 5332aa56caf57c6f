"""PX prefix-heavy traffic: apps with long system prompts and multi-turn chats; the cache is only warm where the
prefix was last computed.

Workload (2 replicas, tiny-cpu, time_scale 1, prefix caching on as in vLLM 0.32): `APPS` apps, each with its own
system prompt of 2,000 to 6,000 tokens (evenly spread), send two kinds of traffic, every request `x-sluice-app`
tagged:
  * single-turn requests: the app's system prompt + a unique question of 150 tokens, 32 output tokens, seeded
    Poisson, the app drawn uniformly;
  * multi-turn sessions (`SESSIONS`, started evenly over the run, apps in turn): each turn resends the
    conversation so far (system prompt, every earlier question of 100 tokens and answer of 48 tokens) plus a
    new question, then waits `THINK_S` after the answer. The resent answers are the client's own stand-in text
    (a real client resends what it received), so a turn hits the cache up to the end of the previous turn's
    prompt, not into its generated tokens.
The prefix working set (every distinct full block of the system prompts and the sessions' conversations,
`working_set_tokens`) is larger than one replica's KV cache: each replica's cache holds `KV_SHARE` = 0.75 of it
(`--num-gpu-blocks`, blocks of the preset's size), so two replicas hold it with room for the running requests
when each app's prefixes live on one of them. So a gateway that sends every request of an app to one replica keeps that app's prefix warm; one
that spreads them computes each prefix on both replicas and evicts them from each other.

Load: the single-turn rate is chosen so that the whole workload (sessions included) offers `LOAD` = 0.6 of what
the best router's pool completes (`best_router_rps`): each replica an engine at the scenario's KV, prefix cache
on, kept saturated with the single-turn requests of its share of the apps (app a on replica a mod replicas),
completions per second summed over the replicas. That is measured, not computed from the uncached tokens alone: a
cached prompt's tail still attends to its whole prefix, and a replica still computes each prefix it evicted
again, so a replica of `tiny-cpu` completes about 9 requests/s of three apps' traffic, not the 21 its uncached
tail alone would allow. It follows the replica count of the run (`with_replicas`: two real engines are loaded like
two simulators). A router that sends every app to every replica thrashes the cache (0.68 hit rate, about a third
of the best router's capacity), so it is overloaded at the same rate.

SLO: the first token within `slo_ttft_s(TTFT alone of the largest prompt with its prefix cached)` (5x, at least
0.5 s, rounded up: 0.5 s at the calibrated preset): a user of an engine that caches prefixes by default expects
the cached speed; a cold 6,000-token prefill (1.7 s alone) misses it, which is what the scenario measures.
Classes: `single` and `session` requests.

Headline metrics: `slo_goodput_rps`, `prefix_hit_rate` (the engines' own counters: sum over replicas of
vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over the run, in tokens),
`best_achievable_hit_rate` (computed from the workload and the block size: every request of an app on one
replica with room for all of them, a request hitting the leading full blocks any earlier request of its app
computed, at least one token left to compute, as vLLM does), `hit_rate_vs_best` (their ratio; the bar: within
10 %), `ttft_p95_s` (every user request from its first send, censored), `kv_usage_max` (highest KV usage of
any replica, against the admission limit `1 - admission.kv_margin` = 0.9 at sluice's defaults).
Reproduced on envoy-rr when prefix_hit_rate < 0.9 x best_achievable_hit_rate (spreading an app's requests
loses hits) and ttft_p95_s > SLO.
Sluice is told: the SLO (`admission.ttft_target_s`); placement at its shipped defaults (prefix-aware placement,
where the sidecar has it, measures affinity from the engines' hit counters). smg runs its `cache_aware` policy
(its prefix tree of request text), its natural competitor here.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from bench.capacity import BENCH_PRESET, LOAD_SCALE, EngineSpec, blocks_for_tokens, drive, slo_ttft_s
from bench.openloop import Arrival, Ctx
from bench.scenarios.base import (MODEL, Call, Metric, RunData, Scenario, Workload, pct, rnd, text_of,
                                  workload_rep, workload_rng)
from extproc.sim.engine import Request, block_hashes
from extproc.sim.tokenizer import chat_prompt

APPS = 6
SYSTEM_MIN, SYSTEM_MAX = 2000, 6000
QUESTION, ANSWER, SINGLE_OUT = 150, 48, 32
SESSION_QUESTION = 100
SESSIONS, TURNS, THINK_S = 6, 6, 1.0
KV_SHARE = 0.75
REPLICAS = 2
LOAD = 0.6  # offered load / the best router's pool capacity (`best_router_rps`)
SATURATED = 200  # single-turn requests queued at once on each replica to measure its capacity
KV_LIMIT = 0.9  # sluice's admission limit at its defaults: 1 - admission.kv_margin (0.1)
_BASE = EngineSpec.of(BENCH_PRESET)


def system_tokens(app: int) -> int:
    return round(SYSTEM_MIN + (SYSTEM_MAX - SYSTEM_MIN) * app / max(1, APPS - 1))


def system_message(app: int) -> dict[str, str]:
    return {"role": "system", "content": text_of(system_tokens(app), 70_000_000 + app)}


def single_body(app: int, salt: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": SINGLE_OUT, "stream": True, "stream_options": {"include_usage": True},
            "messages": [system_message(app), {"role": "user", "content": text_of(QUESTION, salt)}]}


def session_bodies(session: int, app: int) -> list[dict[str, Any]]:
    """Every turn's body: the conversation so far (stand-in answers) plus a new question."""
    msgs: list[dict[str, str]] = [system_message(app)]
    out = []
    for turn in range(TURNS):
        msgs = msgs + [{"role": "user", "content": text_of(SESSION_QUESTION, 80_000_000 + session * 100 + turn)}]
        out.append({"model": MODEL, "max_tokens": ANSWER, "stream": True,
                    "stream_options": {"include_usage": True}, "messages": list(msgs)})
        msgs = msgs + [{"role": "assistant", "content": text_of(ANSWER, 90_000_000 + session * 100 + turn)}]
    return out


def _blocks(body: dict[str, Any]) -> tuple[int, tuple[int, ...]]:
    n, ids = chat_prompt(body["messages"], with_ids=True)
    assert ids is not None
    return n, block_hashes(ids, _BASE.base.block_size)


def best_achievable(bodies: list[tuple[int, dict[str, Any]]]) -> tuple[float, float]:
    """(hit rate, mean uncached tokens per request) when every request of an app runs on one replica that keeps
    everything: a request hits the leading blocks that an earlier request of its app computed, leaving at least
    one token to compute. `bodies`: (app, body) in send order."""
    seen: dict[int, set[int]] = {}
    hits = queries = 0
    bs = _BASE.base.block_size
    for app, body in bodies:
        n, hashes = _blocks(body)
        cache = seen.setdefault(app, set())
        k = 0
        while k < min(len(hashes), (n - 1) // bs) and hashes[k] in cache:
            k += 1
        hits += k * bs
        queries += n
        cache.update(hashes)
    count = max(1, len(bodies))
    return (hits / queries if queries else 0.0), (queries - hits) / count


def working_set_tokens() -> int:
    """Tokens of the reusable prefixes: every distinct full block of the apps' system prompts and of the sessions'
    conversations (a single-turn question's own blocks are never reused, so they are not counted)."""
    every: set[int] = set()
    for app in range(APPS):
        every.update(_blocks(single_body(app, 0))[1][:system_tokens(app) // _BASE.base.block_size])
    for i in range(SESSIONS):
        for body in session_bodies(i, i % APPS):
            every.update(_blocks(body)[1])
    return len(every) * _BASE.base.block_size


def _session_starts(duration: float) -> list[float]:
    return [0.2 + (duration - 0.5 * TURNS * THINK_S) * i / SESSIONS for i in range(SESSIONS)]


@functools.lru_cache(maxsize=16)
def best_router_rps(replicas: int) -> float:
    """Completions per second of `replicas` engines (the scenario's KV, prefix cache on), each saturated with
    SATURATED single-turn requests of its share of the apps (app a on replica a mod replicas)."""
    spec = EngineSpec.of(_BASE.preset, ["--num-gpu-blocks", str(kv_blocks())])
    rng = random.Random(16)
    total = 0.0
    for k in range(replicas):
        apps = [a for a in range(APPS) if a % replicas == k]
        if not apps:
            continue
        reqs = []
        for i in range(SATURATED):
            n, hashes = _blocks(single_body(rng.choice(apps), 60_000_000 + i))
            reqs.append(Request(f"r{i}", n, SINGLE_OUT, hashes=hashes))
        eng = spec.engine()
        drive(eng, reqs)
        total += len(reqs) / max(r.last_token_at for r in reqs)
    return total


def single_rate(quick: bool, replicas: int) -> float:
    """Single-turn requests per second: LOAD x the best router's capacity (x the machine's LOAD_SCALE, as
    `capacity_rps` does for the other scenarios), less the sessions' turns."""
    session_rps = SESSIONS * TURNS / plan(quick)["duration"]
    return max(0.5, LOAD * LOAD_SCALE * best_router_rps(replicas) - session_rps)


@functools.lru_cache(maxsize=4)
def plan(quick: bool) -> dict[str, Any]:
    """The workload's derived numbers for one mode: duration and SLO."""
    duration = 12.0 if quick else 40.0
    # the largest prompt with its prefix cached: one step computing the suffix while attending to the prefix
    largest = system_tokens(APPS - 1)
    eng = _BASE.engine()
    warm = Request("warm", largest + QUESTION, 1, hashes=tuple(range(1, (largest + QUESTION) // 128 + 1)))
    eng.add(warm, 0.0)
    drive(eng)
    t0 = eng.clock
    hit = Request("hit", largest + QUESTION, 1, hashes=warm.hashes)
    eng.add(hit, t0)
    drive(eng)
    cached_ttft = hit.first_token_at - t0
    return {"duration": duration, "slo": slo_ttft_s(cached_ttft)}


def _arrivals(quick: bool, rate: float) -> tuple[list[Arrival], list[tuple[int, dict[str, Any]]]]:
    """The arrivals at `rate` single-turn requests per second and every request body in send order (sessions'
    turns at their nominal times)."""
    duration = plan(quick)["duration"]
    rng = workload_rng(16)
    arrivals: list[Arrival] = []
    timeline: list[tuple[float, int, dict[str, Any]]] = []
    t, n = 0.1, 0
    while t < duration:
        app = rng.randrange(APPS)
        body = single_body(app, n)
        arrivals.append(Arrival(at=t, body=body, kind="single", headers={"x-sluice-app": f"app-{app}"}))
        timeline.append((t, app, body))
        n += 1
        t += rng.expovariate(rate)
    for i, start in enumerate(_session_starts(duration)):
        app = i % APPS
        bodies = session_bodies(i, app)
        arrivals.append(Arrival(at=start, kind="session", group=f"session-{i}",
                                headers={"x-sluice-app": f"app-{app}"}, script=_session_script(bodies, app)))
        for k, b in enumerate(bodies):
            timeline.append((start + k * (THINK_S + 0.3), app, b))
    timeline.sort(key=lambda x: x[0])
    return arrivals, [(a, b) for _t, a, b in timeline]


def _session_script(bodies: list[dict[str, Any]], app: int):
    async def script(ctx: Ctx) -> None:
        for body in bodies:
            rec = await ctx.call(body, headers={"x-sluice-app": f"app-{app}"}, kind="session")
            if not rec.ok:
                return
            await ctx.sleep(THINK_S)
    return script


@functools.lru_cache(maxsize=1)
def kv_blocks() -> int:
    """KV blocks per replica: KV_SHARE of the prefix working set."""
    return blocks_for_tokens(_BASE, round(KV_SHARE * working_set_tokens()))


def best_hit_rate(quick: bool, replicas: int = REPLICAS) -> float:
    """The best achievable hit rate of the mode's workload (the current repetition's, `workload_rep`) on
    `replicas` replicas (`best_achievable`)."""
    return _best_hit_rate(quick, replicas, workload_rep())


@functools.lru_cache(maxsize=16)
def _best_hit_rate(quick: bool, replicas: int, rep: int) -> float:
    _arr, bodies = _arrivals(quick, single_rate(quick, replicas))
    return best_achievable(bodies)[0]


SLO_TTFT_S = plan(True)["slo"]
KV_BLOCKS = kv_blocks()


class S(Scenario):
    id = "PX"
    title = "prefix-heavy apps and multi-turn sessions"
    problem = "shared prefixes are cached only where they were computed"
    replicas = REPLICAS
    time_scale = 1.0
    sim_args = ["--num-gpu-blocks", str(KV_BLOCKS)]
    slo_ttft_s = SLO_TTFT_S

    @property
    def derived_values(self) -> dict[str, Any]:  # type: ignore[override]
        return {"single-turn (req/s)": single_rate(True, self.replicas), "KV blocks": KV_BLOCKS,
                "best achievable hit rate": round(best_hit_rate(True, self.replicas), 3)}

    headline = ("slo_goodput_rps", "prefix_hit_rate", "ttft_p95_s")
    metrics_doc = [
        Metric("prefix_hit_rate", "prompt tokens found in the replicas' prefix caches / prompt tokens queried "
               "(the engines' counters)", "", "higher"),
        Metric("best_achievable_hit_rate", "the hit rate with every request of an app on one replica (from the "
               "workload and the block size)", "", ""),
        Metric("hit_rate_vs_best", "prefix_hit_rate / best_achievable_hit_rate", "", "higher"),
        Metric("ttft_p95_s", "p95 TTFT of every user request from its first send (censored)", "s"),
        Metric("session_ttft_p95_s", "the same for session turns", "s"),
        Metric("kv_usage_max", f"highest KV usage of any replica (admission limit {KV_LIMIT})", "fraction", ""),
        Metric("failed", "user requests that did not complete", "", "lower"),
    ]

    def workload(self, quick: bool) -> Workload:
        arrivals, _bodies = _arrivals(quick, single_rate(quick, self.replicas))
        return Workload(arrivals=arrivals, duration=plan(quick)["duration"], drain=4.0)

    def call_class(self, call: Call, run: RunData) -> str:
        return call.kind

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ts = run.time_scale
        best = best_hit_rate(bool(run.extra.get("quick", True)), len(run.replicas) or self.replicas)
        queries = run.counter_total("prefix_cache_queries")
        hits = run.counter_total("prefix_cache_hits")
        rate = hits / queries if queries else None
        calls = run.calls()
        return {
            "prefix_hit_rate": rnd(rate),
            "best_achievable_hit_rate": rnd(best),
            "hit_rate_vs_best": rnd(rate / best) if rate is not None and best else None,
            "ttft_p95_s": rnd(pct([c.waited * ts for c in calls], 95)),
            "session_ttft_p95_s": rnd(pct([c.waited * ts for c in calls if c.kind == "session"], 95)),
            "kv_usage_max": rnd(run.max_over_replicas("kv")),
            "failed": float(sum(1 for c in calls if not c.ok)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        v, p = m.get("hit_rate_vs_best"), m.get("ttft_p95_s")
        ok = v is not None and v < 0.9 and p is not None and p > SLO_TTFT_S
        return ok, f"hit_rate_vs_best {v} (needs < 0.9), ttft_p95_s {p} (needs > {SLO_TTFT_S})"
