"""Command line of the simulator: ``sluice sim ...`` and ``python -m extproc.sim ...``.

``main(argv)`` gets the arguments after the word ``sim``:

* ``--port N [options]`` (or ``serve --port N ...``): run one replica until SIGTERM/SIGINT;
* ``fault PORT FAULT [VALUE]``: set a fault on a running replica through its admin listener;
* ``calibrate [--preset P] [--json FILE]``: compare a preset with its stored measurement;
  ``calibrate --against URL [--json FILE] [--write-preset FILE]``: measure a live engine and fit a preset.

Exit codes: 0 ok, 1 failure (calibration out of range, admin call refused), 2 usage or
start-up error (bad flag, port taken) with a one-line message and no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import urllib.error
import urllib.request
from typing import Any

from .faults import FAULT_NAMES, FaultError, parse_fault, parse_fault_arg
from .presets import PRESETS

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sluice sim", description="Run a simulated vLLM-like replica.")
    ap.add_argument("--port", type=int, required=True, help="API port (0: any free port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--name", default=None, help="replica name for x-sim-replica (default host:port)")
    ap.add_argument("--model", default="sim-model", help="served model name")
    ap.add_argument("--preset", default="tiny-cpu",
                    help=f"{', '.join(sorted(PRESETS))}, or a preset file from `calibrate --write-preset`")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="run this many times faster than the modelled hardware")
    ap.add_argument("--speed", type=float, default=1.0,
                    help="the modelled hardware's speed relative to the preset's: every engine step takes 1/SPEED "
                         "of the preset's time (a machine whose engines share cores: its bench.rig load scale)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--mean-output-tokens", type=float, default=None,
                    help="mean of the natural output length when max_tokens is absent")
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument("--no-enable-prefix-caching", dest="prefix_cache", action="store_false",
                       help="turn automatic prefix caching off (on by default, as in vLLM 0.32)")
    cache.add_argument("--enable-prefix-caching", "--prefix-cache", dest="prefix_cache", action="store_true",
                       help="automatic prefix caching (the default)")
    ap.set_defaults(prefix_cache=True)
    admit = ap.add_mutually_exclusive_group()
    admit.add_argument("--no-scheduler-reserve-full-isl", dest="reserve_full_isl", action="store_false",
                       help="admit a waiting prompt as soon as its first chunk's KV blocks fit")
    admit.add_argument("--scheduler-reserve-full-isl", dest="reserve_full_isl", action="store_true",
                       help="admit a waiting prompt only when its whole sequence's KV blocks fit (the default, as in "
                            "vLLM 0.32)")
    ap.set_defaults(reserve_full_isl=True)
    ap.add_argument("--metrics-style", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--admin-port", type=int, default=None,
                    help="admin listener port (default port+1000; -1 disables)")
    ap.add_argument("--fault", action="append", default=[], metavar="NAME[=VALUE]",
                    help=f"fault at start, repeatable: {', '.join(FAULT_NAMES)}")
    return ap


async def _serve(cfg: Any) -> int:
    from .server import SimError, start_sim

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix
            pass
    try:
        sim = await start_sim(cfg)
    except SimError as e:
        print(f"sim: {e}", file=sys.stderr, flush=True)
        return 2
    admin = f" (admin http://{sim.host}:{sim.admin_port})" if sim.admin_port is not None else ""
    print(f"sim ready on {sim.url}{admin}", flush=True)
    try:
        await stop.wait()
    finally:
        await sim.stop()
    return 0


def _serve_main(argv: list[str]) -> int:
    from .server import SimConfig

    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        faults = [parse_fault_arg(a) for a in args.fault]
    except FaultError as e:
        print(f"sim: {e}", file=sys.stderr)
        return 2
    cfg = SimConfig(host=args.host, port=args.port, name=args.name, model=args.model,
                    preset=args.preset, time_scale=args.time_scale, speed=args.speed, seed=args.seed,
                    num_gpu_blocks=args.num_gpu_blocks, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len, block_size=args.block_size,
                    mean_output_tokens=args.mean_output_tokens, prefix_cache=args.prefix_cache,
                    reserve_full_isl=args.reserve_full_isl,
                    metrics_style=args.metrics_style, admin_port=args.admin_port, faults=faults)
    try:
        return asyncio.run(_serve(cfg))
    except KeyboardInterrupt:  # pragma: no cover - signal before the handler was installed
        return 0


def _fault_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sluice sim fault",
                                 description="Set a fault on a running simulator.")
    ap.add_argument("port", type=int, help="the simulator's API port")
    ap.add_argument("fault", choices=FAULT_NAMES)
    ap.add_argument("value", nargs="?", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--admin-port", type=int, default=None, help="default: PORT+1000")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        name, value = parse_fault(args.fault, args.value)
    except FaultError as e:
        print(f"sim fault: {e}", file=sys.stderr)
        return 2
    body = json.dumps({"fault": name, "value": value}).encode()
    ports = [args.admin_port] if args.admin_port is not None else [args.port + 1000, args.port]
    last = ""
    for port in ports:
        url = f"http://{args.host}:{port}/sim/fault"
        req = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                state = json.loads(resp.read())
            print(json.dumps({"name": state.get("name"), "faults": state.get("faults")}))
            return 0
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except Exception:
                msg = str(e)
            print(f"sim fault: {msg}", file=sys.stderr)
            return 1
        except (urllib.error.URLError, OSError) as e:
            last = f"{url}: {getattr(e, 'reason', e)}"
    print(f"sim fault: cannot reach the admin endpoint ({last})", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    """Entry point for ``sluice sim ...`` (argv excludes ``sim``)."""
    if argv and argv[0] == "calibrate":
        from .calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv and argv[0] == "fault":
        return _fault_main(argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    return _serve_main(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
