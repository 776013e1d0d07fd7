"""`--ranks-per-node N`: ranks / N node-group bundles of N ranks each (rank r in bundle r // N) under STRICT_SPREAD
(or SPREAD), validated before Ray starts; spawn and elastic grow put each rank in its own group's bundle; on one
Ray node N = ranks serves the tokens of the ungrouped run and N = 1 fails within the timeout, naming the cause."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import yaml

from cluster.config import DEFAULT_MODEL, ClusterConfig
from cluster.node_groups import bundle_of, rank_bundles
from moeray import cli, cli_serve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bundles_are_node_groups_of_n_ranks():
    assert rank_bundles(4, 0.5) == [{"CPU": 0.5}] * 4  # unset: one bundle per rank, as before
    assert rank_bundles(4, 0.5, 0.0, 2) == [{"CPU": 1.0}] * 2
    assert rank_bundles(8, 1.0, 1.0, 4) == [{"CPU": 4.0, "GPU": 4.0}] * 2
    assert rank_bundles(3, 0.1, 0.0, 3) == [{"CPU": 0.3}]  # rounded as Ray does, not 0.30000000000000004
    assert rank_bundles(2, 0.5, 0.0, 1) == [{"CPU": 0.5}] * 2
    with pytest.raises(ValueError, match="ranks=6 must be a multiple of ranks_per_node=4"):
        rank_bundles(6, 0.5, 0.0, 4)


def test_rank_to_bundle_mapping():
    assert [bundle_of(r) for r in range(4)] == [0, 1, 2, 3]
    assert [bundle_of(r, 2) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [bundle_of(r, 3) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [bundle_of(r, 1) for r in range(3)] == [0, 1, 2]


def test_cluster_config_validation_and_strategy():
    assert ClusterConfig().placement_strategy == "PACK" and ClusterConfig().ranks_per_node is None
    cfg = ClusterConfig(ranks=4, ranks_per_node=2)
    assert cfg.placement_strategy == "STRICT_SPREAD"  # node groups on distinct nodes
    assert ClusterConfig(**cfg.to_dict()).placement_strategy == "STRICT_SPREAD"  # the resolved value round-trips
    assert ClusterConfig(ranks=4, ranks_per_node=2, placement_strategy="SPREAD").placement_strategy == "SPREAD"
    with pytest.raises(ValueError, match=r"^ranks=3 must be a multiple of ranks_per_node=2"):
        ClusterConfig(ranks=3, ranks_per_node=2)
    with pytest.raises(ValueError, match=r"^ranks_per_node=0 must be >= 1"):
        ClusterConfig(ranks=2, ranks_per_node=0)
    for s in ("PACK", "STRICT_PACK"):
        with pytest.raises(ValueError, match=f"placement_strategy='{s}' with ranks_per_node=2 must be one of "
                                             "STRICT_SPREAD, SPREAD"):
            ClusterConfig(ranks=2, ranks_per_node=2, placement_strategy=s)


def _kwargs(monkeypatch, argv: list[str]) -> dict:
    got = {}
    monkeypatch.setattr(cli, "cmd_generate", lambda a: got.setdefault("a", a) and 0)
    monkeypatch.setattr(cli_serve, "cmd_serve", lambda a: got.setdefault("a", a) and 0)
    assert cli.main(argv) == 0
    return cli.engine_kwargs(got["a"])


@pytest.mark.parametrize("cmd", [["generate", "hi"], ["serve"]])
def test_flag_reaches_the_cluster_config_keywords(monkeypatch, cmd):
    kw = _kwargs(monkeypatch, cmd)
    assert (kw["ranks_per_node"], kw["placement_strategy"]) == (None, "PACK")
    kw = _kwargs(monkeypatch, [*cmd, "--ranks", "4", "--ranks-per-node", "2"])
    assert (kw["ranks_per_node"], kw["placement_strategy"]) == (2, "STRICT_SPREAD")
    assert ClusterConfig(ranks=4, **kw).placement_strategy == "STRICT_SPREAD"
    kw = _kwargs(monkeypatch, [*cmd, "--ranks", "4", "--ranks-per-node", "2", "--placement-strategy", "spread"])
    assert kw["placement_strategy"] == "SPREAD"


@pytest.mark.parametrize("cmd", [["generate", "hi"], ["serve", "--address", "10.255.255.1:6379"]])
@pytest.mark.parametrize("flags, words", [
    (["--ranks", "3", "--ranks-per-node", "2"], ["--ranks=3 must be a multiple of --ranks-per-node=2"]),
    (["--ranks-per-node", "0"], ["--ranks-per-node=0 must be >= 1"]),
    (["--ranks", "2", "--ranks-per-node", "2", "--placement-strategy", "PACK"],
     ["--placement-strategy='PACK' with --ranks-per-node=2", "STRICT_SPREAD, SPREAD"]),
])
def test_bad_combination_exits_2_before_ray(monkeypatch, capsys, cmd, flags, words):
    import ray

    import moeray.api

    def no_cluster(*a, **k):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr(moeray.api, "LLM", no_cluster)
    monkeypatch.setattr(ray, "init", no_cluster)
    assert cli.main([*cmd, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeray: error: ") and all(w in err for w in words), err


def test_serve_config_sets_ranks_per_node_through_cluster_options():
    from router_service.http.models import ServeAppArgs
    from router_service.serve.deployment import resolve_args

    with open(os.path.join(REPO, "deploy", "serve_config.yaml")) as f:
        (app,) = yaml.safe_load(f)["applications"]
    args = dict(app["args"], model=DEFAULT_MODEL, num_gpus_per_rank=0, num_cpus_per_rank=0.5, ranks=4)
    args["cluster_options"] = {"ranks_per_node": 2}
    cfg = ClusterConfig(**resolve_args(ServeAppArgs.model_validate(args)))
    assert (cfg.ranks_per_node, cfg.placement_strategy) == (2, "STRICT_SPREAD")
    args["cluster_options"] = {"ranks_per_node": 2, "placement_strategy": "PACK"}  # the config's own PACK line
    with pytest.raises(ValueError, match="placement_strategy='PACK' with ranks_per_node=2"):
        ClusterConfig(**resolve_args(ServeAppArgs.model_validate(args)))


class _Remote:
    """Stands in for `ray.remote(RankWorker)`: records each actor's placement-group bundle index."""

    def __init__(self):
        self.bundles: list[int] = []

    def options(self, scheduling_strategy, **_):
        self.bundles.append(scheduling_strategy.placement_group_bundle_index)
        return self

    def remote(self, *a, **k):
        call = SimpleNamespace(remote=lambda *a, **k: None)
        return SimpleNamespace(node_ip=call, open_rendezvous=call, setup=call, prepare_join=call)


def test_spawn_and_grow_put_each_rank_in_its_groups_bundle(monkeypatch):
    import cluster.launcher as launcher
    from cluster.placement import redundant_placement

    fake = _Remote()
    monkeypatch.setattr(launcher.ray, "remote", lambda cls: fake)
    monkeypatch.setattr(launcher.ray, "get", lambda x, timeout=None: [{}] * len(x) if isinstance(x, list)
                        else ("127.0.0.1", 0))
    cl = launcher.EPCluster.__new__(launcher.EPCluster)
    cl.cfg = ClusterConfig(ranks=6, ranks_per_node=2, redundant_experts=True)
    cl.pg = object()
    cl.placement = cl._whole_placement = redundant_placement(2, 8, 6)
    cl._spawn(timeout_s=1)
    assert fake.bundles == [0, 0, 1, 1, 2, 2] and cl.slots == list(range(6))
    for lost, bundle in ((0, 0), (3, 1), (4, 2)):  # after a shrink: the replacement joins its own group's node
        fake.bundles.clear()
        cl.slots = [s for s in range(6) if s != lost]
        assert cl.prepare_grow(timeout_s=1)["slot"] == lost and fake.bundles == [bundle]


PROMPTS = ["the sea and the harbour", "x"]


def test_one_node_group_serves_the_same_tokens(ray_session, tiny_model_dir):
    from actors.engine.sampling import SamplingParams
    from moeray import LLM

    model = tiny_model_dir("qwen2_moe", num_layers=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(model=model, ranks=2, max_model_len=64, kv_cache_bytes=2 << 20)
    with LLM(**kw) as llm:
        plain = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(**kw, ranks_per_node=2) as llm:
        table = ray_session.util.placement_group_table(llm.cluster.pg)
        assert table["strategy"] == "STRICT_SPREAD" and list(table["bundles"].values()) == [{"CPU": 1.0}]
        nodes = ray_session.get([r.node_ip.remote() for r in llm.cluster.ranks], timeout=30)
        assert len(set(nodes)) == 1 and len(nodes) == 2
        grouped = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert grouped == plain and all(len(t) == 6 for t in plain)


def test_more_node_groups_than_nodes_fail_within_the_timeout(ray_session):
    from cluster.launcher import EPCluster

    assert sum(1 for n in ray_session.nodes() if n["Alive"]) == 1
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        EPCluster(ClusterConfig(ranks=2, ranks_per_node=1, placement_timeout_s=3))
    assert time.monotonic() - t0 < 20
    msg = str(e.value)
    for w in ("2 node groups of ranks_per_node=1", "STRICT_SPREAD", "needs 2 nodes", "1 alive nodes", "within 3s"):
        assert w in msg, msg
    assert all(t["state"] == "REMOVED" for t in ray_session.util.placement_group_table().values()
               if t["strategy"] == "STRICT_SPREAD" and len(t["bundles"]) == 2)  # not left pending


def test_replacement_rank_rejoins_its_node_groups_bundle(ray_session, tiny_model_dir):
    """Elastic EP with one node group of 2: rank 1 SIGKILLed, the survivor serves, and the replacement starts in
    bundle 0 (rank 1 // 2; there is no bundle 1) and joins; the group then serves the undisturbed tokens."""
    import signal

    from actors.engine.sampling import SamplingParams
    from moeray import LLM
    from router_service.errors import EngineError

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model=tiny_model_dir("qwen2_moe", num_layers=2), ranks=2, ranks_per_node=2, redundant_experts=True,
             max_model_len=64, kv_cache_bytes=2 << 20) as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, params)]
        pids = [i["pid"] for i in llm.cluster.info]
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while not llm.router.rejoins and time.monotonic() < deadline:
            try:
                llm.router.submit(PROMPTS[0], params).result(timeout=30)
            except EngineError:  # refused (retriable) while the group shrinks or the replacement switches in
                time.sleep(0.05)
        assert llm.router.rejoins, f"no replacement rank joined within 90 s: {llm.router.health()}"
        assert llm.router.recoveries[-1]["elastic"]
        new = [i["pid"] for i in llm.cluster.info]
        assert new[0] == pids[0] and new[1] not in pids and llm.cluster.slots == [0, 1]
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref
