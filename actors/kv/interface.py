"""The KV cache seam between attention and KV storage: `KVCache`, implemented full precision and quantized.

Contract (what attention and the scheduler rely on, whatever the implementation):
  * `allocator` (actors/kv/allocator.py) hands out the block ids of `num_blocks`; the scheduler owns each
    sequence's block table, and token i of a sequence belongs to block `table[i // block_size]`, offset
    `i % block_size` (flat slot `block * block_size + offset`, `meta.slot_mapping`);
  * a block's data is valid only while the sequence holds the block; freeing the last reference of a
    sequence's blocks ends it (a cache may keep per-sequence state, released when its first block is freed);
  * `attend` is called once per layer per step, every layer with the same `meta`; it writes the step's new
    K/V before attending, so each token sees itself and the tokens before it (causal). Under two-batch overlap
    (`actors.model.two_batch`) a decode step is two micro-batches of disjoint sequences, each with its own `meta`
    (`AttentionMetadata.split`): `attend` then runs once per layer per micro-batch, the two metas alternating.
Implementations: actors/kv/paged.py (`PagedKVCache`, full precision), actors/kv/quantized.py
(`QuantizedPagedKVCache`, sub-4-bit pages).

Shape legend: T = tokens in the step, H = query heads, D = head_dim.
"""
from __future__ import annotations

import torch

from actors.kv.allocator import BlockAllocator


class KVCache:
    """The seam between attention and KV storage: full precision or quantized, same interface.

    `attend(layer, q, k, v, positions, meta, rotary, scale)` stores the step's new K/V at
    `meta.slot_mapping` and returns attention of q over each token's sequence (causal). Keys come
    in before RoPE so a quantized cache can store them pre-RoPE (KVQuant) and rotate after
    dequantization; q is already rotated. `allocator` hands out the blocks.
    """

    allocator: BlockAllocator
    block_size: int
    num_blocks: int

    def attend(self, layer: int, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
               positions_T: torch.Tensor, meta, rotary, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def fp_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's K / V pages [N, S, Hkv, Dh] when `attend` is exactly "write RoPE(k) and v at
        `meta.slot_mapping` in them (keys post-RoPE, compute dtype), then paged attention over them", so that a
        caller may do both itself in one compiled call (`kernels.cpu.attention_block`); None (the default) for a
        cache that stores anything else (quantized pages, per-sequence state)."""
        return None
