"""Real name resolution on loopback without touching the machine's /etc/hosts: a private mount namespace.

`unshare --mount` gives a child process its own mount table (propagation private, so nothing leaks back); inside
it, test copies of /etc/hosts, /etc/resolv.conf and /etc/nsswitch.conf are bind-mounted over the real ones. The
child's getaddrinfo (glibc's files and dns modules, exactly as in production) then resolves the test names, and
the test steers it by rewriting those files in place (same inode, so the bind mount sees every change; glibc
re-reads hosts on each lookup and nsswitch.conf when it changes):

  - names listed in the hosts file resolve to their loopback addresses (several lines = several addresses);
  - `nsswitch("files")`: any other name is "not found" (EAI_NONAME), like an NXDOMAIN;
  - `nsswitch("files dns")`: any other name goes to the nameserver of the test resolv.conf, 127.0.0.1:53, where
    nothing answers: "temporary failure" (EAI_AGAIN), a resolver outage.

Needs util-linux `unshare` and either root (CI runs as root) or unprivileged user namespaces (`--map-root-user`).
Everything a test starts under `command()` sees the test files; everything else on the machine does not.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.tools import tool
from tests.waiting import wait_for


class HostsNamespace:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.hosts = directory / "hosts"
        self.resolv = directory / "resolv.conf"
        self.nss = directory / "nsswitch.conf"
        self.set_hosts({})
        self.resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        self.nsswitch("files")

    def set_hosts(self, names: dict[str, list[str]]) -> None:
        """Rewrite the hosts file in place: each name on one line per address."""
        lines = ["127.0.0.1 localhost"] + [f"{ip} {name}" for name, ips in names.items() for ip in ips]
        with open(self.hosts, "w") as fh:  # truncate + write keeps the inode the bind mount points at
            fh.write("\n".join(lines) + "\n")

    def nsswitch(self, hosts_line: str) -> None:
        """`files` (unknown names: not found) or `files dns` (unknown names: resolver failure)."""
        before = self.nss.stat().st_mtime_ns if self.nss.exists() else 0
        with open(self.nss, "w") as fh:
            fh.write(f"hosts: {hosts_line}\n")

        def mtime_changed() -> bool:  # glibc notices a change by mtime
            if self.nss.stat().st_mtime_ns != before:
                return True
            os.utime(self.nss)
            return self.nss.stat().st_mtime_ns != before

        assert wait_for(mtime_changed, 2.0, 0.01), f"{self.nss}: mtime does not change"

    def command(self, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside a private mount namespace with the test files mounted."""
        unshare = tool("unshare")
        tool("mount")  # run by the script, inside the namespace
        script = ("mount --bind \"$1\" /etc/hosts && mount --bind \"$2\" /etc/resolv.conf && "
                  "mount --bind \"$3\" /etc/nsswitch.conf && shift 3 && exec \"$@\"")
        flags = ["--mount", "--propagation", "private"]
        if os.geteuid() != 0:
            flags.insert(0, "--map-root-user")
        return [unshare, *flags, "sh", "-c", script, "sh", str(self.hosts), str(self.resolv), str(self.nss), *argv]
