"""Reading every replica's own /metrics, fast enough to do every 200 ms for 20 replicas on a fraction of a core.

    Scraper loop (every scrape_interval_s, fixed rate):
      for each replica with no scrape in flight: GET http://{address}/metrics  (one aiohttp session, keep-alive,
                                                                               per-request timeout)
        ok   -> MetricsParser.parse (line scanner, needed samples only) -> History (window deltas)
             -> replica.on_scrape(ScrapedState(scraped_at=monotonic(), ...))
        fail -> replica.engine.scrape_failures += 1 (and scrape_timeouts += 1 when it timed out); scraped_at
                stays old, so the replica goes stale
      wait for this round's scrapes at most one interval (a hung replica never delays the others),
      then call every `listeners` callback (health evaluation, dispatch of queued requests).

Parsing (`MetricsParser`, ~90 us for a 490-line, 45 KB vLLM page; prometheus-client's own parser builds objects
for every sample and takes ~7.7 ms): prometheus-client (vLLM, SGLang) writes each family as one block opened by
`# TYPE <name> <type>`, so the page is cut at those lines and only the blocks of wanted families are read;
histogram blocks by one regex pass for their `le` buckets, other blocks line by line (sample name looked up in a
dict built from metric_names.py; only the labels that matter are read: `finished_reason`, `block_size`,
`num_gpu_blocks`). A page without TYPE lines is scanned line by line, touching only lines that start with a
wanted name (a tuple `startswith`, in C).

Windows: each replica keeps its recent cumulative snapshots (one per scrape, bounded); a windowed value is the
newest snapshot minus the newest one at or before `now - window_s` (or the oldest kept). A counter that goes
down means the engine restarted: the history restarts and the state says `restarted=True`. A gap longer than
`stale_after_s + scrape_timeout_s` between two successful scrapes (an outage, not one slow answer) also
restarts the history: first tokens observed before the outage must not count against the replica's recovery.
Slow answers are not an outage: a busy vLLM answers /metrics in seconds now and then (measured on two busy
engines: median 74 ms, p90 0.56 s, 1 in 10 past 1 s), so a gap whose failed scrapes all timed out keeps the
history (unless it outlasts the whole window), and the windowed rates keep covering the lumps in which vLLM
refreshes its counters.

Failed scrapes are told apart: a timeout means the replica may be busy (`scrape_timeouts`); a refused or reset
connection, an HTTP error or an unreadable page means it did not answer (health.py treats only those as
unreachable unless the replica has also stopped serving requests).

    recent p95 TTFT: the same quantile over the last `recent_s` only (slow start judges each step by the first
              tokens of that step: `routing.health.slow_start_step_s`).

    mean inter-token latency: delta of the histogram's sum / delta of its count, over the last `recent_s` too
              (the whole window without one). Admission plans deadlines with it (decode_time.py) and must see
              the engines' speed now: over 10 s, the intervals of a slowdown that had ended kept the mean at
              the slow speed, renewed at every scrape, and refused every request after it (real P5 run after
              P4: 36 of 36, 0.037 s per token read from engines that ran nothing).

    p95 TTFT: the bucket deltas form a histogram of the window's first tokens; the quantile is interpolated
              linearly inside the bucket holding rank 0.95 x count (Prometheus' histogram_quantile: the lowest
              bucket starts at 0; a rank in the +Inf bucket returns the highest finite bound).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import aiohttp
import yarl

from extproc.routing import metrics as rm
from extproc.routing.metric_names import (CACHE_INFO, HIST_BUCKET, HIST_COUNT, HIST_STAT, OUTCOMES, MetricNames,
                                          names_for)
from extproc.routing.policy import RoutingPolicy
from extproc.routing.pool import EngineState, Pool, Replica

log = logging.getLogger("sluice.routing.scrape")

_INF = float("inf")


# ---- what one scrape yields ---------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class ScrapedState(EngineState):
    """`EngineState` plus window facts the health tracker and scorer use (read them with getattr and a default
    so a plain EngineState also works)."""

    window_span_s: float = 0.0        # seconds the windowed values cover (0: first scrape, no deltas yet)
    running_avg: float = 0.0          # mean of the scraped running count over the window
    waiting_avg: float = 0.0          # mean of the scraped waiting count over the window
    preemptions_window: float = 0.0   # preemptions within the window (P9: stop routing to a preempting replica)
    prefix_hit_rate: float = 0.0      # prefix-cache hit share within the window (vLLM) or SGLang's gauge
    restarted: bool = False           # a counter went down since the previous scrape: the engine restarted
    prompt_tokens_total: float = -1.0  # the engine's prompt-token counter (-1: not exported); admission
                                       # learns the prefill speed from it
    first_tokens_total: float = -1.0   # first tokens ever (the TTFT histogram's count; -1: not exported): with
                                       # the prompt counter, the mean real prompt per request (token calibration)
    ttft_p95_recent_s: float = 0.0     # p95 TTFT over the last `History.recent_s` only (slow start's step)
    ttft_count_recent: float = 0.0     # first tokens within that short window
    itl_s: float = 0.0                 # mean inter-token latency over the last `History.recent_s` (0: no token
                                       # in it, or not exported); admission learns decode time per token from it
    itl_count_recent: float = 0.0      # inter-token intervals that mean covers
    prefix_queries_total: float = -1.0  # the prefix-cache counters, in tokens (-1: not exported); admission
    prefix_hits_total: float = -1.0     # confirms its prefix affinity from their deltas
    prefill_seconds_total: float = -1.0   # over the requests the engine finished: the seconds from each one's first
    prefilled_requests_total: float = -1.0  # scheduling to its first token, their number, and the prompt tokens
    prefill_computed_total: float = -1.0  # they computed (-1: not exported); admission reads a lower bound of the
                                          # prefill speed from their deltas, even when no engine queues


class Parsed:
    """The needed samples of one /metrics page (None: not exported)."""

    __slots__ = ("running", "waiting", "kv_usage", "preemptions", "generation_tokens", "prompt_tokens",
                 "generation_tps_gauge", "kv_capacity_tokens", "prefix_queries", "prefix_hits", "cache_hit_rate",
                 "ttft_bounds", "ttft_cum", "ttft_count", "finished", "errors", "cache_info_tokens",
                 "cache_block_tokens", "itl_sum", "itl_count", "prefill_s_sum", "prefill_s_count", "prefill_new_sum")

    def __init__(self) -> None:
        self.running = self.waiting = self.kv_usage = self.preemptions = None
        self.generation_tokens = self.prompt_tokens = self.generation_tps_gauge = None
        self.kv_capacity_tokens = self.prefix_queries = self.prefix_hits = self.cache_hit_rate = None
        self.ttft_bounds: tuple[float, ...] = ()
        self.ttft_cum: tuple[float, ...] = ()
        self.ttft_count: float | None = None   # first tokens ever (the +Inf bucket)
        self.finished: dict[str, float] = {}   # finished_reason -> count
        self.errors: float | None = None
        self.cache_info_tokens: int | None = None  # block_size x num_gpu_blocks (summed over engines)
        self.cache_block_tokens: int | None = None  # block_size: the engine shares a prompt's prefix in whole blocks
        self.itl_sum: float | None = None      # the inter-token latency histogram's _sum and _count
        self.itl_count: float | None = None
        self.prefill_s_sum: float | None = None    # the prefill-time histogram's _sum and _count, and the
        self.prefill_s_count: float | None = None  # computed-prompt-tokens histogram's _sum (per finished request)
        self.prefill_new_sum: float | None = None

    @property
    def first_tokens(self) -> float | None:
        """First tokens ever: the TTFT histogram's +Inf bucket (or its _count); None when not exported."""
        return self.ttft_cum[-1] if self.ttft_cum else self.ttft_count


# one histogram bucket sample: its le label (wherever it sits among the labels) and its value
_BUCKET_RE = re.compile(rb'_bucket\{[^}\n]*?\ble="([^"]*)"[^}\n]*\}[ \t]*(\S+)')
_ENGINE_FIELDS = frozenset(("running", "waiting", "kv_usage"))
_FRACTIONS = frozenset(("kv_usage", "cache_hit_rate"))


class _Acc:
    """Accumulators of one parse."""

    __slots__ = ("vals", "prio", "nvals", "buckets", "bucket_prio", "finished", "cache_tokens", "cache_seen",
                 "block_tokens")

    def __init__(self) -> None:
        self.vals: dict[str, float] = {}
        self.prio: dict[str, int] = {}
        self.nvals: dict[str, int] = {}
        self.buckets: dict[bytes, float] = {}
        self.bucket_prio = 1 << 30
        self.finished: dict[bytes, float] = {}
        self.cache_tokens = 0
        self.cache_seen = False
        self.block_tokens = 0


def _label(labels: bytes, key: bytes) -> bytes | None:
    """Value of one label in `{a="x",le="0.5"}` (no unescaping: the labels read here never need it)."""
    pat = key + b'="'
    i = labels.find(pat)
    while i > 0:
        c = labels[i - 1]
        if c in (0x7B, 0x2C, 0x20):  # '{' ',' ' '
            start = i + len(pat)
            end = labels.find(b'"', start)
            return labels[start:end] if end >= 0 else None
        i = labels.find(pat, i + 1)
    return None


class MetricsParser:
    """A line scanner for the Prometheus text format that reads only the samples named in `MetricNames`."""

    def __init__(self, names: MetricNames) -> None:
        self.names = names
        table = names.samples()
        self._table = {k.encode(): v for k, v in table.items()}
        families = set()
        for name, (kind, _f, _p) in table.items():
            if kind in (HIST_BUCKET, HIST_COUNT, HIST_STAT):
                name = name.rsplit("_", 1)[0]
            families.add(name.encode())
        self._prefixes = tuple(sorted(families))
        # block names as a `# TYPE` line spells them (counters: with and without _total)
        self._families = families | {f[:-len(b"_total")] for f in families if f.endswith(b"_total")}
        self._errors = {r.encode() for r in names.error_reasons}
        self._hist_families = {name[:-len("_bucket")].encode(): p for name, (kind, _f, p) in table.items()
                               if kind == HIST_BUCKET}
        self._le: dict[bytes, float] = {}
        self._order: dict[tuple[bytes, ...], tuple[tuple[float, ...], tuple[int, ...]]] = {}

    def parse(self, body: bytes) -> Parsed:
        """The needed samples of one page. prometheus-client (vLLM, SGLang) writes every family as a block
        opened by `# TYPE <name> <type>`: the page is cut at those lines and only the wanted blocks are split into
        lines. A page without TYPE lines, or where the engine's gauges were not found that way, is scanned line
        by line instead."""
        acc = _Acc()
        blocks = body.split(b"\n# TYPE ")
        if len(blocks) > 1:
            families = self._families
            self._scan(blocks[0].split(b"\n"), acc)
            hists = self._hist_families
            for block in blocks[1:]:
                name = block[:block.find(b" ")]
                if name not in families:
                    continue
                p = hists.get(name)
                if p is not None and block.startswith(b"histogram", len(name) + 1):
                    # buckets only (the +Inf bucket is the count); one C-level pass over the block
                    if p > acc.bucket_prio:
                        continue
                    if p < acc.bucket_prio:
                        acc.bucket_prio = p
                        acc.buckets = {}
                    buckets = acc.buckets
                    for le, raw in _BUCKET_RE.findall(block):
                        try:
                            buckets[le] = buckets.get(le, 0.0) + float(raw)
                        except ValueError:
                            pass
                    continue
                lines = block.split(b"\n")
                lines[0] = b""  # the rest of the TYPE line
                self._scan(lines, acc, False)
            if not acc.vals.keys() & _ENGINE_FIELDS:
                acc = _Acc()
                self._scan(body.split(b"\n"), acc)
        else:
            self._scan(body.split(b"\n"), acc)
        return self._result(acc)

    def _scan(self, lines: list[bytes], acc: "_Acc", check_prefix: bool = True) -> None:
        """Accumulate the wanted samples of `lines` (`check_prefix` False: the lines are one wanted block)."""
        table = self._table
        prefixes = self._prefixes if check_prefix else (b"",)
        vals, prio, nvals = acc.vals, acc.prio, acc.nvals
        for line in lines:
            if not line or line[0] == 35 or not line.startswith(prefixes):  # empty, '#', unwanted
                continue
            b = line.find(b"{")
            if b < 0:
                sp = line.find(b" ")
                if sp < 0:
                    continue
                spec = table.get(line[:sp])
                if spec is None:
                    continue
                labels = b""
                raw = line[sp:]
            else:
                spec = table.get(line[:b])
                if spec is None:
                    continue
                close = line.rfind(b"}")
                if close < b:
                    continue
                labels = line[b:close + 1]
                raw = line[close + 1:]
            try:
                v = float(raw)
            except ValueError:  # a timestamp after the value, or garbage
                parts = raw.split()
                try:
                    v = float(parts[0])
                except (IndexError, ValueError):
                    continue
            kind, fld, p = spec
            if kind == HIST_BUCKET:
                if p > acc.bucket_prio:
                    continue
                if p < acc.bucket_prio:
                    acc.bucket_prio = p
                    acc.buckets = {}
                le = _label(labels, b"le")
                if le is not None:
                    acc.buckets[le] = acc.buckets.get(le, 0.0) + v
                continue
            if kind == OUTCOMES:
                reason = _label(labels, b"finished_reason") or b""
                acc.finished[reason] = acc.finished.get(reason, 0.0) + v
                continue
            if kind == CACHE_INFO:
                bs, nb = _label(labels, b"block_size"), _label(labels, b"num_gpu_blocks")
                try:
                    acc.cache_tokens += int(bs) * int(nb)  # type: ignore[arg-type]
                    acc.block_tokens = max(acc.block_tokens, int(bs))  # type: ignore[arg-type]
                    acc.cache_seen = True
                except (TypeError, ValueError):  # "None" before the engine profiled its memory
                    pass
                continue
            if kind == HIST_COUNT:
                fld = "ttft_count"
            if v != v:  # NaN
                continue
            cur = prio.get(fld)
            if cur is None or p < cur:
                prio[fld] = p
                vals[fld] = v
                nvals[fld] = 1
            elif p == cur:
                vals[fld] += v
                nvals[fld] += 1

    def _result(self, acc: "_Acc") -> Parsed:
        out = Parsed()
        for fld, v in acc.vals.items():
            if fld in _FRACTIONS:
                v = v / acc.nvals[fld]
            setattr(out, fld, v)
        if acc.buckets:
            out.ttft_bounds, out.ttft_cum = self._histogram(acc.buckets)
            if out.ttft_cum and out.ttft_bounds[-1] == _INF:
                out.ttft_count = out.ttft_cum[-1]
        if acc.finished:
            out.finished = {k.decode(errors="replace"): v for k, v in acc.finished.items()}
            out.errors = sum(v for k, v in acc.finished.items() if k in self._errors)
        if acc.cache_seen:
            out.cache_info_tokens = acc.cache_tokens
            out.cache_block_tokens = acc.block_tokens
        return out

    def _histogram(self, buckets: dict[bytes, float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        key = tuple(buckets)
        cached = self._order.get(key)
        if cached is None:
            les = self._le
            bounds = []
            for raw in key:
                f = les.get(raw)
                if f is None:
                    try:
                        f = float(raw)
                    except ValueError:
                        f = math.nan
                    if len(les) < 4096:
                        les[raw] = f
                bounds.append(f)
            order = tuple(i for i in sorted(range(len(key)), key=lambda i: bounds[i]) if bounds[i] == bounds[i])
            cached = (tuple(bounds[i] for i in order), order)
            if len(self._order) < 256:
                self._order[key] = cached
        bounds_t, order = cached
        counts = list(buckets.values())
        return bounds_t, tuple(counts[i] for i in order)


# ---- windowed values ----------------------------------------------------------------------------------------

def histogram_quantile(q: float, bounds: tuple[float, ...], cum: Iterable[float]) -> float:
    """Quantile q (0..1) of a cumulative histogram (upper bounds ascending, the last usually +Inf), like
    Prometheus' histogram_quantile: linear inside the bucket, 0 as the first bucket's lower edge, the highest
    finite bound when the rank falls in +Inf. 0.0 for an empty histogram."""
    cum = list(cum)
    if not cum or not bounds:
        return 0.0
    total = cum[-1]
    if total <= 0:
        return 0.0
    rank = q * total
    prev_bound, prev_cum = 0.0, 0.0
    for bound, c in zip(bounds, cum):
        if c >= rank and c > prev_cum:
            if bound == _INF:
                return prev_bound
            if bound <= 0:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_cum) / (c - prev_cum)
        prev_bound, prev_cum = (bound if bound != _INF else prev_bound), c
    return prev_bound


class _Snap:
    __slots__ = ("t", "gen", "prompt", "ttft", "ttft_count", "running", "waiting", "preempt", "pq", "ph",
                 "itl_sum", "itl_count")

    def __init__(self, t: float, p: Parsed) -> None:
        self.t = t
        self.gen = p.generation_tokens
        self.prompt = p.prompt_tokens
        self.ttft = p.ttft_cum
        self.ttft_count = p.first_tokens or 0.0
        self.running = p.running or 0.0
        self.waiting = p.waiting or 0.0
        self.preempt = p.preemptions
        self.pq = p.prefix_queries
        self.ph = p.prefix_hits
        self.itl_sum = p.itl_sum
        self.itl_count = p.itl_count


def _went_down(new: float | None, old: float | None) -> bool:
    return new is not None and old is not None and new < old


class History:
    """Recent cumulative snapshots of one replica, bounded; windowed deltas over `window_s` (and the TTFT
    quantile and the mean inter-token latency also over the last `recent_s`)."""

    __slots__ = ("window_s", "max_gap_s", "recent_s", "snaps", "bounds")

    def __init__(self, window_s: float, maxlen: int, max_gap_s: float = _INF, recent_s: float = 0.0) -> None:
        self.window_s = window_s
        self.max_gap_s = max_gap_s  # a longer gap between two scrapes (an outage) restarts the window
        self.recent_s = recent_s    # the short window (0: none)
        self.snaps: deque[_Snap] = deque(maxlen=maxlen)
        self.bounds: tuple[float, ...] = ()

    def add(self, t: float, p: Parsed, outage: bool = True) -> bool:
        """Record a scrape; True when a counter went down (the engine restarted). `outage`: a scrape since the
        previous successful one failed other than by timing out; only then (or when the gap outlasts the
        window) does a gap longer than `max_gap_s` restart the window."""
        snap = _Snap(t, p)
        restarted = False
        if self.snaps:
            last = self.snaps[-1]
            if (_went_down(snap.gen, last.gen) or _went_down(snap.prompt, last.prompt)
                    or _went_down(snap.preempt, last.preempt) or snap.ttft_count < last.ttft_count):
                restarted = True
                self.snaps.clear()
            elif p.ttft_bounds != self.bounds:
                self.snaps.clear()  # bucket layout changed (engine upgrade): deltas would be meaningless
            elif t - last.t > self.max_gap_s and (outage or t - last.t > self.window_s):
                self.snaps.clear()  # back after an outage: what happened before it says nothing about now
        self.bounds = p.ttft_bounds
        self.snaps.append(snap)
        start = t - self.window_s
        snaps = self.snaps
        while len(snaps) >= 2 and snaps[1].t <= start:
            snaps.popleft()
        return restarted

    def fill(self, st: ScrapedState, p: Parsed) -> None:
        """Windowed values into `st`."""
        snaps = self.snaps
        new = snaps[-1]
        base = snaps[0]
        recent = self._recent_base()
        span = new.t - base.t
        n = len(snaps)
        st.running_avg = sum(s.running for s in snaps) / n
        st.waiting_avg = sum(s.waiting for s in snaps) / n
        if span > 0:
            st.window_span_s = span
            if new.gen is not None and base.gen is not None:
                st.generation_tps = (new.gen - base.gen) / span
            elif p.generation_tps_gauge is not None:
                st.generation_tps = p.generation_tps_gauge
            if new.prompt is not None and base.prompt is not None:
                st.prompt_tps = (new.prompt - base.prompt) / span
            if new.preempt is not None and base.preempt is not None:
                st.preemptions_window = new.preempt - base.preempt
            if new.pq is not None and base.pq is not None and new.ph is not None and base.ph is not None:
                dq = new.pq - base.pq
                st.prefix_hit_rate = (new.ph - base.ph) / dq if dq > 0 else 0.0
            if new.ttft and len(new.ttft) == len(base.ttft):
                deltas = [a - b for a, b in zip(new.ttft, base.ttft)]
                st.ttft_count_window = deltas[-1]
                st.ttft_p95_s = histogram_quantile(0.95, self.bounds, deltas)
                self._fill_recent(st, recent)
        elif p.generation_tps_gauge is not None:
            st.generation_tps = p.generation_tps_gauge
        if p.cache_hit_rate is not None:
            st.prefix_hit_rate = p.cache_hit_rate
        _fill_itl(st, new, recent)

    def _recent_base(self) -> _Snap:
        """The base of the short window: the newest snapshot at or before now - recent_s (with fewer snapshots,
        or no short window, the window's base)."""
        snaps = self.snaps
        if self.recent_s <= 0:
            return snaps[0]
        start = snaps[-1].t - self.recent_s
        for s in reversed(snaps):
            if s.t <= start:
                return s
        return snaps[0]

    def _fill_recent(self, st: ScrapedState, base: _Snap) -> None:
        """p95 TTFT and first tokens over the last `recent_s` (`base`: `_recent_base`)."""
        if self.recent_s <= 0:
            return
        new = self.snaps[-1]
        if base is new or len(base.ttft) != len(new.ttft):
            return
        deltas = [a - b for a, b in zip(new.ttft, base.ttft)]
        st.ttft_count_recent = deltas[-1]
        st.ttft_p95_recent_s = histogram_quantile(0.95, self.bounds, deltas)


def _fill_itl(st: ScrapedState, new: _Snap, base: _Snap) -> None:
    """The mean inter-token latency since `base`: delta of the histogram's sum / delta of its count."""
    if new.itl_count is None or base.itl_count is None or new.itl_sum is None or base.itl_sum is None:
        return
    n = new.itl_count - base.itl_count
    if n > 0:
        st.itl_s = (new.itl_sum - base.itl_sum) / n
        st.itl_count_recent = n


def build_state(now: float, p: Parsed, hist: History, outage: bool = True) -> ScrapedState:
    """One scrape's `ScrapedState` (records `p` into `hist`; `outage`: see `History.add`)."""
    restarted = hist.add(now, p, outage)
    kv = p.kv_usage or 0.0
    if p.cache_info_tokens:
        cap = p.cache_info_tokens
    elif p.kv_capacity_tokens:
        cap = int(p.kv_capacity_tokens)
    else:
        cap = 0
    st = ScrapedState(
        scraped_at=now,
        kv_usage=min(max(kv, 0.0), 1.0),
        running=int(p.running or 0),
        waiting=int(p.waiting or 0),
        preemptions_total=p.preemptions or 0.0,
        kv_capacity_tokens=cap,
        kv_block_tokens=p.cache_block_tokens or 0,
        errors_total=p.errors or 0.0,
        scrape_failures=0,
        restarted=restarted,
        prompt_tokens_total=-1.0 if p.prompt_tokens is None else p.prompt_tokens,
    )
    hist.fill(st, p)
    first = p.first_tokens
    if first is not None:
        st.first_tokens_total = first
    _fill_prefix_totals(st, p)
    _fill_prefill_totals(st, p)
    return st


def _fill_prefix_totals(st: ScrapedState, p: Parsed) -> None:
    """The prefix-cache counters as read (admission takes its own deltas between scrapes)."""
    if p.prefix_queries is not None and p.prefix_hits is not None:
        st.prefix_queries_total = p.prefix_queries
        st.prefix_hits_total = p.prefix_hits


def _fill_prefill_totals(st: ScrapedState, p: Parsed) -> None:
    """The finished requests' prefill sums as read (admission takes its own deltas between scrapes)."""
    if p.prefill_s_sum is not None and p.prefill_s_count is not None and p.prefill_new_sum is not None:
        st.prefill_seconds_total = p.prefill_s_sum
        st.prefilled_requests_total = p.prefill_s_count
        st.prefill_computed_total = p.prefill_new_sum


def is_fresh(replica: Replica, now: float, stale_after_s: float) -> bool:
    """The replica's metrics were scraped successfully within `stale_after_s` (never scraped: not fresh)."""
    at = replica.engine.scraped_at
    return at > 0 and now - at <= stale_after_s


# ---- the scraper --------------------------------------------------------------------------------------------

class _Target:
    __slots__ = ("pool", "replica", "url", "parser", "metrics", "history", "task", "failing", "unanswered")

    def __init__(self, pool: Pool, replica: Replica, parser: MetricsParser, history: History) -> None:
        self.pool = pool
        self.replica = replica
        self.url = yarl.URL(f"http://{replica.address}/metrics")  # parsed once, not per request
        self.parser = parser
        self.history = history
        self.metrics = rm.replica_metrics(pool.model, replica.address)
        self.task: asyncio.Task | None = None
        self.failing = False
        self.unanswered = False  # a scrape failed other than by timing out since the last successful one


class Scraper:
    """Scrapes every replica of `pools` every `policy.scrape_interval_s`.

    `pools` is read on every round, so replicas added to (or removed from) a pool's list are picked up.
    `listeners` are called (no arguments, synchronously, exceptions logged) after every round.
    """

    def __init__(self, pools: list[Pool], policy: RoutingPolicy) -> None:
        self.pools = pools
        self.policy = policy
        self.listeners: list[Callable[[], None]] = []
        self.rounds = 0            # rounds completed (listeners called)
        self.scrapes_ok = 0        # successful replica scrapes, all time
        self.scrapes_failed = 0    # failed replica scrapes, all time
        self._session: aiohttp.ClientSession | None = None
        self._loop_task: asyncio.Task | None = None
        self._targets: dict[tuple[str, str], _Target] = {}
        self._parsers: dict[str, MetricsParser] = {}
        self._maxlen = min(100_000, int(policy.window_s / policy.scrape_interval_s) * 2 + 16)
        # an outage: no successful scrape for longer than stale + one timed-out scrape (one slow answer is not)
        self._max_gap = policy.stale_after_s + policy.scrape_timeout_s  # type: ignore[operator]
        self._recent = policy.health.slow_start_step_s
        self._first_seen: dict[tuple[str, str], float] = {}

    # ---- public ---------------------------------------------------------------------------------------------
    def is_fresh(self, replica: Replica, now: float | None = None) -> bool:
        """Metrics of `replica` are recent enough to act on (see `RoutingPolicy.stale_after_s`)."""
        return is_fresh(replica, time.monotonic() if now is None else now, self.policy.stale_after_s)  # type: ignore[arg-type]

    async def start(self) -> None:
        """Start the background loop (first round at once). Idempotent."""
        if self._loop_task is not None and not self._loop_task.done():
            return
        self._ensure_session()
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="sluice-scraper")

    async def stop(self) -> None:
        """Stop the loop, cancel scrapes in flight, close the HTTP session."""
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        pending = [t.task for t in self._targets.values() if t.task is not None and not t.task.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape_once(self) -> int:
        """One full round: scrape every replica (waiting for each up to the timeout), then call the listeners.
        Returns how many replicas were scraped successfully."""
        self._ensure_session()
        tasks = self._launch(wait_inflight=True)
        ok = 0
        if tasks:
            for res in await asyncio.gather(*tasks, return_exceptions=True):
                ok += res is True
        self._round_done()
        return ok

    # ---- internals ------------------------------------------------------------------------------------------
    def _ensure_session(self) -> None:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=2, keepalive_timeout=60,
                                             ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.policy.scrape_timeout_s),
                auto_decompress=False,
                headers={"Accept": "text/plain", "Accept-Encoding": "identity", "User-Agent": "sluice-scraper"},
                cookie_jar=aiohttp.DummyCookieJar(),  # replicas set no cookies; skipping the jar saves ~20 us/scrape
                trust_env=False,
            )

    def _parser(self, style: str) -> MetricsParser:
        p = self._parsers.get(style)
        if p is None:
            p = self._parsers[style] = MetricsParser(names_for(style))
        return p

    def _target(self, pool: Pool, r: Replica) -> _Target:
        key = (pool.model, r.address)
        t = self._targets.get(key)
        if t is None or t.replica is not r:
            hist = (t.history if t is not None
                    else History(self.policy.window_s, self._maxlen, self._max_gap, self._recent))
            t = self._targets[key] = _Target(pool, r, self._parser(pool.metrics_style), hist)
            first = self._first_seen.setdefault(key, time.monotonic())
            t.metrics.age_from(lambda r=r: r.engine.scraped_at, first)
        return t

    def _launch(self, wait_inflight: bool) -> list[asyncio.Task]:
        loop = asyncio.get_running_loop()
        tasks = []
        live = set()
        for pool in self.pools:
            for r in pool.replicas:
                t = self._target(pool, r)
                live.add((pool.model, r.address))
                if t.task is not None and not t.task.done():
                    if wait_inflight:
                        tasks.append(t.task)
                    continue
                t.task = loop.create_task(self._scrape(t))
                tasks.append(t.task)
        if len(live) != len(self._targets):
            self._forget(live)
        return tasks

    def _forget(self, live: set[tuple[str, str]]) -> None:
        for key in [k for k in self._targets if k not in live]:
            t = self._targets.pop(key)
            self._first_seen.pop(key, None)
            if t.task is not None and not t.task.done():
                t.task.cancel()
            rm.forget_replica(*key)

    async def _run(self) -> None:
        interval = self.policy.scrape_interval_s
        next_at = time.monotonic()
        while True:
            tasks = self._launch(wait_inflight=False)
            if tasks:
                await asyncio.wait(tasks, timeout=interval)
            self._round_done()
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (slow loop): do not burst to catch up
                next_at = time.monotonic()
                delay = 0.0
            await asyncio.sleep(delay)

    def _round_done(self) -> None:
        self.rounds += 1
        for cb in list(self.listeners):
            try:
                cb()
            except Exception:  # a listener's bug must not stop scraping
                log.exception("scrape listener %r failed", cb)

    async def _scrape(self, t: _Target) -> bool:
        session = self._session
        r = t.replica
        started = time.perf_counter()
        r.scrape_sent()
        try:
            assert session is not None
            async with session.get(t.url) as resp:
                body = await resp.read()
                status = resp.status
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._failed(t, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
                         timed_out=isinstance(exc, TimeoutError))
            return False
        except Exception as exc:  # never let one replica's oddity kill its task unseen
            self._failed(t, f"unexpected {exc!r}")
            return False
        if status != 200:
            self._failed(t, f"HTTP {status}")
            return False
        now = time.monotonic()
        try:
            parsed = t.parser.parse(body)
            if parsed.running is None and parsed.waiting is None and parsed.kv_usage is None:
                self._failed(t, f"no {t.parser.names.style} engine metrics on the page")
                return False
            st = build_state(now, parsed, t.history, outage=t.unanswered)
        except Exception as exc:  # the scanner skips what it cannot read; this is a bug or a very odd page
            self._failed(t, f"unreadable page: {exc!r}")
            return False
        r.on_scrape(st)
        t.unanswered = False
        t.metrics.engine(st, time.perf_counter() - started)
        self.scrapes_ok += 1
        if t.failing:
            t.failing = False
            log.info("scrape of %s/%s works again", t.pool.model, r.address)
        return True

    def _failed(self, t: _Target, why: str, timed_out: bool = False) -> None:
        """A failed scrape. A timeout is counted apart (`scrape_timeouts`): a busy engine answers late, a dead
        one not at all (health.py decides which from the requests it still completes)."""
        self.scrapes_failed += 1
        engine = t.replica.engine
        engine.scrape_failures += 1
        if timed_out:
            engine.scrape_timeouts += 1
            t.metrics.timeouts.inc()
        else:
            t.unanswered = True
        t.metrics.failures.inc()
        if not t.failing:
            t.failing = True
            log.warning("scrape of %s/%s failed: %s (the replica goes stale; logged once until it works)",
                        t.pool.model, t.replica.address, why)
