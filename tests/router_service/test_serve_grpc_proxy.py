"""`moeray.v1.Moeray` through Ray Serve's own gRPC proxy (one replica owning a 1-rank tiny cluster), with
the `grpc_options` of deploy/serve_config.yaml on a free port: streaming Generate, ListModels, Health,
GetClusterStats, a bad request (INVALID_ARGUMENT naming the field), a client cancel that frees the KV
blocks, and the API key."""
from __future__ import annotations

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
APP = "moeray"
KEY = "proxy-s3cret"


def md(key: str | None = KEY) -> list[tuple[str, str]]:
    """Metadata of a proxied call: the Serve application, plus the API key."""
    out = [("application", APP)]
    if key is not None:
        out.append(("authorization", f"Bearer {key}"))
    return out


@pytest.fixture(scope="module")
def stub(ray_session, tiny_moe_dir):
    from ray import serve

    from router_service.http.models import ServeAppArgs
    from router_service.serve_app import build_app
    from router_service.serve.deployment import wait_ready

    with open(os.path.join(REPO, "deploy", "serve_config.yaml")) as f:
        cfg = yaml.safe_load(f)
    (app_cfg,) = cfg["applications"]
    # Serve's gRPC proxy binds [::]:port (no host option in Serve 2.60): a free port keeps the test private enough
    grpc_options = {**cfg["grpc_options"], "port": free_port()}
    args = ServeAppArgs.model_validate({**app_cfg["args"], "model": tiny_moe_dir, "ranks": 1, "api_key": KEY,
                                       "cluster_options": {"kv_cache_bytes": 4 * 2**20, "max_num_seqs": 16}})
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()}, grpc_options=grpc_options)
    try:
        handle = serve.run(build_app(args), name=APP, route_prefix="/")  # returns once the replica is up
        assert wait_ready(handle, timeout_s=120) is None  # and its EP group is built
        ch = grpc.insecure_channel(f"127.0.0.1:{grpc_options['port']}")
        grpc.channel_ready_future(ch).result(timeout=60)
        yield pb_grpc.MoerayStub(ch)
        ch.close()
    finally:
        serve.shutdown()


def _wait_idle(stub, timeout_s: float = 30.0) -> pb.ClusterStats:
    deadline = time.monotonic() + timeout_s
    while True:
        s = stub.GetClusterStats(pb.GetClusterStatsRequest(), timeout=10, metadata=md())
        if (s.in_flight == 0 and s.kv_blocks_free == s.kv_blocks_total) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def test_generate_streams_through_the_proxy(stub):
    req = pb.GenerateRequest(text="To be", sampling=pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    out = list(stub.Generate(req, timeout=60, metadata=md()))
    assert len(out) >= 2  # streamed, not one final message
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in out[:-1])
    assert sum(len(r.token_ids) for r in out) == 6 == out[-1].usage.completion_tokens
    assert len({r.request_id for r in out}) == 1 and out[0].request_id
    # greedy: the same prompt gives the same text again
    again = list(stub.Generate(req, timeout=60, metadata=md()))
    assert "".join(r.text for r in again) == "".join(r.text for r in out)


def test_batch_and_unserved_model_through_the_proxy(stub):
    """A batch streams each prompt under its index (greedy: each equals its own call); an unserved model is
    NOT_FOUND, as on the standalone server."""
    sp = pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    texts = ["To be", "or not"]
    alone = [[t for r in stub.Generate(pb.GenerateRequest(text=t, sampling=sp), timeout=60, metadata=md())
              for t in r.token_ids] for t in texts]
    batch = pb.PromptBatch(prompts=[pb.Prompt(text=t) for t in texts])
    out = list(stub.Generate(pb.GenerateRequest(request_id="pb", batch=batch, sampling=sp), timeout=60,
                             metadata=md()))
    for i in range(2):
        mine = [r for r in out if r.index == i]
        assert [t for r in mine for t in r.token_ids] == alone[i] and {r.request_id for r in mine} == {f"pb-{i}"}
        assert mine[-1].usage.completion_tokens == 4
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(pb.GenerateRequest(model="nope", text="To be"), timeout=30, metadata=md()))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND and ei.value.details().startswith("model: ")


def test_list_models_health_and_stats(stub, tiny_moe_dir):
    models = stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=md()).models
    assert [m.id for m in models] == [os.path.basename(os.path.normpath(tiny_moe_dir))] and models[0].ranks == 1
    h = stub.Health(pb.HealthRequest(), timeout=30, metadata=md(key=None))  # probes need no key
    assert h.status == pb.HealthResponse.STATUS_SERVING and [r.rank for r in h.ranks] == [0]
    s = _wait_idle(stub)
    assert len(s.ranks) == 1 and s.kv_blocks_total > 0 and s.kv_blocks_free == s.kv_blocks_total


def test_bad_request_is_invalid_argument_naming_the_field(stub):
    req = pb.GenerateRequest(text="To be", sampling=pb.SamplingParams(max_tokens=100000))
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(req, timeout=30, metadata=md()))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("max_tokens: ") and "context window" in ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        stub.Cancel(pb.CancelRequest(), timeout=30, metadata=md())
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith("request_id: ")


def test_api_key_is_required(stub):
    with pytest.raises(grpc.RpcError) as ei:
        stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=md(key=None))
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(pb.GenerateRequest(text="To be"), timeout=30, metadata=md(key="wrong")))
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_client_cancel_aborts_and_frees_kv_blocks(stub):
    """Cancelling the call at the client aborts the request on its rank through the proxy: the rank stops
    stepping long before max_tokens, and every KV block is free again. The 240 tokens take only a few seconds,
    so a loaded machine can delay the cancel past the end: up to 3 tries, every one must free every block and
    at least one must stop early (a proxy that never propagated the cancel fails all three)."""
    stopped_early = []
    for _ in range(3):
        steps0 = sum(r.steps for r in _wait_idle(stub).ranks)
        call = stub.Generate(pb.GenerateRequest(text="To be", sampling=pb.SamplingParams(
            max_tokens=240, temperature=0, ignore_eos=True)), timeout=120, metadata=md())
        got = 0
        for r in call:
            got += len(r.token_ids)
            if got >= 2:
                break
        call.cancel()
        s = _wait_idle(stub)
        assert s.in_flight == 0 and s.kv_blocks_free == s.kv_blocks_total
        steps = sum(r.steps for r in s.ranks) - steps0
        assert steps >= 2
        stopped_early.append(steps < 120)  # one step per token: it did not run to 240
        if stopped_early[-1]:
            break
    assert any(stopped_early), stopped_early


def test_client_errors_are_logged_as_one_line():
    """Serve logs a raised gRPC status with a traceback at ERROR; a client error becomes one INFO line, a server
    fault keeps its traceback."""
    import logging
    import sys

    from router_service.grpc.rpc import RpcError
    from router_service.serve.deployment import ClientErrorLogFilter

    class Wrapped(Exception):  # as Serve's gRPCStatusError carries the method's exception
        def __init__(self, original):
            super().__init__("wrapped")
            self.original_exception = original

    def record(exc):
        try:
            raise exc
        except Exception:
            return logging.LogRecord("ray.serve", logging.ERROR, __file__, 1, "Request failed.", (), sys.exc_info())

    f = ClientErrorLogFilter()
    bad = RpcError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=0 must be >= 1")
    for exc in (bad, Wrapped(bad)):
        r = record(exc)
        assert f.filter(r) and r.levelno == logging.INFO and r.exc_info is None
        assert r.getMessage() == "gRPC call ended with INVALID_ARGUMENT: max_tokens=0 must be >= 1"
    for exc in (RpcError(grpc.StatusCode.INTERNAL, "boom"), RuntimeError("boom")):
        r = record(exc)
        assert f.filter(r) and r.levelno == logging.ERROR and r.exc_info is not None
