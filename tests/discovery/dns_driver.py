"""Runs DnsDiscovery with the system resolver inside a HostsNamespace (see hosts_ns.py) for the tests.

argv[1]: JSON {pool: [replica entries]}; argv[2]: remove_after. Reads one command per stdin line:
  refresh  -> prints {"diffs": [...], "snapshot": {pool: [...]}, "held": {pool: bool}} as one JSON line
  lookup NAME -> prints the getaddrinfo_ips answer or the error, as one JSON line
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict

from extproc.discovery import parse_replica_entry
from extproc.discovery.dns import DnsDiscovery, getaddrinfo_ips


async def main() -> None:
    pools = {pool: [parse_replica_entry(e) for e in entries] for pool, entries in json.loads(sys.argv[1]).items()}
    discovery = DnsDiscovery(pools, interval_s=3600, timeout_s=5.0, remove_after=int(sys.argv[2]))
    loop = asyncio.get_running_loop()
    print(json.dumps({"ready": True}), flush=True)
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if not line:
            break
        if line == "refresh":
            diffs = await discovery.refresh()
            out = {"diffs": [asdict(d) for d in diffs],
                   "snapshot": {p: sorted(a) for p, a in discovery.snapshot().items()},
                   "held": {p: discovery.held(p) for p in pools}}
        else:
            name = line.split(" ", 1)[1]
            try:
                out = {"ips": getaddrinfo_ips(name)}
            except OSError as exc:
                out = {"error": exc.errno}
        print(json.dumps(out), flush=True)
    await discovery.stop()


if __name__ == "__main__":
    asyncio.run(main())
