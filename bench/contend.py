"""`python -m bench.contend [--json FILE]`: does one real engine's work slow the other's? (the real-engine rig)

Why: the real-engine scenarios run two vLLM-CPU engines on a 2-core machine, one per core. A replica behind a
gateway is a separate GPU or host: what one replica runs does not slow another. On this machine each engine is
three processes (API server, EngineCore, the worker whose compute threads `VLLM_CPU_OMP_THREADS_BIND` binds), and
if only the worker is bound, the other two float onto whichever core is free. An engine streaming a long answer
then spends the other engine's core on its API server and scheduler loop, and that engine's prefill slows. Such a
rig rewards a gateway that puts every heavy request on one replica and penalises one that spreads them.

The probe starts two engines (`bench.vllm_cpu.start_engines`) twice, whole on their cores (the rig) and with only
the compute threads bound (`whole_core=False`), and times one long prompt's TTFT on engine A, `REPEATS` times each:

    alone              nothing else runs
    B decodes          engine B streams a long answer (LONG_GEN_PROMPT prompt, LONG_GEN_OUTPUT tokens) meanwhile
    B prefills         engine B prefills the same long prompt at the same moment
    A decodes too      the long answer goes to A instead (its first token waits for A's prefill)

A rig without interference shows the same TTFT in the first three rows. Printed as a table, written with --json.
The prompt is P7's long-context prompt on this machine (5,300 tokens, the preset's `prompt_for_ttft(0.5)`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

LONG_PROMPT = 5_300
LONG_OUTPUT = 48
LONG_GEN_PROMPT = 400
LONG_GEN_OUTPUT = 300
REPEATS = 5
PATTERNS = ("alone", "B decodes", "B prefills", "A decodes too")


async def _ttft(session: Any, url: str, body: dict[str, Any]) -> float:
    """Seconds from sending `body` to its first chunk with a `content` field (the whole stream is read): vLLM sends
    its first chunk, the role's, with the first output of the engine, so this is the time to first token."""
    t0 = time.monotonic()
    first = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if first is None and b'"content"' in line:
                first = time.monotonic() - t0
    if first is None:
        raise RuntimeError(f"{url}: no content in the stream")
    return first


async def _measure(urls: list[str], repeats: int) -> dict[str, list[float]]:
    """TTFT of the long prompt on engine A per pattern, `repeats` rounds, prompts unique (no prefix-cache hit)."""
    import aiohttp

    from bench.scenarios.base import chat

    a, b = urls
    salt = iter(range(9_000_000, 10_000_000, 7))

    def long() -> dict[str, Any]:
        return chat(LONG_PROMPT, LONG_OUTPUT, salt=next(salt))

    def long_gen() -> dict[str, Any]:
        return chat(LONG_GEN_PROMPT, LONG_GEN_OUTPUT, salt=next(salt))

    out: dict[str, list[float]] = {p: [] for p in PATTERNS}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for _ in range(2):  # each engine's first requests of these shapes are slower
            await asyncio.gather(_ttft(s, a, long()), _ttft(s, b, long()), _ttft(s, b, long_gen()))
        for _ in range(repeats):
            out["alone"].append(await _ttft(s, a, long()))
            b_decodes = asyncio.create_task(_ttft(s, b, long_gen()))
            await asyncio.sleep(0.1)  # B is past its prefill, streaming
            out["B decodes"].append(await _ttft(s, a, long()))
            await b_decodes
            ttfts = await asyncio.gather(_ttft(s, a, long()), _ttft(s, b, long()))
            out["B prefills"].append(ttfts[0])
            ttfts = await asyncio.gather(_ttft(s, a, long()), _ttft(s, a, long_gen()))
            out["A decodes too"].append(ttfts[0])
    return out


def run(whole_core: bool, repeats: int) -> dict[str, list[float]]:
    from bench import vllm_cpu
    from bench.scenarios.base import MODEL, set_text_scale
    from extproc.supervisor import free_ports

    set_text_scale(1.0)  # the tiny model's tokenizer counts one filler word as one token (measured by the backend)
    log_dir = Path(tempfile.mkdtemp(prefix="sluice-contend-"))
    specs = vllm_cpu.engine_specs(free_ports(2), extra_args=("--served-model-name", MODEL))
    engines = vllm_cpu.start_engines(specs, log_dir, whole_core=whole_core)
    try:
        return asyncio.run(_measure([e.url for e in engines], repeats))
    finally:
        vllm_cpu.stop_engines(engines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.contend", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--json", default=None, help="write the measurements here")
    args = p.parse_args(argv)
    if not 1 <= args.repeats <= 50:
        p.error("--repeats is 1..50")
    results: dict[str, Any] = {"long_prompt": LONG_PROMPT, "long_gen": [LONG_GEN_PROMPT, LONG_GEN_OUTPUT],
                               "repeats": args.repeats, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for name, whole in (("whole engine on its core", True), ("compute threads bound only", False)):
        results[name] = run(whole, args.repeats)
    print(f"TTFT of a {LONG_PROMPT:,}-token prompt on engine A, median (min-max) of {args.repeats}, seconds")
    print(f"| pattern | {' | '.join(k for k in results if isinstance(results[k], dict))} |")
    print("|---|---|---|")
    for pattern in PATTERNS:
        cells = [f"{statistics.median(v[pattern]):.3f} ({min(v[pattern]):.3f}-{max(v[pattern]):.3f})"
                 for v in results.values() if isinstance(v, dict)]
        print(f"| {pattern} | {' | '.join(cells)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
