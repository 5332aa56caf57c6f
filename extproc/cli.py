"""`sluice`: the one command operators use.

    sluice up [--config FILE]        Envoy + sidecar + simulated replicas, until Ctrl-C
    sluice init [PATH] [--force]     write a commented policy file to start from (default ./sluice.yaml)
    sluice serve [--config FILE]     the sidecar alone (what docker-compose runs)
    sluice render [--out DIR]        write Envoy's bootstrap + LDS/CDS from the policy
    sluice check [--config FILE]     validate the policy and the rendered Envoy config
    sluice sim ...                   a simulated vLLM replica (see `sluice sim --help`)
    sluice bench ...                 benchmarks (overhead, the P1..P13 scenarios)
    sluice status | drain R | undrain R | reload | top    operate a running sidecar (admin API)

The policy file: `--config FILE` if given, else ./sluice.yaml in the current directory, else the built-in
default policy (the simulated demo, extproc/default_policy.yaml in the installed package).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from extproc.config import EMBEDDED_POLICY, POLICY_FILE_NAME, Policy, PolicyError, default_policy_path, load_policy

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from extproc.supervisor import Stack


def _load(path: str | None) -> Policy:
    return load_policy(path or default_policy_path())


def _run_async(coro: Coroutine[Any, Any, None]) -> None:
    """uvloop when installed: about 10% less sidecar CPU per request than asyncio's default loop (measured)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def cmd_serve(args: argparse.Namespace) -> int:
    from extproc.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    policy = _load(args.config)
    try:
        _run_async(serve(policy, worker=args.worker, xds_out=args.xds_out,
                         take_over=Path(args.take_over) if args.take_over else None))
    except OSError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from extproc.xds import render

    policy = _load(args.config)
    paths = render(policy, args.out, args.mode, xds_dir=args.xds_dir)
    for name, path in paths.items():
        print(f"wrote {name}: {path}")
    return 0


def validate_with_envoy(policy: Policy, mode: str = "sluice", baseline: Any = None) -> tuple[bool, str]:
    """Run `envoy --mode validate` on a bootstrap that carries the rendered listeners and clusters statically
    (validate mode does not read file-based xDS, so a plain check of bootstrap.yaml would prove little)."""
    import yaml

    from extproc.xds import envoy_binary, render

    with tempfile.TemporaryDirectory() as tmp:
        paths = render(policy, tmp, mode, baseline=baseline)
        boot = yaml.safe_load(paths["bootstrap"].read_text())
        boot.pop("dynamic_resources", None)
        boot["static_resources"] = {
            "listeners": yaml.safe_load(paths["lds"].read_text())["resources"],
            "clusters": yaml.safe_load(paths["cds"].read_text())["resources"],
        }
        for res in boot["static_resources"]["listeners"] + boot["static_resources"]["clusters"]:
            res.pop("@type", None)
        static = Path(tmp) / "validate.yaml"
        static.write_text(yaml.safe_dump(boot))
        proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(static), "--log-level", "error"],
                              capture_output=True, text=True, timeout=60)
        return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def cmd_check(args: argparse.Namespace) -> int:
    policy = _load(args.config)
    print(f"policy {policy.source}: OK ({len(policy.pools)} pool(s), "
          f"{sum(len(p.replicas) for p in policy.pools)} replica(s))")
    ok, out = validate_with_envoy(policy)
    print(("envoy --mode validate: OK" if ok else "envoy --mode validate: FAILED\n" + out))
    return 0 if ok else 1


def default_run_dir(policy: Policy) -> Path:
    """Where `sluice up` writes its run files (rendered Envoy config, logs, the sidecars' copy of the policy)
    unless --run-dir says otherwise: $XDG_STATE_HOME/sluice/up-<gateway port> (~/.local/state/... when
    XDG_STATE_HOME is unset). Not the current directory, which may be anyone's (or read-only); one directory per
    gateway port, so two stacks never share the xDS files their Envoys watch."""
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "sluice" / f"up-{policy.gateway.port}"


def cmd_up(args: argparse.Namespace) -> int:
    from extproc.restarts import RecyclePolicy, Recycler, Restarter, RestartPolicy
    from extproc.supervisor import Stack, StartupError

    policy_path = Path(args.config) if args.config else default_policy_path()
    policy = load_policy(policy_path)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(policy)
    # The sidecar watches the user's own policy file: editing it (or SIGHUP) reloads the policy and Envoy's xDS.
    # The built-in default is not the user's to edit: the sidecars read the run directory's copy of it.
    stack = Stack(policy, run_dir=run_dir, mode=args.mode,
                  policy_file=None if policy_path == EMBEDDED_POLICY else policy_path)
    stopping = {"flag": False}

    def _stop(_sig: int, _frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        stack.start()
    except StartupError as exc:
        print(f"sluice up: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sluice up: {exc}", file=sys.stderr)
        return 1
    model = policy.default_pool.model
    print(_banner(stack, model, policy_path), flush=True)

    def report(line: str) -> None:
        """A supervision line on stderr, with the wall-clock time (to line it up with clients' and logs' times)."""
        stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
        print(f"sluice up: {stamp} {line}", file=sys.stderr, flush=True)

    restarter = Restarter(RestartPolicy(), stack.child_env(), report)
    sc = policy.sidecar
    recycler = Recycler(RecyclePolicy(limit_mb=sc.recycle_rss_mb, check_s=sc.recycle_check_s), stack.child_env(),
                        report)
    try:
        while not stopping["flag"]:
            if args.mode == "sluice":
                recycler.tend(stack.children)
            for child in stack.children:
                if child.alive() or (child.name.startswith("sidecar") and restarter.tend(child)):
                    continue
                print(f"sluice up: {child.name} exited; stopping; log {child.log_path}:\n{child.log_tail()}",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        print("stopping: envoy, sidecar, replicas ...", flush=True)
        recycler.stop()
        stack.stop()
    print("stopped.")
    return 0


def _banner(stack: Stack, model: str, policy_path: Path) -> str:
    base = stack.base_url
    policy = (f"built-in default ({policy_path}); `sluice init` writes ./{POLICY_FILE_NAME} to edit"
              if policy_path == EMBEDDED_POLICY else str(policy_path))
    lines = [
        "sluice is up",
        f"  policy:                    {policy}",
        f"  gateway (OpenAI base URL): {base}/v1",
        f"  Envoy admin / stats:       {stack.admin_url}/stats/prometheus",
        f"  sidecar metrics:           {stack.metrics_url}",
        f"  run files (xDS, logs):     {stack.run_dir}",
    ]
    for model_name, addr in stack.simulated_replicas():
        lines.append(f"  simulated replica:         http://{addr} ({model_name})")
    lines += [
        "",
        "try it:",
        f"  curl -sN {base}/v1/chat/completions -H 'content-type: application/json' \\",
        f"    -d '{{\"model\":\"{model}\",\"stream\":true,\"max_tokens\":32,"
        f"\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'",
        f"  python -c \"from openai import OpenAI; c=OpenAI(base_url='{base}/v1', api_key='x'); "
        f"print(c.chat.completions.create(model='{model}', max_tokens=32, "
        f"messages=[{{'role':'user','content':'hello'}}]).choices[0].message.content)\"",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def cmd_init(args: argparse.Namespace) -> int:
    """Write the commented policy file (extproc/policy_template.py); an existing file is kept unless --force."""
    from extproc.policy_template import render

    path = Path(args.path)
    if path.is_dir():
        path = path / POLICY_FILE_NAME
    if path.exists() and not args.force:
        print(f"sluice init: {path} already exists; --force overwrites it", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    in_cwd = path.resolve() == (Path.cwd() / POLICY_FILE_NAME).resolve()
    config = "" if in_cwd else f" --config {path}"
    print(f"wrote {path}: the demo policy, every other field commented out with its default.\n"
          f"next: edit it, `sluice check{config}`, then `sluice up{config}`")
    return 0


def cmd_sim(argv: list[str]) -> int:
    from extproc.sim.cli import main as sim_main

    return sim_main(argv)


def cmd_bench(argv: list[str]) -> int:
    from bench.cli import main as bench_main

    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", "-c", help=f"policy file (default: ./{POLICY_FILE_NAME} if there is one, else "
                                              "the built-in default policy: the simulated demo)")
        return p

    p = with_config(sub.add_parser("up", help="start Envoy, the sidecar and simulated replicas"))
    p.add_argument("--run-dir", default=None,
                   help="rendered config and logs go here (default: $XDG_STATE_HOME/sluice/up-<gateway port>, "
                        "i.e. ~/.local/state/sluice/up-8080 for the default policy)")
    p.add_argument("--mode", default="sluice", choices=["sluice", "envoy-rr", "envoy-lr"])
    p.set_defaults(func=cmd_up)
    p = with_config(sub.add_parser("serve", help="run the ext_proc sidecar"))
    p.add_argument("--worker", type=int, default=0, help="worker index (ports = base + index)")
    p.add_argument("--xds-out", default=None,
                   help="on a policy reload, also re-render Envoy's xDS files into this directory (the one Envoy "
                        "watches); `sluice up` passes its own")
    p.add_argument("--take-over", default=None, metavar="READY_FILE",
                   help="replace a running worker on the same ports (what `sluice up` does to recycle one): share "
                        "its gRPC port (SO_REUSEPORT), write READY_FILE once serving, then take its metrics and "
                        "admin ports once it frees them (it is sent SIGUSR2)")
    p.set_defaults(func=cmd_serve)
    p = with_config(sub.add_parser("render", help="write Envoy bootstrap + xDS files"))
    p.add_argument("--out", default="envoy", help="output directory (default envoy/)")
    p.add_argument("--xds-dir", default=None,
                   help="directory Envoy reads the xDS files from, e.g. /etc/envoy in a container "
                        "(default: the output directory)")
    p.add_argument("--mode", default="sluice", choices=["sluice", "envoy-rr", "envoy-lr"])
    p.set_defaults(func=cmd_render)
    p = with_config(sub.add_parser("check", help="validate the policy and the rendered Envoy config"))
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("init", help=f"write a commented policy file to start from (default ./{POLICY_FILE_NAME})")
    p.add_argument("path", nargs="?", default=POLICY_FILE_NAME,
                   help=f"file, or directory to write {POLICY_FILE_NAME} in (default: ./{POLICY_FILE_NAME})")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=cmd_init)
    sub.add_parser("sim", help="simulated vLLM replica (sluice sim --help)", add_help=False)
    sub.add_parser("bench", help="benchmarks (sluice bench --help)", add_help=False)
    from extproc.opscli import HELP as OPS_HELP

    for name, text in OPS_HELP.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        return cmd_sim(argv[1:])
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    from extproc.opscli import SUBCOMMANDS
    from extproc.top import main as main_top

    ops = {**SUBCOMMANDS, "top": main_top}
    if argv and argv[0] in ops:
        return ops[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PolicyError as exc:
        print(f"sluice: invalid policy: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
