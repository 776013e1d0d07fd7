"""The server-side request timeout of gRPC `Generate` (`request_timeout_s`, HTTP's 504 rule): a call still generating
past it is aborted on its rank at once and ends with DEADLINE_EXCEEDED naming the limit, on the standalone server
and on the Serve deployment's path; a client's shorter deadline works as before; a limit <= 0 is refused. Fake
routers (no Ray): `SilentRouter`, whose requests never produce an output (a long generation), and the
concurrency test's `FakeRouter` (one token, then nothing until released)."""
from __future__ import annotations

import asyncio
import time
import types
from types import SimpleNamespace

import grpc
import pytest

from actors.engine.messages import TokenOutput
from router_service.grpc.server import MoerayServicer, main, start_grpc_server
from router_service.metrics import Metrics
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc
from tests.router_service.test_grpc_concurrency import FakeRouter
from tests.router_service.test_openai_params import SilentRouter

LIMIT = "the request ran past the server's request timeout of 0.2 s (--request-timeout-s) and was stopped"


class QuickRouter(FakeRouter):
    """`FakeRouter`, plus: a prompt "quick" finishes right after its first token (a short call); streams are timed."""

    def submit(self, prompt, params, request_id):
        s = super().submit(prompt, params, request_id)
        s.t0 = time.perf_counter()  # `Metrics.observer` times from it
        if prompt == "quick":
            s.q.put(TokenOutput(request_id=request_id, token_ids=[8], text="b", finish_reason="length"))
        return s


def serve(router, **kw):
    """A standalone server over `router`, its stub and its Metrics; close with `.stop(0)` on the server."""
    m = Metrics(router)
    srv = start_grpc_server(router, host="127.0.0.1", port=0, metrics=m, **kw)
    ch = grpc.insecure_channel(srv.address)
    return srv, ch, pb_grpc.MoerayStub(ch), m


def test_generate_past_the_request_timeout_is_deadline_exceeded_and_aborted():
    router = QuickRouter(8)
    srv, ch, stub, m = serve(router, request_timeout_s=0.2)
    try:
        t0 = time.monotonic()
        call = stub.Generate(pb.GenerateRequest(request_id="slow", text="hi"), timeout=30)
        assert next(call).token_ids == [7]  # generating; nothing more comes until it is aborted
        with pytest.raises(grpc.RpcError) as ei:
            next(call)
        assert time.monotonic() - t0 < 10  # the server's 0.2 s, not the client's 30 s
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and ei.value.details() == LIMIT
        assert router.aborted == ["slow"] and "slow" not in router.live  # aborted on its rank before the status
        assert m.requests.labels("grpc", "Generate", "DEADLINE_EXCEEDED")._value.get() == 1
        # the server goes on serving: control calls and a short Generate
        assert stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.STATUS_SERVING
        out = list(stub.Generate(pb.GenerateRequest(request_id="fast", text="quick"), timeout=30))
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH and out[-1].usage.completion_tokens == 2
        assert m.requests.labels("grpc", "Generate", "OK")._value.get() == 1 and router.aborted == ["slow"]
    finally:
        router.release.set()
        ch.close()
        srv.stop(0)


def test_a_batch_past_the_request_timeout_aborts_every_prompt(tiny_moe_dir):
    router = SilentRouter(tiny_moe_dir)
    srv, ch, stub, _ = serve(router, request_timeout_s=0.2)
    try:
        batch = pb.PromptBatch(prompts=[pb.Prompt(text="ab"), pb.Prompt(text="cd")])
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(pb.GenerateRequest(request_id="b", batch=batch,
                                                  sampling=pb.SamplingParams(max_tokens=200)), timeout=30))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and ei.value.details() == LIMIT
        assert sorted(router.aborted) == ["b-0", "b-1"]
    finally:
        ch.close()
        srv.stop(0)


def test_a_shorter_client_deadline_works_as_before():
    router = QuickRouter(8)
    srv, ch, stub, m = serve(router)  # the default limit (600 s)
    try:
        assert srv.servicer.request_timeout_s == 600
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(pb.GenerateRequest(request_id="c", text="hi"), timeout=0.5))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "request timeout" not in ei.value.details()
        deadline = time.monotonic() + 10
        while not router.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert router.aborted == ["c"]  # aborted on its rank, as a cancel
        assert m.requests.labels("grpc", "Generate", "CANCELLED")._value.get() == 1
    finally:
        router.release.set()
        ch.close()
        srv.stop(0)


@pytest.mark.parametrize("bad", [0, -1.5])
def test_a_limit_not_above_zero_is_refused(bad, capsys):
    with pytest.raises(ValueError, match=f"request_timeout_s={bad} must be > 0"):
        start_grpc_server(FakeRouter(4), port=0, request_timeout_s=bad)
    with pytest.raises(ValueError, match="request_timeout_s="):
        MoerayServicer(FakeRouter(4), request_timeout_s=bad)
    with pytest.raises(SystemExit) as ei:  # the standalone server's flag, refused before any cluster is built
        main(["--request-timeout-s", str(bad)])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and f"--request-timeout-s={float(bad)} must be > 0" in err
    assert MoerayServicer(FakeRouter(4), request_timeout_s=None).request_timeout_s is None  # None: no limit


class FakeGrpcContext:
    """What the Serve deployment's methods use of Serve's gRPC context."""

    def __init__(self):
        self.code = self.details = None

    def invocation_metadata(self):
        return []

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def test_serve_deployment_generate_past_the_request_timeout(tiny_moe_dir):
    """`MoerayServer.Generate` (behind Serve's gRPC proxy) on a stand-in replica: HTTP's `outputs` deadline ends
    the call with DEADLINE_EXCEEDED, the requests aborted on their ranks."""
    from router_service.grpc.rpc import MoerayRpc, RpcError
    from router_service.http.serving import OpenAIServer
    from router_service.serve.deployment import MoerayServer

    cls = MoerayServer.func_or_class
    router = SilentRouter(tiny_moe_dir)
    http = OpenAIServer(router, request_timeout_s=0.2)
    replica = SimpleNamespace(router=router, http=http, rpc=MoerayRpc(router, metrics=http.metrics))
    replica._unary = types.MethodType(cls._unary, replica)
    ctx = FakeGrpcContext()

    async def run():
        req = pb.GenerateRequest(request_id="p", text="ab", sampling=pb.SamplingParams(max_tokens=100))
        return [r async for r in cls.Generate(replica, req, ctx)]

    with pytest.raises(RpcError) as ei:
        asyncio.run(run())
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and ei.value.details == LIMIT
    assert ctx.code == grpc.StatusCode.DEADLINE_EXCEEDED and ctx.details == LIMIT
    assert router.aborted and set(router.aborted) == {"p"}
    assert http.metrics.requests.labels("grpc", "Generate", "DEADLINE_EXCEEDED")._value.get() == 1
