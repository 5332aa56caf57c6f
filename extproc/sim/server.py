"""The simulated replica's HTTP face: an OpenAI-compatible API shaped like vLLM's, plus admin.

API listener (``--port``): ``POST /v1/chat/completions``, ``POST /v1/completions`` (stream and
non-stream), ``GET /v1/models``, ``GET /health``, ``GET /version``, ``GET /metrics``, and the admin
routes below. Admin listener (``--admin-port``, default port+1000): ``GET /sim/state``,
``POST /sim/fault``; it stays up while the ``crash`` fault has the API listener closed.

Every response carries ``x-sim-replica: <name>``; every error is OpenAI-style JSON
``{"error": {"message", "type", "param", "code"}}``.

Disconnects: the API runner uses aiohttp's ``handler_cancellation``, so a client that goes away
(stream or not, before or after the first token) cancels its handler at once and the handler's
``finally`` aborts the request in the engine (blocks freed before the next step), unless the
``no-abort`` fault is on; then the engine keeps generating and counts ghost tokens.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import time
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from aiohttp import web

from . import tokenizer
from .engine import FINISHED, Engine, Request, block_hashes
from .faults import FaultError, Faults, parse_fault, parse_fault_arg
from .metrics import CONTENT_TYPE, SimCollector, make_registry, render
from .presets import contended_quantile, get_preset
from .runner import EngineRunner

__all__ = ["SimConfig", "SimServer", "start_sim", "SimError", "PortInUse"]


class SimError(Exception):
    """A configuration or start-up problem, reported to the user in one line."""


class PortInUse(SimError):
    pass


@dataclass
class SimConfig:
    """Everything a simulated replica needs; the CLI flags map one to one onto these fields."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (tests)
    name: str | None = None  # default "host:port"
    model: str = "sim-model"
    preset: str = "tiny-cpu"
    time_scale: float = 1.0  # >1 runs faster than the modelled hardware
    speed: float = 1.0  # the hardware's speed relative to the preset's: engine steps take 1/speed of its time
    seed: int = 0
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    mean_output_tokens: float | None = None
    prefix_cache: bool = True  # vLLM 0.32's default; --no-enable-prefix-caching turns it off
    reserve_full_isl: bool = True  # vLLM 0.32's default; --no-scheduler-reserve-full-isl turns it off
    metrics_style: str = "vllm"
    admin_port: int | None = None  # None: port+1000 (or a free port when port is 0); -1: none
    faults: list[tuple[str, Any]] = field(default_factory=list)  # e.g. [("slow", 5.0)]

    @staticmethod
    def parse_faults(args: list[str]) -> list[tuple[str, Any]]:
        return [parse_fault_arg(a) for a in args]


def _error(status: int, message: str, etype: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                413: "RequestEntityTooLargeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(e.status, e.message, _ERROR_TYPES.get(e.status, "BadRequestError"), e.param)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.reason or "error", _ERROR_TYPES.get(e.status, "Error"))


def _set_linger_zero(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass


class _Job:
    """What a handler needs besides the engine request: ids, templates, output offset."""

    __slots__ = ("req", "rid", "created", "offset", "chat", "include_usage", "prompt_tokens")

    def __init__(self, req: Request, rid: str, created: int, offset: int, chat: bool,
                 include_usage: bool, prompt_tokens: int) -> None:
        self.req = req
        self.rid = rid
        self.created = created
        self.offset = offset
        self.chat = chat
        self.include_usage = include_usage
        self.prompt_tokens = prompt_tokens


class SimServer:
    """One simulated replica: engine + runner + API listener + admin listener."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        try:
            preset = get_preset(config.preset)
        except ValueError as e:
            raise SimError(str(e)) from None
        self.preset = preset.with_overrides(
            num_gpu_blocks=config.num_gpu_blocks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, block_size=config.block_size,
            mean_output_tokens=config.mean_output_tokens)
        if config.speed <= 0:
            raise SimError("--speed must be > 0")
        self.preset = replace(self.preset, cost=self.preset.cost.at_speed(config.speed))
        p = self.preset
        if config.metrics_style not in ("vllm", "sglang"):
            raise SimError(f"unknown metrics style {config.metrics_style!r} (vllm or sglang)")
        if config.time_scale <= 0:
            raise SimError("--time-scale must be > 0")
        for label, v in (("num-gpu-blocks", p.num_gpu_blocks), ("max-num-seqs", p.max_num_seqs),
                         ("max-num-batched-tokens", p.max_num_batched_tokens),
                         ("max-model-len", p.max_model_len), ("block-size", p.block_size)):
            if v <= 0:
                raise SimError(f"--{label} must be > 0")
        # vLLM refuses to start when one max-length sequence cannot fit in the KV cache.
        kv_tokens = p.num_gpu_blocks * p.block_size
        if p.max_model_len > kv_tokens:
            if config.max_model_len is not None:
                raise SimError(f"--max-model-len {p.max_model_len} does not fit in the KV cache "
                               f"({p.num_gpu_blocks} blocks x {p.block_size} = {kv_tokens} tokens)")
            self.preset = p = p.with_overrides(max_model_len=kv_tokens)
        self.max_model_len = p.max_model_len
        self.model = config.model
        self.seed = config.seed
        self.time_scale = config.time_scale
        self.faults = Faults()
        self.engine = self._new_engine()
        self._rng = random.Random(config.seed ^ 0xE77)
        self._id_prefix = os.urandom(4).hex()
        self._next_id = 0
        self._runner: EngineRunner | None = None
        self._api_runner: web.AppRunner | None = None
        self._api_site: web.TCPSite | None = None
        self._admin_runner: web.AppRunner | None = None
        self.port = config.port
        self.admin_port: int | None = None
        self.host = config.host
        self.name = config.name or ""
        self.collector = SimCollector(lambda: self.engine, config.model, config.metrics_style,
                                      now_ref=self._sim_now)
        self.registry = make_registry(self.collector)
        self._started = time.time()

    def _sim_now(self) -> float:
        """The engine's time now: the runner's, or the engine's clock before it starts."""
        return self._runner.sim_now() if self._runner is not None else self.engine.clock

    def _new_engine(self) -> Engine:
        p = self.preset
        return Engine(p.cost, num_gpu_blocks=p.num_gpu_blocks, block_size=p.block_size,
                      max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens,
                      prefix_cache=self.config.prefix_cache, time_scale=self.config.time_scale,
                      reserve_full_isl=self.config.reserve_full_isl)

    # ---- lifecycle -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str | None:
        return None if self.admin_port is None else f"http://{self.host}:{self.admin_port}"

    @property
    def runner(self) -> EngineRunner:
        assert self._runner is not None, "start() first"
        return self._runner

    def _api_app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_json], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/version", self.handle_version)
        app.router.add_get("/metrics", self.handle_metrics)
        self._add_admin_routes(app)
        app.on_response_prepare.append(self._tag_response)
        return app

    def _admin_app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_json])
        self._add_admin_routes(app)
        app.on_response_prepare.append(self._tag_response)
        return app

    def _add_admin_routes(self, app: web.Application) -> None:
        app.router.add_get("/sim/state", self.handle_state)
        app.router.add_post("/sim/fault", self.handle_fault)

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-sim-replica"] = self.name

    async def _bind(self, runner: web.AppRunner, port: int) -> web.TCPSite:
        site = web.TCPSite(runner, self.host, port, backlog=1024)
        try:
            await site.start()
        except OSError as e:
            import errno

            if e.errno == errno.EADDRINUSE:
                raise PortInUse(f"port {port} on {self.host} is already in use") from None
            raise SimError(f"cannot listen on {self.host}:{port}: {e.strerror or e}") from None
        return site

    async def start(self) -> "SimServer":
        self._runner = EngineRunner(self.engine, self.time_scale)
        self._runner.start()
        try:
            self._api_runner = web.AppRunner(self._api_app(), handler_cancellation=True,
                                             access_log=None, shutdown_timeout=1.0)
            await self._api_runner.setup()
            self._api_site = await self._bind(self._api_runner, self.config.port)
            self.port = self._api_site.port
            if not self.name:
                self.name = f"{self.host}:{self.port}"
            admin = self.config.admin_port
            if admin is None:
                admin = self.config.port + 1000 if 0 < self.config.port <= 64535 else 0
            if admin >= 0:
                self._admin_runner = web.AppRunner(self._admin_app(), access_log=None,
                                                   shutdown_timeout=1.0)
                await self._admin_runner.setup()
                site = await self._bind(self._admin_runner, admin)
                self.admin_port = site.port
            for name, value in self.config.faults:
                await self.apply_fault(name, value)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """Stop listening, reset open connections, stop the engine task."""
        if self._runner is not None:
            await self._runner.stop()
        if self._api_runner is not None:
            self._reset_connections()
            await self._api_runner.cleanup()
            self._api_runner = None
            self._api_site = None
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None

    def _reset_connections(self, keep: asyncio.BaseTransport | None = None) -> None:
        if self._api_runner is None or self._api_runner.server is None:
            return
        conns = getattr(self._api_runner.server, "_connections", {})
        for transport in list(conns.values()):
            if transport is keep:
                continue  # the connection that asked for the crash still gets its answer
            _set_linger_zero(transport)
            transport.abort()

    # ---- faults --------------------------------------------------------------------------

    async def apply_fault(self, name: str, value: Any = None,
                          keep: asyncio.BaseTransport | None = None) -> None:
        """Apply one fault command (validated here; raises FaultError).

        ``keep``: a connection that a crash must not reset (the one carrying the command).
        """
        n, v = parse_fault(name, value)
        f = self.faults
        if n == "slow":
            f.slow = v
            self.engine.slow_factor = v
        elif n == "hang":
            f.hang = v
        elif n == "error-rate":
            f.error_rate = v
        elif n == "kv-shrink":
            f.kv_shrink = v
            self.engine.set_kv_lost_fraction(v)
        elif n == "no-abort":
            f.no_abort = v
        elif n == "metrics-latency":
            if v == "contended" and not self.preset.metrics_contended:
                raise FaultError(f"preset {self.preset.name} has no measurement of /metrics on a contended machine")
            f.metrics_latency = v
        elif n == "crash":
            await self._crash(keep)
        elif n == "recover":
            await self._recover()
        elif n == "clear":
            f.slow, f.hang, f.error_rate, f.no_abort, f.metrics_latency = 1.0, False, 0.0, False, 0.0
            self.engine.slow_factor = 1.0
            f.kv_shrink = 0.0
            self.engine.set_kv_lost_fraction(0.0)
            await self._recover()
        if self._runner is not None:
            self._runner.paused = f.hang or f.crashed
            self._runner.retime()

    async def _crash(self, keep: asyncio.BaseTransport | None = None) -> None:
        if self.faults.crashed:
            return
        self.faults.crashed = True
        if self._runner is not None:
            self._runner.paused = True
        if self._api_site is not None:
            await self._api_site.stop()
            self._api_site = None
        self._reset_connections(keep)
        dropped = self.engine.reset()
        self.engine.wipe_cache()
        if self._runner is not None:
            self._runner.touch(dropped)
            self._runner.deliver()

    async def _recover(self) -> None:
        if not self.faults.crashed:
            return
        if self._api_runner is not None and self._api_site is None:
            self._api_site = await self._bind(self._api_runner, self.port)
        self.faults.crashed = False

    def state(self) -> dict[str, Any]:
        eng = self.engine
        st = eng.stats
        return {
            "name": self.name,
            "model": self.model,
            "preset": self.preset.name,
            "port": self.port,
            "admin_port": self.admin_port,
            "time_scale": self.time_scale,
            "speed": self.config.speed,
            "running": len(eng.running),
            "waiting": eng.waiting_in_engine(self._sim_now()),
            "kv_usage": eng.kv_usage(),
            "num_gpu_blocks": eng.pool.total,
            "usable_blocks": eng.pool.capacity,
            "used_blocks": eng.pool.used(),
            "free_blocks": eng.pool.num_free(),
            "faults": self.faults.as_dict(),
            "counters": {
                "prompt_tokens": st.prompt_tokens,
                "generation_tokens": st.generation_tokens,
                "preemptions": st.preemptions,
                "prefix_cache_queries": st.prefix_queries,
                "prefix_cache_hits": st.prefix_hits,
                "ghost_tokens": st.ghost_tokens,
                "late_tokens": st.late_tokens,
                "finished": dict(st.finished),
                "steps": st.steps,
            },
        }

    # ---- admin handlers ------------------------------------------------------------------

    async def handle_state(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.state()), content_type="application/json")

    async def handle_fault(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if not isinstance(body.get("fault"), str):
            raise BadRequest("body must be {\"fault\": NAME, \"value\": VALUE}", "fault")
        try:
            await self.apply_fault(body["fault"], body.get("value"), keep=request.transport)
        except FaultError as e:
            raise BadRequest(str(e), "fault") from None
        except SimError as e:
            return _error(500, str(e), "InternalServerError")
        resp = web.Response(body=orjson.dumps(self.state()), content_type="application/json")
        if self.faults.crashed and request.transport is not None:
            resp.force_close()  # the spared connection closes once this answer is out
        return resp

    # ---- plain API handlers --------------------------------------------------------------

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def handle_version(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"version":"0.32.0+sluice.sim"}', content_type="application/json")

    async def handle_metrics(self, request: web.Request) -> web.Response:
        # vLLM renders /metrics in its one API-server process, behind the streams it serves: the
        # answer takes longer the more sequences run (CostModel.metrics_latency, measured).
        delay = self._metrics_delay() / self.time_scale
        if delay > 0:
            await asyncio.sleep(delay)
        resp = web.Response(body=render(self.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE
        return resp

    def _metrics_delay(self) -> float:
        """Seconds the /metrics answer takes: the measured function of the load, or the fault's latency."""
        fault = self.faults.metrics_latency
        if fault == "contended":
            return contended_quantile(self.preset.metrics_contended, self._rng.random())
        if fault:
            return float(fault)
        return self.preset.cost.metrics_latency(len(self.engine.running))

    async def handle_models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": int(self._started),
                "owned_by": "vllm", "root": self.model, "parent": None,
                "max_model_len": self.max_model_len}
        return web.Response(body=orjson.dumps({"object": "list", "data": [card]}),
                            content_type="application/json")

    # ---- completions ---------------------------------------------------------------------

    async def _json(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"JSON decode error: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _common(self, body: dict[str, Any], chat: bool) -> tuple[int | None, bool, bool]:
        """Validate model, n, stream options and max tokens. Returns (max_tokens, stream, usage)."""
        model = body.get("model")
        if model is not None and model != self.model:
            raise BadRequest(f"The model `{model}` does not exist.", "model", 404)
        n = body.get("n")
        if n is not None and n != 1:
            raise BadRequest("n must be 1: the simulator does not support n > 1", "n")
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options")
        if opts is not None and not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        mt = body.get("max_completion_tokens") if chat else None
        if mt is None:
            mt = body.get("max_tokens")
        if mt is not None:
            if isinstance(mt, bool) or not isinstance(mt, int):
                raise BadRequest("max_tokens must be an integer", "max_tokens")
            if mt < 1:
                raise BadRequest(f"max_tokens must be at least 1, got {mt}.", "max_tokens")
        return mt, stream, include_usage

    def _maybe_fail(self) -> web.Response | None:
        p = self.faults.error_rate
        if p > 0 and self._rng.random() < p:
            return _error(500, "simulated internal server error (error-rate fault)",
                          "InternalServerError")
        return None

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        failed = self._maybe_fail()
        if failed is not None:
            return failed
        max_tokens, stream, include_usage = self._common(body, chat=True)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of objects", "messages")
        want_ids = self.engine.prefix_cache
        n_prompt, ids = tokenizer.chat_prompt(messages, with_ids=want_ids)
        key = orjson.dumps(messages) + b"|" + str(body.get("seed")).encode()
        return await self._generate(request, n_prompt, ids, key, max_tokens, stream, include_usage, True)

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        failed = self._maybe_fail()
        if failed is not None:
            return failed
        max_tokens, stream, include_usage = self._common(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        want_ids = self.engine.prefix_cache
        ids: list[int] | None = None
        if isinstance(prompt, str):
            if want_ids:
                ids = tokenizer.token_ids(prompt)
                n_prompt = len(ids)
            else:
                n_prompt = tokenizer.count_tokens(prompt)
            key = prompt.encode()
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = list(prompt)
            n_prompt = len(ids)
            key = orjson.dumps(ids)
        else:
            raise BadRequest("prompt must be a string or a list of token ids "
                             "(batched prompts are not supported by the simulator)", "prompt")
        if n_prompt == 0:
            raise BadRequest("The prompt cannot be empty.", "prompt")
        key += b"|" + str(body.get("seed")).encode()
        return await self._generate(request, n_prompt, ids, key, max_tokens, stream, include_usage, False)

    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self._id_prefix}{self._next_id:08x}"

    async def _generate(self, request: web.Request, n_prompt: int, ids: list[int] | None, key: bytes,
                        max_tokens: int | None, stream: bool, include_usage: bool,
                        chat: bool) -> web.StreamResponse:
        mml = self.max_model_len
        if n_prompt >= mml:
            raise BadRequest(f"This model's maximum context length is {mml} tokens. However, your "
                             f"request has {n_prompt} input tokens. Please reduce the length of the "
                             f"input messages.", "messages" if chat else "prompt")
        if max_tokens is not None:
            if n_prompt + max_tokens > mml:
                raise BadRequest(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                                 f"This model's maximum context length is {mml} tokens and your request "
                                 f"has {n_prompt} input tokens ({max_tokens} > {mml} - {n_prompt}).",
                                 "max_tokens")
            out_len, reason = max_tokens, "length"
        else:
            cap = mml - n_prompt
            out_len = tokenizer.natural_length(self.seed, key, self.preset.mean_output_tokens, cap)
            reason = "length" if out_len >= cap else "stop"
        hashes = block_hashes(ids, self.preset.block_size) if ids is not None and self.engine.prefix_cache \
            else None
        sid = self._new_id()
        req = Request(sid, n_prompt, out_len, hashes=hashes, stop_reason=reason)
        req.notify_each = stream
        req.deadline = self._deadline(request)
        job = _Job(req, ("chatcmpl-" if chat else "cmpl-") + sid, int(time.time()),
                   tokenizer.output_offset(self.seed, key), chat, include_usage, n_prompt)
        runner = self.runner
        runner.submit(req)
        try:
            if stream:
                return await self._stream(request, job)
            return await self._complete(job)
        finally:
            req.waiter = None
            if req.status != FINISHED:
                req.client_gone = True
                if not self.faults.no_abort:
                    self._abort_later(req)

    def _abort_later(self, req: Request) -> None:
        """Abort a request whose client left: the engine stops it at once (vLLM generates no token after a
        disconnect), but ``vllm:num_requests_running`` still counts it for ``cost.abort`` seconds, as
        vLLM's gauge does until its next stats update (measured)."""
        if not self.runner.abort(req):
            return
        delay = self.preset.cost.abort / self.time_scale
        if delay > 0:
            self.collector.lagging_running += 1
            asyncio.get_running_loop().call_later(delay, self._unlag)

    def _unlag(self) -> None:
        self.collector.lagging_running -= 1

    def _deadline(self, request: web.Request) -> float | None:
        """Simulated time of the client's deadline from ``x-sim-deadline`` (unix seconds), a benchmark probe:
        tokens generated after it, for a client still connected, count as ``late_tokens`` (work nobody waits
        for). Absolute, so time spent in a gateway's queue does not move it."""
        text = request.headers.get("x-sim-deadline")
        if not text:
            return None
        try:
            left = float(text) - time.time()
        except ValueError:
            return None
        return self.runner.sim_now() + left * self.time_scale

    async def _wait(self, req: Request) -> None:
        fut = asyncio.get_running_loop().create_future()
        req.waiter = fut
        await fut

    async def _complete(self, job: _Job) -> web.Response:
        req = job.req
        while req.status != FINISHED:
            await self._wait(req)
        text = tokenizer.output_text(job.offset, 0, req.num_output)
        reason = req.finish_reason
        usage = {"prompt_tokens": job.prompt_tokens, "total_tokens": job.prompt_tokens + req.num_output,
                 "completion_tokens": req.num_output, "prompt_tokens_details": None}
        if job.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "tool_calls": [],
                            "reasoning_content": None},
                "logprobs": None, "finish_reason": reason, "stop_reason": None}
            obj = {"id": job.rid, "object": "chat.completion", "created": job.created, "model": self.model,
                   "choices": [choice], "service_tier": None, "system_fingerprint": None,
                   "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None}
        else:
            obj = {"id": job.rid, "object": "text_completion", "created": job.created, "model": self.model,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                                "stop_reason": None, "prompt_logprobs": None}],
                   "usage": usage, "kv_transfer_params": None}
        return web.Response(body=orjson.dumps(obj), content_type="application/json")

    async def _stream(self, request: web.Request, job: _Job) -> web.StreamResponse:
        req = job.req
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)  # headers go out before prefill, as with vLLM
        head = (b'data: {"id":"' + job.rid.encode()
                + (b'","object":"chat.completion.chunk","created":' if job.chat
                   else b'","object":"text_completion","created":')
                + str(job.created).encode() + b',"model":' + orjson.dumps(self.model) + b',"choices":[')
        if job.chat:
            open_ = head + b'{"index":0,"delta":{"content":'
            close = b'},"logprobs":null,"finish_reason":null}]}\n\n'
            first = head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,' \
                           b'"finish_reason":null}]}\n\n'
        else:
            open_ = head + b'{"index":0,"text":'
            close = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            first = b""
        sent = 0
        offset = job.offset
        piece = tokenizer.output_piece
        dumps = orjson.dumps
        while True:
            out = req.num_output
            done = req.status == FINISHED
            if out > sent or done:
                parts: list[bytes] = []
                if sent == 0 and first and out > 0:
                    parts.append(first)
                last = out - 1 if done else out
                for i in range(sent, last):
                    parts.append(open_ + dumps(piece(offset, i)) + close)
                if done:
                    reason = dumps(req.finish_reason)
                    text = dumps(piece(offset, out - 1)) if out > 0 else b'""'
                    if job.chat:
                        parts.append(open_ + text + b'},"logprobs":null,"finish_reason":' + reason
                                     + b',"stop_reason":null}]}\n\n')
                    else:
                        parts.append(open_ + text + b',"logprobs":null,"finish_reason":' + reason
                                     + b',"stop_reason":null}]}\n\n')
                    if job.include_usage:
                        usage = {"prompt_tokens": job.prompt_tokens,
                                 "total_tokens": job.prompt_tokens + out, "completion_tokens": out}
                        parts.append(head + b'],"usage":' + dumps(usage) + b"}\n\n")
                    parts.append(b"data: [DONE]\n\n")
                sent = out
                await resp.write(b"".join(parts))
                if done:
                    break
            await self._wait(req)
        await resp.write_eof()
        return resp


async def start_sim(config: SimConfig) -> SimServer:
    """Start a simulated replica in the running event loop; ``await handle.stop()`` to end it."""
    return await SimServer(config).start()
