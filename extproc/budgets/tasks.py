"""Per agent task budgets (P11): calls, tokens, loop depth, wall time, and active tasks per tenant.

A task is identified by (tenant, task id) where the task id comes from the `x-sluice-task-id` request header
(the gateway reads it into `LLMRequest.task_id`); requests without a task id are not task-budgeted. Per task the store
keeps {calls, tokens, first call time, calls in flight}; every limit is checked and charged in the store's one
atomic admit, so limits hold exactly across sidecars sharing a Redis:
    calls + 1            <= max_calls
    tokens + estimate    <= max_tokens      (estimate = prompt + expected output; corrected to usage at settle)
    now - first_call     <= max_wall_s
    task_depth           <= max_depth       (checked locally: it is a property of the request)
    active tasks of the tenant < max_active_per_tenant, for a task not already active
A task is active while it has a call in flight and for `idle_s` after its last call ended.
Exceeding: 429 `task_budget_exceeded`, `x-should-retry: false`, message naming the limit.
"""

from __future__ import annotations

from extproc.budgets import metrics
from extproc.budgets.errors import BudgetExceeded
from extproc.budgets.keys import ident
from extproc.budgets.policy import TaskPolicy
from extproc.budgets.ops import BACKEND_LOCAL, AdmitOp, AdmitResult, TaskCheck, TaskRef
from extproc.request import LLMRequest

CODE = "task_budget_exceeded"
LIMITS = ("max_calls", "max_tokens", "max_depth", "max_wall_s", "max_active_tasks")


class TaskBudget:
    def __init__(self, policy: TaskPolicy) -> None:
        self.policy = policy
        self.enabled = policy.enabled
        self.store_enabled = bool(policy.max_calls or policy.max_tokens or policy.max_wall_s
                                  or policy.max_active_per_tenant)
        self.ttl_s = max(policy.ttl_s, policy.max_wall_s)
        self._rejections = {name: metrics.TASK_REJECTIONS.labels(name) for name in LIMITS}

    def check_local(self, req: LLMRequest) -> None:
        """Checks that need no state (loop depth). Raises BudgetExceeded."""
        p = self.policy
        if p.max_depth and req.task_id and req.task_depth > p.max_depth:
            self._rejections["max_depth"].inc()
            raise BudgetExceeded(429, CODE, f"task {req.task_id} exceeded max_depth={p.max_depth} "
                                            f"(depth {req.task_depth})", None, False, "max_depth")

    def prepare(self, op: AdmitOp, req: LLMRequest, tenant: str) -> bool:
        if not self.store_enabled or not req.task_id:
            return False
        p = self.policy
        tid = ident(req.task_id)
        op.task = TaskCheck(TaskRef(f"t:{tenant}:{tid}", f"ta:{tenant}", tid), req.total_tokens, p.max_calls,
                            p.max_tokens, p.max_wall_s, p.max_active_per_tenant, self.ttl_s)
        return True

    def rejection(self, req: LLMRequest, res: AdmitResult) -> BudgetExceeded:
        p = self.policy
        name = res.detail
        self._rejections.get(name, self._rejections["max_calls"]).inc()
        local = ""
        configured = {"max_calls": p.max_calls, "max_tokens": p.max_tokens, "max_wall_s": p.max_wall_s,
                      "max_active_tasks": p.max_active_per_tenant}.get(name, res.limit)
        if res.backend == BACKEND_LOCAL and res.limit != configured:
            local = f" (this sidecar's local share {res.limit:g} while the shared store is unreachable)"
        if name == "max_tokens":
            msg = (f"task {req.task_id} exceeded max_tokens={configured:g}{local}: {res.used:.0f} tokens used, "
                   f"this call needs about {req.total_tokens}")
        elif name == "max_wall_s":
            msg = f"task {req.task_id} exceeded max_wall_s={configured:g} (running for {res.used:.1f} s)"
        elif name == "max_active_tasks":
            msg = (f"tenant {req.tenant} has {res.used:.0f} active tasks, max_active_per_tenant={configured:g}"
                   f"{local}; task {req.task_id} refused")
        else:
            msg = f"task {req.task_id} exceeded {name}={configured:g}{local}"
        return BudgetExceeded(429, CODE, msg, None, False, name)
