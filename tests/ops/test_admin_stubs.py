"""The checked-in gRPC stubs in extproc/admin/ must match proto/sluice/v1/admin.proto."""

from __future__ import annotations

from pathlib import Path

from extproc.admin import codegen


def test_checked_in_stubs_match_the_proto(tmp_path: Path):
    written = codegen.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(codegen.FILES)
    stale = []
    for name in codegen.FILES:
        fresh = codegen.normalized((tmp_path / name).read_text())
        checked_in_path = codegen.OUT / name
        assert checked_in_path.exists(), f"{checked_in_path} is missing: run python -m extproc.admin.codegen"
        if codegen.normalized(checked_in_path.read_text()) != fresh:
            stale.append(name)
    assert not stale, f"stale admin stubs {stale}: run `python -m extproc.admin.codegen` and commit the result"


def test_normalization_only_hides_version_stamps(tmp_path: Path):
    """A changed proto must show as a difference (the comparison is not vacuous)."""
    text = (codegen.OUT / "admin_pb2.py").read_text()
    assert codegen.normalized(text) != codegen.normalized(text.replace("ReplicaStatus", "ReplicaState"))
    assert "ValidateProtobufRuntimeVersion" not in codegen.normalized(text)
    assert "from extproc.admin import admin_pb2" in (codegen.OUT / "admin_pb2_grpc.py").read_text()


def test_service_matches_the_proto():
    from extproc.admin import admin_pb2 as pb

    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["Admin"].methods]
    assert methods == ["Status", "Drain", "Undrain", "Reload"]
    assert pb.DESCRIPTOR.package == "sluice.v1"
