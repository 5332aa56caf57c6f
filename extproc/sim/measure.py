"""Measure a live OpenAI-compatible engine through its HTTP API and ``/metrics`` only.

What ``sluice sim calibrate --against URL`` fits a preset to. Every probe sends ``/v1/completions``
with a prompt of token ids (exact lengths, and unique: a fresh random prompt per request, so the
engine's prefix cache never helps unless a probe wants it to), ``ignore_eos`` and ``max_tokens`` (an
exact output length), and streams, so the client sees each token when the engine emits it. Each
probe repeats and keeps the median: the machine is shared and noisy.

Probes (all times in seconds, as the client sees them):

* ``ttft(n)``: one request of ``n`` prompt tokens on an idle engine, time to its first token;
* ``decode(b)``: ``b`` streams of 128 prompt tokens started together; every token of the batch over the
  time from the first send to the last token (``batch_rate``), in tokens/s;
* ``hol(offsets)``: a 100-token request sent ``offset`` seconds after a 4,000-token one; its TTFT (and the
  4,000-token prompt's alone, measured between those trials);
* ``prefix_hit``: a prompt whose first ``hit`` tokens were just computed for another request (same
  ids, other suffix); its TTFT;
* ``kv``: ``vllm:cache_config_info``'s ``num_gpu_blocks`` x ``block_size``;
* ``abort``: one decoding stream is closed by the client; the time until ``vllm:num_requests_running``
  reads 0 (the midpoint of the first scrape that shows it), and the tokens generated after the close;
* ``preempt_onset``: ``streams`` requests that grow until the KV cache is full (a small-KV engine):
  the tokens all streams received before the first preempted stream stalls (alone: a gap in which every
  stream stopped is the client, not a preemption);
* ``closed_loop(streams, prompt, output)``: ``streams`` clients, each sending its next request the moment
  its previous answer ends; completions per second in a window after a warm-up, from the tokens streamed in it
  (the engine kept busy, requests arriving while it computes: what a load probe or a gateway's traffic does,
  and what the rows above, one prompt or one batch at a time, never do);
* ``metrics_latency(streams, long_prompts)``: how long ``GET /metrics`` takes while ``streams``
  decodes run and ``long_prompts`` 4,000-token prompts are prefilled one after another; with
  ``partner``, a second engine on the same machine carries the same load meanwhile (two busy engines
  on two cores leave the API servers, the client and everything else to fight for CPU time).
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp
import orjson

__all__ = ["LiveEngine", "StreamResult", "machine_info", "median", "quantile"]

PROMPT_FLOOR = 16  # token ids below this may be special tokens


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, linear between order statistics (numpy's default)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


STALL_FACTOR = 4.0
OTHERS_MOVING = 2  # tokens another stream must receive during a gap for the gap to be a stall of its own


def stall_start(times: list[float], after: float, others: Sequence[list[float]] = ()) -> float:
    """Arrival time of the token before a stream's first long gap that starts after ``after`` (inf: none).

    ``after`` skips the start, where the other streams' prefills stretch every decode step. With ``others`` (the
    batch's other streams), a gap counts only while another stream received at least ``OTHERS_MOVING`` tokens in
    it: a preempted stream stops alone, while a client that was descheduled sees every stream stop at once."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    if len(gaps) < 3:
        return math.inf
    limit = max(STALL_FACTOR * median(gaps), 0.05)
    for i, g in enumerate(gaps):
        if times[i] > after and g > limit and (not others or _moving(others, times[i], times[i + 1])):
            return times[i]
    return math.inf


def _moving(others: Sequence[list[float]], start: float, end: float) -> bool:
    """Another stream received OTHERS_MOVING tokens strictly between ``start`` and ``end``."""
    return any(sum(1 for t in o if start < t < end) >= OTHERS_MOVING for o in others)


def batch_rate(sent: list[float], token_times: list[list[float]]) -> float:
    """Tokens/s of a batch of streams sent together, from the first send to the last token of any stream:

        rate = sum(tokens of every stream) / (last token of any stream - first send)

    The span includes the batch's prefill (a few percent of it for the decode probes' short prompts); both
    sides of the calibration (`calibrate.sim_decode`) measure it so. Not a sum of per-stream rates over each
    stream's own first-to-last tokens: a stream's tokens can arrive in one lump (a descheduled client, or a
    busy API server flushing late), and a rate over a lump is unbounded."""
    lasts = [t[-1] for t in token_times if t]
    if not lasts or not sent:
        return 0.0
    span = max(lasts) - min(sent)
    return sum(len(t) for t in token_times) / span if span > 0 else 0.0


BATCH_FORMED_SHARE = 0.25  # a batch formed when its last stream's first token came within this share of its span
DECODE_RETRIES = 3


def batch_formed(sent: list[float], token_times: list[list[float]]) -> bool:
    """Did the streams sent together decode together? On vLLM-CPU, whose API server shares one core with the
    engine core, one stream of a burst sometimes starts only as the others end (its first token 1.2 s after the
    send on a 1.2 s run, against 0.02-0.05 s when the batch forms; 2026-12-04, 4 and 8 streams of 128 tokens):
    such a sample measures a batch of fewer streams, at down to a third of the rate. Formed: every stream's first
    token within BATCH_FORMED_SHARE of the span `batch_rate` divides by."""
    firsts = [t[0] for t in token_times if t]
    if not sent or len(firsts) < len(token_times):
        return False
    start = min(sent)
    span = max(t[-1] for t in token_times) - start
    return span > 0 and max(firsts) - start <= BATCH_FORMED_SHARE * span


def machine_info() -> dict[str, Any]:
    """CPU model and core count of the machine the measurement ran on (the client's, loopback engines)."""
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu_model": model, "cores": os.cpu_count(), "platform": platform.platform()}


@dataclass
class StreamResult:
    sent: float  # client clock when the request was sent
    token_times: list[float] = field(default_factory=list)
    closed_at: float | None = None  # set when the client hung up on purpose

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def rate(self) -> float:
        """Tokens/s of this stream after its first token."""
        t = self.token_times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0


class LiveEngine:
    """One engine under measurement: base URL, served model, a seeded source of unique prompts."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, model: str | None = None,
                 vocab: int = 8192, seed: int = 0) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self.model = model
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.decode_retries = 0  # decode samples sent again because their batch did not form

    # ---- what the engine says about itself ----------------------------------------------------

    async def get_model(self) -> str:
        if self.model is None:
            async with self.session.get(self.url + "/v1/models") as r:
                r.raise_for_status()
                self.model = (await r.json())["data"][0]["id"]
        return self.model

    async def version(self) -> str:
        try:
            async with self.session.get(self.url + "/version") as r:
                if r.status == 200:
                    return str((await r.json()).get("version", "unknown"))
        except (aiohttp.ClientError, ValueError):
            pass
        return "unknown"

    async def metrics_text(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            r.raise_for_status()
            return await r.text()

    async def metrics(self) -> dict[str, float]:
        """Sample name -> value summed over label sets; ``vllm:cache_config_info`` keeps its labels."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(await self.metrics_text()):
            for s in fam.samples:
                if s.name == "vllm:cache_config_info":
                    for k in ("block_size", "num_gpu_blocks"):
                        v = s.labels.get(k, "")
                        if v.isdigit():
                            out[f"cache_config_info:{k}"] = float(v)
                    continue
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    async def timed_metrics(self) -> tuple[float, float, dict[str, float]]:
        """(start, end, values) of one scrape, client clock."""
        t0 = time.perf_counter()
        m = await self.metrics()
        return t0, time.perf_counter(), m

    # ---- requests -------------------------------------------------------------------------------

    def prompt(self, n: int) -> list[int]:
        """``n`` random token ids: unique, so nothing of it is cached."""
        r = self.rng
        return [r.randrange(PROMPT_FLOOR, self.vocab) for _ in range(n)]

    async def stream(self, ids: list[int], max_tokens: int, *, close_after: int | None = None,
                     delay: float = 0.0) -> StreamResult:
        """Send one streaming completion (after ``delay``); record each token's arrival.

        ``close_after``: hang up once that many tokens arrived (a client disconnect)."""
        if delay > 0:
            await asyncio.sleep(delay)
        body = {"model": await self.get_model(), "prompt": ids, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.0}
        res = StreamResult(sent=time.perf_counter())
        async with self.session.post(self.url + "/v1/completions", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.url}: HTTP {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                chunk = orjson.loads(line[6:])
                if chunk.get("choices"):
                    res.token_times.append(now)
                    if close_after is not None and len(res.token_times) >= close_after:
                        res.closed_at = time.perf_counter()
                        r.close()
                        break
        return res

    async def idle(self, timeout: float = 30.0) -> None:
        """Wait until the engine runs and queues nothing (the previous probe's aborts settled)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = await self.metrics()
            if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.url}: still busy after {timeout:.0f}s")

    # ---- probes ---------------------------------------------------------------------------------

    async def ttft(self, n: int, repeats: int) -> list[float]:
        out = []
        for _ in range(repeats):
            await self.idle()
            out.append((await self.stream(self.prompt(n), 1)).ttft)
        return out

    async def decode(self, streams: int, repeats: int, prompt: int = 128, out_tokens: int = 128) -> list[float]:
        """``repeats`` batch rates of ``streams`` streams sent together; a batch that did not form (`batch_formed`)
        is sent again, at most DECODE_RETRIES times per sample (the last try is kept whatever it shows)."""
        out = []
        for _ in range(repeats):
            for attempt in range(DECODE_RETRIES + 1):
                await self.idle()
                res = await asyncio.gather(*(self.stream(self.prompt(prompt), out_tokens) for _ in range(streams)))
                sent, times = [r.sent for r in res], [r.token_times for r in res]
                if batch_formed(sent, times):
                    break
                if attempt < DECODE_RETRIES:
                    self.decode_retries += 1
            out.append(batch_rate(sent, times))
        return out

    async def hol(self, offsets: list[float], repeats: int, long: int = 4000,
                  short: int = 100) -> tuple[list[list[float]], list[float]]:
        """Per offset, the short request's TTFTs over the repeats; and the long prompt's TTFT alone, measured once
        before each of those trials.

        The trials compare with the long prefill beside them, not with one measured earlier: this shared machine's
        engines change speed by tens of percent within a minute (on an Intel Xeon the 4,000-token prompt took
        0.273 s just before one calibration's trials, and the trials' shorts found the engine idle 0.19 s into
        them)."""
        out: list[list[float]] = [[] for _ in offsets]
        alone: list[float] = []
        for _ in range(repeats):
            for i, off in enumerate(offsets):
                await self.idle()
                alone.append((await self.stream(self.prompt(long), 1)).ttft)
                await self.idle()
                _long, s = await asyncio.gather(self.stream(self.prompt(long), 1),
                                                self.stream(self.prompt(short), 1, delay=off))
                out[i].append(s.ttft)
        return out, alone

    async def prefix_hit(self, hit: int, total: int, repeats: int) -> list[float]:
        """TTFT of ``total`` tokens whose first ``hit`` were computed just before for another request."""
        out = []
        for _ in range(repeats):
            prefix = self.prompt(hit)
            await self.idle()
            await self.stream(prefix + self.prompt(total - hit), 1)
            await self.idle()
            out.append((await self.stream(prefix + self.prompt(total - hit), 1)).ttft)
        return out

    async def kv_capacity(self) -> tuple[int, int]:
        """(num_gpu_blocks, block_size) from ``vllm:cache_config_info``."""
        m = await self.metrics()
        try:
            return int(m["cache_config_info:num_gpu_blocks"]), int(m["cache_config_info:block_size"])
        except KeyError:
            raise RuntimeError(f"{self.url}: no vllm:cache_config_info with num_gpu_blocks/block_size") from None

    async def abort(self, repeats: int, after_tokens: int = 32) -> tuple[list[float], list[float]]:
        """(seconds until running reads 0 after the client closed, tokens generated after the close)."""
        lat, extra = [], []
        for _ in range(repeats):
            await self.idle()
            await asyncio.sleep(0.3)  # the token counter trails the running gauge a little
            before = (await self.metrics()).get("vllm:generation_tokens_total", 0.0)
            res = await self.stream(self.prompt(128), 4000, close_after=after_tokens)
            assert res.closed_at is not None
            seen = None
            end = res.closed_at + 10.0
            while time.perf_counter() < end:
                t0, t1, m = await self.timed_metrics()
                if m.get("vllm:num_requests_running", 1) == 0:
                    seen = (t0 + t1) / 2 - res.closed_at
                    break
            if seen is None:
                raise RuntimeError(f"{self.url}: a closed stream still runs 10 s later (no abort on disconnect?)")
            await asyncio.sleep(0.2)
            after = (await self.metrics()).get("vllm:generation_tokens_total", 0.0)
            lat.append(max(seen, 0.0))
            extra.append(after - before - len(res.token_times))
        return lat, extra

    async def preempt_onset(self, streams: int, prompt: int, out_tokens: int, repeats: int) -> list[float]:
        """Tokens received (all streams) when the first preemption stalls a stream; the KV must be small.

        Read on the client, not from /metrics: vLLM's gauges and counters are refreshed in lumps, seconds
        apart, so a counter read when ``vllm:num_preemptions_total`` first moves overshoots. A preempted
        stream stops until it is recomputed: its first gap longer than ``STALL_FACTOR`` times its median gap
        (and 50 ms) marks the preemption. ``vllm:num_preemptions_total`` must have moved by the end."""
        out = []
        for _ in range(repeats):
            await self.idle()
            p0 = (await self.metrics()).get("vllm:num_preemptions_total", 0.0)
            res = await asyncio.gather(*(self.stream(self.prompt(prompt), out_tokens) for _ in range(streams)))
            await asyncio.sleep(0.5)
            if (await self.metrics()).get("vllm:num_preemptions_total", 0.0) <= p0:
                raise RuntimeError(f"{self.url}: {streams} streams of {prompt}+{out_tokens} tokens caused no "
                                   "preemption; the engine's KV cache is too large for this probe")
            started = max(r.token_times[0] for r in res)
            stall = min((stall_start(r.token_times, started, [o.token_times for o in res if o is not r])
                         for r in res), default=math.inf)
            out.append(float(sum(1 for r in res for t in r.token_times if t <= stall)))
        return out

    async def closed_loop(self, streams: int, prompt: int, output: int, warmup_s: float = 2.0,
                          window_s: float = 6.0) -> float:
        """Completions per second while ``streams`` clients send requests back to back (unique prompts), over
        ``window_s`` after ``warmup_s``:

            rate = output tokens streamed in the window / window_s / output

        Tokens, not completions: a client completes a long answer every few seconds, so completions in a window
        of seconds come in waves (16 clients' 256-token answers counted in 6 s: samples of 4.33-10.67 req/s in
        steps of 2.67, calibration runs 9-11 on the Intel Xeon); in a steady state the two rates are the same."""
        await self.idle()
        start = time.perf_counter()
        window = (start + warmup_s, start + warmup_s + window_s)
        tokens = 0

        async def client(delay: float) -> None:
            nonlocal tokens
            await asyncio.sleep(delay)
            while time.perf_counter() < window[1]:
                res = await self.stream(self.prompt(prompt), output)
                tokens += sum(1 for t in res.token_times if window[0] <= t <= window[1])

        # starts spread over the warm-up: equal requests sent at once finish in waves, and a window that cuts a wave
        # counts part of it (on a simulator at its own speed, 800/32 read 1.10x its rate with starts 5 ms apart)
        await asyncio.gather(*(client(warmup_s * k / streams) for k in range(streams)))
        return tokens / window_s / output

    def _load(self, streams: int, long_prompts: int) -> list[asyncio.Future[Any]]:
        load: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.stream(self.prompt(128), 800))
                                           for _ in range(streams)]

        async def long_prefills() -> None:
            for _ in range(long_prompts):
                await self.stream(self.prompt(4000), 1)

        if long_prompts:
            load.append(asyncio.ensure_future(long_prefills()))
        return load

    async def metrics_latency(self, streams: int, long_prompts: int, polls: int = 20,
                              interval: float = 0.1, partner: "LiveEngine | None" = None) -> list[float]:
        """``GET /metrics`` durations while ``streams`` decode and ``long_prompts`` long prompts prefill."""
        await self.idle()
        if partner is not None:
            await partner.idle()
        load = self._load(streams, long_prompts)
        if partner is not None:
            load += partner._load(streams, long_prompts)
        lat = []
        try:
            if streams:  # measure once every stream is decoding
                end = time.monotonic() + 60
                while time.monotonic() < end:
                    m = await self.metrics()
                    if m.get("vllm:num_requests_running", 0) >= streams:
                        break
                    await asyncio.sleep(0.05)
            for _ in range(polls):
                t0, t1, _m = await self.timed_metrics()
                lat.append(t1 - t0)
                await asyncio.sleep(interval)
        finally:
            for t in load:
                t.cancel()
            await asyncio.gather(*load, return_exceptions=True)
        return lat
