"""Open-loop replay for the scenarios: arrivals at fixed times, streaming requests, one record per attempt.

Open loop means the arrival times are fixed by the scenario before the run, not by responses: a slow system
does not slow the offered load down (a closed-loop generator would, and would hide every overload problem).
The only response-driven traffic is what real clients do on their own: SDK retries, a business layer's retries
around the SDK (`business_retries`) and agent tasks whose next call follows the previous answer (`Arrival.script`).

Clients are the openai SDK by default (`ClientSpec()`; openai-python's `_base_client.py`): `max_retries` 2; it
retries a connection error or a timeout before the response, and a response whose `x-should-retry` says true, or
(without that header) whose status is 408, 409, 429 or 5xx, unless its `retry-after(-ms)` exceeds 120 s; it
waits the server's `retry-after-ms` / `retry-after` when that is in (0, 120] s, else 0.5 s x 2^retries_taken
(at most 8 s) x a jitter in (0.75, 1]; it sends `x-stainless-retry-count` (the retries taken) and
`x-stainless-read-timeout` (its read timeout, 600 s by default); a stream that has started (status 200) is
handed to the caller and never retried. `tests/bench/test_sdk_parity.py` checks these decisions and delays
against the installed SDK's own functions.

Every run is bounded twice: by the number of arrivals (each arrival is one user request or one script, with a
bounded number of attempts) and by a wall-clock deadline after which every open request is cancelled.

Times. All times here are WALL seconds since the run's t0. The simulated replicas run `time_scale` times faster
than the hardware they model, so the scenario converts its schedule (scenario seconds) into wall seconds before
calling `run_open_loop`, and converts the records back when it computes metrics (`bench/metrics.py`). Headers
sent to the gateway (`x-stainless-read-timeout`) are in wall seconds: the gateway lives in wall time.

TTFT is the time from sending the request to the first SSE event that carries content (not the response
headers: a vLLM-like server sends those before prefill). Tokens are counted as content events.
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp
import orjson

RETRYABLE_STATUS = frozenset({408, 409, 429})
STREAM_ERROR = "stream_error"  # Record.error of a stream that carried an error event (`scan_events`)


# The openai SDK's constants (openai/_constants.py); tests/bench/test_sdk_parity.py checks them against the SDK.
SDK_MAX_RETRIES = 2
SDK_INITIAL_RETRY_DELAY_S = 0.5
SDK_MAX_RETRY_DELAY_S = 8.0
SDK_MAX_RETRY_AFTER_S = 120.0
SDK_READ_TIMEOUT_S = 600.0


@dataclass
class ClientSpec:
    """How one client behaves; the default is the openai SDK with its defaults. Times in wall seconds (the
    scenario scales them)."""

    timeout_s: float | None = None            # whole-attempt timeout: the client closes the connection (P4, P5)
    cancel_after_tokens: int | None = None    # disconnect after this many content tokens (user closes the page)
    cancel_after_s: float | None = None       # disconnect this long after sending (user gives up)
    read_bytes: int = 0                       # slow consumer: read this many bytes at a time ... (P13)
    read_interval_s: float = 0.0              # ... and sleep this long between reads
    sdk_max_retries: int = SDK_MAX_RETRIES    # the openai SDK's max_retries
    sdk_backoff_s: float = SDK_INITIAL_RETRY_DELAY_S  # SDK initial backoff (doubles, capped at 16x), jitter
    read_timeout_s: float = SDK_READ_TIMEOUT_S  # SDK (httpx) read timeout: longest silence on the socket
    business_retries: int = 0                 # retries of the whole SDK call by the business layer (P5)
    business_backoff_s: float = 0.0           # fixed wait before a business retry
    send_read_timeout: bool = True            # send x-stainless-read-timeout (the SDK always does)
    honour_retry_after_max_s: float = SDK_MAX_RETRY_AFTER_S  # the SDK waits a retry-after up to 120 s
    # P4: the SDK gives up at timeout_s (recorded as timed out), but a hop between it and the gateway that does
    # not propagate aborts keeps the connection open and reading for up to linger_s more; content received
    # then is counted in Record.late_tokens (generated for nobody).
    linger_s: float | None = None
    mark_deadline: bool = False               # send x-sim-deadline (unix s): the simulator counts late tokens

    @property
    def stated_timeout_s(self) -> float:
        """What the SDK announces in x-stainless-read-timeout: the caller's timeout, else its read timeout."""
        return self.timeout_s if self.timeout_s is not None else self.read_timeout_s


@dataclass
class Arrival:
    """One user request (or one scripted client, see `script`) at a fixed wall offset `at`."""

    at: float
    body: dict[str, Any] | None = None
    kind: str = "default"
    headers: dict[str, str] = field(default_factory=dict)
    client: ClientSpec = field(default_factory=ClientSpec)
    group: str = ""                             # free label (tenant, task id, ...) copied into the records
    script: Callable[["Ctx"], Awaitable[None]] | None = None  # agent-like clients: several calls in sequence


@dataclass
class Record:
    """One attempt as the client saw it. Times are wall seconds since t0 (None: never happened)."""

    user: int                     # index of the arrival (a script's calls share it)
    attempt: int                  # 0 = first try; counts SDK and business retries together
    sdk_attempt: int              # the x-stainless-retry-count sent
    kind: str
    group: str = ""
    sched: float = 0.0            # when the user request was scheduled (arrival time)
    start: float = 0.0            # when this attempt was sent
    headers_at: float | None = None
    first_token: float | None = None  # first content event
    end: float | None = None
    status: int = 0               # HTTP status; 0 = no response (connection error, timeout before headers)
    tokens: int = 0
    done: bool = False            # saw [DONE]: the stream completed
    cancelled: bool = False       # the client disconnected on purpose (cancel_after_*)
    timed_out: bool = False       # the client's own timeout fired
    error: str = ""               # exception class, "unfinished" (run deadline) or STREAM_ERROR
    replica: str = ""             # x-sim-replica
    should_retry: str = ""        # x-should-retry from the response
    retry_after_s: float | None = None
    body_excerpt: str = ""        # first bytes of an error body
    prompt_tokens: int = 0        # from usage when the stream reports it
    completion_tokens: int = 0
    late_tokens: int = 0          # content events received after the client's own timeout (ClientSpec.linger_s)
    call: int = 0                 # index of the user-level call within its arrival (agent scripts make several)
    first_send: float = 0.0       # when the user-level call's first attempt was sent: its latency starts here

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Ctx:
    """What a running arrival may do: send requests (recorded), sleep, know the clock."""

    def __init__(self, run: "_Run", user: int, arrival: Arrival) -> None:
        self._run = run
        self.user = user
        self.arrival = arrival
        self.attempts = 0
        self.calls = 0

    def now(self) -> float:
        return self._run.now()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    async def call(self, body: dict[str, Any], headers: dict[str, str] | None = None, kind: str | None = None,
                   client: ClientSpec | None = None, group: str | None = None) -> Record:
        """One user-level call with the client's retry behaviour; returns the last attempt's record."""
        return await self._run.user_call(self, body, headers or {}, kind or self.arrival.kind,
                                         client or self.arrival.client,
                                         self.arrival.group if group is None else group)


def _parse_retry_after(headers: Any) -> float | None:
    """Retry-After as the openai SDK reads it: retry-after-ms first, then retry-after (seconds, floats allowed);
    an HTTP date is not sent by any gateway here and reads as None."""
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) / divisor
        except ValueError:
            continue
    return None


def should_retry_response(status: int, should_retry: str, retry_after_s: float | None) -> bool:
    """The openai SDK's `_should_retry` for an HTTP error response: a retry-after over 120 s refuses; then
    x-should-retry wins; else 408, 409, 429 and 5xx are retried."""
    if retry_after_s is not None and math.isfinite(retry_after_s) and retry_after_s > SDK_MAX_RETRY_AFTER_S:
        return False
    if should_retry == "true":
        return True
    if should_retry == "false":
        return False
    return status in RETRYABLE_STATUS or status >= 500


def sdk_should_retry(rec: Record) -> bool:
    """Whether the SDK retries after this attempt: connection errors and timeouts before the response yes; an
    HTTP error per `should_retry_response`; a started stream (200) never (the SDK has returned it)."""
    if rec.cancelled:
        return False
    if rec.status == 0:
        return True  # timeout or connection error before a response
    if rec.status == 200:
        return False
    return should_retry_response(rec.status, rec.should_retry, rec.retry_after_s)


def business_should_retry(rec: Record) -> bool:
    """A typical business layer: retry the SDK call on timeouts, connection errors and 5xx, not on 4xx."""
    if rec.ok or rec.cancelled:
        return False
    return rec.status == 0 or rec.status >= 500 or (rec.status == 200 and not rec.done)


def sdk_retry_delay(retries_taken: int, retry_after_s: float | None, spec: ClientSpec, jitter_u: float) -> float:
    """The openai SDK's `_calculate_retry_timeout`: the server's retry-after when in (0, 120] s, else
    initial x 2^retries_taken capped at 16 x initial (8 s for the SDK's 0.5 s), times (1 - 0.25 u), u in [0, 1)."""
    ra = retry_after_s
    if ra is not None and math.isfinite(ra) and 0 < ra <= spec.honour_retry_after_max_s:
        return ra
    base = min(spec.sdk_backoff_s * (2.0 ** min(retries_taken, 1000)), spec.sdk_backoff_s * 16)
    return max(0.0, base * (1 - 0.25 * jitter_u))


def sdk_backoff(rec: Record, sdk_attempt: int, spec: ClientSpec, rng: random.Random) -> float:
    return sdk_retry_delay(sdk_attempt, rec.retry_after_s, spec, rng.random())


def _is_error_event(ev: bytes) -> bool:
    """A `data:` event whose JSON object has a truthy top-level `error`: the openai SDK raises `APIError` on it
    (openai/_streaming.py, `Stream.__stream__`), whatever follows."""
    try:
        data = orjson.loads(ev[5:])
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and bool(data.get("error"))


def scan_events(buf: bytes, rec: Record, now: float) -> bytes:
    """Consume whole SSE events from `buf`, update `rec`; returns the unconsumed tail.

    An error event (`data: {"error": ...}`) fails the attempt as the openai SDK does, which raises `APIError` there:
    `error` becomes STREAM_ERROR and a `[DONE]` after it does not complete the stream. smg answers an upstream that
    died mid-stream with an error event, then `[DONE]`, on a 200 whose body ends cleanly: counted as done, its
    truncated answers (1-4 of 32 tokens in P6's crash) read as successes.

    After the client's own timeout (a lingering connection) content only counts as `late_tokens`: the answer
    completing then is not a success and its tokens did not reach anyone who was waiting."""
    while True:
        i = buf.find(b"\n\n")
        if i < 0:
            return buf
        ev, buf = buf[:i], buf[i + 2:]
        if not ev.startswith(b"data:"):
            continue
        if rec.timed_out:
            if not ev.startswith(b"data: [DONE]") and b'"choices":[]' not in ev \
                    and b'"role":"assistant","content":""' not in ev:
                rec.late_tokens += 1
            continue
        if rec.error == STREAM_ERROR:
            continue  # the SDK raised at the error event and read no further
        if ev.startswith(b"data: [DONE]"):
            rec.done = True
            continue
        if b'"error"' in ev and _is_error_event(ev):
            rec.error = STREAM_ERROR  # a router that lost its upstream mid-stream (smg), or an engine's own error
            continue
        if b'"choices":[]' in ev:  # usage event
            if b'"usage"' in ev:
                try:
                    usage = orjson.loads(ev[5:]).get("usage") or {}
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
                except (orjson.JSONDecodeError, ValueError, AttributeError):
                    pass
            continue
        if b'"role":"assistant","content":""' in ev:
            continue  # the role event before the first token
        rec.tokens += 1
        if rec.first_token is None:
            rec.first_token = now


def _read_answer(rec: Record, body: bytes, now: float) -> None:
    """A complete non-streaming answer: its first token is the whole answer (TTFT = latency), its tokens the
    usage's completion count."""
    try:
        usage = orjson.loads(body).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        rec.error = "bad_json"
        return
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    rec.completion_tokens = rec.tokens = int(usage.get("completion_tokens") or 0)
    rec.first_token = now
    rec.done = True


class _Run:
    def __init__(self, url: str, session: aiohttp.ClientSession, seed: int) -> None:
        self.url = url
        self.session = session
        self.records: list[Record] = []
        self.t0 = time.monotonic()
        self.rng = random.Random(seed)
        self.lingering: set[asyncio.Task[None]] = set()  # connections kept reading after their client gave up

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def attempt(self, rec: Record, body: bytes, headers: dict[str, str], spec: ClientSpec) -> None:
        rec.start = self.now()
        self.records.append(rec)
        limit = spec.timeout_s
        cancel_at = None if spec.cancel_after_s is None else rec.start + spec.cancel_after_s
        if cancel_at is not None and (limit is None or spec.cancel_after_s < limit):
            limit, cancel_reason = spec.cancel_after_s, "cancel"
        else:
            cancel_reason = "timeout"
        if spec.linger_s is not None and limit is not None and cancel_reason == "timeout":
            await self._attempt_lingering(rec, body, headers, spec, limit)
            return
        try:
            async with asyncio.timeout(limit):
                await self._exchange(rec, body, headers, spec)
        except TimeoutError:
            if cancel_reason == "cancel":
                rec.cancelled = True
            else:
                rec.timed_out = True
                rec.error = rec.error or "timeout"
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            rec.error = type(exc).__name__
        except asyncio.CancelledError:
            rec.error = rec.error or "unfinished"
            rec.end = self.now()
            raise
        rec.end = self.now()

    async def _attempt_lingering(self, rec: Record, body: bytes, headers: dict[str, str], spec: ClientSpec,
                                 limit: float) -> None:
        """The client gives up at `limit` (timed out, end = then) while the exchange goes on in the background,
        bounded by `spec.linger_s` and by the run's deadline (`run_open_loop` cancels what is left)."""
        task = asyncio.create_task(self._read_quietly(rec, body, headers, spec))
        self.lingering.add(task)
        task.add_done_callback(self.lingering.discard)
        try:
            done, _ = await asyncio.wait({task}, timeout=limit)
        except asyncio.CancelledError:
            task.cancel()
            rec.error = rec.error or "unfinished"
            rec.end = self.now()
            raise
        rec.end = self.now()
        if done:
            return
        rec.timed_out = True
        rec.error = rec.error or "timeout"
        asyncio.get_running_loop().call_later(spec.linger_s or 0.0, task.cancel)

    async def _read_quietly(self, rec: Record, body: bytes, headers: dict[str, str], spec: ClientSpec) -> None:
        """`_exchange` for a lingering client: a connection error before the timeout is the attempt's error;
        after it, it only ends the linger (e.g. the gateway reset the stream at the deadline)."""
        try:
            await self._exchange(rec, body, headers, spec)
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            if not rec.timed_out:
                rec.error = type(exc).__name__

    async def _exchange(self, rec: Record, body: bytes, headers: dict[str, str], spec: ClientSpec) -> None:
        # A slow reader keeps aiohttp's own buffer small too (it pauses the socket past 2x this), so the
        # backpressure reaches the server instead of piling up in the client process.
        kw: dict[str, Any] = {"read_bufsize": max(1024, 4 * spec.read_bytes)} if spec.read_bytes > 0 else {}
        # The SDK's httpx timeouts: connect 5 s, read = the longest silence between bytes (headers included).
        kw["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=spec.read_timeout_s)
        async with self.session.post(self.url, data=body, headers=headers, **kw) as resp:
            rec.status = resp.status
            rec.headers_at = self.now()
            h = resp.headers
            rec.replica = h.get("x-sim-replica", "")
            rec.should_retry = h.get("x-should-retry", "")  # compared as sent, like the SDK
            rec.retry_after_s = _parse_retry_after(h)
            if resp.status != 200:
                rec.body_excerpt = (await resp.read())[:300].decode("utf-8", "replace")
                return
            if resp.content_type == "application/json":  # a non-streaming answer: every token arrives at once
                _read_answer(rec, await resp.read(), self.now())
                return
            buf = b""
            content = resp.content
            slow = spec.read_bytes > 0
            while True:
                chunk = await (content.read(spec.read_bytes) if slow else content.readany())
                if not chunk:
                    break
                buf = scan_events(buf + chunk, rec, self.now())
                if spec.cancel_after_tokens is not None and rec.tokens >= spec.cancel_after_tokens \
                        and not rec.done:
                    rec.cancelled = True
                    resp.close()  # drop the connection: the disconnect the gateway must propagate
                    return
                if slow and spec.read_interval_s > 0:
                    await asyncio.sleep(spec.read_interval_s)

    async def user_call(self, ctx: Ctx, body_obj: dict[str, Any], headers: dict[str, str], kind: str,
                        spec: ClientSpec, group: str) -> Record:
        body = orjson.dumps(body_obj)
        base = {"content-type": "application/json", **headers}
        if spec.send_read_timeout:
            base["x-stainless-read-timeout"] = f"{spec.stated_timeout_s:.3f}"
        rec: Record | None = None
        call, ctx.calls = ctx.calls, ctx.calls + 1
        first_send: float | None = None
        for biz in range(spec.business_retries + 1):
            for sdk_attempt in range(spec.sdk_max_retries + 1):
                hdrs = dict(base)
                hdrs["x-stainless-retry-count"] = str(sdk_attempt)
                if spec.mark_deadline and spec.timeout_s:
                    hdrs["x-sim-deadline"] = f"{time.time() + spec.timeout_s:.3f}"
                rec = Record(user=ctx.user, attempt=ctx.attempts, sdk_attempt=sdk_attempt, kind=kind, group=group,
                             sched=ctx.arrival.at, call=call)
                ctx.attempts += 1
                if first_send is None:
                    first_send = self.now()
                rec.first_send = first_send
                await self.attempt(rec, body, hdrs, spec)
                if rec.ok or rec.cancelled:
                    return rec
                if sdk_attempt >= spec.sdk_max_retries or not sdk_should_retry(rec):
                    break
                await asyncio.sleep(sdk_backoff(rec, sdk_attempt, spec, self.rng))
            assert rec is not None
            if not business_should_retry(rec) or biz >= spec.business_retries:
                return rec
            if spec.business_backoff_s > 0:
                await asyncio.sleep(spec.business_backoff_s)
        assert rec is not None
        return rec

    async def run_arrival(self, user: int, arr: Arrival) -> None:
        delay = arr.at - self.now()
        if delay > 0:
            await asyncio.sleep(delay)
        ctx = Ctx(self, user, arr)
        if arr.script is not None:
            await arr.script(ctx)
        else:
            assert arr.body is not None
            await ctx.call(arr.body, headers=arr.headers)


def raise_nofile(want: int) -> int:
    """Raise this process's RLIMIT_NOFILE soft limit towards `want` (P12 holds thousands of sockets)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, want), hard if hard != resource.RLIM_INFINITY else want)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _small_rcvbuf_factory(rcvbuf: int) -> Callable[[Any], socket.socket]:
    """Sockets with a small receive buffer: a slow reader's backpressure reaches the server sooner (P13)."""
    def factory(addr_info: Any) -> socket.socket:
        family, type_, proto, _canon, _addr = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        return sock
    return factory


async def run_open_loop(url: str, arrivals: list[Arrival], deadline_s: float, *, seed: int = 0,
                        max_arrivals: int = 20000, session: aiohttp.ClientSession | None = None,
                        on_start: Callable[[float], None] | None = None,
                        rcvbuf: int = 0) -> tuple[list[Record], float]:
    """Replay `arrivals` against `url`; returns (records, t0 as time.monotonic()).

    Bounded: at most `max_arrivals` arrivals, and every attempt still open at `deadline_s` (wall seconds after
    t0) is cancelled and recorded with error "unfinished".
    """
    if len(arrivals) > max_arrivals:
        raise ValueError(f"{len(arrivals)} arrivals exceed the bound {max_arrivals}")
    own = session is None
    if session is None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False,
                                         socket_factory=_small_rcvbuf_factory(rcvbuf) if rcvbuf else None)
        session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                        read_bufsize=2 ** 16)
    run = _Run(url, session, seed)
    if on_start is not None:
        on_start(run.t0)
    tasks = [asyncio.create_task(run.run_arrival(i, a)) for i, a in enumerate(sorted(arrivals, key=lambda a: a.at))]
    try:
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline_s - run.now()))
        if run.lingering:  # lingering connections end with the response, their cap or the run's deadline
            await asyncio.wait(set(run.lingering), timeout=max(0.0, deadline_s - run.now()))
        pending |= set(run.lingering)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # a harness bug, not a system failure: surface it
    finally:
        for t in tasks:
            t.cancel()
        if own:
            await session.close()
    return run.records, run.t0
