"""Read a Hugging Face MoE checkpoint (`*.safetensors`, single file or sharded index) for one rank.

Every rank reads the replicated non-expert weights and only its own experts' tensors, through
`safetensors.safe_open(...).get_slice`, so no rank materialises the whole expert set. Two expert
layouts are understood: per-expert 2-D tensors (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.{e}.w1.weight`) and fused 3-D tensors (`mlp.experts.gate_up_proj`
`[E, 2I, D]`, `mlp.experts.down_proj` `[E, D, I]`, as transformers 5 keeps them in memory).

Internal names (shapes; D = hidden, I = expert intermediate, E_loc = local experts, V = vocab):
    embed [V, D], lm_head [V, D], norm [D]
    layers.{l}.{input_norm, post_norm} [D]; {q,k,v,o}_w / _b; q_norm, k_norm
    layers.{l}.gate_w [E, D]                                  (router, replicated)
    layers.{l}.w_gate_up [E_loc, 2I, D], layers.{l}.w_down [E_loc, D, I]   (local routed experts)
    layers.{l}.shared_gate_up [2I_s, D], shared_down [D, I_s], shared_gate_w [1, D]
    layers.{l}.mlp_gate_up [2I, D], mlp_down [D, I]            (dense layers)

Dtypes: everything is cast to the compute dtype, except that with `keep_bf16=True` the matrices that a
layer multiplies by (every name above but the norms and biases) stay bf16 when the checkpoint stores them
in bf16. Their values are then exactly the checkpoint's and cost half the bytes of fp32;
`kernels.cpu.linear` multiplies them by fp32 activations with fp32 accumulation.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterable

import torch
from safetensors import safe_open

from actors.model.config import ModelConfig


class CheckpointReader:
    """Name -> file index over a checkpoint folder; reads whole tensors or slices lazily.

    Raises:
        FileNotFoundError: no `*.safetensors` in `path`.
        KeyError: a tensor the model needs is missing (the message names it).
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        self.file_of: dict[str, str] = {}
        if os.path.isfile(index):
            with open(index) as f:
                for name, fn in json.load(f)["weight_map"].items():
                    self.file_of[name] = os.path.join(path, fn)
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"model={path!r}: no *.safetensors files")
            for fn in files:
                with safe_open(fn, "pt") as f:
                    for name in f.keys():
                        self.file_of[name] = fn
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def _open(self, name: str):
        if name not in self.file_of:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.path!r}")
        fn = self.file_of[name]
        if fn not in self._handles:
            self._handles[fn] = safe_open(fn, "pt")
        return self._handles[fn]

    def get(self, name: str) -> torch.Tensor:
        return self._open(name).get_tensor(name)

    def get_rows(self, name: str, index: int) -> torch.Tensor:
        """`tensor[index]` of a stacked tensor, reading only that slice from disk."""
        return self._open(name).get_slice(name)[index : index + 1][0]

    def first(self, *names: str) -> str | None:
        return next((n for n in names if n in self.file_of), None)


def _moe_prefix(reader: CheckpointReader, l: int) -> str:
    for p in (f"model.layers.{l}.mlp", f"model.layers.{l}.block_sparse_moe"):
        if f"{p}.gate.weight" in reader:
            return p
    raise KeyError(f"layer {l}: no router weight (mlp.gate.weight or block_sparse_moe.gate.weight)")


def _cast(t: torch.Tensor, dtype: torch.dtype, keep_bf16: bool) -> torch.Tensor:
    """A matrix weight in memory: kept bf16 when asked and stored so, else in the compute dtype."""
    return t if keep_bf16 and t.dtype == torch.bfloat16 else t.to(dtype)


def load_expert_weights(reader: CheckpointReader, cfg: ModelConfig, l: int, experts: Iterable[int],
                        dtype: torch.dtype, keep_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the given experts of layer `l`: returns (w_gate_up [E_loc, 2I, D], w_down [E_loc, D, I]) in `dtype`
    (bf16 when `keep_bf16` and the checkpoint stores them in bf16; see the module docstring).

    A packed checkpoint (`actors.experts.checkpoint`) has no full-precision experts: both come back with
    E_loc = 0 and the engine reads the packed experts itself.
    """
    p = _moe_prefix(reader, l)
    gate_up, down = [], []
    fused = f"{p}.experts.gate_up_proj" in reader
    if f"{p}.experts.packed.gate_up.qmeta" in reader:
        experts = []
    for e in experts:
        if fused:
            gu = reader.get_rows(f"{p}.experts.gate_up_proj", e)
            dn = reader.get_rows(f"{p}.experts.down_proj", e)
        elif f"{p}.experts.{e}.w1.weight" in reader:  # Mixtral: w1 gate, w3 up, w2 down
            gu = torch.cat([reader.get(f"{p}.experts.{e}.w1.weight"), reader.get(f"{p}.experts.{e}.w3.weight")])
            dn = reader.get(f"{p}.experts.{e}.w2.weight")
        else:
            gu = torch.cat([reader.get(f"{p}.experts.{e}.gate_proj.weight"), reader.get(f"{p}.experts.{e}.up_proj.weight")])
            dn = reader.get(f"{p}.experts.{e}.down_proj.weight")
        gate_up.append(_cast(gu, dtype, keep_bf16))
        down.append(_cast(dn, dtype, keep_bf16))
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    if not gate_up:
        return torch.empty(0, 2 * I, D, dtype=dtype), torch.empty(0, D, I, dtype=dtype)
    if len({t.dtype for t in gate_up + down}) > 1:  # mixed storage in the checkpoint: one dtype per stack
        gate_up, down = [t.to(dtype) for t in gate_up], [t.to(dtype) for t in down]
    return torch.stack(gate_up).contiguous(), torch.stack(down).contiguous()


def load_rank_weights(path: str, cfg: ModelConfig, local_experts: list[list[int]],
                      dtype: torch.dtype = torch.float32, keep_bf16: bool = False) -> dict[str, torch.Tensor]:
    """Load replicated weights plus `local_experts[l]` (global expert ids of layer l) for one rank.

    Returns a flat dict with the internal names in the module docstring, in `dtype`; with `keep_bf16`, the
    matrices the checkpoint stores in bf16 stay bf16 (module docstring).
    """
    r = CheckpointReader(path)
    w: dict[str, torch.Tensor] = {}

    def put(dst: str, src: str, optional: bool = False, matrix: bool = True) -> None:
        if optional and src not in r:
            return
        t = r.get(src)
        w[dst] = _cast(t, dtype, keep_bf16 and matrix)

    def cat(*srcs: str) -> torch.Tensor:
        parts = [r.get(s) for s in srcs]
        keep = keep_bf16 and all(t.dtype == torch.bfloat16 for t in parts)
        return _cast(torch.cat(parts), dtype, keep)

    put("embed", "model.embed_tokens.weight")
    put("norm", "model.norm.weight", matrix=False)
    if "lm_head.weight" in r and not cfg.tie_word_embeddings:
        put("lm_head", "lm_head.weight")
    else:
        w["lm_head"] = w["embed"]
    for l in range(cfg.num_layers):
        a, o = f"model.layers.{l}.self_attn", f"layers.{l}."
        put(o + "input_norm", f"model.layers.{l}.input_layernorm.weight", matrix=False)
        put(o + "post_norm", f"model.layers.{l}.post_attention_layernorm.weight", matrix=False)
        for n in "qkvo":
            put(o + f"{n}_w", f"{a}.{n}_proj.weight")
            put(o + f"{n}_b", f"{a}.{n}_proj.bias", optional=True, matrix=False)
        if cfg.qk_norm != "none":
            put(o + "q_norm", f"{a}.q_norm.weight", matrix=False)
            put(o + "k_norm", f"{a}.k_norm.weight", matrix=False)
        if cfg.moe_layers[l]:
            p = _moe_prefix(r, l)
            put(o + "gate_w", f"{p}.gate.weight")
            w[o + "w_gate_up"], w[o + "w_down"] = load_expert_weights(r, cfg, l, local_experts[l], dtype, keep_bf16)
            if cfg.has_shared_expert:
                s = f"{p}.shared_expert"
                w[o + "shared_gate_up"] = cat(f"{s}.gate_proj.weight", f"{s}.up_proj.weight")
                put(o + "shared_down", f"{s}.down_proj.weight")
                put(o + "shared_gate_w", f"{p}.shared_expert_gate.weight")
        else:
            m = f"model.layers.{l}.mlp"
            w[o + "mlp_gate_up"] = cat(f"{m}.gate_proj.weight", f"{m}.up_proj.weight")
            put(o + "mlp_down", f"{m}.down_proj.weight")
    return w
