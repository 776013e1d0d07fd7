"""The committed gRPC stubs are what grpc_tools.protoc makes of the committed .proto."""
from __future__ import annotations

import os
import re
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO = "router_service/proto/moeray/v1/moeray.proto"
STUBS = ("moeray_pb2.py", "moeray_pb2_grpc.py", "moeray_pb2.pyi")


def test_stubs_match_proto(tmp_path):
    grpc_tools = pytest.importorskip("grpc_tools")
    from grpc_tools import protoc

    committed_dir = os.path.join(REPO, os.path.dirname(PROTO))
    with open(os.path.join(committed_dir, "moeray_pb2_grpc.py")) as f:
        made_with = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", f.read()).group(1)
    import grpc_tools as gt

    installed = getattr(gt, "__version__", None)
    if installed is None:
        from importlib.metadata import version

        installed = version("grpcio-tools")
    if installed != made_with:
        pytest.skip(f"stubs were generated with grpcio-tools {made_with}; {installed} is installed (output differs by version)")
    # protoc wants the proto at the same relative path, so the generated imports come out the same
    os.makedirs(tmp_path / os.path.dirname(PROTO))
    shutil.copy(os.path.join(REPO, PROTO), tmp_path / PROTO)
    out = tmp_path / "out"
    out.mkdir()
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main(["grpc_tools.protoc", f"-I{tmp_path}", f"-I{include}", f"--python_out={out}",
                      f"--pyi_out={out}", f"--grpc_python_out={out}", str(tmp_path / PROTO)])
    assert rc == 0
    for name in STUBS:
        with open(out / os.path.dirname(PROTO) / name) as f:
            fresh = f.read()
        with open(os.path.join(committed_dir, name)) as f:
            assert f.read() == fresh, f"{name} is stale: regenerate (see the header of {PROTO})"


def test_service_shape():
    from router_service.proto.moeray.v1 import moeray_pb2 as pb

    svc = pb.DESCRIPTOR.services_by_name["Moeray"]
    assert pb.DESCRIPTOR.package == "moeray.v1"
    methods = {m.name: m for m in svc.methods}
    assert set(methods) == {"Generate", "Cancel", "Health", "ListModels", "GetClusterStats"}
    assert methods["Generate"].server_streaming and not methods["Cancel"].server_streaming
    fields = pb.GenerateResponse.DESCRIPTOR.fields_by_name
    assert {"text", "token_ids", "finish_reason", "usage"} <= set(fields)
