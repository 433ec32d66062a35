"""The `jaxpd.v1` gRPC protocol: `jaxpd.proto` and its generated, checked-in stubs.

`jaxpd_pb2` (messages) and `jaxpd_pb2_grpc` (the `Generation` service) are generated
from the repository root, so that they import each other as `jaxpd.serving.proto.jaxpd_pb2`:

    python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \\
        jaxpd/serving/proto/jaxpd.proto

`tests/test_proto_sync.py` regenerates them and fails when the checked-in files differ.
"""
