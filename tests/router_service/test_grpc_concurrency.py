"""The standalone gRPC server admits as many concurrent streams as the router's queue limit (not a fixed
thread pool): more than 64 open Generate streams are served, the one past `max_queue` gets the router's
RESOURCE_EXHAUSTED, and control calls still get through while the queue is full. A fake router (no Ray)
holds every stream open until released."""
from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import grpc
import pytest

from actors.engine.messages import TokenOutput
from router_service.errors import OverloadedError
from router_service.grpc.server import CONTROL_HEADROOM, start_grpc_server
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc

MAX_QUEUE = 80  # above the old fixed limit of 64 worker threads


class FakeStream:
    """One token at once, then nothing until `release` (the finish) or an abort."""

    def __init__(self, rid: str, release: threading.Event):
        self.request_id, self.release = rid, release
        self.out = SimpleNamespace(prompt_tokens=2, prompt="hi")
        self.done = threading.Event()
        self.q: queue.Queue = queue.Queue()
        self.q.put(TokenOutput(request_id=rid, token_ids=[7], text="a"))

    def get(self, timeout: float | None = None) -> TokenOutput:
        try:
            return self.q.get(timeout=0.05)
        except queue.Empty:
            if self.release.wait(timeout):
                return TokenOutput(request_id=self.request_id, token_ids=[8], text="b", finish_reason="length")
            raise

    def attach_queue(self, q: queue.Queue, key) -> None:
        """`RequestStream.attach_queue`: outputs go to `q` as (key, output), here from a pump thread."""
        def pump():
            while True:
                try:
                    out = self.get(timeout=0.5)
                except queue.Empty:
                    continue
                q.put((key, out))
                if out.finish_reason:
                    self.done.set()
                    return

        threading.Thread(target=pump, daemon=True).start()


class FakeRouter:
    """The slice of `Router` the servicer uses, with its queue limit."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.cfg = SimpleNamespace(model="/models/fake", max_model_len=256, ranks=1)
        self.vocab_size = 320
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.live: dict[str, FakeStream] = {}
        self.aborted: list[str] = []

    def submit(self, prompt, params, request_id):
        with self.lock:
            if len(self.live) >= self.max_queue:
                raise OverloadedError(f"{len(self.live)} requests in flight; the queue limit is {self.max_queue}")
            s = self.live[request_id] = FakeStream(request_id, self.release)
        return s

    def abort(self, request_id):
        with self.lock:
            self.aborted.append(request_id)
            self.live.pop(request_id, None)

    def get_stream(self, request_id):
        return self.live.get(request_id)

    def health(self):
        return {"ok": True, "status": "ok", "ranks": [{"rank": 0, "ok": True}]}


@pytest.fixture
def served():
    router = FakeRouter(MAX_QUEUE)
    srv = start_grpc_server(router, host="127.0.0.1", port=0)
    ch = grpc.insecure_channel(srv.address)
    yield router, srv, pb_grpc.MoerayStub(ch)
    router.release.set()
    ch.close()
    srv.stop(0)


def test_limit_follows_max_queue(served):
    router, srv, stub = served
    assert srv.max_concurrency == MAX_QUEUE + CONTROL_HEADROOM
    calls = []
    for i in range(MAX_QUEUE):
        call = stub.Generate(pb.GenerateRequest(request_id=f"r{i}", text="hi"), timeout=60)
        assert next(call).token_ids == [7]  # admitted and streaming: its worker thread is held
        calls.append(call)
    assert len(router.live) == MAX_QUEUE
    # the next stream is refused by the router's queue limit, with its message, not by the thread pool
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=30))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"the queue limit is {MAX_QUEUE}" in ei.value.details()
    # control calls still get a thread while the queue is full
    assert stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.STATUS_SERVING
    assert stub.Cancel(pb.CancelRequest(request_id="r0"), timeout=10).found
    assert "r0" in router.aborted
    router.release.set()
    for call in calls[1:]:
        rest = list(call)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 2


def test_explicit_max_concurrency_and_bad_value():
    router = FakeRouter(4)
    srv = start_grpc_server(router, port=0, max_concurrency=300)
    try:
        assert srv.max_concurrency == 300
    finally:
        srv.stop(0)
    with pytest.raises(ValueError, match="max_concurrency=0"):
        start_grpc_server(router, port=0, max_concurrency=0)
