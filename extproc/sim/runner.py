"""Drives an :class:`Engine` in real time: one asyncio task per replica, stepping while there is work.

Time mapping: simulated seconds = (loop time - t0) * time_scale. A step of ``d`` simulated
seconds sleeps ``d / time_scale`` wall seconds. Steps run back to back on the simulated clock;
if the event loop falls behind (a busy host) by more than ``MAX_LAG`` wall seconds the clock is
resynchronised to now and the lost time is simply gone, as it would be for an overloaded server.

Token delivery is batched: requests touched by steps are woken once, just before the runner
sleeps again, so a handler writes every token it has not sent yet in one write.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import sys
import traceback

from .engine import FINISHED, Engine, Request, Step

__all__ = ["EngineRunner"]

MAX_LAG = 0.05  # wall seconds of backlog tolerated before resynchronising the clock


def _wake_future(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


class EngineRunner:
    def __init__(self, engine: Engine, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.engine = engine
        self.time_scale = time_scale
        self.paused = False  # the hang fault (and a crash): accept work, never step
        self._wake = asyncio.Event()
        self._pending: set[Request] = set()
        self._task: asyncio.Task[None] | None = None
        self._step_fut: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self.on_step: Callable[[], None] | None = None

    # ---- time ----------------------------------------------------------------------------

    def sim_now(self) -> float:
        return (self._loop.time() - self._t0) * self.time_scale

    def wall_at(self, sim_t: float) -> float:
        return self._t0 + sim_t / self.time_scale

    # ---- control -------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self.engine.clock = self.sim_now()
            self._task = self._loop.create_task(self._run(), name="sim-engine")
            self._task.add_done_callback(self._died)

    @staticmethod
    def _died(task: "asyncio.Task[None]") -> None:
        # The engine task must never end by itself: make a bug loud instead of a silent hang.
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            print("sim: engine task died:", file=sys.stderr)
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def wake(self) -> None:
        self._wake.set()

    def retime(self) -> None:
        """A fault changed (slow factor, hang, crash): cut the current step's sleep short."""
        fut = self._step_fut
        if fut is not None and not fut.done():
            fut.set_result(None)
        self._wake.set()

    async def _sleep_step(self, step: "Step", delay: float) -> None:
        """Sleep until ``step`` ends; if the slow factor changes meanwhile, stretch or shrink
        what is left of the step; if the engine is paused, return at once."""
        loop = self._loop
        factor = self.engine.slow_factor
        while delay > 0 and not self.paused:
            fut = loop.create_future()
            self._step_fut = fut
            handle = loop.call_later(delay, _wake_future, fut)
            try:
                await fut
            finally:
                handle.cancel()
                self._step_fut = None
            new = self.engine.slow_factor
            if new != factor:
                now = self.sim_now()
                left = max(0.0, step.start + step.duration - now)
                step.duration = (now - step.start) + left * new / factor
                factor = new
            delay = self.wall_at(step.start + step.duration) - loop.time()

    def submit(self, req: Request) -> None:
        """Queue a request arriving now."""
        eng = self.engine
        now = self.sim_now()
        if not eng.has_work() and eng.clock < now:
            eng.clock = now
        eng.add(req, now)
        self._wake.set()

    def abort(self, req: Request) -> bool:
        if self.engine.abort(req):
            self._pending.add(req)
            self._wake.set()
            return True
        return False

    def deliver(self) -> None:
        """Wake every handler whose request got tokens or finished since the last delivery."""
        if not self._pending:
            return
        for req in self._pending:
            fut = req.waiter
            if fut is not None and not fut.done() and (req.notify_each or req.status == FINISHED):
                fut.set_result(None)
        self._pending.clear()

    def touch(self, reqs: list[Request]) -> None:
        self._pending.update(reqs)

    # ---- the loop ------------------------------------------------------------------------

    async def _idle(self, timeout: float | None) -> None:
        self._wake.clear()
        if timeout is None:
            await self._wake.wait()
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _run(self) -> None:
        eng = self.engine
        loop = self._loop
        idle = True
        catch_up = 0
        while True:
            if self.paused:
                self.deliver()
                await self._idle(None)
                idle = True
                continue
            sn = self.sim_now()
            if idle or eng.clock < sn - MAX_LAG * self.time_scale:
                eng.clock = max(eng.clock, sn) if idle else sn
            step = eng.schedule()
            if step is None:
                self.deliver()
                idle = True
                nxt = eng.next_ready_time()
                if nxt is not None and nxt > eng.clock:
                    await self._idle(max(0.0, self.wall_at(nxt) - loop.time()))
                else:
                    await self._idle(None)
                continue
            idle = False
            delay = self.wall_at(step.start + step.duration) - loop.time()
            if delay > 0:
                self.deliver()
                await self._sleep_step(step, delay)
                catch_up = 0
            else:
                catch_up += 1
                if catch_up >= 8:  # behind schedule: still let handlers and I/O run
                    self.deliver()
                    await asyncio.sleep(0)
                    catch_up = 0
            if self.paused:
                # A hang/crash arrived mid-step: the step never completes.
                continue
            touched = eng.complete(step)
            if touched:
                self._pending.update(touched)
            if self.on_step is not None:
                self.on_step()
