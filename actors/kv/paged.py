"""Full-precision paged KV cache: `PagedKVCache`, the reference implementation of the `KVCache` seam.

What a block holds: `block_size` (S) consecutive tokens of one sequence, for every layer: k[l][block] and
v[l][block], [S, Hkv, Dh] in the compute dtype, keys after RoPE. Token i of a sequence lives in block
`table[i // S]` at offset `i % S`, i.e. flat slot `block * S + offset` (`meta.slot_mapping`).
Ownership: block ids come from `allocator` (actors/kv/allocator.py; with `prefix_caching` a
`PrefixCachingAllocator`, actors/kv/prefix_cache.py, which keeps freed full blocks by hash); a block's rows are meaningful only while
a sequence holds it, and the next holder overwrites them (nothing is cleared on free). This cache has no
copy-on-write: a block shared by several holders (`BlockAllocator.share`) must not be written while shared.

Shape legend: N = blocks, S = block_size, Hkv = KV heads, Dh = head_dim, L = layers, T = tokens in the step.
"""
from __future__ import annotations

import torch

from actors.kv.allocator import BlockAllocator
from actors.kv.interface import KVCache
from actors.kv.prefix_cache import PrefixCachingAllocator
from actors.model.attention import paged_attention


class PagedKVCache(KVCache):
    """Full-precision paged KV storage: k[l], v[l] of shape [N, S, Hkv, Dh] in the compute dtype.

    Keys are stored after RoPE. `bytes_per_block` = 2 * L * S * Hkv * Dh * itemsize.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", prefix_caching: bool = False):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = PrefixCachingAllocator(num_blocks) if prefix_caching else BlockAllocator(num_blocks)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, k_THD: torch.Tensor, v_THD: torch.Tensor, slots_T: torch.Tensor) -> None:
        """Scatter new tokens' K/V ([T, Hkv, Dh]) into flat slots [T] (int64)."""
        if k_THD.shape[0] == 0:
            return
        H, D = k_THD.shape[1:]
        self.k[layer].view(-1, H, D)[slots_T] = k_THD
        self.v[layer].view(-1, H, D)[slots_T] = v_THD

    def fp_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def attend(self, layer, q_THD, k_THD, v_THD, positions_T, meta, rotary, scale):
        self.write(layer, rotary.apply(k_THD, positions_T), v_THD, meta.slot_mapping)
        return paged_attention(q_THD, self.k[layer], self.v[layer], meta, scale)
