"""`sluice bench`: benchmark entry point.

    sluice bench overhead [--json FILE]                      what the gateway adds per request
    sluice bench run SCENARIO... [--systems ...] [--quick]   the P1..P13 scenarios, side by side
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "overhead":
        from bench.overhead import main as overhead_main

        return overhead_main(rest)
    if cmd == "run":
        from bench.runner import main as run_main

        return run_main(rest)
    print(f"sluice bench: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2
