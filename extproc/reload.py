"""Hot reload of the policy file: on SIGHUP, on a change of the file (mtime polled every second), or through the
admin API (`sluice reload`).

    read + validate (load_policy: every section, typed) ─► apply_policy (checks what a reload cannot change,
    then swaps: the fleet rebuilt in place, each pool's queue handed to its new scheduler)
        ok    ─► sluice_policy_reloads_total{result="ok"}, last_reload_success = 1, optional xDS re-render
        error ─► one log line naming the field, sluice_policy_reloads_total{result="error"},
                 last_reload_success = 0; the old policy stays in force

Settings read only at start (listen ports and hosts, worker count, Envoy's bootstrap: admin address, overload
limit, concurrency, log level) are reported as "takes effect after a restart" instead of silently ignored.

No extra dependency: a stat() per second is nothing next to the sidecar's scrapes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from extproc.admission.scheduler import Shed
from extproc.metrics import LAST_RELOAD_TS, LAST_SUCCESS, MAX_DOWNSTREAM_CONNECTIONS, RELOADS
from extproc.config import Policy, PolicyError, PoolConfig, load_policy
from extproc.identity import Identity
from extproc.routing.pool import Pool, Replica

if TYPE_CHECKING:
    from extproc.gateway import Gateway

log = logging.getLogger("sluice.reload")

_OK, _ERROR = RELOADS.labels("ok"), RELOADS.labels("error")

TRIGGERS = ("admin", "sighup", "file_change")

# Fields the running processes read only at start (the bootstrap is not watched by Envoy; ports are bound once).
RESTART_FIELDS = {
    "gateway": ("admin_host", "admin_port", "max_downstream_connections", "envoy_concurrency", "envoy_log_level"),
    "sidecar": ("host", "grpc_port", "metrics_host", "metrics_port", "admin_port", "workers"),
    "limits": ("max_body_bytes", "default_output_tokens", "tokenizer", "tokenizer_path", "bytes_per_token"),
}

# Sections the running gateway does not re-read on reload (Gateway.apply_policy keeps the start-up object).
RESTART_SECTIONS = ("streaming",)


@dataclass
class ReloadResult:
    ok: bool
    changes: list[str] = field(default_factory=list)
    error: str = ""
    source: str = ""
    at: float = 0.0          # unix time
    trigger: str = "admin"   # admin | sighup | file_change


_last: ReloadResult | None = None


def last_result() -> ReloadResult | None:
    """The last reload attempt of this process (None: none since start)."""
    return _last


def note_policy(policy: Policy) -> None:
    """Export what the policy in force says that alerts need (called at start and after every applied reload)."""
    MAX_DOWNSTREAM_CONNECTIONS.set(policy.gateway.max_downstream_connections)


def restart_notes(old: Policy, new: Policy) -> list[str]:
    """Changed settings that only a restart applies."""
    notes = []
    for section, names in RESTART_FIELDS.items():
        a, b = getattr(old, section), getattr(new, section)
        for name in names:
            if getattr(a, name) != getattr(b, name):
                notes.append(f"{section}.{name} changed ({getattr(a, name)!r} -> {getattr(b, name)!r}): "
                             "takes effect after a restart")
    for section in RESTART_SECTIONS:
        if getattr(old, section) != getattr(new, section):
            notes.append(f"{section}: changed; takes effect after a restart")
    return notes


def apply_policy(gateway: Gateway, policy: Policy) -> list[str]:
    """Apply a valid policy to the running gateway: first what a reload cannot change or may fail on (raises
    ValueError, nothing changed), then the swap. Replicas that stay keep their live state and accounting; the
    waiters of each pool keep their place in its new scheduler (shed with 503 if the pool is gone); requests in
    flight release to the objects that placed them. Returns the changes, in words."""
    fleet = gateway.fleet
    if len(policy.admission.lanes) != len(fleet.admission.lanes):
        raise ValueError("admission.lanes: changing the number of lanes needs a restart")
    identity = Identity(policy.tenants)  # reads the key file: may fail
    identity.open_streams = gateway.identity.open_streams
    pools, changes = _merge_pools(fleet.pools, policy.pools)
    replaced = fleet.rebuild(policy, pools)
    for name, old in replaced.items():
        new = fleet.schedulers.get(name)
        if new is None:
            old.shed_queued(Shed(503, "pool_removed", "the pool was removed by a policy reload"))
        else:
            new.take_over(old)
    budgets = gateway.budgets
    if policy.budgets != budgets.policy:
        budgets = gateway.make_budgets(policy)
        changes.append("budgets policy replaced")
    gateway.adopt(policy, identity, budgets)
    return changes or ["no change"]


def _merge_pools(old: dict[str, Pool], configs: list[PoolConfig]) -> tuple[dict[str, Pool], list[str]]:
    """The pools of the new policy: a pool that stays is the same object, and its replicas that stay too."""
    changes: list[str] = []
    pools: dict[str, Pool] = {}
    for cfg in configs:
        pool = old.get(cfg.model)
        if pool is None:
            pools[cfg.model] = Pool.from_config(cfg)
            changes.append(f"pool {cfg.model} added")
            continue
        keep = {r.address: r for r in pool.replicas}
        added = [a for a in cfg.replicas if a not in keep]
        removed = [a for a in keep if a not in cfg.replicas]
        if added or removed:
            changes.append(f"pool {cfg.model}: +{added} -{removed}")
        pool.replicas = [keep.get(a) or Replica(address=a, pool=cfg.model) for a in cfg.replicas]
        pools[cfg.model] = pool
    changes += [f"pool {name} removed" for name in old if name not in pools]
    return pools, changes


_background: set[asyncio.Task[None]] = set()


def _start_budgets(budgets: Any) -> None:
    """A reload that changes `budgets:` builds a new Budgets object; connect its store (Redis) like serve() does at
    start. The old object stays open: requests admitted under it still settle through it."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop (a synchronous caller): the store connects lazily or on its first probe

    async def start() -> None:
        try:
            await budgets.start()
        except Exception:
            log.exception("starting the reloaded budgets store failed; it falls back to local limits")

    task = loop.create_task(start(), name="sluice-budgets-start")
    _background.add(task)
    task.add_done_callback(_background.discard)


def _record(result: ReloadResult) -> ReloadResult:
    global _last
    _last = result
    (_OK if result.ok else _ERROR).inc()
    LAST_SUCCESS.set(1 if result.ok else 0)
    LAST_RELOAD_TS.set(result.at)
    return result


def reload_policy(path: str | os.PathLike[str], gateway: Gateway, trigger: str = "admin",
                  xds_out: str | os.PathLike[str] | None = None, xds_dir: str | os.PathLike[str] | None = None,
                  mode: str = "sluice") -> ReloadResult:
    """Read, validate and apply the policy file; never raises for a bad policy. With `xds_out`, Envoy's files are
    re-rendered there after the sidecar applied the policy (Envoy watches that directory). Synchronous: for
    callers without an event loop; the running sidecar uses `reload_policy_async`."""
    attempt = _Attempt(path, gateway, trigger)
    policy = attempt.read()
    if policy is None or not attempt.apply(policy):
        return attempt.result
    if xds_out is not None:
        attempt.rendered(_render_xds(policy, xds_out, xds_dir, mode))
    return attempt.finish(policy)


async def reload_policy_async(path: str | os.PathLike[str], gateway: Gateway, trigger: str = "admin",
                              xds_out: str | os.PathLike[str] | None = None,
                              xds_dir: str | os.PathLike[str] | None = None, mode: str = "sluice") -> ReloadResult:
    """`reload_policy` for the running sidecar: reading and validating the file, and rendering Envoy's files
    (about 130 ms of CPU with envoy-data-plane), run in a worker thread, so the event loop keeps answering Envoy
    within its `message_timeout` while a reload is under way. Only the swap itself (`apply_policy`, well under a
    millisecond) runs on the loop, between two messages, as before."""
    attempt = _Attempt(path, gateway, trigger)
    policy = await asyncio.to_thread(attempt.read)
    if policy is None or not attempt.apply(policy):
        return attempt.result
    if xds_out is not None:
        attempt.rendered(await asyncio.to_thread(_render_xds, policy, xds_out, xds_dir, mode))
    return attempt.finish(policy)


class _Attempt:
    """One reload attempt, step by step: read (any thread), apply (the gateway's loop), then finish. A failed step
    records the attempt (`result`) and leaves the previous policy in force."""

    def __init__(self, path: str | os.PathLike[str], gateway: Gateway, trigger: str) -> None:
        self.path, self.gateway, self.trigger = path, gateway, trigger
        self.at = time.time()
        self.src = str(path)
        self.old = gateway.policy
        self.budgets_before = getattr(gateway, "budgets", None)
        self.changes: list[str] = []
        self.result: ReloadResult | None = None

    def read(self) -> Policy | None:
        try:
            return load_policy(self.path)
        except Exception as exc:
            self._fail(exc)
            return None

    def apply(self, policy: Policy) -> bool:
        try:
            self.changes = apply_policy(self.gateway, policy)
        except Exception as exc:
            self._fail(exc)
            return False
        return True

    def rendered(self, change: str) -> None:
        self.changes.append(change)

    def finish(self, policy: Policy) -> ReloadResult:
        """Record the applied policy: restart-only changes noted, a replaced budgets store started."""
        changes = [c for c in self.changes if c != "no change"] + restart_notes(self.old, policy)
        budgets_after = getattr(self.gateway, "budgets", None)
        if budgets_after is not self.budgets_before and hasattr(budgets_after, "start"):
            _start_budgets(budgets_after)
        note_policy(policy)
        if not changes:
            changes = ["no change"]
        log.info("policy reload (%s) applied from %s: %s", self.trigger, self.src, "; ".join(changes))
        self.result = _record(ReloadResult(True, changes, "", self.src, self.at, self.trigger))
        return self.result

    def _fail(self, exc: Exception) -> None:
        if isinstance(exc, (PolicyError, ValueError, TypeError)):
            msg = str(exc) if isinstance(exc, PolicyError) else f"{self.src}: {exc}"
            log.error("policy reload (%s) rejected, the previous policy stays in force: %s", self.trigger, msg)
        else:  # a bug in a section parser must not kill the watcher
            msg = f"{self.src}: {type(exc).__name__}: {exc}"
            log.exception("policy reload (%s) failed, the previous policy stays in force", self.trigger)
        self.result = _record(ReloadResult(False, [], msg, self.src, self.at, self.trigger))


def _render_xds(policy: Policy, xds_out: str | os.PathLike[str], xds_dir: str | os.PathLike[str] | None,
                mode: str) -> str:
    """Re-render Envoy's files after the sidecar applied the policy; returns the change line (a failure is said
    loudly, and the sidecar side stays applied)."""
    try:
        from extproc.xds import render

        render(policy, xds_out, mode, xds_dir=xds_dir)
        return f"envoy xDS re-rendered into {xds_out}"
    except Exception as exc:
        log.exception("policy applied to the sidecar, but re-rendering Envoy's xDS into %s failed", xds_out)
        return f"envoy xDS NOT re-rendered: {type(exc).__name__}: {exc}"


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class PolicyWatcher:
    """Reloads the gateway's policy on SIGHUP and when the file changes (content, not just mtime).

    `on_change(result)` is called after every attempt (ok or not). With `xds_out`, Envoy's bootstrap/LDS/CDS are
    re-rendered there (point it at the directory Envoy watches; `xds_dir` is where Envoy reads them, as for
    `sluice render --xds-dir`)."""

    def __init__(self, path: str | os.PathLike[str], gateway: Gateway,
                 on_change: Callable[[ReloadResult], Any] | None = None, interval_s: float = 1.0,
                 xds_out: str | os.PathLike[str] | None = None, xds_dir: str | os.PathLike[str] | None = None,
                 mode: str = "sluice", settle_s: float = 0.1) -> None:
        self.path = Path(path)
        self.gateway = gateway
        self.on_change = on_change
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.xds_out, self.xds_dir, self.mode = xds_out, xds_dir, mode
        self._stamp = _stamp(self.path)
        self._digest = _digest(self.path)
        self._task: asyncio.Task[None] | None = None
        self._sighup = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reloading = asyncio.Lock()
        LAST_SUCCESS.set(1)  # the policy the gateway started with is valid and in force
        note_policy(gateway.policy)

    # ---- lifecycle --------------------------------------------------------------------------------------
    async def start(self, sighup: bool = True) -> None:
        """Start polling; with `sighup`, also reload on SIGHUP (main thread of the process only)."""
        self._loop = asyncio.get_running_loop()
        if sighup:
            try:
                self._loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
                self._sighup = True
            except (NotImplementedError, RuntimeError, ValueError) as exc:
                log.warning("SIGHUP reload unavailable here (%s); file changes and `sluice reload` still work", exc)
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name="sluice-policy-watcher")
        log.info("watching %s for changes (every %gs%s)", self.path, self.interval_s,
                 ", and SIGHUP" if self._sighup else "")

    async def stop(self) -> None:
        if self._sighup and self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    # ---- reloading --------------------------------------------------------------------------------------
    def reload(self, trigger: str = "admin") -> ReloadResult:
        """Reload now, synchronously (callers without a running loop)."""
        self._remember_file()
        return self._report(reload_policy(self.path, self.gateway, trigger, self.xds_out, self.xds_dir, self.mode))

    async def reload_async(self, trigger: str = "admin") -> ReloadResult:
        """Reload now without blocking the loop (admin API hook: `AdminServicer(..., on_reload=watcher.reload_async)`;
        SIGHUP and file changes go through it too)."""
        async with self._reloading:  # one at a time: a SIGHUP during a file-change reload waits its turn
            self._remember_file()
            return self._report(await reload_policy_async(self.path, self.gateway, trigger, self.xds_out,
                                                          self.xds_dir, self.mode))

    def _remember_file(self) -> None:
        self._stamp = _stamp(self.path)
        self._digest = _digest(self.path)

    def _report(self, result: ReloadResult) -> ReloadResult:
        if self.on_change is not None:
            try:
                self.on_change(result)
            except Exception:
                log.exception("policy watcher on_change callback failed")
        return result

    def _on_sighup(self) -> None:
        log.info("SIGHUP: reloading %s", self.path)
        task = asyncio.ensure_future(self.reload_async("sighup"))
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            stamp = _stamp(self.path)
            if stamp == self._stamp or stamp is None:
                continue  # unchanged, or gone for a moment (an editor's rename): keep the policy in force
            # Let a writer finish: wait until the file stops changing (bounded).
            for _ in range(20):
                await asyncio.sleep(self.settle_s)
                again = _stamp(self.path)
                if again == stamp:
                    break
                stamp = again
            digest = _digest(self.path)
            if digest is not None and digest == self._digest:
                self._stamp = stamp  # touched, same content: nothing to do
                continue
            await self.reload_async("file_change")


__all__ = ["PolicyWatcher", "ReloadResult", "apply_policy", "reload_policy", "reload_policy_async", "last_result", "note_policy",
           "restart_notes",
           "RELOADS", "LAST_SUCCESS", "LAST_RELOAD_TS", "MAX_DOWNSTREAM_CONNECTIONS"]
