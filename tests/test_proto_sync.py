"""The checked-in gRPC stubs are exactly what `grpc_tools.protoc` makes of jaxpd.proto.

They are generated from the repository root (`-I.`), which is what makes the service
module import the messages as `jaxpd.serving.proto.jaxpd_pb2`; see `jaxpd/serving/proto/__init__.py`
for the command. The output embeds the grpcio-tools version, hence its pin in setup.cfg.
"""
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO = os.path.join("jaxpd", "serving", "proto", "jaxpd.proto")
GENERATED = ("jaxpd_pb2.py", "jaxpd_pb2.pyi", "jaxpd_pb2_grpc.py")


def test_checked_in_stubs_match_a_fresh_protoc_run(tmp_path):
    pytest.importorskip("grpc_tools")
    from grpc_tools import grpc_version, protoc

    status = protoc.main(["protoc", f"-I{REPO}", f"--python_out={tmp_path}",
                          f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                          os.path.join(REPO, PROTO)])
    assert status == 0, "protoc failed on jaxpd.proto"
    regenerate = ("regenerate: python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. "
                  f"--grpc_python_out=. {PROTO}  (with grpcio-tools "
                  f"{grpc_version.VERSION})")
    for name in GENERATED:
        with open(tmp_path / "jaxpd" / "serving" / "proto" / name) as f:
            fresh = f.read()
        with open(os.path.join(REPO, "jaxpd", "serving", "proto", name)) as f:
            checked_in = f.read()
        assert checked_in == fresh, f"jaxpd/serving/proto/{name} is stale; {regenerate}"


def test_stubs_import_as_a_package_and_describe_the_service():
    from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc

    assert jaxpd_pb2_grpc.jaxpd_dot_serving_dot_proto_dot_jaxpd__pb2 is jaxpd_pb2
    service = jaxpd_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "jaxpd.v1.Generation"
    assert {m.name for m in service.methods} == {"Generate", "Complete", "Tokenize",
                                                  "ModelInfo", "Stats"}
    assert service.methods_by_name["Generate"].server_streaming
    request = jaxpd_pb2.GenerateRequest.DESCRIPTOR
    assert [f.name for f in request.oneofs_by_name["input"].fields] == ["prompt", "token_ids"]
    for name in ("max_tokens", "temperature", "top_p", "seed", "request_id"):
        assert request.fields_by_name[name].has_presence, name   # proto3 optional


def test_stats_carries_the_host_tier_and_migration_counters():
    """What the host tier and live migration count reaches a Stats answer too, not only
    /metrics (the Stats handler passes every engine field the message names)."""
    from jaxpd.serving.proto import jaxpd_pb2
    from jaxpd.stats import EngineStats

    fields = jaxpd_pb2.StatsResponse.DESCRIPTOR.fields_by_name
    names = [n for n in EngineStats.__dataclass_fields__
             if n.startswith(("host_tier_", "prefix_host_", "migration", "prefill_host_tier_",
                              "prefill_cache_host_"))]
    assert len(names) == 18
    for name in names:
        assert name in fields, name
        assert fields[name].type == fields[name].TYPE_INT64, name
