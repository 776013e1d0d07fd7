"""`moeray serve` argument handling (no cluster is started: each case fails before Ray)."""
from __future__ import annotations

import pytest

from moeray.cli import main


@pytest.mark.parametrize("argv, msg", [
    (["--http-port", "0", "--grpc-port", "0"], "nothing to serve"),
    (["--http-port", "70000"], "--http-port=70000"),
    (["--ranks", "0"], "--ranks=0"),
    (["--model", "/nonexistent"], "no config.json"),
    (["--gating-option", "sticky_margin"], "KEY=VALUE"),
    (["--gating-option", "bogus=1"], "unknown gating option(s) ['bogus']"),
    (["--gating", "sticky", "--gating-option", "sticky_margin=-1"], "sticky_margin=-1"),
    (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens=8 must be >= --max-num-seqs=64"),
    (["--request-timeout-s", "0"], "--request-timeout-s=0.0 must be > 0"),
])
def test_bad_arguments_exit_2(tiny_model_dir, capsys, argv, msg):
    model = ["--model", tiny_model_dir("qwen2_moe")] if "--model" not in argv else []
    assert main(["serve", *model, *argv]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--address", "127.0.0.11:6379", "--http-port", "0"]])
def test_detach_needs_a_cluster_and_serve(tiny_model_dir, capsys, monkeypatch, argv):
    """`--detach` on a private local Ray, or without Serve (a gRPC-only server in this process): nothing could
    outlive the command, so it is refused (exit 2) before Ray."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["serve", "--model", tiny_model_dir("qwen2_moe"), "--detach", *argv]) == 2
    assert "--detach needs --address (or $RAY_ADDRESS) and --http-port > 0" in capsys.readouterr().err


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--ranks", "--host", "--http-port", "--grpc-port", "--api-key", "--detach", "--kv-bits",
                 "--kv-extra-bits", "--kv-profile", "--gating", "--weight-bits", "--max-model-len"):
        assert flag in out
    assert "127.0.0.1" in out


def test_engine_flags_reach_the_cluster_options():
    """`serve` takes the same engine flags as `generate` and hands them to the Serve app / LLM as ClusterConfig
    keywords (the ranks then run with them)."""
    import argparse

    from moeray.cli import engine_kwargs
    from moeray.cli_serve import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    a = sub.choices["serve"].parse_args(["--kv-bits", "3", "--kv-extra-bits", "2", "4", "--kv-profile", "auto",
                                         "--gating", "sticky", "--gating-option", "sticky_margin=0.1",
                                         "--max-model-len", "512", "--weight-storage", "compute",
                                         "--max-num-batched-tokens", "128", "--no-enable-chunked-prefill",
                                         "--no-prefix-caching"])
    kw = engine_kwargs(a)
    assert kw["max_model_len"] == 512 and kw["max_batched_tokens"] == 128
    opts = kw["engine_options"]
    assert opts["kv_bits"] == 3 and opts["kv_extra_bits"] == [2, 4] and opts["kv_profile"] == "auto"
    assert opts["gating"] == "sticky" and opts["gating_options"] == {"sticky_margin": 0.1}
    assert opts["weight_storage"] == "compute" and opts["enable_chunked_prefill"] is False
    from cluster.config import ClusterConfig

    from actors.engine.config import EngineConfig

    ec = EngineConfig(**ClusterConfig(**kw).engine_config())  # accepted as is, as a rank takes it
    assert ec.max_batched_tokens == 128 and ec.enable_chunked_prefill is False
    assert opts["enable_prefix_caching"] is False and ec.enable_prefix_caching is False
    a = sub.choices["serve"].parse_args([])
    assert engine_kwargs(a)["engine_options"]["enable_prefix_caching"] is True  # on by default


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_busy_port_exits_2_before_ray(tiny_model_dir, capsys, monkeypatch, flag):
    """A port already listened on: exit 2 naming the flag (Serve's proxy would share a SO_REUSEPORT port with
    another `moeray serve` silently, or fail ~10 s later inside Ray)."""
    import socket

    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as uvicorn in Serve's proxy
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        other = {"--http-port": "--grpc-port", "--grpc-port": "--http-port"}[flag]
        argv = ["serve", "--model", tiny_model_dir("qwen2_moe"), flag, str(port), other, "0"]
        was_up = ray.is_initialized()
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag}={port}: cannot listen on 127.0.0.1:{port}" in err
    assert ray.is_initialized() == was_up  # refused before Ray


def test_a_port_left_in_time_wait_by_a_stopped_server_is_not_busy(monkeypatch):
    """Restarting `moeray serve` right after Ctrl-C: its port only has connections in TIME_WAIT (the server closed
    them first), which the real listeners bind over (SO_REUSEADDR); the pre-check must not call it busy (it did:
    "Address already in use" for ~60 s)."""
    import argparse
    import socket

    from moeray.cli_serve import _port_problem

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server side closes first: its (port, peer) pair stays in TIME_WAIT
        cli.recv(1)
        cli.close()
    with pytest.raises(OSError):  # a plain bind still fails: the situation the helper hit
        with socket.socket() as plain:
            plain.bind(("127.0.0.1", port))
    a = argparse.Namespace(address=None, host="127.0.0.1", http_port=port, grpc_port=0, grpc_proxy=False)
    assert _port_problem(a) is None


def test_request_timeout_reaches_the_grpc_only_server(tiny_model_dir, monkeypatch):
    """`--request-timeout-s` reaches the gRPC server `--http-port 0` runs in this process, not only HTTP (the Serve
    replica gets it through `ServeAppArgs.request_timeout_s`)."""
    import moeray.api
    import moeray.cli_serve as cli_serve
    import router_service.grpc.server as grpc_server

    class FakeLLM:
        def __init__(self, **kw):
            self.router = "router"

        def shutdown(self):
            pass

    seen: dict = {}
    server = type("FakeServer", (), {"address": "127.0.0.1:1", "stop": lambda self: None})()
    monkeypatch.setattr(moeray.api, "LLM", FakeLLM)
    monkeypatch.setattr(grpc_server, "start_grpc_server", lambda *a, **kw: seen.update(kw) or server)
    monkeypatch.setattr(cli_serve, "_wait_for_signal", lambda: None)
    monkeypatch.setattr(cli_serve, "owns_local_ray", lambda address: False)  # no local Ray, no port probe
    argv = ["serve", "--model", tiny_model_dir("qwen2_moe"), "--http-port", "0", "--request-timeout-s", "7.5"]
    assert main(argv) == 0
    assert seen["request_timeout_s"] == 7.5
