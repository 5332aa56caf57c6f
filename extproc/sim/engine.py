"""Iteration-level model of one vLLM V1 engine: scheduler, KV block pool, cost, statistics.

Pure logic, no I/O and no wall clock: the caller owns time. ``schedule()`` plans one step at
``engine.clock`` and returns it with its duration; ``complete(step)`` advances the clock to the
step's end and applies it (tokens, finishes). The asyncio runner in ``runner.py`` sleeps between
the two; tests and ``calibrate.py`` call them back to back (see :func:`run_offline`).

The scheduler follows vLLM V1's ``Scheduler.schedule``:

1. running requests first, in order: a decode takes 1 token of the step budget
   (``max_num_batched_tokens``), an unfinished prefill takes ``min(remaining, budget)``
   (chunked prefill). If its KV blocks do not fit, the *newest* running request is preempted
   (blocks freed, progress dropped, back to the head of the waiting queue, recomputed later),
   repeatedly, possibly itself;
2. then, only if nothing was preempted in this step, waiting requests in FCFS order, while the
   budget lasts and fewer than ``max_num_seqs`` run; one starts only when the blocks for its
   whole sequence so far fit, prompt and any output it already made (vLLM's
   ``scheduler_reserve_full_isl``, on by default in vLLM 0.32: it keeps chunked prefill
   from admitting a prompt whose first chunk fits but whose rest does not, which would preempt
   it or its neighbours a step later), otherwise it and all behind it wait (head-of-line, like
   vLLM). With ``reserve_full_isl=False`` only the first chunk has to fit (vLLM's
   ``--no-scheduler-reserve-full-isl``).

So preemption comes from running requests outgrowing the free blocks while they decode, not
from admission.

KV cache is counted in blocks of ``block_size`` tokens. With the prefix cache on, full prompt
blocks are keyed by a chained hash of their token ids, shared between requests, and kept after
release as evictable (LRU) until the space is needed.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from .presets import CostModel

__all__ = [
    "Request",
    "Step",
    "Engine",
    "Histogram",
    "EngineStats",
    "block_hashes",
    "run_offline",
    "run_closed_loop",
    "WAITING",
    "RUNNING",
    "FINISHED",
]

WAITING = 0
RUNNING = 1
FINISHED = 2

# vLLM 0.32's histogram buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's 1-2-5 token buckets up to the model's context (here up to 100,000 tokens)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(5) for m in (1, 2, 5)) + (100_000,)


class Histogram:
    """A Prometheus-style histogram kept as plain counts (cheap per observation)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above the top bound
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def observe_many(self, v: float, n: int) -> None:
        self.counts[bisect_left(self.bounds, v)] += n
        self.sum += v * n
        self.count += n

    def cumulative(self) -> list[tuple[float, int]]:
        out = []
        acc = 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((b, acc))
        return out


@dataclass
class EngineStats:
    """Counters and histograms in the names' spirit of vLLM's; times divided by ``time_scale``.

    The engine works in simulated seconds; observers see wall seconds (simulated / time_scale),
    so what a gateway measures and what it scrapes agree.
    """

    time_scale: float = 1.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    ghost_tokens: int = 0
    late_tokens: int = 0  # generated after the client's deadline (x-sim-deadline) while it was still connected
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    steps: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    # Per finished request (stop or length; a client's abort is not observed, as in vLLM): its first scheduling to
    # its first token, and the prompt tokens it computed (the prompt less its prefix-cache hit).
    prefill_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    prefill_computed: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))


class Request:
    """One sequence in the engine. ``num_tokens`` = prompt + generated so far."""

    __slots__ = (
        "rid", "prompt_len", "max_output", "arrival", "ready_at", "hashes", "status",
        "num_computed", "num_output", "private_blocks", "shared", "first_scheduled", "cached",
        "first_token_at", "last_token_at", "finish_reason", "preemptions", "client_gone",
        "ghost_tokens", "stop_reason", "waiter", "notify_each", "tag", "deadline",
    )

    def __init__(self, rid: str, prompt_len: int, max_output: int, *,
                 hashes: tuple[int, ...] | None = None, stop_reason: str = "length",
                 tag: Any = None) -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.max_output = max_output
        self.hashes = hashes  # chained hashes of full prompt blocks (prefix cache), or None
        self.stop_reason = stop_reason  # finish reason once max_output is reached
        self.arrival = 0.0
        self.ready_at = 0.0
        self.status = WAITING
        self.num_computed = 0
        self.num_output = 0
        self.private_blocks = 0
        self.shared: list[int] = []  # hashes of the cached blocks it holds (leading blocks)
        self.first_scheduled: float | None = None
        self.cached = 0  # prompt tokens found in the prefix cache when first scheduled
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.client_gone = False
        self.ghost_tokens = 0
        self.waiter: Any = None  # owned by the runner (an asyncio future)
        self.notify_each = True  # wake the waiter on every token (streams) or only at the end
        self.tag = tag
        self.deadline: float | None = None  # simulated time after which nobody waits for the answer

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output

    @property
    def num_blocks(self) -> int:
        return self.private_blocks + len(self.shared)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Request({self.rid!r}, prompt={self.prompt_len}, out={self.num_output}/"
                f"{self.max_output}, computed={self.num_computed}, status={self.status})")


def block_hashes(ids: list[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``ids``: block i's key covers blocks 0..i."""
    out = []
    h = 0
    for i in range(0, len(ids) - block_size + 1, block_size):
        h = hash((h, tuple(ids[i:i + block_size])))
        out.append(h)
    return tuple(out)


class BlockPool:
    """KV blocks: free, in use, or cached-and-evictable (ref count 0, LRU order).

    Like vLLM's BlockPool, one block is the null block (a placeholder that never holds a token), so
    ``total`` blocks hold ``total - 1`` blocks of tokens; measured: 8 streams of 1,024-token prompts on
    an 80-block engine are preempted when they need their 10th block each (79 usable, not 80)."""

    __slots__ = ("total", "lost", "free", "refs", "evictable")

    NULL_BLOCKS = 1

    def __init__(self, total: int) -> None:
        self.total = total
        self.lost = 0  # blocks removed by the kv-shrink fault
        self.free = max(total - self.NULL_BLOCKS, 0)  # free blocks holding nothing cached
        self.refs: dict[int, int] = {}  # hash -> holders
        self.evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def capacity(self) -> int:
        return max(self.total - self.NULL_BLOCKS - self.lost, 0)

    def num_free(self) -> int:
        return self.free + len(self.evictable)

    def used(self) -> int:
        return self.capacity - self.free - len(self.evictable)

    def take(self, n: int) -> None:
        """Take ``n`` blocks (caller checked they fit): plain free ones first, then evict LRU."""
        self.free -= n
        while self.free < 0 and self.evictable:
            h, _ = self.evictable.popitem(last=False)
            del self.refs[h]
            self.free += 1

    def ref(self, h: int) -> None:
        r = self.refs[h]
        if r == 0:
            del self.evictable[h]
        self.refs[h] = r + 1

    def unref(self, h: int) -> None:
        r = self.refs[h] - 1
        self.refs[h] = r
        if r == 0:
            self.evictable[h] = None

    def set_lost(self, lost: int) -> None:
        self.free -= lost - self.lost
        self.lost = lost
        while self.free < 0 and self.evictable:
            h, _ = self.evictable.popitem(last=False)
            del self.refs[h]
            self.free += 1


@dataclass(slots=True)
class Step:
    """One planned forward pass: ``items`` are (request, tokens computed for it)."""

    start: float
    duration: float
    items: list[tuple[Request, int]]
    prefill_tokens: int
    samples: int


class Engine:
    """One replica's engine. All times are simulated seconds on ``self.clock``."""

    def __init__(self, cost: CostModel, *, num_gpu_blocks: int, block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 prefix_cache: bool = True, time_scale: float = 1.0, reserve_full_isl: bool = True) -> None:
        self.cost = cost
        self.reserve_full_isl = reserve_full_isl  # admit only when the whole sequence's blocks fit (see above)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.pool = BlockPool(num_gpu_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.clock = 0.0
        self.slow_factor = 1.0  # the `slow` fault: every step this many times longer
        # The API server's work (cost.server_core each) for requests that arrived while the engine was busy, not yet
        # paid: they share its core, so the next step runs that much longer.
        self.core_debt = 0.0
        self.stats = EngineStats(time_scale=time_scale)
        self._by_id: dict[str, Request] = {}

    # ---- inspection ----------------------------------------------------------------------

    @property
    def num_gpu_blocks(self) -> int:
        return self.pool.total

    def kv_usage(self) -> float:
        """Blocks in use / blocks available (cached-but-free blocks count as free, like vLLM)."""
        cap = self.pool.capacity
        return min(1.0, self.pool.used() / cap) if cap > 0 else 1.0

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def waiting_in_engine(self, now: float | None = None) -> int:
        """Waiting requests that reached the engine by `now` (default: the clock): a request still in its frontend
        delay (the API server tokenizing it) is not yet in vLLM's scheduler queue, which `vllm:num_requests_waiting`
        counts, and a gateway reading the gauge takes a waiting request for one the engine has no room for."""
        t = self.clock if now is None else now
        return sum(1 for r in self.waiting if r.ready_at <= t)

    def next_ready_time(self) -> float | None:
        """When the head of the waiting queue reaches the engine (after its frontend delay)."""
        return self.waiting[0].ready_at if self.waiting else None

    def get(self, rid: str) -> Request | None:
        return self._by_id.get(rid)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---- requests in and out -------------------------------------------------------------

    def add(self, req: Request, arrival: float | None = None) -> None:
        """Queue a request that arrived at ``arrival`` (default: now) at the API server."""
        req.arrival = self.clock if arrival is None else arrival
        req.ready_at = req.arrival + self.cost.frontend + self.cost.frontend_tok * req.prompt_len
        if self.running or self.waiting:
            self.core_debt += self.cost.server_core
        req.status = WAITING
        self.waiting.append(req)
        self._by_id[req.rid] = req

    def abort(self, rid_or_req: str | Request) -> bool:
        """Abort a request now: its blocks are free before the next step is planned."""
        req = self._by_id.get(rid_or_req) if isinstance(rid_or_req, str) else rid_or_req
        if req is None or req.status == FINISHED:
            return False
        if req.status == RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._finish(req, "abort", self.clock)
        return True

    def set_kv_lost_fraction(self, fraction: float) -> None:
        """The kv-shrink fault: lose ``fraction`` of the blocks (running work may be preempted)."""
        fraction = min(max(fraction, 0.0), 0.99)
        self.pool.set_lost(int(self.pool.total * fraction))

    def reset(self) -> list[Request]:
        """Drop every request (the crash fault). Returns them, already finished as aborted."""
        dropped = list(self.running) + list(self.waiting)
        for req in dropped:
            self.abort(req)
        self.core_debt = 0.0
        return dropped

    def wipe_cache(self) -> None:
        """Forget every cached block (a crashed engine's GPU memory is gone). Engine must be empty."""
        assert not self.running and not self.waiting
        lost = self.pool.lost
        self.pool = BlockPool(self.pool.total)
        self.pool.set_lost(lost)

    # ---- scheduling ----------------------------------------------------------------------

    def _release(self, req: Request) -> None:
        pool = self.pool
        for h in req.shared:
            pool.unref(h)
        req.shared = []
        pool.free += req.private_blocks
        req.private_blocks = 0

    def _finish(self, req: Request, reason: str, now: float) -> None:
        self._release(req)
        req.status = FINISHED
        req.finish_reason = reason
        st = self.stats
        st.finished[reason] = st.finished.get(reason, 0) + 1
        self._by_id.pop(req.rid, None)
        if reason != "abort":
            st.e2e.observe((now - req.arrival) / st.time_scale)
            if req.first_token_at is not None and req.first_scheduled is not None:
                st.prefill_time.observe((req.first_token_at - req.first_scheduled) / st.time_scale)
                st.prefill_computed.observe(req.prompt_len - req.cached)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed = 0
        req.status = WAITING
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _prefix_lookup(self, req: Request) -> tuple[int, int]:
        """Leading prompt blocks already cached: (blocks, of which evictable)."""
        hashes = req.hashes
        if not hashes:
            return 0, 0
        refs = self.pool.refs
        # Leave at least one token to compute, as vLLM does (it must produce logits).
        limit = min(len(hashes), (req.num_tokens - 1) // self.block_size)
        k = 0
        ev = 0
        while k < limit:
            r = refs.get(hashes[k])
            if r is None:
                break
            if r == 0:
                ev += 1
            k += 1
        return k, ev

    def schedule(self) -> Step | None:
        """Plan the next step at ``self.clock``; None when nothing can run now."""
        now = self.clock
        pool = self.pool
        running = self.running
        # A kv-shrink may have left fewer blocks than are in use: preempt the newest until it fits.
        while pool.free < 0 and running:
            self._preempt(running.pop())
        budget = self.max_num_batched_tokens
        items: list[tuple[Request, int]] = []
        prefill = 0
        samples = 0
        pairs = 0.0  # query-key pairs within the prefill chunks
        ctx_pairs = 0.0  # pairs of chunk tokens with the context computed before the chunk
        kv_read = 0
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            remaining = req.num_tokens - req.num_computed
            n = remaining if remaining < budget else budget
            need = self.blocks_for(req.num_computed + n) - req.num_blocks
            if need > 0:
                scheduled = True
                while need > pool.num_free():
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        scheduled = False
                        break
                if not scheduled:
                    break
                pool.take(need)
                req.private_blocks += need
            items.append((req, n))
            budget -= n
            if n == remaining:
                samples += 1
            if req.num_output > 0 and remaining == 1:
                kv_read += req.num_computed + 1  # a decode reads its whole context
            else:
                prefill += n
                pairs += n * (n + 1) * 0.5
                ctx_pairs += n * req.num_computed
            i += 1

        if not preempted:
            waiting = self.waiting
            max_seqs = self.max_num_seqs
            bs = self.block_size
            while waiting and budget > 0 and len(running) < max_seqs:
                req = waiting[0]
                if req.ready_at > now:
                    break
                hit_blocks, hit_evictable = (0, 0)
                if self.prefix_cache and req.num_computed == 0 and req.hashes:
                    hit_blocks, hit_evictable = self._prefix_lookup(req)
                computed = hit_blocks * bs
                if self.blocks_for(req.num_tokens) > pool.capacity:
                    # Can never fit (kv-shrink made the cache smaller than the request).
                    waiting.popleft()
                    self._finish(req, "abort", now)
                    continue
                remaining = req.num_tokens - computed
                n = remaining if remaining < budget else budget
                need = self.blocks_for(computed + n) - hit_blocks
                gate = self.blocks_for(req.num_tokens) - hit_blocks if self.reserve_full_isl else need
                if gate > pool.num_free() - hit_evictable:
                    break
                waiting.popleft()
                if self.prefix_cache and req.hashes is not None and req.num_output == 0 \
                        and req.preemptions == 0:
                    self.stats.prefix_queries += req.prompt_len
                    self.stats.prefix_hits += computed
                    req.cached = computed
                if hit_blocks:
                    hashes = req.hashes
                    assert hashes is not None
                    for k in range(hit_blocks):
                        pool.ref(hashes[k])
                    req.shared = list(hashes[:hit_blocks])
                    req.num_computed = computed
                pool.take(need)
                req.private_blocks += need
                req.status = RUNNING
                running.append(req)
                if req.first_scheduled is None:
                    req.first_scheduled = now
                    self.stats.queue.observe(max(0.0, now - req.ready_at) / self.stats.time_scale)
                items.append((req, n))
                budget -= n
                if n == remaining:
                    samples += 1
                prefill += n
                pairs += n * (n + 1) * 0.5
                ctx_pairs += n * computed

        if not items:
            # Everything running was preempted (the first request could not grow): plan again,
            # this time from the waiting queue, rather than stalling for a step.
            return self.schedule() if preempted else None
        duration = self.cost.step_seconds(prefill, samples, pairs, kv_read, ctx_pairs) * self.slow_factor
        duration += self.core_debt
        self.core_debt = 0.0
        return Step(now, duration, items, prefill, samples)

    def complete(self, step: Step) -> list[Request]:
        """Apply a planned step at its end time. Returns requests that got a token or finished."""
        end = step.start + step.duration
        if end > self.clock:
            self.clock = end
        st = self.stats
        scale = st.time_scale
        touched: list[Request] = []
        done = False
        itl_value = -1.0
        itl_n = 0
        bs = self.block_size
        for req, n in step.items:
            if req.status != RUNNING:
                continue  # aborted (or preempted by a later plan) while the step ran
            req.num_computed += n
            if self.prefix_cache and req.hashes:
                self._register_blocks(req, bs)
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            req.num_output += 1
            st.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = end
                st.prompt_tokens += req.prompt_len
                st.ttft.observe((end - req.arrival) / scale)
            else:
                gap = (end - req.last_token_at) / scale
                if gap == itl_value:
                    itl_n += 1
                else:
                    if itl_n:
                        st.itl.observe_many(itl_value, itl_n)
                    itl_value, itl_n = gap, 1
            req.last_token_at = end
            if req.client_gone:
                req.ghost_tokens += 1
                st.ghost_tokens += 1
            elif req.deadline is not None and end > req.deadline:
                st.late_tokens += 1
            if req.num_output >= req.max_output:
                self._finish(req, req.stop_reason, end)
                done = True
            touched.append(req)
        if itl_n:
            st.itl.observe_many(itl_value, itl_n)
        if done:
            self.running = [r for r in self.running if r.status == RUNNING]
        st.steps += 1
        return touched

    def _register_blocks(self, req: Request, bs: int) -> None:
        """Make newly computed full prompt blocks shareable (keyed by their chained hash)."""
        hashes = req.hashes
        assert hashes is not None
        have = len(req.shared)
        full = min(len(hashes), req.num_computed // bs)
        if have >= full:
            return
        pool = self.pool
        refs = pool.refs
        for k in range(have, full):
            h = hashes[k]
            r = refs.get(h)
            if r is None:
                refs[h] = 1  # our private block becomes the cached copy
            else:
                pool.ref(h)  # someone cached the same block first: share it, free ours
                pool.free += 1
            req.private_blocks -= 1
            req.shared.append(h)

    # ---- invariants (tests) --------------------------------------------------------------

    def check_invariants(self) -> None:
        pool = self.pool
        held = sum(r.private_blocks for r in self.running)
        refcount: dict[int, int] = {}
        for r in self.running:
            for h in r.shared:
                refcount[h] = refcount.get(h, 0) + 1
        for h, c in pool.refs.items():
            assert refcount.get(h, 0) == c, (h, c, refcount.get(h))
            assert (c == 0) == (h in pool.evictable)
        cached_in_use = sum(1 for c in pool.refs.values() if c > 0)
        assert pool.used() == held + cached_in_use, (pool.used(), held, cached_in_use)
        for r in self.waiting:
            assert r.num_blocks == 0


def run_offline(engine: Engine, arrivals: list[tuple[float, Request]],
                until: float = 1e9, max_steps: int = 10_000_000) -> list[Request]:
    """Drive ``engine`` in simulated time for a fixed arrival list (no I/O; tests, calibration).

    ``arrivals`` are (time, request) pairs; returns the requests once all have finished (or the
    clock passed ``until``). The clock jumps over idle gaps.
    """
    pending = deque(sorted(arrivals, key=lambda a: a[0]))
    reqs = [r for _, r in arrivals]
    steps = 0
    while (pending or engine.has_work()) and engine.clock < until and steps < max_steps:
        while pending and pending[0][0] <= engine.clock:
            t, r = pending.popleft()
            engine.add(r, t)
        step = engine.schedule()
        if step is None:
            nxt = [t for t in (engine.next_ready_time(), pending[0][0] if pending else None)
                   if t is not None and t > engine.clock]
            if not nxt:
                break  # stuck: nothing can run and nothing will arrive
            engine.clock = min(nxt)
            continue
        # Requests arriving during the step are queued at their arrival time; they can only
        # be scheduled from the next step on, as in the real engine.
        end = step.start + step.duration
        while pending and pending[0][0] <= end:
            t, r = pending.popleft()
            engine.add(r, t)
        engine.complete(step)
        steps += 1
    return reqs


def run_closed_loop(engine: Engine, streams: int, prompt: int, output: int, warmup: int = 2,
                    counted: int = 12) -> float:
    """Completions per second of ``engine`` kept busy by ``streams`` clients, each sending its next request
    (``prompt`` + ``output`` tokens) the moment its previous answer ends, as a load probe's clients do:

        rate = completions counted / (last counted completion - the end of the warm-up)

    The first ``warmup`` x ``streams`` completions are the warm-up (the clients start together); the next
    ``counted`` x ``streams`` are counted. NaN when the engine cannot serve the request."""
    first, total = warmup * streams, (warmup + counted) * streams
    for k in range(streams):
        engine.add(Request(f"c{k}", prompt, output), engine.clock)
    sent, finished, warm_end = streams, 0, engine.clock
    for _ in range(10_000_000):
        step = engine.schedule()
        if step is None:
            nxt = engine.next_ready_time()
            if nxt is None or nxt <= engine.clock:
                return float("nan")  # nothing can run and nothing will: the request does not fit
            engine.clock = nxt
            continue
        for req in engine.complete(step):
            if not req.finished:
                continue
            finished += 1
            if finished == first:
                warm_end = engine.clock
            elif finished == total:
                return (total - first) / (engine.clock - warm_end)
            engine.add(Request(f"c{sent}", prompt, output), engine.clock)
            sent += 1
    return float("nan")
