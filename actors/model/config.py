"""Model configuration read from a Hugging Face `config.json`.

Supported architectures (the `model_type` field): `qwen2_moe`, `qwen3_moe`, `mixtral`, `olmoe`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only MoE model, normalised across families.

    Attributes mirror the HF names where they exist. `moe_layers[l]` is True where layer l has
    routed experts (from `decoder_sparse_step` and `mlp_only_layers`), else the layer has a dense MLP
    of width `intermediate_size`.

    Raises:
        ValueError: on an unsupported `model_type` or inconsistent sizes (named in the message).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int
    norm_topk_prob: bool
    moe_layers: list[bool]
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # "none" | "per_head" (Qwen3-MoE) | "full" (OLMoE)
    clip_qkv: float | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries, expected num_hidden_layers={self.num_layers}")
        if self.qk_norm not in ("none", "per_head", "full"):
            raise ValueError(f"qk_norm={self.qk_norm!r} must be none|per_head|full")

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a parsed HF `config.json` dict (transformers 4.x and 5.x field names)."""
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={mt!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        n_layers = hf["num_hidden_layers"]
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported (only default RoPE)")
        rope_theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
        if mt == "mixtral":
            n_exp, inter_moe = hf["num_local_experts"], hf["intermediate_size"]
            moe_layers = [True] * n_layers
            norm_topk = True
        else:
            n_exp = hf.get("num_experts", hf.get("num_local_experts"))
            inter_moe = hf.get("moe_intermediate_size", hf.get("intermediate_size"))
            step = hf.get("decoder_sparse_step", 1) or 1
            mlp_only = set(hf.get("mlp_only_layers") or [])
            moe_layers = [(l not in mlp_only) and n_exp > 0 and (l + 1) % step == 0 for l in range(n_layers)]
            norm_topk = bool(hf.get("norm_topk_prob", mt == "qwen3_moe"))
        if mt == "mixtral" and hf.get("sliding_window"):
            if hf["sliding_window"] < hf.get("max_position_embeddings", 0):
                raise ValueError(f"sliding_window={hf['sliding_window']} is not supported yet (set it to null)")
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
        return cls(
            model_type=mt,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            num_experts=n_exp,
            top_k=hf["num_experts_per_tok"],
            moe_intermediate_size=inter_moe,
            intermediate_size=hf.get("intermediate_size", inter_moe),
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0,
            qkv_bias=bool(hf.get("qkv_bias", True)) if mt == "qwen2_moe" else bool(hf.get("attention_bias", False)),
            o_bias=bool(hf.get("attention_bias", False)) if mt in ("olmoe", "qwen3_moe") else False,
            qk_norm={"qwen3_moe": "per_head", "olmoe": "full"}.get(mt, "none"),
            clip_qkv=hf.get("clip_qkv") if mt == "olmoe" else None,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read `<path>/config.json` (and EOS ids from `generation_config.json` when present)."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"model={path!r}: no config.json there")
        with open(cfg_path) as f:
            cfg = cls.from_hf(json.load(f))
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                extra = list(eos) if isinstance(eos, (list, tuple)) else [eos]
                cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(extra))
        return cfg
