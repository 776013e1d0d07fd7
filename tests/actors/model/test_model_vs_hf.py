"""Logits and greedy generations of the world_size == 1 engine against transformers, per architecture."""
from __future__ import annotations

import pytest
import torch

from actors.moe.placement import ExpertPlacement
from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.engine.messages import GenerateRequest
from actors.engine.sampling import SamplingParams
from tests.reference import agree_until_small_margin, hf_greedy
from tests.tiny_models import load_hf

ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"]


def make_engine(path: str, **kw) -> RankEngine:
    from actors.model.config import ModelConfig

    mc = ModelConfig.from_pretrained(path)
    cfg = EngineConfig(model=path, max_model_len=kw.pop("max_model_len", 256), kv_cache_bytes=kw.pop("kv_cache_bytes", 8 << 20), **kw)
    return RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))


def run_to_completion(eng: RankEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, params=params.to_dict()))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    done = set()
    for _ in range(10_000):
        for o in eng.step():
            out[o.request_id] += o.token_ids
            if o.finish_reason:
                assert o.finish_reason in ("stop", "length"), o.error
                done.add(o.request_id)
        if len(done) == len(prompts):
            return out
    raise AssertionError("engine did not finish")


PROMPTS = [[5, 17, 33, 2, 99, 150, 7], [200, 3], list(range(40, 81)), [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_transformers(tiny_model_dir, arch):
    path = tiny_model_dir(arch, num_layers=3)
    hf = load_hf(path)
    eng = make_engine(path)
    for ids in PROMPTS:
        ours = eng.prompt_logits(ids)
        ref = hf(torch.tensor([ids])).logits[0].float()
        assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_transformers(tiny_model_dir, arch):
    """Prompts of different lengths share prefill and decode batches; each equals HF greedy."""
    path = tiny_model_dir(arch, num_layers=3)
    hf = load_hf(path)
    eng = make_engine(path)
    n = 12
    got = run_to_completion(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    compared = 0
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(hf, p, n)
        compared += agree_until_small_margin(got[str(i)], ref, margins)
    assert compared >= len(PROMPTS) * n // 2
    assert eng.cache.allocator.num_free == eng.cache.allocator.num_blocks


def test_fused_expert_layout_and_sharded_index(tiny_model_dir, tmp_path):
    """The fused 3-D expert layout and a sharded index load to the same logits."""
    import json
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file

    per_expert = tiny_model_dir("qwen2_moe", num_layers=2)
    fused = tiny_model_dir("qwen2_moe", num_layers=2, fused_experts=True)
    with safe_open(os.path.join(fused, "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert any(n.endswith("experts.gate_up_proj") for n in names)
        tensors = {n: f.get_tensor(n) for n in names}
    # re-shard the fused checkpoint into two files with an index
    shard = tmp_path / "sharded"
    shard.mkdir()
    half = len(names) // 2
    wm = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(shard / fn))
        wm.update({n: fn for n in part})
    (shard / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    for fn in ("config.json", "tokenizer.json"):
        (shard / fn).write_text(open(os.path.join(fused, fn)).read())
    ids = PROMPTS[0]
    a = make_engine(per_expert).prompt_logits(ids)
    b = make_engine(str(shard)).prompt_logits(ids)
    assert (a - b).abs().max().item() < 1e-5


def test_tied_embeddings_and_dense_layers(tiny_model_dir):
    """mlp_only_layers (dense MLP layers) and tied embeddings follow the config."""
    path = tiny_model_dir("qwen2_moe", num_layers=4, tie_word_embeddings=True)
    from actors.model.config import ModelConfig

    mc = ModelConfig.from_pretrained(path)
    assert mc.tie_word_embeddings and mc.moe_layers == [True, False, True, True]
    hf = load_hf(path)
    ours = make_engine(path).prompt_logits(PROMPTS[2])
    assert (ours - hf(torch.tensor([PROMPTS[2]])).logits[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_bf16_checkpoint_keeps_bf16_weights_and_matches_transformers(tiny_model_dir, arch):
    """A bf16 checkpoint served in fp32: with weight_storage=auto the matrices stay bf16 (exactly the
    checkpoint's values, `kernels.cpu`), and logits and greedy tokens equal both the all-fp32 engine
    and transformers computing in fp32 over the same values."""
    from kernels.cpu import cpu_kernels_available

    path = tiny_model_dir(arch, num_layers=3, save_dtype=torch.bfloat16)
    hf = load_hf(path)
    eng = make_engine(path)
    full = make_engine(path, weight_storage="compute")
    kept = cpu_kernels_available()
    assert eng.keep_bf16 == kept and not full.keep_bf16
    w = eng.model.w
    assert w["layers.0.qkv_w"].dtype == eng.model.experts[0].w_gate_up.dtype == w["lm_head"].dtype == (
        torch.bfloat16 if kept else torch.float32)
    assert w["norm"].dtype == w["layers.0.gate_w"].dtype == torch.float32  # norms, router: compute dtype
    assert full.model.w["layers.0.qkv_w"].dtype == torch.float32
    for ids in PROMPTS:
        ours, ref = eng.prompt_logits(ids), hf(torch.tensor([ids])).logits[0].float()
        assert (ours - full.prompt_logits(ids)).abs().max().item() < 1e-4
        assert (ours - ref).abs().max().item() < 1e-4
    n = 10
    got = run_to_completion(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert got == run_to_completion(full, PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    compared = 0
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(hf, p, n)
        compared += agree_until_small_margin(got[str(i)], ref, margins)
    assert compared >= len(PROMPTS) * n // 2


def test_weight_storage_is_validated():
    with pytest.raises(ValueError, match="weight_storage"):
        EngineConfig(model="m", weight_storage="int8")
