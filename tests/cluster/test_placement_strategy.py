"""`--placement-strategy` (issue 19): parsed and validated before Ray starts, carried by `generate`, `serve` and
the Serve config into ClusterConfig, and given to the ranks' placement group."""
from __future__ import annotations

import os

import pytest
import yaml

from cluster.config import DEFAULT_MODEL, PLACEMENT_STRATEGIES, ClusterConfig
from moeray import cli, cli_serve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parsed(monkeypatch, argv: list[str]):
    """The namespace `moeray <argv>` hands its subcommand (the subcommand itself does not run)."""
    got = {}
    monkeypatch.setattr(cli, "cmd_generate", lambda a: got.setdefault("a", a) and 0)
    monkeypatch.setattr(cli_serve, "cmd_serve", lambda a: got.setdefault("a", a) and 0)
    assert cli.main(argv) == 0
    return got["a"]


@pytest.mark.parametrize("cmd", [["generate", "hi"], ["serve"]])
def test_flag_reaches_the_cluster_config_keywords(monkeypatch, cmd):
    assert cli.engine_kwargs(_parsed(monkeypatch, cmd))["placement_strategy"] == "PACK"  # the default
    for given, want in (("SPREAD", "SPREAD"), ("strict_spread", "STRICT_SPREAD"), ("STRICT_PACK", "STRICT_PACK")):
        a = _parsed(monkeypatch, [*cmd, "--placement-strategy", given])
        assert cli.engine_kwargs(a)["placement_strategy"] == want


@pytest.mark.parametrize("cmd", [["generate", "hi"], ["serve"]])
def test_bad_value_is_a_usage_error_naming_flag_and_choices(monkeypatch, capsys, cmd):
    ran = []
    monkeypatch.setattr(cli, "cmd_generate", ran.append)
    monkeypatch.setattr(cli_serve, "cmd_serve", ran.append)
    with pytest.raises(SystemExit) as e:
        cli.main([*cmd, "--placement-strategy", "wide"])
    assert e.value.code == 2 and ran == []  # refused while parsing: the command (and Ray) never started
    err = capsys.readouterr().err
    assert "--placement-strategy" in err and all(s in err for s in PLACEMENT_STRATEGIES), err


def test_cluster_config_refuses_an_unknown_strategy():
    assert ClusterConfig(placement_strategy="SPREAD").placement_strategy == "SPREAD"
    with pytest.raises(ValueError, match="placement_strategy='spread' must be one of PACK, SPREAD, STRICT_SPREAD"):
        ClusterConfig(placement_strategy="spread")


def test_serve_config_sets_the_strategy_through_cluster_options():
    from router_service.http.models import ServeAppArgs
    from router_service.serve.deployment import resolve_args

    with open(os.path.join(REPO, "deploy", "serve_config.yaml")) as f:
        (app,) = yaml.safe_load(f)["applications"]
    args = dict(app["args"], model=DEFAULT_MODEL, num_gpus_per_rank=0, num_cpus_per_rank=0.5)
    assert ClusterConfig(**resolve_args(ServeAppArgs.model_validate(args))).placement_strategy == "PACK"
    args["cluster_options"] = {"placement_strategy": "STRICT_SPREAD"}
    assert ClusterConfig(**resolve_args(ServeAppArgs.model_validate(args))).placement_strategy == "STRICT_SPREAD"


def test_placement_group_gets_the_strategy(ray_session, tiny_model_dir):
    """SPREAD is soft, so on this one-node Ray both ranks still fit; the placement group carries SPREAD and the
    group generates."""
    from actors.engine.sampling import SamplingParams
    from moeray import LLM

    model = tiny_model_dir("qwen2_moe", num_layers=2)
    with LLM(model=model, ranks=2, max_model_len=64, kv_cache_bytes=2 << 20, placement_strategy="SPREAD") as llm:
        assert ray_session.util.placement_group_table(llm.cluster.pg)["strategy"] == "SPREAD"
        (out,) = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert out.error is None and len(out.token_ids) == 3
