"""Prometheus metrics (router_service.metrics, cluster.metrics): unit tests on synthetic stats, then the
/metrics text of a real 2-rank tiny cluster (one dense layer) after a few requests through the HTTP app."""
from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router_service.metrics import Metrics

FAMILIES = ("moeray_expert_tokens_total", "moeray_rank_tokens_total", "moeray_expert_balancedness",
            "moeray_rank_balancedness", "moeray_expert_max_mean", "moeray_rank_max_mean",
            "moeray_time_to_first_token_seconds_count", "moeray_inter_token_latency_seconds_count",
            "moeray_e2e_request_latency_seconds_count", "moeray_queue_depth", "moeray_sequences_running",
            "moeray_sequences_waiting", "moeray_requests_in_flight", "moeray_kv_blocks_used", "moeray_kv_blocks_free",
            "moeray_kv_blocks_total", "moeray_ranks_failed", "moeray_generated_tokens_total")


def samples(text: str) -> dict[str, dict[tuple, float]]:
    """sample name -> {sorted label items: value}."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_layer(d: dict[tuple, float], key: str = "expert") -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for labels, v in d.items():
        lab = dict(labels)
        out.setdefault(int(lab["layer"]), {})[int(lab[key])] = v
    return out


# ------------------------------------------------------------------------------------------- unit: cluster.metrics
def test_aggregate_balancedness_and_routing():
    from actors.moe.placement import ExpertPlacement
    from cluster.metrics import aggregate_stats, balancedness

    nan = float("nan")
    placement = ExpertPlacement.contiguous(3, 4, 2)  # rank 0: experts 0-1, rank 1: experts 2-3
    ranks = [
        {"rank": 0, "expert_load": [[1, 2, 3, 4], [0] * 4, [2, 2, 2, 2]], "kv_blocks_total": 10, "kv_blocks_free": 7,
         "running": 1, "waiting": 0, "routing": {"thrash": [0.5, nan, 0.1]}},
        {"rank": 1, "expert_load": [[1, 0, 0, 0], [0] * 4, [0, 0, 0, 0]], "kv_blocks_total": 10, "kv_blocks_free": 10,
         "running": 0, "waiting": 2, "routing": {"thrash": [0.3, nan, nan], "hit_rate": 0.9, "recall": {"0": 0.5}}},
    ]
    s = aggregate_stats(ranks, placement)
    assert s["expert_load"][0] == [2, 2, 3, 4] and s["rank_load"][0] == [4, 7]
    assert [r["layer"] for r in s["layers"]] == [0, 2]  # layer 1 routes nothing (dense)
    assert set(s["layers"][0]) == {"layer", "tokens", "expert_max_mean", "rank_max_mean"}  # the gRPC LayerLoad keys
    b0 = s["balance"][0]
    assert b0["layer"] == 0 and b0["expert_balancedness"] == pytest.approx(2.75 / 4)
    assert b0["rank_balancedness"] == pytest.approx(5.5 / 7)
    assert s["balance"][1]["expert_balancedness"] == 1.0 and s["balance"][1]["rank_balancedness"] == 1.0
    assert s["kv_blocks_used"] == 3 and s["kv_blocks_used"] + s["kv_blocks_free"] == s["kv_blocks_total"]
    r = s["routing"]
    assert r["thrash"][0] == pytest.approx(0.4) and math.isnan(r["thrash"][1]) and r["thrash"][2] == pytest.approx(0.1)
    assert r["hit_rate"] == [0.9] * 3
    assert r["recall"][0] == 0.5 and math.isnan(r["recall"][2])
    assert balancedness([]) == 1.0 and balancedness([0, 0]) == 1.0 and balancedness([1, 3]) == 2 / 3


def test_aggregate_without_routing_reports_none():
    from actors.moe.placement import ExpertPlacement
    from cluster.metrics import aggregate_stats

    rank = {"rank": 0, "expert_load": [[1, 1]], "kv_blocks_total": 4, "kv_blocks_free": 4, "running": 0, "waiting": 0,
            "prefix_cache_queries": 32, "prefix_cache_hits": 16}
    agg = aggregate_stats([rank, dict(rank, rank=1)], ExpertPlacement.contiguous(1, 2, 2))
    assert agg["routing"] == {}
    assert agg["prefix_cache_queries"] == 64 and agg["prefix_cache_hits"] == 32  # summed over the ranks


# ------------------------------------------------------------------------------------------- unit: exporter
def synthetic_stats() -> dict:
    nan = float("nan")
    return {"expert_load": [[1, 2, 3, 4], [0] * 4, [5, 5, 5, 5]], "rank_load": [[3, 7], [0, 0], [10, 10]],
            "layers": [{"layer": 0, "tokens": 10, "expert_max_mean": 1.6, "rank_max_mean": 1.4},
                       {"layer": 2, "tokens": 20, "expert_max_mean": 1.0, "rank_max_mean": 1.0}],
            "balance": [{"layer": 0, "expert_balancedness": 0.625, "rank_balancedness": 5 / 7},
                        {"layer": 2, "expert_balancedness": 1.0, "rank_balancedness": 1.0}],
            "kv_blocks_total": 20, "kv_blocks_free": 15, "kv_blocks_used": 5, "running": 2, "waiting": 1,
            "prefix_cache_queries": 900, "prefix_cache_hits": 768, "prefix_routed": 3, "in_flight": 4, "routing": {"thrash": [0.4, nan, 0.2], "hit_rate": [0.75, nan, nan],
                                        "recall": [0.5, nan, 0.25], "unknown_key": [1.0, 1.0, 1.0]},
            "dispatch_rank_rows": [[4, 6], [0, 0], [10, 10]],
            "ranks": [{"rank": 0}, {"rank": 1, "failed": "boom"}]}


def test_exporter_families_from_snapshot():
    m = Metrics()
    assert "moeray_expert_tokens_total" not in generate_latest(m.registry).decode()  # nothing before a snapshot
    m.refresh(synthetic_stats())
    s = samples(generate_latest(m.registry).decode())
    for f in FAMILIES:
        assert f in s, f
    tok = by_layer(s["moeray_expert_tokens_total"])
    assert tok == {0: {0: 1, 1: 2, 2: 3, 3: 4}, 2: {e: 5 for e in range(4)}}  # dense layer 1 left out
    assert by_layer(s["moeray_rank_tokens_total"], "rank") == {0: {0: 3, 1: 7}, 2: {0: 10, 1: 10}}
    assert s["moeray_expert_balancedness"] == {(("layer", "0"),): 0.625, (("layer", "2"),): 1.0}
    assert s["moeray_rank_balancedness"][(("layer", "0"),)] == pytest.approx(5 / 7)
    assert by_layer(s["moeray_dispatch_rank_rows_total"], "rank") == {0: {0: 4, 1: 6}, 2: {0: 10, 1: 10}}
    assert s["moeray_dispatch_rank_balancedness"] == {(("layer", "0"),): 5 / 6, (("layer", "2"),): 1.0}
    assert s["moeray_thrash_rate"] == {(("layer", "0"),): 0.4, (("layer", "2"),): 0.2}  # nan layers skipped
    assert s["moeray_expert_cache_hit_rate"] == {(("layer", "0"),): 0.75}
    assert s["moeray_prefetch_recall"] == {(("layer", "0"),): 0.5, (("layer", "2"),): 0.25}
    one = {k: v[()] for k, v in s.items() if () in v}
    assert one["moeray_queue_depth"] == 2  # max(in flight 4 - running 2, waiting 1)
    assert one["moeray_kv_blocks_used"] == 5 and one["moeray_kv_blocks_free"] == 15 and one["moeray_kv_blocks_total"] == 20
    assert one["moeray_sequences_running"] == 2 and one["moeray_sequences_waiting"] == 1
    assert one["moeray_requests_in_flight"] == 4 and one["moeray_ranks_failed"] == 1
    assert one["moeray_prefix_cache_queries_total"] == 900 and one["moeray_prefix_cache_hits_total"] == 768
    assert one["moeray_prefix_routed_total"] == 3


def test_request_observer_latencies():
    m = Metrics()
    clock = iter([0.1, 0.2, 0.5, 0.7, 0.3, 0.4]).__next__
    obs = m.observer([0.0, 0.05])
    obs.clock = clock
    obs.observe(0, [7], None)          # t=0.1: TTFT 0.1
    obs.observe(0, [8], None)          # t=0.2: ITL 0.1
    obs.observe(0, [9, 10, 11], None)  # t=0.5: three tokens after 0.3 -> 3 ITL samples of 0.1
    obs.observe(0, [], "stop")         # t=0.7: E2E 0.7
    obs.observe(1, [1], None)          # t=0.3: TTFT 0.25
    obs.observe(1, [], "error")        # t=0.4: an error is not a served request: no E2E
    s = samples(generate_latest(m.registry).decode())
    assert s["moeray_time_to_first_token_seconds_count"][()] == 2
    assert s["moeray_time_to_first_token_seconds_sum"][()] == pytest.approx(0.35)
    assert s["moeray_inter_token_latency_seconds_count"][()] == 4
    assert s["moeray_inter_token_latency_seconds_sum"][()] == pytest.approx(0.4)
    assert s["moeray_e2e_request_latency_seconds_count"][()] == 1
    assert s["moeray_e2e_request_latency_seconds_sum"][()] == pytest.approx(0.7)
    assert s["moeray_generated_tokens_total"][(("frontend", "http"),)] == 6


# ------------------------------------------------------------------------------------------- a real cluster
@pytest.fixture(scope="module")
def served(ray_session, tiny_model_dir):
    from fastapi.testclient import TestClient

    from router_service.http.app import create_app
    from tests.router_service.conftest import start_llm

    llm = start_llm(tiny_model_dir("qwen2_moe", num_layers=3), ranks=2)  # layer 1 is dense (mlp_only_layers)
    try:
        with TestClient(create_app(llm.router)) as c:
            yield llm, c
    finally:
        llm.shutdown()


@pytest.mark.ray
def test_metrics_after_requests(served):
    from tests.router_service.conftest import wait_idle

    llm, client = served
    before = samples(client.get("/metrics").text)
    usages = []
    for prompt, n in (("To be, or not to be", 6), ("def add(a, b):", 3)):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    with client.stream("POST", "/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 4,
                                                        "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    usages.append({"prompt_tokens": llm.router.tokenizer.encode("The quick brown fox").ids.__len__(),
                   "completion_tokens": 4})
    wait_idle(llm.router)
    after = samples(client.get("/metrics").text)
    for f in FAMILIES:
        assert f in after, f

    mc = llm.cluster.model_config
    moe = [l for l in range(mc.num_layers) if mc.moe_layers[l]]
    assert moe == [0, 2]
    # every forwarded token (prompt + all generated but the last) is routed to top_k experts in each MoE layer
    forwarded = sum(u["prompt_tokens"] + u["completion_tokens"] - 1 for u in usages)
    tok_a, tok_b = by_layer(after["moeray_expert_tokens_total"]), by_layer(before.get("moeray_expert_tokens_total", {}))
    assert sorted(tok_a) == moe and all(len(tok_a[l]) == mc.num_experts for l in moe)
    delta = sum(v - tok_b.get(l, {}).get(e, 0) for l in tok_a for e, v in tok_a[l].items())
    assert delta == forwarded * mc.top_k * len(moe)
    ranks = by_layer(after["moeray_rank_tokens_total"], "rank")
    for l in moe:
        assert sorted(ranks[l]) == [0, 1] and sum(ranks[l].values()) == sum(tok_a[l].values())
        loads = list(tok_a[l].values())
        assert after["moeray_expert_balancedness"][(("layer", str(l)),)] == pytest.approx(sum(loads) / len(loads) / max(loads))
        rl = list(ranks[l].values())
        assert after["moeray_rank_balancedness"][(("layer", str(l)),)] == pytest.approx(sum(rl) / 2 / max(rl))
        assert 0 < after["moeray_expert_balancedness"][(("layer", str(l)),)] <= 1

    if "moeray_dispatch_rank_rows_total" in after:  # measured at dispatch: one row per (token, expert) pair
        rows = by_layer(after["moeray_dispatch_rank_rows_total"], "rank")
        assert {l: sum(r.values()) for l, r in rows.items()} == {l: sum(tok_a[l].values()) for l in moe}

    one = {k: v[()] for k, v in after.items() if () in v}
    assert one["moeray_kv_blocks_used"] + one["moeray_kv_blocks_free"] == one["moeray_kv_blocks_total"]
    assert one["moeray_kv_blocks_used"] == 0 and one["moeray_kv_blocks_total"] == llm.router.stats()["kv_blocks_total"]
    assert one["moeray_queue_depth"] == 0 and one["moeray_sequences_running"] == 0 and one["moeray_requests_in_flight"] == 0

    def d(name, key=()):
        return after[name][key] - before.get(name, {}).get(key, 0)

    assert d("moeray_time_to_first_token_seconds_count") == 3
    assert d("moeray_e2e_request_latency_seconds_count") == 3
    assert d("moeray_inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usages)
    http = (("frontend", "http"),)
    assert d("moeray_generated_tokens_total", http) == sum(u["completion_tokens"] for u in usages)
    assert d("moeray_prompt_tokens_total", http) == sum(u["prompt_tokens"] for u in usages)
    assert d("moeray_requests_total", (("code", "200"), ("endpoint", "/v1/completions"), ("frontend", "http"))) == 3
    assert d("moeray_e2e_request_latency_seconds_sum") >= d("moeray_time_to_first_token_seconds_sum") > 0

    # thrash rate: once the ranks report it (RankEngine.stats()["routing"]), per MoE layer, in [0, 1]
    if "thrash" in (llm.router.stats()["ranks"][0].get("routing") or {}):
        th = after["moeray_thrash_rate"]
        assert {int(dict(k)["layer"]) for k in th} <= set(moe) and all(0 <= v <= 1 for v in th.values())


def test_aggregate_reads_expert_cache_summary():
    from actors.moe.placement import ExpertPlacement
    from cluster.metrics import aggregate_stats

    nan = float("nan")
    rank = {"rank": 0, "expert_load": [[1, 1], [1, 1]], "kv_blocks_total": 4, "kv_blocks_free": 4, "running": 0,
            "waiting": 0, "routing": {"thrash": [0.1, 0.2]},
            "expert_cache": {"hit_rate": 0.5, "layers": {0: {"hit_rate": 0.25, "recall": nan}, 1: {"hit_rate": 0.75,
                                                                                                 "recall": 0.5}}}}
    r = aggregate_stats([rank], ExpertPlacement.contiguous(2, 2, 1))["routing"]
    assert r["thrash"] == [0.1, 0.2] and r["hit_rate"] == [0.25, 0.75]
    assert math.isnan(r["recall"][0]) and r["recall"][1] == 0.5


@pytest.mark.ray
def test_packed_experts_export_hit_rate_and_recall(ray_session, tiny_moe_dir):
    """A quarter-size expert cache with Markov prefetch: the ranks' cache hit rate and prefetch recall reach
    /metrics (per MoE layer, in [0, 1])."""
    from actors.engine.sampling import SamplingParams
    from moeray.api import LLM

    llm = LLM(model=tiny_moe_dir, ranks=1, kv_cache_bytes=4 * 2**20, max_num_seqs=4,
              engine_options={"weight_bits": 4, "expert_cache_capacity": 2, "prefetch": "markov"})
    try:
        out = llm.generate(["To be, or not to be"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert out.finish_reason == "length"
        m = Metrics(llm.router)
        m.refresh(llm.router.stats())
    finally:
        llm.shutdown()
    s = samples(generate_latest(m.registry).decode())
    for fam in ("moeray_expert_cache_hit_rate", "moeray_prefetch_recall"):
        assert s.get(fam), fam
        assert all(0.0 <= v <= 1.0 for v in s[fam].values())
