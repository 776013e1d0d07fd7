"""Paged KV cache (full precision) and its block allocator.

A block (KV page) holds `block_size` consecutive tokens of one sequence for every layer. Each
sequence owns a block table (list of block ids); token i of a sequence lives in block
`table[i // block_size]` at offset `i % block_size`, i.e. flat slot `block * block_size + offset`.

Shape legend: N = blocks, S = block_size, Hkv = KV heads, Dh = head_dim, L = layers.
"""
from __future__ import annotations

import torch


class BlockAllocator:
    """Free list of KV blocks with reference counts (so a forked prefix can be shared).

    Raises:
        MemoryError: `allocate` with no free block (callers check `num_free` first).
        ValueError: freeing a block that is not allocated.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free KV block")
        b = self._free.pop()
        self._ref[b] = 1
        return b

    def share(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._ref[block] += 1

    def free(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} is not allocated (double free)")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free.append(block)

    def free_all(self, blocks: list[int]) -> None:
        for b in blocks:
            self.free(b)


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


class PagedKVCache(KVCache):
    """Full-precision paged KV storage: k[l], v[l] of shape [N, S, Hkv, Dh] in the compute dtype.

    Keys are stored after RoPE. `bytes_per_block` = 2 * L * S * Hkv * Dh * itemsize.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks)

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

    def attend(self, layer, q_THD, k_THD, v_THD, positions_T, meta, rotary, scale):
        from actors.model.attention import paged_attention

        self.write(layer, rotary.apply(k_THD, positions_T), v_THD, meta.slot_mapping)
        return paged_attention(q_THD, self.k[layer], self.v[layer], meta, scale)
