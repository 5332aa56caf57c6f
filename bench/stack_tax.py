"""`python -m bench.stack_tax [--json FILE]`: what the scenarios' own stack (Envoy, the sidecar) takes from the two
real engines' throughput on this machine, and what the openai SDK as a client would (issue 16: the simulated
column's speed).

Why: the rig probe (bench/rig.py) drives the two engines straight, with a light aiohttp client, and finds what
share of the preset's capacity they deliver side by side (0.477 on the Xeon). The scenarios drive them through
Envoy and a gateway (their clients are aiohttp behaving as the openai SDK does, bench/openloop.py), on the same two
cores, and the simulated column ran at that one share:
long prompts that arrive slowly came out twice as slow as the engines ran them, streams of answers about right
(docs/benchmarks.md, "The simulated column on the rig's shared cores"). The engines do not slow each other
(bench/contend.py), so the rest of the machine takes the difference; which part was not measured.

The probe: two engines, whole on their cores (`bench.vllm_cpu.start_engines`). For each request shape, clients
keep `STREAMS_PER_ENGINE` x 2 streaming chat completions in flight back to back (unique prompts: no prefix-cache
hit; their starts staggered) for `WINDOW_S` after `WARMUP_S`, along each path in turn:

    direct aiohttp   the rig's probe: aiohttp straight to the engines
    envoy-rr         the same client through Envoy round robin (the harness's Stack, mode envoy-rr)
    sluice           the same client through Envoy + the sidecar at its shipped defaults (mode sluice)
    direct openai    the openai SDK itself (AsyncOpenAI, streaming, max_retries 0) straight to the engines: what
                     the end-to-end tests' client costs, for comparison

Per (shape, path): completions/s, output tokens/s (counted as they stream), refusals/s and the completions' median
time to first token in the window, and the cores the engines (their process groups, split into the API server,
EngineCore's scheduler and the worker that computes), Envoy, the sidecar and the clients (this process) used over
the drive. The shapes: the rig's reference request (800 prompt, 32 output tokens), a long answer (100 prompt, 256
output tokens, `ignore_eos`) and a tiny request (16 prompt, 1 output token), where the engine's own work is least
and its API server's per-request work shows. Printed as a table; written with --json; `--show FILE` prints the
table of a written file again.

`--model PRESET` adds what the preset's cost model serves under the same load: per engine, `streams` clients back
to back on a simulated replica (bench/capacity.py `closed_loop_rps`), times the engines; the table gives each
path's completions/s as a share of it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from bench.procstat import cpu_seconds, group_cpu_by_name

STREAMS_PER_ENGINE = 16
WARMUP_S, WINDOW_S = 3.0, 12.0
STAGGER_S = 0.05  # client k starts k x this late: streams of equal requests would otherwise end in waves
SHAPES = {"prompt 800 / output 32": (800, 32), "prompt 100 / output 256": (100, 256), "prompt 16 / output 1": (16, 1)}
# an engine's processes by command name (/proc/PID/comm) -> the part of the engine each is
ENGINE_PARTS = {"vllm": "api server", "VLLM::EngineCor": "engine core", "VLLM::Worker": "worker"}
PATHS = ("direct aiohttp", "envoy-rr", "sluice", "direct openai")


@dataclass
class Window:
    """What one (shape, path) measurement counts inside its window: completions as they end, output tokens as
    they stream (a long answer's tokens would otherwise all count at its end, in waves)."""

    start: float
    end: float
    completions: int = 0
    output_tokens: int = 0
    failed: int = 0                                        # answers other than 200 (a gateway's refusals)
    ttfts: list[float] = field(default_factory=list)       # seconds from send to the first token, completions only

    def count(self, ttft: float | None = None) -> None:
        if self.start <= time.monotonic() <= self.end:
            self.completions += 1
            if ttft is not None:
                self.ttfts.append(ttft)

    def fail(self) -> None:
        if self.start <= time.monotonic() <= self.end:
            self.failed += 1

    def token(self) -> None:
        if self.start <= time.monotonic() <= self.end:
            self.output_tokens += 1


def _cpu_or_zero(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except OSError:  # it has exited
        return 0.0


def own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def body(prompt: int, output: int, salt: int) -> dict[str, Any]:
    from bench.scenarios.base import chat

    b = chat(prompt, output, salt=salt)
    b["ignore_eos"] = True  # the answer's length is the shape's, whatever the tiny random model samples
    return b


async def aiohttp_client(session: Any, url: str, prompt: int, output: int, salt: int, stop_at: float,
                         window: Window, delay_s: float = 0.0) -> None:
    """The rig's client, and the scenarios' (bench/openloop.py is aiohttp too): POST, read the whole stream, count
    its tokens and the completion."""
    import orjson

    await asyncio.sleep(delay_s)

    n = 0
    while time.monotonic() < stop_at:
        data = orjson.dumps(body(prompt, output, salt + n))
        n += 1
        sent, first = time.monotonic(), None
        async with session.post(url + "/v1/chat/completions", data=data,
                                headers={"Content-Type": "application/json"}) as r:
            async for line in r.content:
                if b'"content":"' in line and b'"content":""' not in line:  # one token a chunk (vLLM)
                    if first is None:
                        first = time.monotonic() - sent
                    window.token()
            ok = r.status == 200
        if ok:
            window.count(first)
        else:
            window.fail()
            await asyncio.sleep(0.1)  # a refusal comes back at once: not a busy loop


async def openai_client(api: Any, prompt: int, output: int, salt: int, stop_at: float, window: Window,
                        delay_s: float = 0.0) -> None:
    """The openai SDK itself (the end-to-end tests' client) streaming a chat completion, read to its end."""
    await asyncio.sleep(delay_s)
    n = 0
    while time.monotonic() < stop_at:
        b = body(prompt, output, salt + n)
        n += 1
        sent, first = time.monotonic(), None
        stream = await api.chat.completions.create(
            model=b["model"], messages=b["messages"], max_tokens=b["max_tokens"], stream=True,
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.monotonic() - sent
                window.token()
        window.count(first)


async def drive(urls: list[str], sdk: bool, prompt: int, output: int, streams: int, warmup_s: float,
                window_s: float, salt: int) -> Window:
    """`streams` clients per URL in `urls`, back to back until the window ends."""
    import aiohttp
    import openai

    start = time.monotonic()
    window = Window(start + warmup_s, start + warmup_s + window_s)
    clients: list[Awaitable[None]] = []
    closers: list[Callable[[], Awaitable[None]]] = []
    if sdk:
        for url in urls:
            api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120.0)
            closers.append(api.close)
            clients += [openai_client(api, prompt, output, salt + (len(clients) + k) * 100_000, window.end, window,
                                      STAGGER_S * (len(clients) + k)) for k in range(streams)]
        await asyncio.gather(*clients)
    else:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=1.0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for url in urls:
                clients += [aiohttp_client(session, url, prompt, output, salt + (len(clients) + k) * 100_000,
                                           window.end, window, STAGGER_S * (len(clients) + k))
                            for k in range(streams)]
            await asyncio.gather(*clients)
    for close in closers:
        await close()
    return window


def cpu_now(engines: list[Any], stack: Any | None) -> dict[str, float]:
    from bench.runner import _gateway_pids

    out = {"engines": 0.0, "clients": own_cpu_s(), **{part: 0.0 for part in ENGINE_PARTS.values()}}
    for e in engines:
        for name, seconds in group_cpu_by_name(e.pgid).items():
            out["engines"] += seconds
            if name in ENGINE_PARTS:
                out[ENGINE_PARTS[name]] += seconds
    if stack is not None:
        for part, pids in _gateway_pids(stack).items():
            if pids:
                out[part] = sum(_cpu_or_zero(p) for p in pids)
    return out


def measure_path(path: str, engines: list[Any], run_dir: Path, salt: int, streams: int, warmup_s: float,
                 window_s: float) -> dict[str, dict[str, float]]:
    """Every shape along one path: completions/s, output tokens/s and CPU seconds per part in the window."""
    from bench.scenarios.base import MODEL
    from extproc.config import policy_from_dict
    from extproc.supervisor import Stack, with_free_ports

    stack = None
    urls = [e.url for e in engines]
    if path in ("envoy-rr", "sluice"):
        replicas = [f"127.0.0.1:{e.spec.port}" for e in engines]
        policy = with_free_ports(policy_from_dict({"pools": [{"model": MODEL, "replicas": replicas}],
                                                   "simulator": {"enabled": False},
                                                   "gateway": {"envoy_log_level": "error"}}))
        policy.pools = [dataclasses.replace(policy.pools[0], replicas=replicas)]  # the engines' own ports
        stack = Stack(policy, run_dir=run_dir / path, mode=path)
        stack.start()
        urls = [stack.base_url]
    try:
        out: dict[str, dict[str, float]] = {}
        for i, (shape, (prompt, output)) in enumerate(SHAPES.items()):
            per_url = streams * len(engines) // len(urls)
            before = cpu_now(engines, stack)
            t0 = time.monotonic()
            window = asyncio.run(drive(urls, path == "direct openai", prompt, output, per_url, warmup_s, window_s,
                                       salt + i * 10_000_000))
            after = cpu_now(engines, stack)
            elapsed = time.monotonic() - t0  # the whole drive, warm-up included: cores = CPU seconds / elapsed
            cores = {part: round((after[part] - before[part]) / elapsed, 2) for part in after if part in before}
            ttft = statistics.median(window.ttfts) if window.ttfts else None
            out[shape] = {"completions_per_s": round(window.completions / window_s, 2),
                          "output_tokens_per_s": round(window.output_tokens / window_s, 1),
                          "failed_per_s": round(window.failed / window_s, 2),
                          "ttft_p50_s": None if ttft is None else round(ttft, 3),
                          "cores": cores}
            print(f"  {path:15s} {shape:24s} {out[shape]['completions_per_s']:7.2f} completions/s "
                  f"{out[shape]['output_tokens_per_s']:8.1f} tokens/s  failed {out[shape]['failed_per_s']}/s  "
                  f"TTFT p50 {out[shape]['ttft_p50_s']} s  cores {cores}", flush=True)
        return out
    finally:
        if stack is not None:
            stack.stop()


def run(streams: int = STREAMS_PER_ENGINE, warmup_s: float = WARMUP_S, window_s: float = WINDOW_S,
        engines_n: int = 2, paths: tuple[str, ...] = PATHS) -> dict[str, dict[str, Any]]:
    """Start `engines_n` engines (one per core), measure `paths`, stop them: {path: {shape: numbers}}."""
    from bench import vllm_cpu
    from bench.scenarios.base import MODEL, set_text_scale
    from extproc.supervisor import free_ports

    set_text_scale(1.0)  # the tiny model's tokenizer counts one filler word as one token (bench/backends.py)
    log_dir = Path(tempfile.mkdtemp(prefix="sluice-stack-tax-"))
    specs = vllm_cpu.engine_specs(free_ports(engines_n), extra_args=("--served-model-name", MODEL))
    engines = vllm_cpu.start_engines(specs, log_dir)
    try:
        return {path: measure_path(path, engines, log_dir, 50_000_000 * (i + 1), streams, warmup_s, window_s)
                for i, path in enumerate(paths)}
    finally:
        vllm_cpu.stop_engines(engines)


def model_rps(preset: str, engines_n: int, streams: int) -> dict[str, float]:
    """Per shape, the completions/s the preset's cost model gives `engines_n` engines with `streams` clients each
    (bench/capacity.py `closed_loop_rps`)."""
    from bench.capacity import EngineSpec, closed_loop_rps

    spec = EngineSpec.of(preset)
    return {shape: round(engines_n * closed_loop_rps(spec, streams, *size), 2) for shape, size in SHAPES.items()}


def _engine_cores(c: dict[str, float]) -> str:
    """The engines' cores, split into API server / engine core / worker where the run recorded it."""
    if "engines" not in c:
        return "-"
    parts = [c.get(part) for part in ENGINE_PARTS.values()]
    if any(v is None for v in parts):
        return str(c["engines"])
    return f"{c['engines']} ({' / '.join(str(v) for v in parts)})"


def table(result: dict[str, dict[str, Any]], model: dict[str, float] | None = None) -> str:
    """One row per (shape, path): throughput, its share of the direct probe's (and of the model's, with `model`),
    and the cores each part used."""
    head = "| shape | path | completions/s | of direct aiohttp | "
    head += "of the model | " if model else ""
    head += ("output tokens/s | failed/s | TTFT p50 (s) | cores: engines (api server / engine core / worker) | "
             "clients | envoy | sidecar |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for shape in (s for s in SHAPES if any(s in r for r in result.values())):
        base = result["direct aiohttp"][shape]["completions_per_s"] if "direct aiohttp" in result else 0
        for path in (p for p in PATHS if p in result):
            row = result[path][shape]
            c = row["cores"]
            share = f"{row['completions_per_s'] / base:.2f}" if base else "-"
            of_model = ""
            if model:
                m = model.get(shape)
                of_model = f"{row['completions_per_s'] / m:.2f} of {m} | " if m else "- | "
            lines.append(f"| {shape} | {path} | {row['completions_per_s']} | {share} | {of_model}"
                         f"{row['output_tokens_per_s']} | {row.get('failed_per_s', '-')} | "
                         f"{row.get('ttft_p50_s', '-')} | {_engine_cores(c)} | {c.get('clients', '-')} | "
                         f"{c.get('envoy', '-')} | "
                         f"{c.get('sidecar', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stack_tax", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--window", type=float, default=WINDOW_S, help="seconds measured per (shape, path)")
    ap.add_argument("--show", nargs="+", metavar="FILE", help="print the tables of earlier --json files instead")
    ap.add_argument("--engines", type=int, choices=(1, 2), default=2,
                    help="engines started, one per core (1: the other core left to the clients)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}")
    ap.add_argument("--model", metavar="PRESET", help="also give each path's throughput as a share of what this "
                                                      "preset (a name or a .json file) serves under the same load")
    args = ap.parse_args(argv)
    paths = tuple(p.strip() for p in args.paths.split(","))
    if any(p not in PATHS for p in paths):
        ap.error(f"--paths: each of {', '.join(PATHS)}")
    if args.show:
        for name in args.show:
            data = json.loads(Path(name).read_text())
            n = data.get("engines", 2)
            model = model_rps(args.model, n, data["streams_per_engine"]) if args.model else None
            more = f" --model {args.model}" if args.model else ""
            print(f"<!-- generated by `python -m bench.stack_tax --show {name}{more}`; do not edit by hand -->")
            print(f"{data['machine']['cpu_model']}, {data['date']}, {n} engine{'s' if n != 1 else ''}, "
                  f"{data['streams_per_engine']} streams per engine, {data['window_s']:g} s window"
                  + (f"; the model: {Path(args.model).name}, the same clients" if model else "") + ":\n")
            print(table(data["paths"], model) + "\n")
        return 0
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result = run(window_s=args.window, engines_n=args.engines, paths=paths)
    model = model_rps(args.model, args.engines, STREAMS_PER_ENGINE) if args.model else None
    print(table(result, model))
    if args.json:
        from extproc.sim.measure import machine_info

        out = {"date": started, "machine": machine_info(), "engines": args.engines,
               "streams_per_engine": STREAMS_PER_ENGINE,
               "warmup_s": WARMUP_S, "window_s": args.window, "shapes": {k: list(v) for k, v in SHAPES.items()},
               "paths": result}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
