"""Paged quantized KV storage of one layer (`KVPages`), the kernel side of the paged cache.

Layout (block = `block_size` tokens; codes as `kernels.kv_pack`, tensors as `kernels.kv_quant.QuantizedKV`):
  k_codes     [NB, H, S, Pk] uint8  packed key codes, Pk = P, or ceil(sum(k_bits[h]) / 8) with k_bits
  v_codes     [NB, H, S, P] uint8   packed value codes, P = D * bits / 8 bytes per token and head
  v_scale     [NB, S, H]    fp16    per-token value scale
  k_outliers  [NB, S, H, Ok] fp16   dense key outlier channels, order of `profile.k_outlier_idx[h]`
  v_outliers  [NB, S, H, Ov] fp16   dense value outlier channels (Ov may be 0)
Token t of a sequence's quantized region lives in block `block_table[t // S]` at slot `t % S`.

Shape legend: N = tokens, H = KV heads, D = head_dim, P = packed bytes per token and head (D * bits / 8),
Pk = packed key bytes, NB = blocks, S = block_size, Ok / Ov = outlier channels per head (K / V).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_profile import KVQuantProfile
from kernels.kv_quant import QuantizedKV


@dataclass(kw_only=True, slots=True)
class KVPages:
    """Paged quantized KV storage of one layer (layout in the module docstring).

    Fields: k_codes [NB, H, S, Pk] / v_codes [NB, H, S, P] uint8, v_scale [NB, S, H] fp16 (or uint8 log2 codes,
    profiles with v_scale_bits 8),
    k_outliers [NB, S, H, Ok] fp16,
    v_outliers [NB, S, H, Ov] fp16. Token t of a sequence's quantized region lives in block
    `block_table[t // S]` at slot `t % S`. Head-major codes keep one (block, head) contiguous for the kernel.
    """

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    k_outliers: torch.Tensor
    v_outliers: torch.Tensor

    def __post_init__(self) -> None:
        nb, h, s, _ = self.k_codes.shape
        expect = {
            "v_codes": ((nb, h, s, self.v_codes.shape[-1]), torch.uint8),
            "v_scale": ((nb, s, h), self.v_scale.dtype if self.v_scale.dtype == torch.uint8 else torch.float16),
            "k_outliers": ((nb, s, h, self.k_outliers.shape[-1]), torch.float16),
            "v_outliers": ((nb, s, h, self.v_outliers.shape[-1]), torch.float16),
        }
        if self.k_codes.dtype != torch.uint8:
            raise ValueError(f"k_codes.dtype={self.k_codes.dtype} must be torch.uint8")
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}; expected {shape} {dtype}")

    @property
    def num_blocks(self) -> int:
        return self.k_codes.shape[0]

    @property
    def block_size(self) -> int:
        return self.k_codes.shape[2]

    @staticmethod
    def empty(profile: KVQuantProfile, num_blocks: int, block_size: int = 16,
              device: torch.device | str = "cpu") -> "KVPages":
        """Zero-filled pages for `num_blocks` blocks of `block_size` tokens.

        Raises: ValueError if num_blocks < 1 or block_size < 1.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        h, p = profile.num_kv_heads, profile.packed_bytes
        f16 = torch.float16
        return KVPages(
            k_codes=torch.zeros(num_blocks, h, block_size, profile.k_packed_bytes, dtype=torch.uint8, device=device),
            v_codes=torch.zeros(num_blocks, h, block_size, p, dtype=torch.uint8, device=device),
            v_scale=torch.zeros(num_blocks, block_size, h, dtype=f16 if profile.v_scale_bits == 16 else torch.uint8,
                                device=device),
            k_outliers=torch.zeros(num_blocks, block_size, h, profile.n_outlier_k, dtype=f16, device=device),
            v_outliers=torch.zeros(num_blocks, block_size, h, profile.n_outlier_v, dtype=f16, device=device),
        )

    def write(self, blocks: torch.Tensor, slots: torch.Tensor, q: QuantizedKV) -> None:
        """Write N quantized tokens in place: token i goes to block blocks[i], slot slots[i].

        Args:
            blocks, slots: [N] integer tensors (slots in [0, S)).
            q: QuantizedKV of N tokens.
        Raises: ValueError if the lengths differ.
        """
        if blocks.shape != slots.shape or blocks.shape[0] != q.num_tokens:
            raise ValueError(f"blocks.shape={tuple(blocks.shape)}, slots.shape={tuple(slots.shape)} must both "
                             f"be [N={q.num_tokens}]")
        b, s = blocks.long(), slots.long()
        self.k_codes[b, :, s] = q.k_codes
        self.v_codes[b, :, s] = q.v_codes
        self.v_scale[b, s] = q.v_scale
        self.k_outliers[b, s] = q.k_outliers
        self.v_outliers[b, s] = q.v_outliers

    def read(self, blocks: torch.Tensor, slots: torch.Tensor) -> QuantizedKV:
        """Gather N tokens back into per-token rows (inverse of `write`)."""
        b, s = blocks.long(), slots.long()
        return QuantizedKV(k_codes=self.k_codes[b, :, s], v_codes=self.v_codes[b, :, s], v_scale=self.v_scale[b, s],
                           k_outliers=self.k_outliers[b, s], v_outliers=self.v_outliers[b, s])
