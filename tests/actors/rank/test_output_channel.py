"""The rank's output channel (TCP frames instead of one Ray call per token), with an in-process RankWorker:
a wrong token gets nothing, outputs produced before the router connects arrive on connect, a whole greedy
generation streams in order, heartbeats flow while idle, and a failed rank's `failed` frame precedes its
error outputs (the router fails the whole group's requests on the first)."""
from __future__ import annotations

import socket
import struct
import time

import pytest

from actors.moe.placement import ExpertPlacement
from actors.engine.messages import GenerateRequest, decode_frame
from actors.rank.output_channel import HEARTBEAT_S
from actors.rank.worker import RankWorker
from actors.engine.sampling import SamplingParams
from tests.tiny_models import build_tiny_model


def _recv_frame(conn):
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf
    n = struct.unpack(">I", exact(4))[0]
    return decode_frame(exact(n) if n else b"")


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = build_tiny_model("qwen2_moe", str(tmp_path_factory.mktemp("m")))
    from actors.model.config import ModelConfig

    mc = ModelConfig.from_pretrained(path)
    w = RankWorker(0, 1, {"model": path, "max_model_len": 64, "kv_cache_bytes": 1 << 20},
                   ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1).to_dict())
    w.setup("127.0.0.1", 0)
    yield w
    w.shutdown(10**9)


def _submit(w, rid, n, seq):
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    w.add_request(GenerateRequest(request_id=rid, prompt_ids=[3, 4, 5], params=p.to_dict()).encode(), seq)


def test_channel_streams_outputs_after_authentication(worker):
    _submit(worker, "early", 4, 1)  # finishes before anyone connects: waits in the outbox
    deadline = time.monotonic() + 60
    while worker.engine.has_work and time.monotonic() < deadline:
        time.sleep(0.05)
    host, port, token = worker.open_output_channel()
    with socket.create_connection((host, port), timeout=10) as bad:  # wrong token: closed, nothing sent
        bad.sendall(b"0" * len(token) + b"\n")
        assert bad.recv(16) == b""
    conn = socket.create_connection((host, port), timeout=10)
    conn.sendall(token.encode() + b"\n")
    got = []
    while not any(o.finish_reason for o in got if o.request_id == "early"):
        got += _recv_frame(conn)[0]
    assert [len(o.token_ids) for o in got if o.request_id == "early"] == [1, 1, 1, 1]
    _submit(worker, "live", 6, 2)
    live = []
    while not (live and live[-1].finish_reason):
        outs, failed = _recv_frame(conn)
        assert failed is None
        live += [o for o in outs if o.request_id == "live"]
    assert len([t for o in live for t in o.token_ids]) == 6 and live[-1].finish_reason == "length"
    t0 = time.monotonic()
    assert _recv_frame(conn) == ([], None)  # idle: a heartbeat
    assert time.monotonic() - t0 < 5 * HEARTBEAT_S
    # a failure: the `failed` frame, then the in-flight request's error output
    _submit(worker, "doomed", 40, 3)
    worker.engine.run = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    failed = None
    while failed is None:
        outs, failed = _recv_frame(conn)
        assert all(o.finish_reason != "error" for o in outs)
    assert "boom" in failed
    outs, again = _recv_frame(conn)
    assert again is None and any(o.request_id == "doomed" and o.finish_reason == "error" for o in outs)
    conn.close()
