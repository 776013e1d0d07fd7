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
])
def test_bad_arguments_exit_2(tiny_model_dir, capsys, argv, msg):
    model = ["--model", tiny_model_dir("qwen2_moe")] if "--model" not in argv else []
    assert main(["serve", *model, *argv]) == 2
    assert msg in capsys.readouterr().err


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--ranks", "--host", "--http-port", "--grpc-port", "--api-key", "--kv-bits",
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
                                         "--max-model-len", "512", "--weight-storage", "compute"])
    kw = engine_kwargs(a)
    assert kw["max_model_len"] == 512
    opts = kw["engine_options"]
    assert opts["kv_bits"] == 3 and opts["kv_extra_bits"] == [2, 4] and opts["kv_profile"] == "auto"
    assert opts["gating"] == "sticky" and opts["gating_options"] == {"sticky_margin": 0.1}
    assert opts["weight_storage"] == "compute"
    from cluster.config import ClusterConfig

    ClusterConfig(**kw).engine_config()  # accepted as is
