"""P11 agents amplify traffic: one task makes dozens of LLM calls and one tenant eats the pool.

Workload (2 replicas, tiny-cpu, time_scale 1): tenant `interactive` sends chat requests of 300 prompt and 24
output tokens at 5 % of the pool's capacity for them (`2 x capacity_rps(300, 24)`, bench/capacity.py: 4.9
requests/s at the calibrated tiny-cpu; seeded Poisson) all along (`x-sluice-tenant: interactive`). From t=2 s
tenant `agents` starts an agent task every `TASK_EVERY_S`; a task calls the model in a loop (planner, tools,
reflection...), each call sent when the previous answered, up to 30 calls (multi-agent 20-50 in the document),
its context growing by 60 tokens per step (a tool result) from 300, 16 output tokens. `TASK_EVERY_S` is chosen
so that the tasks, run to their end, would offer 1.5x the pool's capacity (the sum of `1 / capacity_rps` over
a task's 30 calls, per replica: a task every 1.2 s at the calibrated preset). Prompts are unique (no shared
prefix: an agent's context is resent, but each call's salt leads it, so the prefix cache plays no part here;
PX is the scenario about prefixes). Calls carry `x-sluice-tenant: agents`, `x-sluice-task-id` and
`x-sluice-task-depth` (the step). A call refused by the gateway (4xx) ends its task, as an agent framework
surfaces the budget error.

SLO: the first token within `slo_ttft_s(ttft_alone(720))` (5x the TTFT alone of the largest prompt the SLO
covers, the task budget's last call, at least 0.5 s, rounded up: 0.5 s at the calibrated preset) of the user's
first send (retries included) and the response completed.
Classes: `interactive`; `agent` for a task's first TASK_CALLS calls (within the task budget below);
`agent-beyond-budget` for its later calls: the class sluice refuses by design (`refused_classes`), left out of
`worst_class_ratio`.

Headline metrics: `slo_goodput_rps`, `max_calls_per_task` (calls that got an answer, most in one task),
`max_tokens_per_task` (prompt + completion tokens of one task, from usage), `other_tenant_ttft_p95_s`
(interactive tenant while agents run), `other_tenant_ttft_p95_idle_s` (before they start), `tasks_refused`
(tasks stopped by a budget).
Reproduced on envoy-rr when max_calls_per_task >= 20 and the interactive tenant's p95 TTFT at least doubles.
Sluice is told: the SLO (`admission.ttft_target_s`) and the agents' task budget, a deployment fact
(`budgets.tasks`: max_calls 8, max_tokens twice what 8 calls of the task use: 8,416 at these sizes). The tenants are named by `x-sluice-tenant` (trusted
by default). Deployment topology, also a fact: two sidecar processes (`sidecar.workers: 2`) share the budgets
through a redis-server the harness starts (`budgets.store`), so `max_calls_per_task` == 8 shows the limit holding
across sidecars.
"""

from __future__ import annotations

import zlib

from bench.capacity import BENCH_PRESET, EngineSpec, capacity_rps, pool_rps, slo_ttft_s, ttft_alone_s
from bench.openloop import Arrival, Ctx
from bench.scenarios.base import Call, Metric, RunData, Scenario, Workload, chat, pct, rnd, workload_rng

MAX_CALLS = 30
CTX0, CTX_STEP, CALL_OUT = 300, 60, 16
INTERACTIVE = (300, 24)
SPEC = EngineSpec.of(BENCH_PRESET)
INTERACTIVE_RPS = 0.05 * pool_rps(SPEC, 2, *INTERACTIVE)
_TASK_SECONDS = sum(1.0 / capacity_rps(SPEC, CTX0 + CTX_STEP * k, CALL_OUT) for k in range(MAX_CALLS))
TASK_EVERY_S = round(_TASK_SECONDS / (1.5 * 2), 2)  # engine-seconds per task / (1.5 x replicas)
TASK_CALLS = 8  # the agents' task budget (a deployment fact sluice is told) ...
TASK_TOKENS = 2 * sum(CTX0 + CTX_STEP * k + CALL_OUT for k in range(TASK_CALLS))  # ... and its tokens
SLO_TTFT_S = slo_ttft_s(ttft_alone_s(SPEC, CTX0 + CTX_STEP * (TASK_CALLS - 1)))


def agent_script(task: str, steps: int):
    async def script(ctx: Ctx) -> None:
        for step in range(steps):
            headers = {"x-sluice-tenant": "agents", "x-sluice-task-id": task, "x-sluice-task-depth": str(step)}
            rec = await ctx.call(chat(CTX0 + CTX_STEP * step, CALL_OUT, salt=zlib.crc32(f"{task}/{step}".encode()) & 0xFFFFFF), headers=headers,
                                 kind="agent", group=task)
            if not rec.ok:
                return
    return script


class S(Scenario):
    id = "P11"
    title = "agent amplification"
    problem = "agents amplify traffic internally"
    replicas = 2
    time_scale = 1.0
    # Two sidecar processes share the task budgets through a real Redis: the limit must hold exactly across them.
    sidecar = {"workers": 2}
    redis = True
    slo_ttft_s = SLO_TTFT_S
    derived_values = {"interactive (req/s)": INTERACTIVE_RPS, "task every (s)": TASK_EVERY_S,
                      "task tokens": TASK_TOKENS}
    sluice_facts = {"budgets": {"tasks": {"max_calls": TASK_CALLS, "max_tokens": TASK_TOKENS}}}
    refused_classes = ("agent-beyond-budget",)
    # typical requests per tenant (the agents' mean over a whole task), for envoy-tuned's per-tenant rate limit
    tenant_requests = {"interactive": INTERACTIVE, "agents": (CTX0 + CTX_STEP * (MAX_CALLS - 1) // 2, CALL_OUT)}
    headline = ('slo_goodput_rps', 'max_calls_per_task', 'other_tenant_ttft_p95_s')
    metrics_doc = [
        Metric("max_calls_per_task", "answered calls of the busiest task", "calls"),
        Metric("max_tokens_per_task", "prompt + completion tokens of the costliest task", "tok"),
        Metric("mean_calls_per_task", "answered calls per task", "calls", ""),
        Metric("other_tenant_ttft_p95_s", "p95 TTFT of the interactive tenant while agents run", "s"),
        Metric("other_tenant_ttft_p95_idle_s", "p95 TTFT of the interactive tenant before agents start", "s"),
        Metric("tasks_refused", "tasks stopped by a gateway refusal (4xx)", "", ""),
    ]

    def phases(self, quick: bool) -> tuple[float, float]:
        return (2.0, 11.0) if quick else (5.0, 40.0)

    def workload(self, quick: bool) -> Workload:
        t_agents, duration = self.phases(quick)
        rng = workload_rng(11)
        arrivals = []
        t, n = 0.1, 0
        while t < duration:
            arrivals.append(Arrival(at=t, body=chat(*INTERACTIVE, salt=n), kind="interactive",
                                    headers={"x-sluice-tenant": "interactive"}))
            n += 1
            t += rng.expovariate(INTERACTIVE_RPS)
        t, k = t_agents, 0
        while t < duration - 1.0:
            task = f"task-{k:04d}"
            arrivals.append(Arrival(at=t, kind="agent", group=task, script=agent_script(task, MAX_CALLS)))
            k += 1
            t += TASK_EVERY_S
        return Workload(arrivals=arrivals, duration=duration, drain=4.0)

    def call_class(self, call: Call, run: RunData) -> str:
        if call.kind != "agent":
            return call.kind
        return "agent" if call.final.call < TASK_CALLS else "agent-beyond-budget"

    def metrics(self, run: RunData) -> dict[str, float | None]:
        ts = run.time_scale
        t_agents = self.phases(run.extra.get("quick", True))[0] / ts
        calls: dict[str, int] = {}
        tokens: dict[str, int] = {}
        refused: set[str] = set()
        for r in run.recs("agent"):
            calls.setdefault(r.group, 0)
            tokens.setdefault(r.group, 0)
            if r.status == 200 and r.tokens:
                calls[r.group] += 1
                tokens[r.group] += (r.prompt_tokens + r.completion_tokens) or r.tokens
            elif 400 <= r.status < 500:
                refused.add(r.group)
        inter = run.recs("interactive")
        busy = [r for r in inter if r.start >= t_agents + 1.0 / ts]
        idle = [r for r in inter if r.start < t_agents]
        return {
            "max_calls_per_task": float(max(calls.values())) if calls else None,
            "max_tokens_per_task": float(max(tokens.values())) if tokens else None,
            "mean_calls_per_task": rnd(sum(calls.values()) / len(calls), 1) if calls else None,
            "other_tenant_ttft_p95_s": rnd(pct(run.ttfts(busy), 95)),
            "other_tenant_ttft_p95_idle_s": rnd(pct(run.ttfts(idle), 95)),
            "tasks_refused": float(len(refused)),
        }

    def reproduced(self, m: dict[str, float | None]) -> tuple[bool, str]:
        c = m.get("max_calls_per_task")
        b, i = m.get("other_tenant_ttft_p95_s"), m.get("other_tenant_ttft_p95_idle_s")
        hurt = b is not None and i is not None and i > 0 and b / i >= 2
        return (c is not None and c >= 20 and hurt,
                f"max_calls_per_task {c} (needs >= 20), interactive p95 {b} vs idle {i} (needs >= 2x)")
