"""`moeray serve` argument handling (no cluster is started: each case fails before Ray)."""
from __future__ import annotations

import pytest

from moeray.cli import main


@pytest.mark.parametrize("argv, msg", [
    (["--http-port", "0", "--grpc-port", "0"], "nothing to serve"),
    (["--http-port", "70000"], "--http-port=70000"),
    (["--ranks", "0"], "--ranks=0"),
    (["--model", "/nonexistent"], "no config.json"),
])
def test_bad_arguments_exit_2(tiny_model_dir, capsys, argv, msg):
    model = ["--model", tiny_model_dir("qwen2_moe")] if "--model" not in argv else []
    assert main(["serve", *model, *argv]) == 2
    assert msg in capsys.readouterr().err


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--ranks", "--host", "--http-port", "--grpc-port", "--api-key"):
        assert flag in out
    assert "127.0.0.1" in out
