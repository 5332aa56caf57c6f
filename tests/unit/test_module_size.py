"""gateway.py is the per-request state machine a newcomer reads first: it stays under 400 lines, so each new
job (gauges, access-log handling, reload) goes into its own module rather than into it."""

from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "extproc" / "gateway.py"


def test_gateway_module_stays_under_400_lines():
    lines = GATEWAY.read_text().count("\n")
    assert 100 < lines < 400, f"extproc/gateway.py has {lines} lines; move a job out into its own module"
