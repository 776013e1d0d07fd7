"""The Serve application for real (one replica owning a 1-rank tiny cluster, HTTP proxy and the in-replica
gRPC server on 127.0.0.1), built from deploy/serve_config.yaml's import path and args."""
from __future__ import annotations

import http.client
import importlib
import json
import os
import time

import grpc
import pytest
import yaml

from actors.rank.rendezvous import free_port
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc

pytestmark = pytest.mark.ray

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _request(port, method, path, body=None, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    return r.status, data


@pytest.fixture(scope="module")
def served(ray_session, tiny_moe_dir):
    from ray import serve

    from router_service.http.models import ServeAppArgs
    from router_service.serve.deployment import wait_ready

    with open(os.path.join(REPO, "deploy", "serve_config.yaml")) as f:
        (app_cfg,) = yaml.safe_load(f)["applications"]
    mod, attr = app_cfg["import_path"].split(":")
    builder = getattr(importlib.import_module(mod), attr)
    http_port, grpc_port = free_port(), free_port()
    args = ServeAppArgs.model_validate({**app_cfg["args"], "model": tiny_moe_dir, "ranks": 1, "grpc_port": grpc_port,
                                       "cluster_options": {"kv_cache_bytes": 4 * 2**20, "max_num_seqs": 16}})
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    handle = serve.run(builder(args), name="moeray", route_prefix="/")  # returns once the replica is up
    assert wait_ready(handle, timeout_s=120) is None  # and its EP group is built
    try:
        yield http_port, grpc_port
    finally:
        serve.shutdown()


def test_http_through_serve(served):
    port, _ = served
    status, body = _request(port, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = _request(port, "GET", "/v1/models")
    model = json.loads(body)["data"][0]["id"]
    status, body = _request(port, "POST", "/v1/completions",
                            {"model": model, "prompt": "To be", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    d = json.loads(body)
    assert d["usage"]["completion_tokens"] == 5
    status, body = _request(port, "POST", "/v1/completions", {"prompt": "To be", "max_tokens": -3})
    assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens"
    status, body = _request(port, "POST", "/v1/completions", {"prompt": "To be", "max_tokens": 5, "temperature": 0,
                                                              "ignore_eos": True, "stream": True,
                                                              "stream_options": {"include_usage": True}})
    assert status == 200
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 5
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == d["choices"][0]["text"]
    status, body = _request(port, "GET", "/metrics")
    assert status == 200 and "moeray_kv_blocks_total" in body


def test_grpc_in_the_replica(served):
    _, grpc_port = served
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = pb_grpc.MoerayStub(ch)
        grpc.channel_ready_future(ch).result(timeout=30)
        out = list(stub.Generate(pb.GenerateRequest(text="To be", sampling=pb.SamplingParams(
            max_tokens=4, temperature=0, ignore_eos=True)), timeout=60))
        assert out[-1].usage.completion_tokens == 4
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            s = stub.GetClusterStats(pb.GetClusterStatsRequest(), timeout=10)
            if s.in_flight == 0 and s.kv_blocks_free == s.kv_blocks_total:
                break
            time.sleep(0.1)
        assert s.kv_blocks_free == s.kv_blocks_total


def test_the_replica_and_its_ranks_run_at_niceness_0(served):
    """Ray runs its workers at niceness 15; the MoerayServer replica (the front door) and its rank actors ask for 0,
    so neither is preempted by every nice-0 process, and neither outranks the other."""
    import psutil

    procs = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"]]
    replica = [p for p in procs if "ServeReplica:moeray:MoerayServer" in " ".join(p.info["cmdline"])]
    ranks = [p for p in procs if "RankWorker" in " ".join(p.info["cmdline"])]
    assert replica and ranks
    assert {p.nice() for p in replica + ranks} == {0}
