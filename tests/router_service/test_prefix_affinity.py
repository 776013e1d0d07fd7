"""Prefix-aware rank choice (router_service/prefix_affinity.py), without a cluster: the router's block hashes are the
rank's, the choice rules (threshold edges included), LRU ageing, and the configuration that turns it on or off."""
from __future__ import annotations

import pytest

from actors.engine.sampling import SamplingParams
from cluster.config import ClusterConfig
from router_service.prefix_affinity import PrefixIndex, RankChooser, choose_rank

S = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def test_router_hashes_name_the_blocks_the_rank_cached():
    """Same block size, same chain, same cut points (at most len - 1 tokens) as the rank's prefix cache."""
    from tests.actors.kv.test_prefix_cache import _engine, _req, _run, _text

    eng = _engine()
    prompt = _text(70)
    _run(eng, [_req("a", prompt, 2)])
    hashes = PrefixIndex(1, S, 64).hashes(prompt)
    assert len(hashes) == (70 - 1) // S == 4
    alloc = eng.scheduler.prefix.alloc
    assert all(alloc.lookup(h) is not None for h in hashes)
    assert len(PrefixIndex(1, S, 64).hashes(prompt[:65])) == 4 and len(PrefixIndex(1, S, 64).hashes(prompt[:64])) == 3
    other = PrefixIndex(1, S, 64).hashes(_text(70, at=500))
    assert all(alloc.lookup(h) is None for h in other)


@pytest.mark.parametrize("costs, requests, matched, prompt, expect", [
    ([100, 50], [1, 2], [0, 0], 100, (1, False)),         # no prefix data: least token cost
    ([0, 500], [0, 3], [0, 96], 100, (1, True)),           # a match within the threshold wins over least-loaded
    ([0, 500], [0, 8], [0, 96], 100, (1, True)),           # exactly the threshold (8) over the least: still balanced
    ([0, 500], [0, 9], [0, 96], 100, (0, False)),          # one past it: least-loaded
    ([0, 10], [0, 1], [0, 16], 200, (0, False)),           # match rate 16/200 < 0.1: least-loaded
    ([0, 10], [0, 1], [0, 16], 160, (1, True)),            # 16/160 = 0.1: enough
    ([5, 9], [2, 1], [96, 96], 100, (1, True)),            # equal matches: the one with fewer requests
    ([0, 900, 10], [0, 20, 1], [0, 96, 48], 100, (2, True)),  # best match overloaded: the best among the rest
])
def test_choose_rank_rules(costs, requests, matched, prompt, expect):
    assert choose_rank(costs, requests, matched, prompt, imbalanced_threshold=8, match_rate_threshold=0.1) == expect


def test_index_ages_out_least_recent_tail_first():
    idx = PrefixIndex(2, S, capacity_blocks=5)
    a, b = list(range(100, 165)), list(range(200, 249))  # 4 and 3 full blocks
    ha, hb = idx.hashes(a), idx.hashes(b)
    assert (len(ha), len(hb)) == (4, 3)
    idx.insert(1, ha)
    assert idx.match(ha) == [0, 4] and idx.match(ha[:2] + hb[:1]) == [0, 2]
    idx.insert(1, hb)  # 7 > 5: A's two last blocks go, its head stays
    assert idx.size(1) == 5 and idx.match(ha) == [0, 2] and idx.match(hb) == [0, 3]
    idx.insert(1, ha[:2])  # touched: now B's tail is the least recent
    idx.insert(1, idx.hashes(list(range(300, 317))))
    assert idx.match(hb) == [0, 2] and idx.match(ha) == [0, 2]
    idx.clear(capacity_blocks=3)
    assert idx.match(ha) == [0, 0] and idx.capacity == 3


def test_chooser_sends_a_shared_prefix_to_its_rank_unless_overloaded():
    ch = RankChooser(2, capacity_blocks=64, imbalanced_threshold=1, default_gating="exact")
    prefix = list(range(10, 106))  # 6 blocks
    a, b = prefix + [1, 2, 3], prefix + [4, 5, 6]
    filler = list(range(150, 160))
    assert ch.choose(ch.hashes(filler, GREEDY), len(filler), 300) == 0  # idle: rank 0
    assert ch.choose(ch.hashes(a, GREEDY), len(a), len(a) + 4) == 1  # least-loaded; its prefix is indexed there
    ch.release(0, 300)
    ch.release(1, len(a) + 4)
    assert ch.costs == [0, 0] and ch.requests == [0, 0] and ch.routed == 0
    assert ch.choose(ch.hashes(b, GREEDY), len(b), 10) == 1 and ch.routed == 1  # least-loaded would say 0
    assert ch.choose(ch.hashes(b, GREEDY), len(b), 10) == 1 and ch.routed == 2  # 1 request over rank 0: balanced
    assert ch.choose(ch.hashes(b, GREEDY), len(b), 10) == 0 and ch.routed == 2  # 2 over: least-loaded
    assert ch.requests == [1, 2]
    # a request that cannot hit is not routed by prefix: prompt_logprobs, or a stateful gating policy
    assert ch.hashes(b, SamplingParams(temperature=0, prompt_logprobs=0)) is None
    assert ch.hashes(b, SamplingParams(temperature=0, gating="sticky")) is None
    assert RankChooser(2, default_gating="sticky").hashes(b, GREEDY) is None
    assert RankChooser(2, default_gating="sticky").hashes(b, SamplingParams(gating="exact")) is not None
    # a named KV profile names other pages (the quantized cache salts its hashes with it): no match across profiles
    prose, code = (ch.hashes(b, SamplingParams(kv_profile=p)) for p in ("prose", "code"))
    assert prose != code and ch.hashes(b, SamplingParams(kv_profile="auto")) == ch.hashes(b, GREEDY)
    assert ch.index.match(prose) == [0, 0] and ch.index.match(ch.hashes(b, GREEDY)) == [6, 6]
    ch.reset(capacity_blocks=8)
    assert ch.requests == [0, 0] and ch.index.match(ch.hashes(b, GREEDY)) == [0, 0] and ch.index.capacity == 8


def test_without_prefix_routing_least_loaded_only():
    ch = RankChooser(2, prefix_routing=False)
    prefix = list(range(10, 106))
    assert ch.hashes(prefix, GREEDY) is None
    assert ch.choose(None, 96, 500) == 0
    assert ch.choose(None, 96, 10) == 1 and ch.choose(None, 96, 10) == 1 and ch.choose(None, 96, 10) == 1
    assert ch.choose(None, 96, 1000) == 1 and ch.routed == 0  # rank 1: 30 tokens outstanding vs 500


def test_on_by_default_with_prefix_caching_and_flags_turn_it_off():
    assert RankChooser.for_cluster(ClusterConfig()).prefix_routing
    assert not RankChooser.for_cluster(ClusterConfig(prefix_routing=False)).prefix_routing
    assert not RankChooser.for_cluster(ClusterConfig(engine_options={"enable_prefix_caching": False})).prefix_routing
    ch = RankChooser.for_cluster(ClusterConfig(prefix_routing_imbalanced_threshold=float("inf"),
                                               prefix_routing_match_rate_threshold=0.5), capacity_blocks=7)
    assert ch.imbalanced_threshold == float("inf") and ch.match_rate_threshold == 0.5 and ch.index.capacity == 7
    with pytest.raises(ValueError, match=r"prefix_routing_imbalanced_threshold=-1 must be >= 0"):
        ClusterConfig(prefix_routing_imbalanced_threshold=-1)
    with pytest.raises(ValueError, match=r"prefix_routing_match_rate_threshold=1.5 must be in \[0, 1\]"):
        ClusterConfig(prefix_routing_match_rate_threshold=1.5)
    with pytest.raises(ValueError, match="match_rate_threshold=nan"):
        RankChooser(2, match_rate_threshold=float("nan"))


def test_cli_flags_reach_the_cluster_config():
    import argparse

    from moeray.cli import engine_kwargs
    from moeray.cli_serve import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    serve = sub.choices["serve"]
    kw = engine_kwargs(serve.parse_args([]))
    assert kw["prefix_routing"] is True and kw["prefix_routing_imbalanced_threshold"] == 8.0
    kw = engine_kwargs(serve.parse_args(["--no-prefix-routing", "--prefix-routing-imbalanced-threshold", "3",
                                         "--prefix-routing-match-rate-threshold", "0.25"]))
    cfg = ClusterConfig(**kw)
    assert (cfg.prefix_routing, cfg.prefix_routing_imbalanced_threshold, cfg.prefix_routing_match_rate_threshold) \
        == (False, 3.0, 0.25)
    with pytest.raises(ValueError, match=r"^--prefix-routing-match-rate-threshold=2.0 must be in \[0, 1\]"):
        engine_kwargs(serve.parse_args(["--prefix-routing-match-rate-threshold", "2"]))


def test_drop_and_insert_a_rank_keep_the_others_load_and_index():
    """Elastic EP: a lost rank leaves (the ranks above move down), a replacement joins empty; `reset` restores the
    whole group."""
    ch = RankChooser(3, capacity_blocks=64, imbalanced_threshold=100, default_gating="exact")
    ids = list(range(40))
    h = ch.hashes(ids, GREEDY)
    ch.costs, ch.requests = [5, 0, 0], [1, 0, 0]
    ch.index.insert(2, h)
    ch.drop(1)
    assert ch.ranks == 2 and ch.costs == [5, 0] and ch.requests == [1, 0]
    assert ch.choose(h, len(ids), 1) == 1  # old rank 2, now 1, still holds the prefix
    ch.insert(1)
    assert ch.ranks == 3 and ch.costs == [5, 0, 1] and ch.index.match(h)[1] == 0 and ch.index.match(h)[2] > 0
    ch.reset()
    assert ch.ranks == 3 and ch.costs == [0, 0, 0] and ch.index.match(h) == [0, 0, 0]
