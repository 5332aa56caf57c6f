"""Compile proto/sluice/v1/admin.proto into extproc/admin/admin_pb2.py and admin_pb2_grpc.py (checked in).

    python -m extproc.admin.codegen            # regenerate in place (needs grpcio-tools: pip install '.[build]')

protoc writes `from sluice.v1 import admin_pb2` into the gRPC stub; it is rewritten to import from this package,
so the stubs work without adding proto/ to sys.path. `tests/ops/test_admin_stubs.py` regenerates into a temporary
directory and fails when the checked-in files differ (version banners aside).
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
PROTO = "sluice/v1/admin.proto"
OUT = Path(__file__).resolve().parent
FILES = ("admin_pb2.py", "admin_pb2.pyi", "admin_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpcio-tools) and write the three stub files into out_dir."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO_ROOT / PROTO)]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in FILES:
            src = Path(tmp) / "sluice" / "v1" / name
            text = src.read_text()
            text = text.replace("from sluice.v1 import admin_pb2", "from extproc.admin import admin_pb2")
            dst = out_dir / name
            dst.write_text(text)
            written.append(dst)
    return written


_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s*\d+,\s*$|\s*'',\s*$|"
    r"_runtime_version\.ValidateProtobufRuntimeVersion\(.*)$", re.M)


def normalized(text: str) -> str:
    """Stub text without the generator's version stamps (a newer grpcio-tools alone is not staleness)."""
    return _VERSION_LINES.sub("", text)


def main(argv: list[str] | None = None) -> int:
    for path in generate(OUT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
