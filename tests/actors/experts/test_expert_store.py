"""Packed experts + expert cache + prefetch in the engine (world_size 1, in-process, fp32, tiny models).

Shape legend: R = rows, D = hidden, I = expert intermediate, E = experts.
"""
from __future__ import annotations

import os

import pytest
import torch

from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.experts.build import quantize_local_experts
from actors.experts.cache import ExpertCache
from router_service.routing.calibration import calibrate
from actors.experts.packed import PackedLayerExperts
from actors.experts.worker import PrefetchWorker
from actors.engine.messages import GenerateRequest
from actors.experts.checkpoint import load_packed_experts, read_quant_config, write_packed_checkpoint
from actors.engine.sampling import SamplingParams
from kernels import tuning
from kernels.packed_weights import dequantize
from actors.prefetch.transitions import TRANSITIONS_FILE
from actors.moe.stats import RoutingStats

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [99, 3, 250]]


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_dir):
    # 3 layers: layer 1 is dense (mlp_only_layers), so prefetch must skip over it.
    return tiny_model_dir("qwen2_moe", num_layers=3)


def make_engine(path: str, world: int = 1, rank: int = 0, **kw) -> RankEngine:
    mc = ModelConfig.from_pretrained(path)
    cfg = EngineConfig(model=path, max_model_len=128, kv_cache_bytes=4 << 20, **kw)
    return RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, world), rank=rank)


def greedy(eng: RankEngine, prompts=PROMPTS, max_tokens: int = 12) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, params=params.to_dict()))
    out = {str(i): [] for i in range(len(prompts))}
    done = set()
    for _ in range(1000):
        for o in eng.step():
            out[o.request_id] += o.token_ids
            if o.finish_reason:
                done.add(o.request_id)
        if len(done) == len(prompts):
            return out
    raise AssertionError("engine did not finish")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _layer(capacity: int, packed, backend="torch") -> PackedLayerExperts:
    return PackedLayerExperts(0, packed, capacity=capacity, policy="lru", dtype=torch.float32, backend=backend,
                              worker=PrefetchWorker(sync=True), stats=RoutingStats(), demand_fill=False)


def test_hit_and_miss_paths_agree_fp32():
    g = torch.Generator().manual_seed(0)
    E, D, I, R = 6, 64, 96, 40
    gu, dn = torch.randn(E, 2 * I, D, generator=g) * 0.1, torch.randn(E, D, I, generator=g) * 0.1
    packed = quantize_local_experts(gu, dn, bits=3, group_size=32)
    x = torch.randn(R, D, generator=g)
    ids = torch.randint(0, E, (R,), generator=g)
    ids[ids == 4] = 3  # one expert unused
    all_hit, all_miss, some_hit = _layer(E, packed), _layer(0, packed), _layer(2, packed)
    all_hit.warm(list(range(E)))
    some_hit.warm([3, 5])
    y_hit, y_miss, y_mix = all_hit(x, ids), all_miss(x, ids), some_hit(x, ids)
    assert _rel(y_hit, y_miss) < 1e-5 and _rel(y_mix, y_miss) < 1e-5
    assert all_hit.stats.summary()[0]["hit_rate"] == 1.0 and all_miss.stats.summary()[0]["hit_rate"] == 0.0
    # and the function is the dequantized SwiGLU expert
    e = int(ids[0])
    w_gu, w_dn = dequantize(packed.gate_up[e]), dequantize(packed.down[e])
    g_, u_ = (x[:1] @ w_gu.T).chunk(2, dim=1)
    assert _rel(y_miss[:1], (torch.nn.functional.silu(g_) * u_) @ w_dn.T) < 1e-5
    assert all_hit(x[:0], ids[:0]).shape == (0, D)


def test_one_token_path_equals_general_path():
    """`run_token` (decode at batch 1) equals the general call on all hits, a partial miss and repeated ids,
    and counts one lookup per expert either way."""
    g = torch.Generator().manual_seed(3)
    E, D, I = 5, 32, 48
    packed = quantize_local_experts(torch.randn(E, 2 * I, D, generator=g) * 0.1, torch.randn(E, D, I, generator=g) * 0.1,
                                    bits=4, group_size=32)
    x = torch.randn(1, D, generator=g)
    for ids, warm in (([2, 4], [2, 4]), ([1, 3], [3]), ([0, 0], [0])):
        a, b = _layer(2, packed), _layer(2, packed)
        a.warm(warm)
        b.warm(warm)
        t = torch.tensor(ids)
        y_tok, y_gen = a.run_token(x, t), b(x.expand(len(ids), D).contiguous(), t)
        assert y_tok.shape == (len(ids), D) and _rel(y_tok, y_gen) < 1e-6
        sa, sb = a.stats.summary()[0], b.stats.summary()[0]
        assert sa["hit_rate"] == sb["hit_rate"]


@pytest.mark.parametrize("policy", ["lru", "lfu", "predicted"])
def test_eviction_policies(policy):
    loads = []
    c = ExpertCache(2, 5, policy, lambda e: loads.append(e) or (e,))
    assert c.fill(0) and c.fill(1)
    c.lookup([0]), c.lookup([0]), c.lookup([1])  # 0 used twice (LFU keeps it), 1 most recently (LRU keeps it)
    c.set_scores([0.1, 0.9, 0.0, 0.0, 0.0])  # predicted keeps 1
    assert c.fill(2)
    kept = {"lru": [1, 2], "lfu": [0, 2], "predicted": [1, 2]}[policy]
    assert c.resident == kept
    assert not c.fill(2)  # already resident: no load
    assert c.fill(3, protect={kept[0], 2}) is False  # everything protected: no room
    assert loads == [0, 1, 2]
    with pytest.raises(ValueError, match="policy='mru'"):
        ExpertCache(1, 2, "mru", lambda e: e)


def test_full_and_quarter_cache_give_the_same_tokens(qwen_dir):
    full = make_engine(qwen_dir, weight_bits=4, expert_cache_capacity=8)  # C = E: every expert dequantized
    quarter = make_engine(qwen_dir, weight_bits=4, expert_cache_capacity=2, prefetch="markov")  # C = E / 4
    assert full.expert_runtime.summary()["predictor"] == "none"
    rt = quarter.expert_runtime
    assert all(s is None or s.cache.capacity == 2 for s in rt.layers) and rt.layers[1] is None
    ids = PROMPTS[1]
    a, b = full.prompt_logits(ids), quarter.prompt_logits(ids)
    assert _rel(b, a) < 1e-5
    assert greedy(full) == greedy(quarter)
    rt.wait_idle()
    s = rt.summary()
    assert s["policy"] == "predicted" and s["predictor"] == "markov"
    assert 0 < s["hit_rate"] < 1 and 0 <= s["recall"] <= 1 and 0 <= s["thrashing"] <= 1
    assert set(s["layers"]) == {0, 2} and s["layers"][2]["prefetched"] > 0
    assert full.expert_runtime.summary()["hit_rate"] == 1.0
    rt.detach()


def test_cpu_default_cache_is_empty_where_the_fused_kernel_runs(qwen_dir):
    # Unset expert_cache_capacity: 0 on CPU when the compiled fused kernel serves misses (every expert runs from
    # its packed bytes), all experts otherwise; both give the tokens of C = E.
    from kernels.cpu import cpu_kernels_available

    default = make_engine(qwen_dir, weight_bits=4)
    full = make_engine(qwen_dir, weight_bits=4, expert_cache_capacity=8)
    caps = {s.cache.capacity for s in default.expert_runtime.layers if s is not None}
    assert caps == ({0} if cpu_kernels_available() else {8})
    assert default.expert_runtime.summary()["predictor"] == "none"
    assert _rel(default.prompt_logits(PROMPTS[0]), full.prompt_logits(PROMPTS[0])) < 1e-5
    assert greedy(default) == greedy(full)


def test_quantized_tokens_close_to_full_precision(qwen_dir):
    # 4-bit experts change logits a little, not the model: most greedy tokens agree on this tiny model.
    a, b = greedy(make_engine(qwen_dir)), greedy(make_engine(qwen_dir, weight_bits=4, expert_cache_capacity=4))
    same = sum(x == y for k in a for x, y in zip(a[k], b[k]))
    assert same >= 0.5 * sum(map(len, a.values()))


def test_packed_checkpoint_round_trip_reads_only_rank_experts(qwen_dir, tmp_path):
    dst = str(tmp_path / "packed")
    qc = write_packed_checkpoint(qwen_dir, dst, bits=4, group_size=64)
    assert read_quant_config(dst)["bits"] == 4 and 4 < qc["effective_bits"] < 5
    mc = ModelConfig.from_pretrained(dst)
    rank1 = load_packed_experts(dst, mc, 0, [4, 5, 6, 7])
    assert rank1.num_experts == 4
    eng = make_engine(qwen_dir)
    ref = quantize_local_experts(eng.model.w["layers.0.w_gate_up"][4:], eng.model.w["layers.0.w_down"][4:],
                                 bits=4, group_size=64)
    assert torch.equal(rank1.gate_up.codes, ref.gate_up.codes) and torch.equal(rank1.down.scales, ref.down.scales)
    # Rank 1 of 2 holds experts 4..7 only, read from the packed folder; a full-precision dense part.
    r1 = make_engine(dst, world=2, rank=1)
    assert r1.expert_runtime.layers[0].num_local == 4 and r1.model.w["layers.0.w_gate_up"].shape[0] == 0
    # Serving the packed folder == quantizing at load time with the same settings.
    loaded = make_engine(dst, expert_cache_capacity=2)
    at_load = make_engine(qwen_dir, weight_bits=4, expert_cache_capacity=2)
    assert _rel(loaded.prompt_logits(PROMPTS[0]), at_load.prompt_logits(PROMPTS[0])) < 1e-5  # hit/miss timing differs
    with pytest.raises(ValueError, match="weight_bits=3 but model="):
        make_engine(dst, weight_bits=3)


def test_triton_backend_matches_torch(qwen_dir):
    tri = make_engine(qwen_dir, weight_bits=3, expert_cache_capacity=2, prefetch="frequent", kernel_backend="triton")
    ref = make_engine(qwen_dir, weight_bits=3, expert_cache_capacity=2, prefetch="frequent")
    ids = PROMPTS[0]
    assert _rel(tri.prompt_logits(ids), ref.prompt_logits(ids)) < 1e-4
    assert greedy(tri, PROMPTS[:1], 4) == greedy(ref, PROMPTS[:1], 4)


def test_calibration_seeds_the_predictor(qwen_dir, tmp_path):
    dst = str(tmp_path / "packed")
    write_packed_checkpoint(qwen_dir, dst, bits=4, group_size=64)
    eng = make_engine(dst)
    counts = calibrate(eng, [list(range(3, 60)), list(range(100, 140))], os.path.join(dst, TRANSITIONS_FILE))
    assert counts.tokens == 57 + 40 and counts.inter[2].sum() == 97 * 4  # K * K pairs per token, 0 -> 2
    seeded = make_engine(dst, expert_cache_capacity=2, prefetch="markov")
    assert torch.equal(seeded.expert_runtime.predictor.counts.freq, counts.freq)
    # the fitted lookahead gates: one [E, D] per MoE layer after the first, used by the served hybrid predictor
    mc = eng.model.cfg
    moe = [l for l in range(mc.num_layers) if mc.moe_layers[l]]
    assert sorted(counts.lookahead_gates) == moe[1:]
    assert all(g.shape == (mc.num_experts, mc.hidden_size) for g in counts.lookahead_gates.values())
    hybrid = make_engine(dst, expert_cache_capacity=2, prefetch="hybrid").expert_runtime.predictor
    for l, g in counts.lookahead_gates.items():
        assert torch.equal(hybrid.lookahead.gate[l], g)


def test_config_errors(qwen_dir):
    with pytest.raises(ValueError, match=r"^expert_cache_capacity=2 apply to packed experts"):  # not prefetch='auto'
        make_engine(qwen_dir, expert_cache_capacity=2)
    with pytest.raises(ValueError, match="prefetch='oracle'"):
        make_engine(qwen_dir, weight_bits=4, prefetch="oracle")
    with pytest.raises(ValueError, match="capacity=-1"):
        make_engine(qwen_dir, weight_bits=4, expert_cache_capacity=-1)


def _packed_layer(seed: int, E: int, D: int, I: int, bits: int, **kw):
    """(generator, random experts packed at `bits`, a capacity-2 LRU PackedLayerExperts over them on the torch
    backend with a synchronous worker); the generator continues the same random stream."""
    g = torch.Generator().manual_seed(seed)
    packed = quantize_local_experts(torch.randn(E, 2 * I, D, generator=g) * 0.1,
                                    torch.randn(E, D, I, generator=g) * 0.1, bits=bits, group_size=32)
    layer = PackedLayerExperts(0, packed, capacity=2, policy="lru", dtype=torch.float32, backend="torch",
                               worker=PrefetchWorker(sync=True), stats=RoutingStats(), **kw)
    return g, packed, layer


def test_reference_miss_path_fills_the_cache_inline():
    # The torch miss path dequantizes the whole expert anyway: it hands the pair to the cache (no worker fill).
    R = 12
    g, packed, cached = _packed_layer(1, 6, 64, 96, 4, demand_fill=True)
    x = torch.randn(R, 64, generator=g)
    ids = torch.tensor([1, 4] * (R // 2))
    assert cached.inline_fill
    ref = _layer(0, packed)
    assert _rel(cached(x, ids), ref(x, ids)) < 1e-5
    assert cached.cache.resident == [1, 4] and cached.stats.summary()[0]["cache_fills"] == 2
    assert _rel(cached(x, ids), ref(x, ids)) < 1e-5  # now both hits
    assert cached.stats.summary()[0]["hit_rate"] == 0.5
    c = ExpertCache(1, 3, "lru", lambda e: (e,))
    assert c.put(0, ("w0",)) and not c.put(0, ("again",)) and c.put(2, ("w2",)) and c.resident == [2]
    assert not c.put(1, ("w1",), protect={2})


def test_fill_falls_back_when_the_compiled_dequantize_is_gone():
    # A worker fill whose compiled dequantize answers None (the kernels became unavailable, as when a test turns
    # them off while another engine's worker runs) must dequantize on the reference path, never cache None.
    from types import SimpleNamespace

    from kernels.packed_weights import dequantize

    _, packed, layer = _packed_layer(2, 4, 64, 96, 4)
    layer._cffn = SimpleNamespace(dequantize=lambda e: None)
    assert layer.cache.fill(3)
    gu, dn = layer.cache.lookup([3])[3]
    assert torch.equal(gu, dequantize(packed.gate_up[3], torch.float32))
    assert torch.equal(dn, dequantize(packed.down[3], torch.float32))
    assert layer.cache.resident_bytes == (gu.numel() + dn.numel()) * 4


def test_auto_prefetch_rule():
    from actors.experts.build import auto_prefetch
    from actors.prefetch.predictors import DEFAULT_PREDICTOR

    assert auto_prefetch("cpu", full=True) == "none" and auto_prefetch("cuda", full=True) == "none"
    assert auto_prefetch("cpu", full=False) == "none"  # no spare core to hide a fill: LRU + inline fills
    assert auto_prefetch("cuda", full=False) == DEFAULT_PREDICTOR
    assert auto_prefetch("cpu", full=False, cold=True) == DEFAULT_PREDICTOR  # hide cold reads


@pytest.mark.parametrize("predictor", ["markov", "hybrid"])
def test_list_bookkeeping_matches_tensor_bookkeeping(qwen_dir, monkeypatch, predictor):
    """Decode steps keep the prediction bookkeeping on Python lists (`SMALL_STEP_CELLS`); forcing the tensor
    path must give the same tokens and the same recall, precision and thrashing (fills run inline)."""
    import actors.experts.build as es

    def run(cells):
        monkeypatch.setattr(tuning, "SMALL_STEP_CELLS", cells)
        eng = make_engine(qwen_dir, weight_bits=4)
        m = eng.model
        rt = es.build_runtime(model_cfg=m.cfg, weights=m.w, dtype=m.dtype, device=m.device,
                              local=eng.expert_runtime.local,
                              packed=[None if s is None else s.packed for s in eng.expert_runtime.layers],
                              model_path=None, capacity=2, prefetch=predictor, async_prefetch=False)
        eng.expert_runtime.detach()
        rt.attach(m)
        m.experts = rt.layers
        toks = greedy(eng, PROMPTS[:2], max_tokens=8)
        return toks, rt.summary()

    (t_list, s_list), (t_tensor, s_tensor) = run(10**9), run(0)
    assert t_list == t_tensor
    for k in ("recall", "precision", "thrashing", "hit_rate"):
        assert s_list[k] == pytest.approx(s_tensor[k], abs=1e-6), k  # thrashing: fp32 sums on the tensor path
    assert s_list["recall"] > 0


def test_one_token_miss_fills_the_cache():
    # run_token's own miss path (torch backend: the compiled fused kernel on CPU, else dequantize inline): the
    # missed experts reach the cache (the worker is synchronous here), results equal the general call's, and the
    # hits that follow agree with the misses to fp32 rounding.
    D = 32
    g, packed, lay = _packed_layer(5, 4, D, 40, 3, demand_fill=True)
    x, ids = torch.randn(1, D, generator=g), torch.tensor([3, 1])
    y = lay.run_token(x, ids)
    assert _rel(y, _layer(0, packed)(x.expand(2, D).contiguous(), ids)) < 1e-6
    assert lay.cache.resident == [1, 3] and lay.stats.summary()[0]["cache_fills"] == 2
    assert _rel(lay.run_token(x, ids), y) < 1e-5 and lay.stats.summary()[0]["hit_rate"] == 0.5


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dequantize_vectorised_matches_the_formula(bits):
    # The per-matrix vectorised unpack (2/4 bits by word shifts, 3 bits by 96-bit runs with two straddling codes)
    # and the broadcast group scale/zero equal (q - z) * s element by element, with a tail group; `out=` too.
    from kernels.packed_quantize import quantize
    from kernels.packed_weights import unpack_codes

    g = torch.Generator().manual_seed(bits)
    w = torch.randn(2, 5, 100, generator=g)
    pw = quantize(w, bits=bits, group_size=32)
    q = unpack_codes(pw.codes, bits, 100).float()
    gi = torch.arange(100) // 32
    ref = (q - pw.zeros.float()[..., gi]) * pw.scales.float()[..., gi]
    assert torch.equal(dequantize(pw), ref) and dequantize(pw).is_contiguous()
    out = torch.empty(2, 5, 100)
    assert dequantize(pw, out=out) is out and torch.equal(out, ref)
    assert torch.equal(dequantize(pw[1], torch.bfloat16), ref[1].to(torch.bfloat16))
    with pytest.raises(ValueError, match="out has shape"):
        dequantize(pw, out=torch.empty(5, 100))


@pytest.mark.parametrize("predictor", ["markov", "hybrid"])
def test_compiled_prefetch_step_equals_the_python_bookkeeping(qwen_dir, predictor, monkeypatch):
    """The decode-step bookkeeping in one compiled call per layer (`kernels.cpu.prefetch_step`) against
    the Python-list path (kernels off): same greedy tokens, same prediction recall / precision / thrash, and the
    same learned Markov counts, on batches of 3 sequences decoding together."""
    from kernels.cpu import _build

    if not _build.cpu_kernels_available():
        pytest.skip("no compiled CPU kernels here")
    kw = dict(weight_bits=4, expert_cache_capacity=2, prefetch=predictor)
    fast = make_engine(qwen_dir, **kw)
    a = greedy(fast)
    with monkeypatch.context() as m:
        m.setattr(_build, "_lib", None)
        m.setattr(_build, "_tried", True)
        slow = make_engine(qwen_dir, **kw)
        b = greedy(slow)
        sb = slow.expert_runtime.summary()
        cb = slow.expert_runtime.predictor
        cb = getattr(cb, "markov", cb).counts
    assert a == b
    sa = fast.expert_runtime.summary()
    ca = fast.expert_runtime.predictor
    ca = getattr(ca, "markov", ca).counts
    assert 0 < sa["recall"] <= 1 and 0 < sa["thrashing"] <= 1 and ca.tokens > 0
    for k in ("recall", "precision", "thrashing"):
        assert sa[k] == pytest.approx(sb[k], rel=1e-9), k
    for f in ("freq", "inter", "intra"):
        assert torch.equal(getattr(ca, f), getattr(cb, f)), f
    assert ca.tokens == cb.tokens


def test_prefetch_worker_thread_ends_when_the_worker_is_dropped():
    """An engine dropped without close() must not leave its fill thread behind (a test session built ~25 of them)."""
    import gc

    w = PrefetchWorker()
    done = []
    w.submit(lambda: done.append(1))
    w.wait_idle()
    t = w._thread
    assert done == [1] and t.is_alive()
    del w
    gc.collect()
    t.join(timeout=5)
    assert not t.is_alive()


def _sticky_predictions(path: str, deployment: str, request: str | None, path_kind: str, monkeypatch) -> tuple:
    """Decode one sequence; per decode step and MoE layer after the first: (prediction made for the layer, the
    previous step's routing at that layer). Returns (pairs, runtime)."""
    from kernels.cpu import _build

    if path_kind == "lists":
        monkeypatch.setattr(_build, "_lib", None)
        monkeypatch.setattr(_build, "_tried", True)
    elif path_kind == "tensor":
        monkeypatch.setattr(tuning, "SMALL_STEP_CELLS", 0)
    eng = make_engine(path, weight_bits=4, expert_cache_capacity=2, prefetch="hybrid", gating=deployment)
    rt = eng.expert_runtime
    routed: dict[int, list[int]] = {}
    pairs = []
    inner = rt.on_route

    def on_route(l, ids):
        pred = rt._pred.get(l)
        if ids.shape[0] == 1 and pred is not None and l in routed:  # a decode step with a prediction for l
            row = pred[0] if isinstance(pred, list) else pred[0].tolist()
            pairs.append((list(row), routed[l]))
        routed[l] = ids[-1].tolist()  # after the prefill: its last token, the first decode token's predecessor
        inner(l, ids)

    rt.on_route = on_route
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, gating=request)
    eng.add_request(GenerateRequest(request_id="s", prompt_ids=PROMPTS[0], params=params.to_dict()))
    for _ in range(100):
        if any(o.finish_reason for o in eng.step()):
            return pairs, rt
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("path_kind", ["compiled", "lists", "tensor"])
@pytest.mark.parametrize("deployment,request_policy", [("sticky", None), ("exact", "sticky")])
def test_sticky_tokens_are_predicted_with_their_previous_experts_first(qwen_dir, monkeypatch, path_kind,
                                                                       deployment, request_policy):
    """Under `sticky` (the deployment's policy or the request's), each decode token's prediction for a layer holds
    its predecessor's experts at that layer and fills the budget (k + 1) from the predictor; under `exact` it is
    the predictor's own ranking, which here leaves some of them out."""
    from kernels.cpu import _build

    if path_kind == "compiled" and not _build.cpu_kernels_available():
        pytest.skip("no compiled CPU kernels here")
    pairs, rt = _sticky_predictions(qwen_dir, deployment, request_policy, path_kind, monkeypatch)
    assert len(pairs) >= 8
    for pred, prev in pairs:
        assert len(pred) == len(set(pred)) == rt.budget
        assert set(prev) <= set(pred), (pred, prev)
    exact, _ = _sticky_predictions(qwen_dir, "exact", None, path_kind, monkeypatch)
    assert any(not set(prev) <= set(pred) for pred, prev in exact)
