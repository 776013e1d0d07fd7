"""Cold expert tier: packed experts read on demand from the memory-mapped packed checkpoint into a bounded
resident set (world_size 1 and one EP rank, in-process, fp32, tiny Qwen2-MoE packed at 4 bits).

Shape legend: R = rows, D = hidden, E = experts of a layer (8 here), P = resident packed experts per layer.
"""
from __future__ import annotations

import threading

import pytest
import torch

from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.experts.cold_tier import ColdExpertTier
from actors.experts.packed import PackedLayerExperts
from actors.experts.worker import PrefetchWorker
from actors.engine.messages import GenerateRequest
from actors.experts.checkpoint import PackedExpertReader, load_packed_experts, write_packed_checkpoint
from actors.engine.sampling import SamplingParams
from actors.moe.stats import RoutingStats

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [99, 3, 250]]


@pytest.fixture(scope="module")
def packed_dir(tiny_model_dir, tmp_path_factory):
    # 3 layers, layer 1 dense: the tier and the prefetch must skip it.
    src = tiny_model_dir("qwen2_moe", num_layers=3)
    dst = str(tmp_path_factory.mktemp("cold") / "q4")
    write_packed_checkpoint(src, dst, bits=4, group_size=64)
    return dst


def make_engine(path: str, world: int = 1, rank: int = 0, **kw) -> RankEngine:
    mc = ModelConfig.from_pretrained(path)
    cfg = EngineConfig(model=path, max_model_len=128, kv_cache_bytes=4 << 20, **kw)
    return RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, world), rank=rank)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def greedy(eng: RankEngine, check=None, max_tokens: int = 10) -> dict[str, list[int]]:
    """Greedy tokens of PROMPTS, calling `check()` after every engine step."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, params=params.to_dict()))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    done: set[str] = set()
    for _ in range(1000):
        for o in eng.step():
            out[o.request_id] += o.token_ids
            if o.finish_reason:
                done.add(o.request_id)
        if check is not None:
            check()
        if len(done) == len(PROMPTS):
            return out
    raise AssertionError("engine did not finish")


def test_cold_tier_matches_all_resident_store(packed_dir):
    ref = make_engine(packed_dir)  # every packed expert resident, every expert dequantized (hit path)
    ref_packed = make_engine(packed_dir, expert_cache_capacity=0)  # every packed expert resident, all misses
    cold = make_engine(packed_dir, resident_experts=3, prefetch="markov")  # P = 3 < E = 8, cache empty
    rt = cold.expert_runtime
    full_bytes = ref.expert_runtime.tier_stats()["packed"]["resident_bytes"]
    for l, store in enumerate(rt.layers):
        if store is None:
            assert l == 1
            continue
        assert store.packed is None and store.tier.capacity == 3 and store.cache.capacity == 0
        # the slot stack is all this layer holds packed: 3 of 8 experts' bytes
        assert store.tier.pool.nbytes == store.tier.budget_bytes == 3 * store.tier.expert_bytes
    budget = rt.tier_stats()["packed"]["budget_bytes"]
    assert budget == pytest.approx(full_bytes * 3 / 8)

    ids = PROMPTS[1]
    a, b, c = ref.prompt_logits(ids), ref_packed.prompt_logits(ids), cold.prompt_logits(ids)
    assert _rel(c, a) < 1e-5 and _rel(c, b) < 1e-5

    def within_budget():
        t = rt.tier_stats()
        assert t["packed"]["resident_bytes"] <= t["packed"]["budget_bytes"] == budget
        assert t["packed"]["allocated_bytes"] == budget
        for lt in t["layers"].values():
            assert lt["resident_experts"] <= lt["capacity"] == 3

    assert greedy(cold, within_budget) == greedy(ref)
    rt.wait_idle()
    s = cold.expert_runtime.summary()
    t = s["tiers"]
    assert t["cold"]["enabled"] and not ref.expert_runtime.summary()["tiers"]["cold"]["enabled"]
    assert t["cold"]["misses"] > 0 and t["packed"]["hits"] > 0 and t["cold"]["evictions"] > 0
    assert t["cold"]["prefetch_reads"] > 0  # the predictor warmed slots ahead of their layer
    assert t["cold"]["bytes_read"] > 0 and t["cache"]["resident_bytes"] == 0
    assert set(t["layers"]) == {0, 2}
    rt.detach()


def test_cold_tier_with_dequantized_cache_and_ep_rank(packed_dir):
    ref = make_engine(packed_dir)
    both = make_engine(packed_dir, resident_experts=2, expert_cache_capacity=2, prefetch="hybrid")
    assert greedy(both) == greedy(ref)
    both.expert_runtime.wait_idle()
    t = both.expert_runtime.tier_stats()
    assert 0 < t["cache"]["experts"] <= t["cache"]["capacity"] == 4  # 2 per MoE layer
    assert t["cache"]["resident_bytes"] > 0 and t["packed"]["resident_bytes"] <= t["packed"]["budget_bytes"]
    both.expert_runtime.detach()
    # rank 1 of 2 holds experts 4..7; its share of P = 3 is ceil(3 * 4 / 8) = 2 slots
    r1 = make_engine(packed_dir, world=2, rank=1, resident_experts=3)
    assert r1.expert_runtime.layers[0].tier.capacity == 2 and r1.expert_runtime.layers[0].tier.local == [4, 5, 6, 7]
    # P >= E is the all-resident store: no tier
    assert make_engine(packed_dir, resident_experts=8).expert_runtime.layers[0].tier is None


def _layers(packed_dir, capacity: int):
    mc = ModelConfig.from_pretrained(packed_dir)
    reader = PackedExpertReader(packed_dir, mc)
    ids = list(range(mc.num_experts))
    kw = dict(capacity=0, policy="lru", dtype=torch.float32, backend="torch", worker=PrefetchWorker(sync=True),
              demand_fill=False)
    full = PackedLayerExperts(0, load_packed_experts(packed_dir, mc, 0, ids), stats=RoutingStats(), **kw)
    tier = ColdExpertTier(0, ids, reader, capacity=capacity, policy="lru")
    return mc, full, PackedLayerExperts(0, None, tier=tier, stats=RoutingStats(), **kw)


def test_rounds_and_transient_reads_agree(packed_dir):
    mc, full, cold = _layers(packed_dir, capacity=2)
    g = torch.Generator().manual_seed(0)
    R = 40
    x = torch.randn(R, mc.hidden_size, generator=g)
    ids = torch.arange(R) % mc.num_experts  # every expert used: 4 rounds of 2 slots
    y_ref = full(x, ids)
    assert _rel(cold(x, ids), y_ref) < 1e-5
    st = cold.tier.stats()
    assert st["misses"] == mc.num_experts and st["resident_experts"] == 2 and st["resident_bytes"] <= st["budget_bytes"]
    assert st["bytes_read"] == mc.num_experts * st["expert_bytes"]
    # Both slots pinned elsewhere (as by the prefetch worker mid-read): the layer reads unslotted, once each.
    held = cold.tier.acquire(cold.tier.resident, demand=False)
    assert len(held) == 2
    sub = ids[ids < 5]
    other = [e for e in range(5) if e not in held]
    assert _rel(cold(x[: len(sub)], sub), full(x[: len(sub)], sub)) < 1e-5
    st2 = cold.tier.stats()
    assert st2["transient_reads"] == len(other) and st2["hits"] == st["hits"] + len([e for e in held if e < 5])
    cold.tier.release(held)
    assert sorted(cold.tier.resident) == sorted(held)  # transient reads took no slot


def test_tier_eviction_and_prefetch(packed_dir):
    _, _, cold = _layers(packed_dir, capacity=2)
    tier = cold.tier
    tier.prefetch([3, 5])
    assert tier.resident == [3, 5] and tier.stats()["prefetch_reads"] == 2
    tier.release(tier.acquire([5], demand=True))  # 5 used now: LRU evicts 3 next
    tier.release(tier.acquire([6], demand=True))
    assert tier.resident == [5, 6] and tier.stats()["evictions"] == 1
    held = tier.acquire([5, 6], demand=True)  # both pinned: nothing can be evicted
    assert tier.acquire([1], demand=True) == {} and tier.resident == [5, 6]
    tier.release(held)
    gu, dn = tier.dequantized(1, cold._deq, torch.float32)  # not resident: read once, no slot taken
    assert gu.shape == (2 * tier.intermediate_size, tier.pool.hidden_size) and tier.resident == [5, 6]
    with pytest.raises(ValueError, match="capacity=0"):
        ColdExpertTier(0, [0, 1], tier.reader, capacity=0, policy="lru")


def test_config_errors(packed_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="resident_experts=0"):
        EngineConfig(model=packed_dir, resident_experts=0)
    with pytest.raises(ValueError, match="needs a packed checkpoint"):
        make_engine(tiny_model_dir("qwen2_moe", num_layers=3), weight_bits=4, resident_experts=2)


def test_forward_waits_for_an_inflight_prefetch_read_and_survives_a_failed_read(packed_dir):
    _, _, cold = _layers(packed_dir, capacity=2)
    tier, reader = cold.tier, cold.tier.reader
    orig = reader.read_into
    started, gate = threading.Event(), threading.Event()

    def slow(*a):
        started.set()
        gate.wait(10)
        return orig(*a)

    reader.read_into = slow
    worker = threading.Thread(target=tier.prefetch, args=([3],))
    worker.start()
    assert started.wait(10)
    reader.read_into = orig
    threading.Timer(0.1, gate.set).start()
    got = tier.acquire([3], demand=True)  # the prefetcher is reading 3: wait for it, do not read it again
    worker.join(10)
    st = tier.stats()
    assert 3 in got and st["waits"] == 1 and st["misses"] == 0 and st["prefetch_reads"] == 1
    tier.release(got)

    def broken(*a):
        raise OSError("disk gone")

    reader.read_into = broken
    with pytest.raises(OSError, match="disk gone"):
        tier.acquire([4, 5], demand=True)
    reader.read_into = orig
    # 3 was evicted to make room before the reads failed; both slots are free again, nothing pinned
    assert tier.resident == [] and tier._owner == [-1, -1] and tier._pins == [0, 0] and not tier._loading
    assert 4 in tier.acquire([4], demand=True)  # the slot a failed read held is usable again


def test_triton_backend_on_the_slot_stack(packed_dir):
    ref = make_engine(packed_dir, expert_cache_capacity=0)
    tri = make_engine(packed_dir, resident_experts=3, kernel_backend="triton", prefetch="frequent")
    assert _rel(tri.prompt_logits(PROMPTS[0]), ref.prompt_logits(PROMPTS[0])) < 1e-5
    tri.expert_runtime.detach()
