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


@pytest.fixture
def fresh_worker(tmp_path):
    path = build_tiny_model("qwen2_moe", str(tmp_path))
    from actors.model.config import ModelConfig

    mc = ModelConfig.from_pretrained(path)
    w = RankWorker(0, 1, {"model": path, "max_model_len": 64, "kv_cache_bytes": 1 << 20},
                   ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1).to_dict())
    w.setup("127.0.0.1", 0)
    host, port, token = w.open_output_channel()
    conn = socket.create_connection((host, port), timeout=20)
    conn.sendall(token.encode() + b"\n")
    yield w, conn
    conn.close()
    w.shutdown(10**9)


def _until_finished(conn, rid):
    got = []
    while not (got and got[-1].finish_reason):
        outs, failed = _recv_frame(conn)
        assert failed is None
        got += [o for o in outs if o.request_id == rid]
    return [t for o in got for t in o.token_ids], got[-1].finish_reason


def test_control_frames_take_requests_and_aborts_in_order(fresh_worker):
    """Requests and aborts written on the channel (the router's path once every channel is up) run as the Ray
    calls do: the same greedy tokens as `add_request`, and an abort frame ends its request and frees its blocks."""
    from actors.rank.output_channel import ABORT, REQUEST, encode_control

    w, conn = fresh_worker
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True).to_dict()
    req = GenerateRequest(request_id="by-frame", prompt_ids=[3, 4, 5], params=p)
    conn.sendall(encode_control(REQUEST, 1, req.encode()))
    by_frame = _until_finished(conn, "by-frame")
    w.add_request(GenerateRequest(request_id="by-call", prompt_ids=[3, 4, 5], params=p).encode(), 2)
    assert by_frame == _until_finished(conn, "by-call") and by_frame[1] == "length" and len(by_frame[0]) == 8
    free = w.engine.cache.allocator.num_free
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True).to_dict()
    # the request and its abort in one write: the rank reads them in order (an abort never overtakes)
    conn.sendall(encode_control(REQUEST, 3, GenerateRequest(request_id="cut", prompt_ids=[3, 4, 5], params=long)
                                .encode()) + encode_control(ABORT, 4, b"cut"))
    toks, reason = _until_finished(conn, "cut")
    assert reason == "abort" and len(toks) < 50
    deadline = time.monotonic() + 10
    while w.engine.cache.allocator.num_free != free and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.engine.cache.allocator.num_free == free and not w.engine.has_work


def test_a_malformed_control_frame_drops_the_connection(fresh_worker):
    from actors.rank.output_channel import encode_control

    w, conn = fresh_worker
    conn.sendall(encode_control(b"R", 1, b"not msgpack"))
    with pytest.raises((ConnectionError, OSError)):
        while True:
            _recv_frame(conn)  # heartbeats until the rank closes it
    assert w.health()["ok"]  # the rank itself is fine: the router reconnects or rebuilds


def test_a_control_frame_in_the_token_segment_is_not_lost(fresh_worker):
    """The router may write its first request right behind the token: the rank reads exactly the token, so the
    frame that shares its TCP segment still arrives (it used to be swallowed with the token, failing the check)."""
    from actors.rank.output_channel import REQUEST, encode_control

    w, _ = fresh_worker
    host, port, token = w.open_output_channel()
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True).to_dict()
    frame = encode_control(REQUEST, 5, GenerateRequest(request_id="behind", prompt_ids=[3, 4], params=p).encode())
    conn = socket.create_connection((host, port), timeout=20)
    conn.sendall(token.encode() + b"\n" + frame)
    toks, reason = _until_finished(conn, "behind")
    conn.close()
    assert reason == "length" and len(toks) == 3
