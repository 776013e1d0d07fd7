"""The calibrated KV quantization profile of one layer (`KVQuantProfile`) and its storage cost (`effective_bits`).

Per layer (KVQuant, arXiv 2401.18079; the method is described in `kernels.kv_quant`):
  k_scale/k_zero/v_zero [H, D] fp32, k_codebook/v_codebook [L] fp32, k_outlier_idx [H, Ok] int32,
  v_outlier_idx [H, Ov] int32, k_bits [H, D] uint8 or [0] (none).
  Bytes per quantized token and layer: H * (Pk + P + v_scale_bits / 8 + 2 * Ok + 2 * Ov).
Profiles are calibrated offline by `kernels.kv_calibrate.fit_kv_profile` and saved with `to_tensors`.

Shape legend: H = KV heads, D = head_dim, L = 2**bits codebook levels, P = packed bytes per token and head
(D * bits / 8), Pk = packed key bytes, Ok / Ov = outlier channels per head (K / V).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from kernels.kv_pack import _check_bits, _check_widths, packed_bytes

_INT_FIELDS = ("bits", "v_scale_bits")


@dataclass(kw_only=True, slots=True)
class KVQuantProfile:
    """Calibrated KV quantization profile of one layer (KVQuant, arXiv 2401.18079).

    Fields (H = KV heads, D = head_dim, L = 2**bits, Ok / Ov = outlier channels per head):
        bits: code width in bits per element, 1, 2, 3 or 4 (1 only as one layer's value width inside a 2-bit
            model profile, `actors.kv.layer_widths`; the value row is then D / 8 bytes and v_codebook 2 levels).
        k_scale: [H, D] fp32, per-channel key scale (> 0); 1 on outlier channels.
        k_zero: [H, D] fp32, per-channel key zero point (0 when calibrated without zero points).
        v_zero: [H, D] fp32, per-channel value offset removed before the per-token scale (0 = off).
        k_codebook, v_codebook: [L] fp32, strictly ascending levels in normalised units.
        k_outlier_idx: [H, Ok] int32, key channels kept dense in fp16; unique per head, 0 <= Ok <= D.
        v_outlier_idx: [H, Ov] int32, value channels kept dense in fp16; 0 <= Ov <= D.
        k_bits: [H, D] uint8 per-channel key widths in [1, 8] with equal row sums (keys then use the
            per-channel uniform grid and k_codebook is unused), or an empty tensor (default): every key
            channel uses `bits` and k_codebook.
        v_scale_bits: 16 (default: the per-token value scale in fp16) or 8 (an 8-bit log2 code,
            `kernels.kv_quant.encode_value_scale`; 8 bits fewer per token and head).
    Raises (in __post_init__):
        ValueError naming the field, the value and the limit.
    """

    bits: int
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_zero: torch.Tensor
    k_codebook: torch.Tensor
    v_codebook: torch.Tensor
    k_outlier_idx: torch.Tensor
    v_outlier_idx: torch.Tensor
    k_bits: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.uint8))
    v_scale_bits: int = 16

    def __post_init__(self) -> None:
        _check_bits(int(self.bits))
        self.bits = int(self.bits)
        self.v_scale_bits = int(self.v_scale_bits)
        if self.v_scale_bits not in (8, 16):
            raise ValueError(f"v_scale_bits={self.v_scale_bits} must be 8 or 16")
        if self.k_scale.dim() != 2:
            raise ValueError(f"k_scale.shape={tuple(self.k_scale.shape)} must be [H, D]")
        h, d = self.k_scale.shape
        packed_bytes(d, self.bits)
        for name in ("k_zero", "v_zero"):
            if getattr(self, name).shape != (h, d):
                raise ValueError(f"{name}.shape={tuple(getattr(self, name).shape)} must equal k_scale.shape={(h, d)}")
        if not bool((self.k_scale > 0).all()):
            raise ValueError("k_scale must be > 0 everywhere")
        n_levels = 1 << self.bits
        for name in ("k_codebook", "v_codebook"):
            cb = getattr(self, name)
            if cb.shape != (n_levels,):
                raise ValueError(f"{name}.shape={tuple(cb.shape)} must be ({n_levels},) for bits={self.bits}")
            if not bool((cb[1:] > cb[:-1]).all()):
                raise ValueError(f"{name} must be strictly ascending")
        for name in ("k_outlier_idx", "v_outlier_idx"):
            idx = getattr(self, name)
            if idx.dim() != 2 or idx.shape[0] != h or idx.shape[1] > d:
                raise ValueError(f"{name}.shape={tuple(idx.shape)} must be [H={h}, n<= D={d}]")
            if idx.dtype != torch.int32:
                raise ValueError(f"{name}.dtype={idx.dtype} must be torch.int32")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= d):
                raise ValueError(f"{name} values must lie in [0, {d})")
            if idx.shape[1] and bool((idx.sort(dim=1).values.diff(dim=1) == 0).any()):
                raise ValueError(f"{name} has a repeated channel within a head")
        if self.k_bits.numel():
            if self.k_bits.shape != (h, d):
                raise ValueError(f"k_bits.shape={tuple(self.k_bits.shape)} must be [H={h}, D={d}] or empty")
            _check_widths(self.k_bits)
            self.k_bits = self.k_bits.to(torch.uint8).contiguous()
        else:
            self.k_bits = self.k_bits.reshape(0).to(torch.uint8)
        self.k_scale = self.k_scale.float().contiguous()
        self.k_zero = self.k_zero.float().contiguous()
        self.v_zero = self.v_zero.float().contiguous()
        self.k_codebook = self.k_codebook.float().contiguous()
        self.v_codebook = self.v_codebook.float().contiguous()

    @property
    def num_kv_heads(self) -> int:
        return self.k_scale.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k_scale.shape[1]

    @property
    def n_outlier_k(self) -> int:
        return self.k_outlier_idx.shape[1]

    @property
    def n_outlier_v(self) -> int:
        return self.v_outlier_idx.shape[1]

    @property
    def packed_bytes(self) -> int:
        """P: bytes of packed value codes per token and head (also the key row without `k_bits`)."""
        return packed_bytes(self.head_dim, self.bits)

    @property
    def per_channel_keys(self) -> bool:
        """True when keys use per-channel widths `k_bits` (uniform grid per channel)."""
        return self.k_bits.numel() > 0

    @property
    def k_packed_bytes(self) -> int:
        """Pk: bytes of packed key codes per token and head."""
        return _check_widths(self.k_bits)[1] if self.per_channel_keys else self.packed_bytes

    def bytes_per_token(self) -> int:
        """Bytes one quantized token costs in one layer: K and V codes, V scale, K and V outlier values."""
        return self.num_kv_heads * (self.k_packed_bytes + self.packed_bytes + self.v_scale_bits // 8
                                    + 2 * self.n_outlier_k + 2 * self.n_outlier_v)

    def outlier_slots(self, which: str) -> torch.Tensor:
        """[H, D] int32: position of channel d in the outlier side array of head h, or -1 if an inlier.

        Lets the dense dequantizer and the Triton kernel restore outliers with one gather.
        Raises: ValueError if `which` is not "k" or "v".
        """
        if which not in ("k", "v"):
            raise ValueError(f"which={which!r} must be 'k' or 'v'")
        idx = (self.k_outlier_idx if which == "k" else self.v_outlier_idx).long()
        slots = torch.full((self.num_kv_heads, self.head_dim), -1, dtype=torch.int32, device=idx.device)
        if idx.shape[1]:
            rank = torch.arange(idx.shape[1], dtype=torch.int32, device=idx.device).expand_as(idx)
            slots.scatter_(1, idx, rank.contiguous())
        return slots

    def to(self, device: torch.device | str) -> "KVQuantProfile":
        return KVQuantProfile(**{f.name: (getattr(self, f.name).to(device) if f.name not in _INT_FIELDS
                                          else getattr(self, f.name)) for f in fields(self)})

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat dict of contiguous tensors for safetensors (`bits` as an int32 scalar tensor; `k_bits` only
        when per-channel, so uniform-width profiles keep their old file contents)."""
        out = {f.name: getattr(self, f.name).contiguous() for f in fields(self)
               if f.name not in _INT_FIELDS and (f.name != "k_bits" or self.per_channel_keys)}
        out["bits"] = torch.tensor(self.bits, dtype=torch.int32)
        if self.v_scale_bits != 16:
            out["v_scale_bits"] = torch.tensor(self.v_scale_bits, dtype=torch.int32)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "KVQuantProfile":
        """Inverse of `to_tensors` (`k_bits`, `v_scale_bits` optional). Raises ValueError naming a missing key."""
        names = [f.name for f in fields(cls) if f.name not in ("k_bits", "v_scale_bits")]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"tensors is missing keys {missing}")
        kw = {n: tensors[n] for n in names}
        if "k_bits" in tensors:
            kw["k_bits"] = tensors["k_bits"]
        kw["bits"] = int(tensors["bits"])
        if "v_scale_bits" in tensors:
            kw["v_scale_bits"] = int(tensors["v_scale_bits"])
        return cls(**kw)


def effective_bits(
    profile: KVQuantProfile,
    *,
    num_tokens: int,
    block_size: int | None = None,
    num_full_precision_tokens: int = 0,
    full_precision_bytes: int = 2,
) -> float:
    """Effective bits per stored K or V element of one layer, counting every byte.

    Counted: packed K and V codes, V scales (fp16 or 8-bit codes), fp16 K and V outlier values (per token); the
    profile's scales, zeros, codebooks and outlier indices (amortised over the tokens); the full-precision
    tokens (sink prefix, unsealed tail) at `full_precision_bytes` bytes per element. With `block_size`, quantized
    tokens are rounded up to whole blocks, since a partly filled block is still allocated.
    Result = total bytes * 8 / ((num_tokens + num_full_precision_tokens) * 2 * H * D), in bits per element.

    Raises:
        ValueError: negative counts, block_size < 1, or no tokens at all.
    """
    if num_tokens < 0 or num_full_precision_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} and num_full_precision_tokens={num_full_precision_tokens} "
                         "must be >= 0")
    total_tokens = num_tokens + num_full_precision_tokens
    if total_tokens == 0:
        raise ValueError("num_tokens + num_full_precision_tokens must be > 0")
    stored = num_tokens
    if block_size is not None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        stored = -(-num_tokens // block_size) * block_size
    h, d = profile.num_kv_heads, profile.head_dim
    profile_bytes = sum(t.numel() * t.element_size() for t in profile.to_tensors().values())
    total = (stored * profile.bytes_per_token() + profile_bytes
             + num_full_precision_tokens * 2 * h * d * full_precision_bytes)
    return total * 8.0 / (total_tokens * 2 * h * d)
