"""The sidecar's admin API (proto/sluice/v1/admin.proto): generated stubs (`admin_pb2`, `admin_pb2_grpc`, made by
`python -m extproc.admin.codegen`), the servicer (`service.py`) and a small blocking client (`client.py`) used by
`sluice status / drain / undrain / reload / top`."""
