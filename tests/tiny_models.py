"""Build tiny random MoE checkpoints with `transformers` (no download) for correctness tests.

Every parameter is perturbed (biases and norm weights non-trivial) and router weights are scaled
so top-k margins are well above 1e-3 for typical tokens.
"""
from __future__ import annotations

import os

import torch


def _tokenizer_json(path: str, vocab: int) -> None:
    """A byte-level BPE tokenizer over a tiny corpus, vocab <= `vocab` (ids fit the model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["To be, or not to be, that is the question.", "def add(a, b):\n    return a + b\n",
              "The quick brown fox jumps over the lazy dog. " * 3, "for i in range(10):\n    print(i)\n"]
    tok.train_from_iterator(corpus, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))


def hf_config(arch: str, num_experts: int = 8, num_layers: int = 2, **kw):
    import transformers as tf

    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    common.update(kw)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=96, num_experts=num_experts, num_experts_per_tok=2,
                                 moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                 decoder_sparse_step=1, mlp_only_layers=[1] if num_layers > 2 else [],
                                 norm_topk_prob=False)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=24, intermediate_size=96, num_experts=num_experts,
                                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                 decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=num_experts, num_experts_per_tok=2,
                                sliding_window=None)
    if arch == "olmoe":
        return tf.OlmoeConfig(**common, intermediate_size=32, num_experts=num_experts, num_experts_per_tok=2,
                              clip_qkv=3.0, norm_topk_prob=False)
    raise ValueError(arch)


def build_tiny_model(arch: str, out_dir: str, seed: int = 0, fused_experts: bool = False,
                     save_dtype: torch.dtype | None = None, **kw) -> str:
    """Save a perturbed tiny `arch` model plus tokenizer to `out_dir` (in `save_dtype`, default fp32);
    returns `out_dir`."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hf_config(arch, **kw)
    cls = {"qwen2_moe": tf.Qwen2MoeForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
           "mixtral": tf.MixtralForCausalLM, "olmoe": tf.OlmoeForCausalLM}[arch]
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight") and p.shape[0] == cfg.num_experts if hasattr(cfg, "num_experts") else False:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.08)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight") or name.endswith("router.weight"):
                p.copy_(torch.randn_like(p) * 0.6)
    if save_dtype is not None:
        model = model.to(save_dtype)
    os.makedirs(out_dir, exist_ok=True)
    if fused_experts:
        from safetensors.torch import save_file

        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(sd, os.path.join(out_dir, "model.safetensors"))
        cfg.save_pretrained(out_dir)
    else:
        model.save_pretrained(out_dir, safe_serialization=True)
    _tokenizer_json(out_dir, cfg.vocab_size)
    return out_dir


def load_hf(path: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
