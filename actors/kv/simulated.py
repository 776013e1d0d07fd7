"""A KV cache that quantizes through a function, and whole-window logits through any cache: what calibration
(`actors.kv.layer_widths`) and bench/kv_quality.py measure storage formats with before (or without) the paged
cache holding them.

`SimulatedCache` applies `qdq(layer, k_pre [C, H, D], v) -> (k, v)` (a quantize-dequantize of pre-RoPE keys and
values) with the visibility rule of `QuantizedPagedKVCache` without a sink: key j is read quantized by query p iff
j < S * ((p + 1) // S) (S = 16, its block size: a block is quantized once sealed), in full precision otherwise.
It evaluates whole windows in one prefill (`window_logits`), the path the paged cache provably matches
(tests/actors/kv/test_kv_quant_cache.py: prefill equals decode).

Shape legend: C = window tokens, H = KV heads, D = head_dim, V = vocabulary, S = block size.
"""
from __future__ import annotations

import torch

from actors.kv.allocator import BlockAllocator
from actors.kv.interface import KVCache
from actors.kv.quantized import mixed_causal_attention
from actors.model.attention import AttentionMetadata
from kernels.rope import apply_rope, rope_tables

BLOCK = 16


class SimulatedCache(KVCache):
    """Our quantization through `qdq(layer, k_pre [C,H,D] fp32, v [C,H,D] fp32) -> (k_pre, v)` fp32, with the
    paged cache's visibility rule (module docstring). Whole windows only (`window_logits`).

    Raises (attend): ValueError for anything but one whole-window prefill."""

    def __init__(self, qdq, rope_theta: float, head_dim: int, max_tokens: int):
        self.qdq = qdq
        self.cos, self.sin = rope_tables(max_tokens, head_dim, base=rope_theta)
        self.block_size, self.num_blocks = BLOCK, -(-max_tokens // BLOCK) + 1
        self.allocator = BlockAllocator(self.num_blocks)

    def attend(self, layer, q_THD, k_THD, v_THD, positions_T, meta, rotary, scale):
        if len(meta.prefills) != 1 or meta.prefills[0][1] != meta.prefills[0][2]:
            raise ValueError("SimulatedCache evaluates whole windows only")
        ctx = meta.prefills[0][2]
        k, v = k_THD.float(), v_THD.float()
        k_dq, v_dq = self.qdq(layer, k, v)
        pos = positions_T.to(torch.int64)
        cos, sin = self.cos[:ctx], self.sin[:ctx]
        hi = (pos + 1) // BLOCK * BLOCK
        return mixed_causal_attention(q_THD, apply_rope(k, cos, sin), v, apply_rope(k_dq, cos, sin), v_dq,
                                      pos, 0, hi, scale).to(q_THD.dtype)


def prefill_meta(n: int, blocks: list[int], bs: int) -> AttentionMetadata:
    """Metadata of one n-token prefill from position 0 into `blocks` (block size bs)."""
    return AttentionMetadata(
        slot_mapping=torch.tensor([blocks[i // bs] * bs + i % bs for i in range(n)], dtype=torch.int64),
        decode_tokens=torch.zeros(0, dtype=torch.int64), decode_block_tables=torch.zeros(0, 0, dtype=torch.int64),
        decode_context_lens=torch.zeros(0, dtype=torch.int64),
        prefills=[(0, n, n, torch.tensor(blocks, dtype=torch.int64))])


@torch.inference_mode()
def window_logits(model, cache: KVCache, ids: list[int]) -> torch.Tensor:
    """Logits [n - 1, V] fp32 at positions 0 .. n-2 of one window prefilled through `cache` (`model`: an
    `actors.model.model.MoEModel`); the blocks are freed after."""
    bs = cache.block_size
    blocks = [cache.allocator.allocate() for _ in range(-(-len(ids) // bs))]
    try:
        h = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, prefill_meta(len(ids), blocks, bs))
        return model.logits(h[:-1]).float()
    finally:
        cache.allocator.free_all(blocks)
