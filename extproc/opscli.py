"""Operator subcommands that talk to a running sidecar's admin API (proto/sluice/v1/admin.proto):

    sluice status  [--admin ADDR] [--json] [--pool MODEL]   pools, replicas, lanes, queues
    sluice drain   REPLICA [--pool MODEL]                   no new requests to REPLICA (ip:port)
    sluice undrain REPLICA [--pool MODEL]                   back through slow start
    sluice reload                                           re-read the policy file now
    sluice top     [--interval S] [--once]                  live view, refreshed in place

Without `--admin`, the addresses come from the policy file (`--config`, default sluice.yaml): every worker's
`127.0.0.1:(sidecar.admin_port + i)`, so a drain reaches every worker. Exit codes: 0 ok, 1 a call failed or a
reload was rejected, 2 usage or policy error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from extproc.admin import admin_pb2 as pb
from extproc.admin.client import DEFAULT_ADMIN, AdminClient, AdminError, admin_addresses, to_dict
from extproc.config import PolicyError, default_policy_path, load_policy, parse_section, read_policy_file


def add_common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--admin", action="append", metavar="HOST:PORT",
                   help="admin API address (repeatable; default: every worker's, from the policy file)")
    p.add_argument("--config", "-c", help="policy file to find the admin ports in (default: sluice.yaml)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default 5)")
    return p


def addresses(args: argparse.Namespace, sidecar_only: bool = False) -> list[str]:
    """--admin, else every worker of the policy file; the built-in default when no policy file is readable.

    An explicit file must be valid (PolicyError); with `sidecar_only` only its `sidecar:` section is read, for
    `sluice reload`: the running sidecar judges the rest of the file and reports what it refuses."""
    if args.admin:
        return list(args.admin)
    if args.config:
        if sidecar_only:
            data = read_policy_file(args.config)
            try:
                return admin_addresses(parse_section("sidecar", data.get("sidecar")))
            except PolicyError as exc:
                raise PolicyError(f"{args.config}: {exc}") from None
        return admin_addresses(load_policy(args.config).sidecar)
    try:
        return admin_addresses(load_policy(default_policy_path()).sidecar)
    except PolicyError:
        return [DEFAULT_ADMIN]


def _run(prog: str, argv: list[str] | None, build: Callable[[argparse.ArgumentParser], None],
         body: Callable[[argparse.Namespace, list[str]], int], description: str, sidecar_only: bool = False) -> int:
    parser = add_common(argparse.ArgumentParser(prog=prog, description=description))
    build(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        addrs = addresses(args, sidecar_only)
    except PolicyError as exc:
        print(f"{prog}: invalid policy: {exc}", file=sys.stderr)
        return 2
    return body(args, addrs)


# ---- formatting -------------------------------------------------------------------------------------------

def fmt_seconds(s: float) -> str:
    if s < 0:
        return "never"
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 120:
        return f"{s:.1f}s"
    return f"{s / 60:.0f}m"


def fmt_ttft(r: pb.ReplicaStatus) -> str:
    return f"{r.ttft_p95_s:.3f}s" if r.ttft_p95_s > 0 else "-"


def format_status(address: str, st: pb.StatusResponse) -> str:
    lines = [f"sidecar {address} (pid {st.pid}) policy {st.policy_source or '?'} up {fmt_seconds(st.uptime_s)}"
             + ("  DRAINING (shutting down)" if st.draining else "")]
    if st.HasField("last_reload"):
        lr = st.last_reload
        lines.append(f"  last reload ({lr.trigger}): " + ("ok: " + "; ".join(lr.changes) if lr.ok
                                                           else "REJECTED: " + lr.error))
    for pool in st.pools:
        shed = sum(pool.shed_total.values())
        lines.append(f"pool {pool.model} (cluster {pool.cluster}): in flight {pool.inflight_requests} requests / "
                     f"{pool.inflight_tokens} tokens, queued {pool.queued}, admitted {pool.admitted_total:.0f}, "
                     f"shed {shed:.0f}" + ("  ALL DEGRADED" if pool.all_degraded else ""))
        header = (f"  {'REPLICA':<22} {'STATE':<10} {'WEIGHT':>6} {'DRAIN':>5} {'KV%':>6} {'RUN':>4} {'WAIT':>4} "
                  f"{'INFL':>5} {'INFL_TOK':>9} {'TTFT95':>8} {'TOK/S':>7} {'SCRAPED':>8}")
        lines.append(header)
        for r in pool.replicas:
            drain = "gone" if r.retired else "yes" if r.draining else "-"
            lines.append(f"  {r.address:<22} {r.state:<10} {r.weight:>6.2f} {drain:>5} "
                         f"{r.kv_usage * 100:>6.1f} {r.running:>4} {r.waiting:>4} {r.inflight_requests:>5} "
                         f"{r.inflight_tokens:>9} {fmt_ttft(r):>8} {r.generation_tps:>7.0f} "
                         f"{fmt_seconds(r.scrape_age_s):>8}")
            if r.state != "healthy" and r.state_reason:
                lines.append(f"  {'':<22} ({r.state_reason})")
            if r.retired:
                lines.append(f"  {'':<22} (gone from discovery: leaves the pool when its requests in flight end)")
            if r.shared_inflight_requests:
                lines.append(f"  {'':<22} (other gateways: {r.shared_inflight_requests} requests / "
                             f"{r.shared_inflight_tokens} tokens in flight)")
        for lane in pool.lanes:
            prio = ", ".join(f"{k} {v}" for k, v in sorted(lane.queued_by_priority.items()))
            limit = f"/{lane.max_concurrency}" if lane.max_concurrency else ""
            lines.append(f"  lane {lane.name:<8} queued {lane.queued}/{lane.max_queue}"
                         + (f" ({prio})" if prio else "")
                         + f", in flight {lane.inflight_requests}{limit} ({lane.inflight_tokens} tokens)")
        if pool.shed_total:
            lines.append("  shed by reason: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(pool.shed_total.items())))
    return "\n".join(lines)


# ---- subcommands ------------------------------------------------------------------------------------------

def main_status(argv: list[str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--pool", default="", help="only this pool (model name)")

    def body(args: argparse.Namespace, addrs: list[str]) -> int:
        rc = 0
        out = []
        for addr in addrs:
            try:
                with AdminClient(addr, args.timeout) as c:
                    st = c.status(args.pool)
            except AdminError as exc:
                print(f"sluice status: {exc}", file=sys.stderr)
                out.append({"admin": addr, "error": exc.message})
                rc = 1
                continue
            if args.json:
                out.append({"admin": addr, "status": to_dict(st)})
            else:
                print(format_status(addr, st))
        if args.json:
            print(json.dumps({"sidecars": out}, indent=2, sort_keys=True))
        return rc

    return _run("sluice status", argv, build, body, "Pools, replicas, lanes and queues of the running sidecar(s).")


def _drain_cmd(name: str, verb: str, argv: list[str] | None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("replica", help="replica address as in the policy file (ip:port)")
        p.add_argument("--pool", default="", help="model name, if the address serves several pools")

    def body(args: argparse.Namespace, addrs: list[str]) -> int:
        rc = 0
        for addr in addrs:
            try:
                with AdminClient(addr, args.timeout) as c:
                    resp = getattr(c, verb)(args.replica, args.pool)
            except AdminError as exc:
                print(f"sluice {name}: {exc}", file=sys.stderr)
                rc = 1
                continue
            prefix = f"{addr}: " if len(addrs) > 1 else ""
            print(f"{prefix}{resp.message} (pool {resp.pool})")
        return rc

    doc = {"drain": "Stop sending new requests to a replica; requests in flight finish.",
           "undrain": "Return a drained replica to service through slow start."}[name]
    return _run(f"sluice {name}", argv, build, body, doc)


def main_drain(argv: list[str] | None = None) -> int:
    return _drain_cmd("drain", "drain", argv)


def main_undrain(argv: list[str] | None = None) -> int:
    return _drain_cmd("undrain", "undrain", argv)


def main_reload(argv: list[str] | None = None) -> int:
    def body(args: argparse.Namespace, addrs: list[str]) -> int:
        rc = 0
        for addr in addrs:
            try:
                with AdminClient(addr, args.timeout) as c:
                    resp = c.reload()
            except AdminError as exc:
                print(f"sluice reload: {exc}", file=sys.stderr)
                rc = 1
                continue
            prefix = f"{addr}: " if len(addrs) > 1 else ""
            if resp.ok:
                print(f"{prefix}reloaded {resp.source}: " + "; ".join(resp.changes))
            else:
                print(f"{prefix}reload REJECTED, the previous policy stays in force: {resp.error}", file=sys.stderr)
                rc = 1
        return rc

    return _run("sluice reload", argv, lambda p: None, body,
                "Re-read the policy file in every sidecar worker (an invalid file is rejected, nothing changes).",
                sidecar_only=True)


SUBCOMMANDS: dict[str, Callable[[list[str] | None], int]] = {
    "status": main_status, "drain": main_drain, "undrain": main_undrain, "reload": main_reload,
}  # `sluice top` (extproc/top.py, which builds on this module) is added by the CLI
HELP = {"status": "pools, replicas, lanes and queues of the running sidecar (admin API)",
        "drain": "stop sending new requests to a replica (ip:port)",
        "undrain": "return a drained replica through slow start",
        "reload": "re-read the policy file now",
        "top": "live terminal view of replicas and queues"}
