"""`python -m bench.rig --preset FILE --json RIG_FILE`: how much of the simulator's capacity this machine's real
engines deliver when they run side by side, as the real-engine scenarios run them (the load scale).

Why: the scenarios set their arrival rates as shares of a replica's capacity, `capacity_rps` (bench/capacity.py),
which the preset's cost model gives for a replica on its own hardware. The real-engine backend runs two vLLM-CPU
engines on a 2-core machine, and their API servers, the clients, Envoy and the sidecar share those cores: on an
AVX-512 machine the engines compute ~5x faster than the tiny-cpu preset's host, but the rest does not, and P3's
"0.2 x capacity" (36 requests/s) queued every system's short requests for over a second (TTFT p50 0.39 s at 20
requests/s per engine, where the preset predicts 0.02 s). A load the machine cannot serve compares queues, not
routing.

The probe: both engines at once, `STREAMS_PER_ENGINE` clients each sending the reference request (`PROMPT`
prompt tokens, `OUTPUT` output tokens, streaming chat, the harness's own bodies) back to back for `WINDOW_S`
after `WARMUP_S`; the completions per second in the window are the machine's throughput for that request, and

    load_scale = min(1, measured completions/s / (engines x closed_loop_rps(preset, STREAMS, PROMPT, OUTPUT)))

with STREAMS = `STREAMS_PER_ENGINE`.

The model's side is the preset under the probe's own load (bench/capacity.py `closed_loop_rps`: the same clients,
back to back, on a simulated replica), so the ratio compares like with like: the engines' speed against the
preset's. `capacity_rps`, the scenarios' yardstick, is the preset under a backlog that fills the engine's 64
sequences; 16 clients keep fewer in flight, each step's fixed cost is shared by fewer sequences, and for the rig's
request the Xeon preset serves 29.8 completions/s that way against 37 under the backlog. Dividing by the backlog's
number read that regime's difference as the machine's slowness (and the loads came out that much lighter).

`capacity_rps` multiplies by it when `SLUICE_BENCH_RIG` names the file (bench/capacity.py), so every scenario's
load is the same share of what the machine delivers; the simulated runs of the same preset (make bench-real's
`sim` batches) use the same loads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

PROMPT, OUTPUT = 800, 32
STREAMS_PER_ENGINE = 16
WARMUP_S, WINDOW_S = 3.0, 8.0
ENGINES = 2


async def _client(session: Any, url: str, salt: int, stop_at: float, window: tuple[float, float],
                  done: list[float]) -> None:
    """Send reference requests back to back until `stop_at`, each with a prompt of its own (a repeated prompt
    would be served from the prefix cache); record each completion's time inside `window`."""
    import orjson

    from bench.scenarios.base import chat

    n = 0
    while time.monotonic() < stop_at:
        body = orjson.dumps(chat(PROMPT, OUTPUT, salt=salt + n))
        n += 1
        async with session.post(url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"}) as r:
            await r.read()
            ok = r.status == 200
        now = time.monotonic()
        if ok and window[0] <= now <= window[1]:
            done.append(now)


async def measure_rps(urls: list[str], streams: int = STREAMS_PER_ENGINE, warmup_s: float = WARMUP_S,
                      window_s: float = WINDOW_S) -> float:
    """Completions per second of the engines at `urls` together, each kept busy by `streams` clients."""
    import aiohttp

    start = time.monotonic()
    window = (start + warmup_s, start + warmup_s + window_s)
    done: list[float] = []
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=1.0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [_client(session, url, 7_000_000 + (i * streams + k) * 100_000, window[1], window, done)
                 for i, url in enumerate(urls) for k in range(streams)]
        await asyncio.gather(*tasks)
    return len(done) / window_s


def load_scale(measured_rps: float, model_rps: float) -> float:
    """The share of the cost model's capacity the machine delivers (at most 1)."""
    return round(min(1.0, measured_rps / model_rps), 3) if model_rps > 0 else 1.0


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from bench import vllm_cpu
    from bench.backends import MODEL, VllmBackend
    from bench.capacity import EngineSpec, closed_loop_rps
    from extproc.supervisor import free_ports

    if args.vllm:
        vllm_cpu.VENV = Path(args.vllm)
    specs = vllm_cpu.engine_specs(free_ports(ENGINES), extra_args=("--served-model-name", MODEL))
    engines = vllm_cpu.start_engines(specs, Path(args.log_dir), dev_mode=True)
    try:
        backend = VllmBackend(Path(args.log_dir))
        backend.engines = engines
        from bench.scenarios.base import set_text_scale

        set_text_scale(backend._measure_text_scale())
        measured = asyncio.run(measure_rps([e.url for e in engines]))
    finally:
        vllm_cpu.stop_engines(engines)
    model = ENGINES * closed_loop_rps(EngineSpec.of(args.preset), STREAMS_PER_ENGINE, PROMPT, OUTPUT)
    return {"preset": args.preset, "request": {"prompt": PROMPT, "output": OUTPUT},
            "engines": ENGINES, "streams_per_engine": STREAMS_PER_ENGINE, "window_s": WINDOW_S,
            "measured_rps": round(measured, 2), "model_rps": round(model, 2), "model_load": "closed loop",
            "load_scale": load_scale(measured, model),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rig", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True, help="the preset the scenarios derive from (a .json file)")
    ap.add_argument("--json", required=True, help="where to write the load scale (SLUICE_BENCH_RIG)")
    ap.add_argument("--vllm", default=None, help="the vllm-cpu venv (default: bench/vllm_cpu.py's VENV)")
    ap.add_argument("--log-dir", default=str(Path(".run") / "vllm"))
    args = ap.parse_args(argv)
    out = _measure(args)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{args.json}: the engines delivered {out['measured_rps']} completions/s of {PROMPT}+{OUTPUT}-token "
          f"requests where the preset gives {out['model_rps']}: load scale {out['load_scale']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
