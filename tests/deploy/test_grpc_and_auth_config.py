"""Offline checks of the gRPC-proxy and Ray-auth parts of deploy/ and k8s/ (no cluster started): Serve's
grpc_options import the moeray servicer and the deployment answers every RPC of the service; the KubeRay
clusters run with Ray token authentication and expose the gRPC proxy port."""
from __future__ import annotations

import inspect
import os

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_CONFIG = os.path.join(REPO, "deploy", "serve_config.yaml")


def _load(name: str) -> dict:
    with open(os.path.join(REPO, name)) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def config() -> dict:
    return _load("deploy/serve_config.yaml")


def test_grpc_options_load_the_moeray_servicer(config):
    from ray.serve.config import gRPCOptions

    from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc
    from router_service.serve.deployment import GRPC_SERVICER_FUNCTION

    opts = gRPCOptions(**config["grpc_options"])
    assert opts.grpc_servicer_functions == [GRPC_SERVICER_FUNCTION]
    assert opts.grpc_servicer_func_callable == [pb_grpc.add_MoerayServicer_to_server]  # importable as Serve does it
    assert opts.request_timeout_s >= config["http_options"]["request_timeout_s"]
    assert opts.port != config["http_options"]["port"]


def test_deployment_has_a_method_per_rpc():
    from router_service.proto.moeray.v1 import moeray_pb2 as pb
    from router_service.serve.deployment import MoerayServer

    cls = MoerayServer.func_or_class
    service = pb.DESCRIPTOR.services_by_name["Moeray"]
    for m in service.methods:
        fn = getattr(cls, m.name, None)
        assert fn is not None, f"MoerayServer has no method {m.name} for Serve's gRPC proxy"
        assert "grpc_context" in inspect.signature(fn).parameters, m.name  # Serve passes the context by this name
        if m.server_streaming:
            assert inspect.isasyncgenfunction(fn), f"{m.name} streams: it must be an async generator"
        else:
            assert inspect.iscoroutinefunction(fn), m.name


@pytest.mark.parametrize("manifest", ["k8s/rayservice.yaml", "k8s/raycluster.yaml"])
def test_ray_token_auth_and_grpc_port(manifest, config):
    doc = _load(manifest)
    spec = doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]
    assert spec["authOptions"] == {"mode": "token"}
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    ports = {p["containerPort"] for p in head["ports"]}
    # proxy_location HeadOnly: both Serve proxies run on the head
    assert {config["http_options"]["port"], config["grpc_options"]["port"]} <= ports
    # nobody sets Ray's auth variables by hand: the operator injects them with the generated token
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for c in group["template"]["spec"]["containers"]:
            assert not {e["name"] for e in c.get("env", [])} & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
