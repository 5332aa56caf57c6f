"""A blocking client of the admin API, for the `sluice status / drain / undrain / reload / top` commands.

Every sidecar worker serves its own admin API on loopback at `sidecar.admin_port + worker`; `admin_addresses`
lists them from the policy, so a drain reaches every worker (each worker keeps its own view of the replicas).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from extproc.admin import admin_pb2 as pb
from extproc.admin import admin_pb2_grpc as pb_grpc
from extproc.config import SidecarConfig

DEFAULT_ADMIN = "127.0.0.1:50061"


class AdminError(RuntimeError):
    """The call failed: sidecar unreachable, unknown replica, ... (message is one line for the terminal)."""

    def __init__(self, address: str, code: grpc.StatusCode | None, message: str) -> None:
        super().__init__(f"{address}: {message}")
        self.address, self.code, self.message = address, code, message


def admin_addresses(sc: SidecarConfig) -> list[str]:
    """Every worker's admin address (loopback: the admin API never listens elsewhere by default)."""
    return [f"127.0.0.1:{sc.admin_port + i}" for i in range(max(1, sc.workers))]


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _repeated(f: FieldDescriptor) -> bool:
    rep = getattr(f, "is_repeated", None)
    return bool(rep) if rep is not None else f.label == FieldDescriptor.LABEL_REPEATED  # older protobuf


def _numbers(value: dict, desc: Descriptor) -> dict:
    """proto3 JSON writes 64-bit integers as strings; a status for humans and jq wants numbers."""
    for f in desc.fields:
        if f.name not in value:
            continue
        v = value[f.name]
        sub = f.message_type
        if sub is not None and sub.GetOptions().map_entry:
            vf = sub.fields_by_name["value"]
            if vf.type in _INT64:
                value[f.name] = {k: int(x) for k, x in v.items()}
            elif vf.message_type is not None:
                value[f.name] = {k: _numbers(x, vf.message_type) for k, x in v.items()}
        elif sub is not None:
            value[f.name] = [_numbers(x, sub) for x in v] if _repeated(f) else _numbers(v, sub)
        elif f.type in _INT64:
            value[f.name] = [int(x) for x in v] if _repeated(f) else int(v)
    return value


def to_dict(msg: Message) -> dict:
    """A message as a JSON-ready dict: proto field names, every field present, 64-bit integers as numbers."""
    d = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _numbers(d, msg.DESCRIPTOR)


@dataclass
class AdminClient:
    address: str = DEFAULT_ADMIN
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        self._channel = grpc.insecure_channel(self.address)
        self._stub = pb_grpc.AdminStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: object) -> object:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                details = (f"sidecar admin API unreachable ({details}); is `sluice serve` running, and is "
                           "sidecar.admin_port right?")
            raise AdminError(self.address, code, details) from None

    def status(self, pool: str = "") -> pb.StatusResponse:
        return self._call("Status", pb.StatusRequest(pool=pool))  # type: ignore[return-value]

    def drain(self, replica: str, pool: str = "") -> pb.DrainResponse:
        return self._call("Drain", pb.DrainRequest(replica=replica, pool=pool))  # type: ignore[return-value]

    def undrain(self, replica: str, pool: str = "") -> pb.DrainResponse:
        return self._call("Undrain", pb.DrainRequest(replica=replica, pool=pool))  # type: ignore[return-value]

    def reload(self) -> pb.ReloadResponse:
        return self._call("Reload", pb.ReloadRequest())  # type: ignore[return-value]
