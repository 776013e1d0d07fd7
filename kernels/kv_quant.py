"""Sub-4-bit, outlier-aware, non-uniform KV-cache quantization (KVQuant, arXiv 2401.18079).

What is quantized, and how (one layer):
  * keys, per channel: `k_norm = (k - k_zero[h, d]) / k_scale[h, d]` with scales/zeros calibrated offline on
    pre-RoPE keys (KVQuant section 3.1-3.2: per-channel, pre-RoPE; the range is min/max or, `k_range="mse"`,
    shrunk per channel to the least squared error through the codebook), then the nearest level of the
    layer's key codebook (k-means / Lloyd-Max fitted on normalised calibration keys, section 3.3, or a
    uniform grid);
  * values, per token: `v_norm = (v - v_zero[h, d]) / v_scale[t, h]`, `v_scale` = max-abs of the token's
    centred inlier channels, computed online at quantize time and stored as fp16, then the nearest level of
    the value codebook. `v_zero` is an optional calibrated per-channel mean (not in KVQuant): values share a
    per-channel offset (e.g. the v_proj bias of Qwen2), and removing it leaves the per-token scale to the
    part that varies, which at 3 bits halves the value error on such data; it costs H * D fp32 per layer;
  * outlier channels: per KV head, the `n_outlier` channels of largest calibrated max-abs are kept dense in
    fp16 in a side array and excluded from the scale and codebook fit. KVQuant isolates ~1% of values as
    sparse per-token outliers; a fixed per-head channel set is the dense-and-static variant, chosen because
    the paged kernel can restore it with one gather and no sparse format. Their code slots are still
    stored (and ignored), which costs `n_outlier * bits` bits per token and head but keeps the bit offset
    of channel d equal to `d * bits`.

Per-channel key widths (`k_bits`, optional): instead of one `bits`-bit codebook for every key channel, each
channel d of head h gets its own width b[h, d] in [1, 8] on a uniform grid over its calibrated range:
`k = k_zero + k_scale * (2 * code / (2**b - 1) - 1)` (the `uniform` codebook, per channel). `fit_kv_profile`
(`k_channel_bits=B`) allocates B bits per head row by greedy reverse water-filling on the calibration keys'
squared error weighted by the query energy of the channel's RoPE pair (the expected squared attention-logit
error, see `allocate_channel_bits`): classic transform-coding bit allocation (Gersho & Gray, ch. 8) applied
to keys, in the spirit of KVQuant's sensitivity-weighted quantization (section 3.3, Fisher-weighted
k-means). It replaces the fp16 outlier side array: a large channel simply gets more bits. Every head's
widths sum to the same B, so the key row is P_k = ceil(B / 8) bytes (the value row stays P); the codes
of a row are one bitstream, channel d at bit offset sum(b[h, :d]) (`pack_codes_var`).

The uniform baseline `kivi_quantize` / `kivi_dequantize` (KIVI, arXiv 2402.02750: per-channel keys and
per-token values in groups, each group with an fp16 scale and zero) is here for benchmark comparison.

Bit layout of packed codes (`pack_codes` / `unpack_codes`), bits b in {2, 3, 4}:
  A row of D codes is one little-endian bitstream of D * b bits stored in D * b / 8 bytes. Code i occupies
  stream bits [i*b, i*b + b), least-significant bit first; byte j holds stream bits [8j, 8j + 8).
  b=4: code 2j in the low nibble of byte j, code 2j+1 in the high nibble.
  b=2: byte j holds codes 4j..4j+3 at bit offsets 0, 2, 4, 6.
  b=3: every 8 codes fill exactly 3 bytes; codes 2 and 5 of each group of 8 straddle a byte boundary
       (code 2 = bits 6-7 of byte 0 + bit 0 of byte 1). A 3-bit code costs exactly 3/8 byte.
  Requires D * b % 8 == 0 (D % 8 == 0 for 3 bits).

Paged storage (`KVPages`, kernel side of the paged cache, one layer; block = `block_size` tokens):
  k_codes     [NB, H, S, Pk] uint8  packed key codes, Pk = P, or ceil(sum(k_bits[h]) / 8) with k_bits
  v_codes     [NB, H, S, P] uint8   packed value codes, P = D * bits / 8 bytes per token and head
  v_scale     [NB, S, H]    fp16    per-token value scale
  k_outliers  [NB, S, H, Ok] fp16   dense key outlier channels, order of `profile.k_outlier_idx[h]`
  v_outliers  [NB, S, H, Ov] fp16   dense value outlier channels (Ov may be 0)
  Per layer (in `KVQuantProfile`): k_scale/k_zero/v_zero [H, D] fp32, k_codebook/v_codebook [L] fp32,
  k_outlier_idx [H, Ok] int32, v_outlier_idx [H, Ov] int32, k_bits [H, D] uint8 or [0] (none).
  Bytes per token and layer: H * (Pk + P + 2 + 2 * Ok + 2 * Ov).

Shape legend: N = tokens, H = KV heads, D = head_dim, L = 2**bits codebook levels, P = packed bytes per
token and head (D * bits / 8), Pk = packed key bytes, NB = blocks, S = block_size,
Ok / Ov = outlier channels per head (K / V),
G = group size (KIVI).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from kernels.codebook import lloyd_max

SUPPORTED_BITS = (2, 3, 4)
CODEBOOK_METHODS = ("kmeans", "uniform")
_FP16_MAX = 65504.0
# k-means on more points than this changes the codebook by far less than the quantization step.
_MAX_FIT_SAMPLES = 1 << 20
K_RANGES = ("mse", "minmax")
# Candidate shrink factors of a key channel's calibrated half-range for k_range="mse". Below 0.4 the clipped
# tails dominate the error for every channel measured on tiny-moe, so the grid stops there.
MSE_CLIP_FACTORS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
MSE_ROUNDS = 2


def _check_bits(bits: int, name: str = "bits") -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{name}={bits} is not supported; choose one of {SUPPORTED_BITS}")


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one packed row of `head_dim` codes at `bits` bits each (P in the legend).

    Raises:
        ValueError: bits not in {2, 3, 4}, or head_dim * bits not a multiple of 8.
    """
    _check_bits(bits)
    if head_dim <= 0 or (head_dim * bits) % 8:
        raise ValueError(f"head_dim={head_dim} * bits={bits} must be a positive multiple of 8 to pack densely")
    return head_dim * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes densely along the last dim (layout in the module docstring).

    Args:
        codes: [..., D] integer tensor with values in [0, 2**bits).
        bits: 2, 3 or 4 bits per code.
    Returns:
        [..., D * bits / 8] uint8.
    Raises:
        ValueError: unsupported bits, or D * bits not a multiple of 8.
    """
    d = codes.shape[-1]
    p = packed_bytes(d, bits)
    c = codes.to(torch.int32)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], p, 8)  # [..., P, 8] bits
    weights = torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream << weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of `pack_codes`.

    Args:
        packed: [..., P] uint8 with P = head_dim * bits / 8.
        bits: 2, 3 or 4.
        head_dim: D, the number of codes per row.
    Returns:
        [..., D] int64 codes in [0, 2**bits).
    Raises:
        ValueError: unsupported bits, or packed.shape[-1] != head_dim * bits / 8.
    """
    p = packed_bytes(head_dim, bits)
    if packed.shape[-1] != p:
        raise ValueError(f"packed.shape[-1]={packed.shape[-1]} != head_dim*bits/8={p}")
    weights = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32).unsqueeze(-1) >> weights) & 1).reshape(*packed.shape[:-1], head_dim, bits)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream << shifts).sum(-1).to(torch.int64)


MAX_CHANNEL_BITS = 8


def _check_widths(widths_HD: torch.Tensor) -> tuple[int, int]:
    """(bits per head row, packed bytes Pk) of per-channel widths [H, D]; ValueError naming the limit."""
    if widths_HD.dim() != 2:
        raise ValueError(f"k_bits.shape={tuple(widths_HD.shape)} must be [H, D]")
    w = widths_HD.to(torch.int64)
    if w.numel() == 0 or int(w.min()) < 1 or int(w.max()) > MAX_CHANNEL_BITS:
        raise ValueError(f"k_bits values must lie in [1, {MAX_CHANNEL_BITS}]")
    sums = w.sum(dim=1)
    if bool((sums != sums[0]).any()):
        raise ValueError(f"k_bits rows must sum to the same bits per head; got {sums.tolist()}")
    total = int(sums[0])
    return total, -(-total // 8)


def _bit_mask(widths_HD: torch.Tensor) -> torch.Tensor:
    """[H, D, 8] bool: bit j of channel d's code is stored (j < width)."""
    j = torch.arange(MAX_CHANNEL_BITS, device=widths_HD.device)
    return j[None, None, :] < widths_HD.to(torch.int64)[..., None]


def pack_codes_var(codes: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Pack codes of per-channel widths: each (token, head) row is one little-endian bitstream, channel d at bit
    offset sum(widths[h, :d]), LSB first, zero-padded to whole bytes (same stream rule as `pack_codes`).

    Args:
        codes: [N, H, D] integer codes, 0 <= codes[..., h, d] < 2**widths[h, d].
        widths: [H, D] integer widths in [1, 8], every row with the same sum B.
    Returns:
        [N, H, ceil(B / 8)] uint8.
    Raises:
        ValueError: widths out of range or rows with different sums, or codes not [N, H, D].
    """
    total, pk = _check_widths(widths)
    n, h, d = codes.shape
    if widths.shape != (h, d):
        raise ValueError(f"codes.shape={tuple(codes.shape)} does not match widths.shape={tuple(widths.shape)}")
    shifts = torch.arange(MAX_CHANNEL_BITS, device=codes.device, dtype=torch.int32)
    bits = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [N, H, D, 8]
    stream = bits[:, _bit_mask(widths)].reshape(n, h, total)
    stream = torch.nn.functional.pad(stream, (0, pk * 8 - total)).reshape(n, h, pk, 8)
    return (stream << shifts).sum(-1).to(torch.uint8)


def unpack_codes_var(packed: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_codes_var`: [N, H, Pk] uint8 -> [N, H, D] int64 codes.

    Raises: ValueError for bad widths or packed.shape[-1] != ceil(B / 8).
    """
    total, pk = _check_widths(widths)
    n, h = packed.shape[:2]
    if packed.dim() != 3 or packed.shape[2] != pk or widths.shape[0] != h:
        raise ValueError(f"packed.shape={tuple(packed.shape)} must be [N, H={widths.shape[0]}, Pk={pk}]")
    shifts = torch.arange(MAX_CHANNEL_BITS, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(n, h, pk * 8)[..., :total]
    mask = _bit_mask(widths)
    bits = torch.zeros(n, *mask.shape, dtype=torch.int32, device=packed.device)
    bits[:, mask] = stream.reshape(n, -1)
    return (bits << shifts).sum(-1).to(torch.int64)


def channel_bit_offsets(widths: torch.Tensor) -> torch.Tensor:
    """[H, D] int32 bit offset of each channel's code within its head row (exclusive prefix sum of widths)."""
    w = widths.to(torch.int32)
    return (torch.cumsum(w, dim=1) - w).to(torch.int32)


def allocate_channel_bits(err_BHD: torch.Tensor, weight_HD: torch.Tensor, budget: int, *, min_bits: int = 2
                          ) -> torch.Tensor:
    """Per-channel widths minimising sum_d weight[h, d] * err[b[h, d], h, d] with sum_d b[h, d] = budget.

    Greedy reverse water-filling: start every channel at `min_bits`, then hand out one bit at a time to the
    channel whose weighted error drops most (optimal for convex error curves; err is made non-increasing).

    Args:
        err_BHD: [B + 1, H, D] float, err[b] = mean squared error of the channel at width b (index 0 unused).
        weight_HD: [H, D] float >= 0, importance of the channel's squared error.
        budget: bits per head row, min_bits * D <= budget <= (B) * D.
        min_bits: smallest width, >= 1.
    Returns:
        [H, D] uint8 widths.
    Raises:
        ValueError: budget or min_bits out of range.
    """
    bmax = err_BHD.shape[0] - 1
    _, h, d = err_BHD.shape
    if not 1 <= min_bits <= bmax or not min_bits * d <= budget <= bmax * d:
        raise ValueError(f"k_channel_bits={budget} must be in [{min_bits} * D, {bmax} * D] with D={d}, "
                         f"min_bits={min_bits} in [1, {bmax}]")
    err = torch.cummin(err_BHD.float(), dim=0).values
    bits = torch.full((h, d), min_bits, dtype=torch.int64, device=err.device)
    ar = torch.arange(d, device=err.device)
    for hh in range(h):
        for _ in range(budget - min_bits * d):
            b = bits[hh]
            nxt = (b + 1).clamp(max=bmax)
            gain = weight_HD[hh].float() * (err[b, hh, ar] - err[nxt, hh, ar])
            gain = torch.where(b < bmax, gain, torch.full_like(gain, -float("inf")))
            bits[hh, int(gain.argmax())] += 1
    return bits.to(torch.uint8)


def _uniform_channel_codes(x_norm: torch.Tensor, widths_HD: torch.Tensor) -> torch.Tensor:
    """Nearest level of the per-channel uniform grid -1 + 2 c / (2**b - 1), c in [0, 2**b)."""
    top = ((1 << widths_HD.to(torch.int64)) - 1).to(x_norm.dtype)
    return torch.minimum(((x_norm.clamp(-1.0, 1.0) + 1.0) * 0.5 * top).round(), top).to(torch.int64)


def _uniform_channel_levels(codes: torch.Tensor, widths_HD: torch.Tensor) -> torch.Tensor:
    top = ((1 << widths_HD.to(torch.int64)) - 1).float()
    return codes.float() * (2.0 / top) - 1.0


def nearest_level(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codebook level for every element.

    Args:
        x: any shape, float.
        codebook: [L] float, sorted ascending.
    Returns:
        int64 codes, same shape as x. Values outside the codebook range clip to the end levels.
    """
    mids = (codebook[1:] + codebook[:-1]) * 0.5
    return torch.bucketize(x.float().contiguous(), mids.float().contiguous())


def fit_codebook(samples: torch.Tensor, bits: int, *, method: str = "kmeans", iters: int = 30) -> torch.Tensor:
    """Fit a 2**bits-level codebook on normalised values (KVQuant section 3.3, non-uniform quantization).

    `kmeans` is 1-D Lloyd-Max: deterministic quantile initialisation, then `iters` rounds of
    assign-to-nearest / move-to-mean. `uniform` is the cheap grid linspace(-1, 1, L). Samples are clamped
    to [-1, 1] (values outside were clipped by the calibrated scale anyway) and deterministically
    subsampled above 2**20 elements.

    Args:
        samples: any shape, float, normalised to roughly [-1, 1]. May be empty (returns the uniform grid).
        bits: 2, 3 or 4.
        method: "kmeans" or "uniform".
        iters: Lloyd iterations, >= 0.
    Returns:
        [L] fp32 levels, strictly ascending.
    Raises:
        ValueError: unsupported bits or method, negative iters.
    """
    _check_bits(bits)
    if method not in CODEBOOK_METHODS:
        raise ValueError(f"method={method!r} is not one of {CODEBOOK_METHODS}")
    if iters < 0:
        raise ValueError(f"iters={iters} must be >= 0")
    n_levels = 1 << bits
    uniform = torch.linspace(-1.0, 1.0, n_levels)
    x = samples.detach().reshape(-1).float().cpu().clamp(-1.0, 1.0)
    if method == "uniform" or x.numel() < n_levels:
        return uniform
    if x.numel() > _MAX_FIT_SAMPLES:
        x = x[torch.linspace(0, x.numel() - 1, _MAX_FIT_SAMPLES).long()]
    levels = lloyd_max(x, n_levels, iters)
    # Identical levels (e.g. from a constant input) would make nearest_level ambiguous; break ties.
    if not bool((levels[1:] > levels[:-1]).all()):
        levels = levels + torch.arange(n_levels, dtype=torch.float32) * 1e-6
    return levels.contiguous()


@dataclass(kw_only=True, slots=True)
class KVQuantProfile:
    """Calibrated KV quantization profile of one layer (KVQuant, arXiv 2401.18079).

    Fields (H = KV heads, D = head_dim, L = 2**bits, Ok / Ov = outlier channels per head):
        bits: code width in bits per element, 2, 3 or 4.
        k_scale: [H, D] fp32, per-channel key scale (> 0); 1 on outlier channels.
        k_zero: [H, D] fp32, per-channel key zero point (0 when calibrated without zero points).
        v_zero: [H, D] fp32, per-channel value offset removed before the per-token scale (0 = off).
        k_codebook, v_codebook: [L] fp32, strictly ascending levels in normalised units.
        k_outlier_idx: [H, Ok] int32, key channels kept dense in fp16; unique per head, 0 <= Ok <= D.
        v_outlier_idx: [H, Ov] int32, value channels kept dense in fp16; 0 <= Ov <= D.
        k_bits: [H, D] uint8 per-channel key widths in [1, 8] with equal row sums (keys then use the
            per-channel uniform grid and k_codebook is unused), or an empty tensor (default): every key
            channel uses `bits` and k_codebook.
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

    def __post_init__(self) -> None:
        _check_bits(int(self.bits))
        self.bits = int(self.bits)
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
        return self.num_kv_heads * (self.k_packed_bytes + self.packed_bytes + 2 + 2 * self.n_outlier_k
                                    + 2 * self.n_outlier_v)

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
        return KVQuantProfile(**{f.name: (getattr(self, f.name).to(device) if f.name != "bits" else self.bits)
                                 for f in fields(self)})

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat dict of contiguous tensors for safetensors (`bits` as an int32 scalar tensor; `k_bits` only
        when per-channel, so uniform-width profiles keep their old file contents)."""
        out = {f.name: getattr(self, f.name).contiguous() for f in fields(self)
               if f.name != "bits" and (f.name != "k_bits" or self.per_channel_keys)}
        out["bits"] = torch.tensor(self.bits, dtype=torch.int32)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "KVQuantProfile":
        """Inverse of `to_tensors` (`k_bits` optional). Raises ValueError naming a missing key."""
        names = [f.name for f in fields(cls) if f.name != "k_bits"]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"tensors is missing keys {missing}")
        kw = {n: tensors[n] for n in names}
        if "k_bits" in tensors:
            kw["k_bits"] = tensors["k_bits"]
        kw["bits"] = int(tensors["bits"])
        return cls(**kw)


def _top_channels(x_NHD: torch.Tensor, n: int) -> torch.Tensor:
    """[H, n] int32 channels of largest max-abs per head, sorted ascending (deterministic order)."""
    mag_HD = x_NHD.abs().amax(dim=0)
    return mag_HD.topk(n, dim=1).indices.sort(dim=1).values.to(torch.int32)


def _inlier_mask(idx_HO: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[H, D] bool, True on channels that go through the codebook."""
    mask = torch.ones(idx_HO.shape[0], head_dim, dtype=torch.bool, device=idx_HO.device)
    if idx_HO.shape[1]:
        mask.scatter_(1, idx_HO.long(), False)
    return mask


def fit_kv_profile(
    k_calib: torch.Tensor,
    v_calib: torch.Tensor,
    *,
    bits: int,
    n_outlier: int = 2,
    n_outlier_v: int = 0,
    percentile: float = 1.0,
    use_zero: bool = True,
    use_v_zero: bool = True,
    codebook: str = "kmeans",
    iters: int = 30,
    k_range: str = "mse",
    codebook_v: str | None = None,
    k_channel_bits: int | None = None,
    query_energy: torch.Tensor | None = None,
    k_min_bits: int = 2,
) -> KVQuantProfile:
    """Calibrate one layer's `KVQuantProfile` offline (KVQuant, arXiv 2401.18079, sections 3.1-3.4).

    Args:
        k_calib: [N, H, D] float, calibration keys BEFORE RoPE (per-channel structure is cleaner pre-RoPE).
        v_calib: [N, H, D] float, calibration values.
        bits: code width, 2, 3 or 4 bits per element.
        n_outlier: key outlier channels per head kept in fp16, 0 <= n_outlier <= D (D bypasses K quantization).
        n_outlier_v: value outlier channels per head kept in fp16, 0 <= n_outlier_v <= D.
        percentile: in (0.5, 1]; per-channel key range is [q(1 - p), q(p)] over tokens (1.0 = min/max),
            values beyond are clipped to the end levels.
        use_zero: per-channel key zero point (asymmetric range) if True, else symmetric max-abs scale.
        use_v_zero: subtract the calibrated per-channel value mean before per-token scaling.
        codebook: "kmeans" (non-uniform, Lloyd-Max) or "uniform", for the key codebook (and the value one
            unless codebook_v is given).
        codebook_v: "kmeans" or "uniform" for the value codebook; None = same as codebook. At 2 bits on
            tiny-moe a uniform key grid with a k-means value codebook measured best (BENCHMARKS.md, KV section):
            MSE-fitted key levels pull the end levels inwards, and the rare large keys that decide attention
            lose most.
        iters: Lloyd iterations.
        k_range: "mse" (default) or "minmax". "minmax" maps each key channel's calibrated [lo, hi] (after
            `percentile`) onto [-1, 1]. "mse" then shrinks each channel's half-range by the factor in
            `MSE_CLIP_FACTORS` that minimises that channel's squared error through the layer's codebook,
            refitting the codebook after each of `MSE_ROUNDS` rounds (clipping search as in weight
            quantizers, e.g. AWQ's clip search, arXiv 2306.00978, applied per key channel). Calibration-only:
            the stored format is unchanged. On tiny-moe at 2 bits it lowers the held-out perplexity increase
            by ~0.4-1 points (bench/kv_quality.py, row `-mse`).
        k_channel_bits: None (one width `bits` for every key channel), or B bits per head row for per-channel
            key widths (`k_bits`, module docstring): each inlier channel's width in [k_min_bits, 8] on a
            uniform grid over its calibrated range (after `percentile`; k_range and codebook then do not
            apply to keys), allocated by `allocate_channel_bits` on the calibration keys' squared error
            weighted by `query_energy`. Outlier channels get k_min_bits (their slots are ignored) and should
            normally be 0: a large channel gets more bits instead. B in [k_min_bits * D, 8 * D]; the key
            row costs ceil(B / 8) bytes per token and head.
        query_energy: [H, D] float >= 0, the weight of channel d's squared key error: for RoPE'd attention,
            the mean over calibration queries of (q_d**2 + q_{d +- D/2}**2) / 2 summed over the KV head's
            query heads (`actors.kv.profiles.collect_calibration_kv(..., with_query_energy=True)`). A
            pre-RoPE key error e_d moves the logit by q_rot . R e, whose mean square over the pair's
            rotation angle is that pair energy times e_d**2 / 2 (rotation-invariant, so post-RoPE queries
            give it). None = equal weights.
        k_min_bits: smallest per-channel key width, in [1, 8].
    Returns:
        KVQuantProfile on the device of k_calib.
    Raises:
        ValueError: mismatched shapes, N == 0, out-of-range bits / n_outlier / n_outlier_v / percentile /
            k_channel_bits / k_min_bits, query_energy not [H, D], unknown k_range.
    """
    codebook_v = codebook if codebook_v is None else codebook_v
    if codebook_v not in CODEBOOK_METHODS:
        raise ValueError(f"codebook_v={codebook_v!r} is not one of {CODEBOOK_METHODS}")
    if k_range not in K_RANGES:
        raise ValueError(f"k_range={k_range!r} is not one of {K_RANGES}")
    if k_calib.dim() != 3 or v_calib.shape != k_calib.shape:
        raise ValueError(f"k_calib.shape={tuple(k_calib.shape)} and v_calib.shape={tuple(v_calib.shape)} "
                         "must both be [N, H, D]")
    n, h, d = k_calib.shape
    if n == 0:
        raise ValueError("k_calib has N=0 calibration tokens; need at least 1")
    _check_bits(bits)
    packed_bytes(d, bits)
    if not 0 <= n_outlier <= d:
        raise ValueError(f"n_outlier={n_outlier} must be in [0, head_dim={d}]")
    if not 0 <= n_outlier_v <= d:
        raise ValueError(f"n_outlier_v={n_outlier_v} must be in [0, head_dim={d}]")
    if not 0.5 < percentile <= 1.0:
        raise ValueError(f"percentile={percentile} must be in (0.5, 1.0]")
    k = k_calib.detach().float()
    v = v_calib.detach().float()

    k_idx = _top_channels(k, n_outlier)
    v_idx = _top_channels(v, n_outlier_v)
    k_in_HD = _inlier_mask(k_idx, d)
    v_in_HD = _inlier_mask(v_idx, d)

    if percentile >= 1.0:
        hi_HD, lo_HD = k.amax(dim=0), k.amin(dim=0)
    else:
        k_sorted = k.sort(dim=0).values
        hi_HD = k_sorted[min(n - 1, math.ceil(percentile * (n - 1)))]
        lo_HD = k_sorted[max(0, math.floor((1.0 - percentile) * (n - 1)))]
    if use_zero:
        zero_HD = (hi_HD + lo_HD) * 0.5
        scale_HD = (hi_HD - lo_HD) * 0.5
    else:
        zero_HD = torch.zeros_like(hi_HD)
        scale_HD = torch.maximum(hi_HD.abs(), lo_HD.abs())
    # A constant channel has zero range; any positive scale reproduces it through the zero point.
    scale_HD = torch.where(k_in_HD, scale_HD.clamp_min(1e-8), torch.ones_like(scale_HD))
    zero_HD = torch.where(k_in_HD, zero_HD, torch.zeros_like(zero_HD))

    k_bits_HD = torch.zeros(0, dtype=torch.uint8)
    if k_channel_bits is not None:
        if query_energy is not None and tuple(query_energy.shape) != (h, d):
            raise ValueError(f"query_energy.shape={tuple(query_energy.shape)} must be [H={h}, D={d}]")
        w_HD = torch.ones(h, d) if query_energy is None else query_energy.detach().float().cpu().clamp_min(0)
        k_norm_all = (k - zero_HD) / scale_HD
        errs = [torch.zeros(h, d, device=k.device)]
        for b in range(1, MAX_CHANNEL_BITS + 1):
            wb = torch.full((h, d), b, dtype=torch.int64, device=k.device)
            lv = _uniform_channel_levels(_uniform_channel_codes(k_norm_all, wb), wb)
            errs.append((((lv - k_norm_all) * scale_HD) ** 2).mean(dim=0))
        err = torch.stack(errs).cpu()
        err[0] = err[1] * 4  # unused (min_bits >= 1); keeps cummin monotone
        # outlier channels never go through the grid; keep them at the floor so the budget goes elsewhere
        w_HD = torch.where(k_in_HD.cpu(), w_HD, torch.zeros(()))
        k_bits_HD = allocate_channel_bits(err, w_HD, k_channel_bits, min_bits=k_min_bits).to(k.device)
        k_codebook = torch.linspace(-1.0, 1.0, 1 << bits, device=k.device)  # unused with k_bits
        k_range = "minmax"  # the per-channel grid keeps the calibrated range (no clipping search)
    else:
        k_norm = ((k - zero_HD) / scale_HD)[:, k_in_HD]  # [N, inliers]
        k_codebook = fit_codebook(k_norm, bits, method=codebook, iters=iters).to(k.device)
    if k_range == "mse":
        for _ in range(MSE_ROUNDS):
            scale_HD = _mse_clip_scale(k, zero_HD, scale_HD, k_codebook, k_in_HD)
            k_norm = ((k - zero_HD) / scale_HD)[:, k_in_HD]
            k_codebook = fit_codebook(k_norm, bits, method=codebook, iters=iters).to(k.device)
    v_zero_HD = torch.where(v_in_HD, v.mean(dim=0), torch.zeros((), device=v.device)) if use_v_zero \
        else torch.zeros(h, d, device=v.device)
    v_c = v - v_zero_HD
    v_scale_NH = _value_scale(v_c, v_in_HD).float()
    v_norm = (v_c / v_scale_NH[..., None])[:, v_in_HD]
    return KVQuantProfile(
        bits=bits,
        k_scale=scale_HD,
        k_zero=zero_HD,
        v_zero=v_zero_HD,
        k_codebook=k_codebook,
        v_codebook=fit_codebook(v_norm, bits, method=codebook_v, iters=iters).to(k.device),
        k_outlier_idx=k_idx,
        v_outlier_idx=v_idx,
        k_bits=k_bits_HD,
    )


def _mse_clip_scale(k_NHD: torch.Tensor, zero_HD: torch.Tensor, scale_HD: torch.Tensor, codebook: torch.Tensor,
                    inlier_HD: torch.Tensor) -> torch.Tensor:
    """[H, D] per-channel key scale: scale_HD times the factor of MSE_CLIP_FACTORS with the least squared error
    of the channel's calibration keys through `codebook` (values beyond the clipped range saturate at the end
    levels). Outlier channels keep scale 1. Ties keep the earlier (larger) factor."""
    best_err = torch.full_like(scale_HD, float("inf"))
    best = scale_HD.clone()
    for f in MSE_CLIP_FACTORS:
        s = scale_HD * f
        x_hat = codebook[nearest_level((k_NHD - zero_HD) / s, codebook)] * s + zero_HD
        err = ((x_hat - k_NHD) ** 2).mean(dim=0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s, best)
    return torch.where(inlier_HD, best, torch.ones_like(best))


def _value_scale(v_NHD: torch.Tensor, inlier_HD: torch.Tensor) -> torch.Tensor:
    """[N, H] fp16 per-token scale: max-abs over inlier channels, fp16-safe, never 0."""
    mag = torch.where(inlier_HD, v_NHD.float().abs(), torch.zeros((), device=v_NHD.device)).amax(dim=-1)
    # Rounding to fp16 first means quantize divides by exactly the scale dequantize multiplies by.
    s = mag.clamp(max=_FP16_MAX).to(torch.float16)
    return torch.where(s > 0, s, torch.ones_like(s))


@dataclass(kw_only=True, slots=True)
class QuantizedKV:
    """Quantized keys and values of N tokens of one layer, in per-token rows ready to write into pages.

    Fields: k_codes [N, H, Pk] / v_codes [N, H, P] uint8 (packed, module-docstring layout), v_scale [N, H] fp16,
    k_outliers [N, H, Ok] fp16, v_outliers [N, H, Ov] fp16.
    """

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    k_outliers: torch.Tensor
    v_outliers: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.k_codes.shape[0]


def _check_kv(x: torch.Tensor, profile: KVQuantProfile, name: str) -> None:
    if x.dim() != 3 or x.shape[1:] != (profile.num_kv_heads, profile.head_dim):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be [N, H={profile.num_kv_heads}, "
                         f"D={profile.head_dim}]")


def _gather_channels(x_NHD: torch.Tensor, idx_HO: torch.Tensor) -> torch.Tensor:
    """[N, H, O] fp16 values of the outlier channels."""
    idx = idx_HO.long().unsqueeze(0).expand(x_NHD.shape[0], -1, -1)
    return x_NHD.gather(2, idx).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)


def _restore_channels(x_NHD: torch.Tensor, vals_NHO: torch.Tensor, idx_HO: torch.Tensor) -> torch.Tensor:
    if idx_HO.shape[1] == 0:
        return x_NHD
    idx = idx_HO.long().unsqueeze(0).expand(x_NHD.shape[0], -1, -1)
    return x_NHD.scatter(2, idx, vals_NHO.float())


def quantize_kv(k: torch.Tensor, v: torch.Tensor, profile: KVQuantProfile) -> QuantizedKV:
    """Quantize N tokens of keys (pre-RoPE, per channel) and values (per token) with a calibrated profile.

    Args:
        k: [N, H, D] float keys BEFORE RoPE.
        v: [N, H, D] float values.
        profile: the layer's KVQuantProfile (same device).
    Returns:
        QuantizedKV with k_codes [N, H, Pk] / v_codes [N, H, P] uint8, v_scale [N, H] fp16, k_outliers [N, H, Ok] fp16,
        v_outliers [N, H, Ov] fp16. Magnitudes above 65504 saturate in the fp16 side arrays.
    Raises:
        ValueError: k or v not [N, H, D] matching the profile.
    """
    _check_kv(k, profile, "k")
    _check_kv(v, profile, "v")
    kf, vf = k.float(), v.float()
    k_norm = (kf - profile.k_zero) / profile.k_scale
    if profile.per_channel_keys:
        k_packed = pack_codes_var(_uniform_channel_codes(k_norm, profile.k_bits), profile.k_bits)
    else:
        k_packed = pack_codes(nearest_level(k_norm, profile.k_codebook), profile.bits)
    v_c = vf - profile.v_zero
    v_scale = _value_scale(v_c, _inlier_mask(profile.v_outlier_idx, profile.head_dim))
    v_codes = nearest_level(v_c / v_scale.float()[..., None], profile.v_codebook)
    return QuantizedKV(
        k_codes=k_packed,
        v_codes=pack_codes(v_codes, profile.bits),
        v_scale=v_scale,
        k_outliers=_gather_channels(kf, profile.k_outlier_idx),
        v_outliers=_gather_channels(vf, profile.v_outlier_idx),
    )


def dequantize_keys(k_codes: torch.Tensor, k_outliers: torch.Tensor, profile: KVQuantProfile) -> torch.Tensor:
    """[N, H, Pk] uint8 codes + [N, H, Ok] fp16 outliers -> [N, H, D] fp32 keys (pre-RoPE)."""
    if profile.per_channel_keys:
        level = _uniform_channel_levels(unpack_codes_var(k_codes, profile.k_bits), profile.k_bits)
    else:
        level = profile.k_codebook[unpack_codes(k_codes, profile.bits, profile.head_dim)]
    k = level * profile.k_scale + profile.k_zero
    return _restore_channels(k, k_outliers, profile.k_outlier_idx)


def dequantize_values(v_codes: torch.Tensor, v_scale: torch.Tensor, v_outliers: torch.Tensor,
                      profile: KVQuantProfile) -> torch.Tensor:
    """[N, H, P] uint8 codes, [N, H] fp16 scale, [N, H, Ov] fp16 outliers -> [N, H, D] fp32 values."""
    codes = unpack_codes(v_codes, profile.bits, profile.head_dim)
    v = profile.v_codebook[codes] * v_scale.float()[..., None] + profile.v_zero
    return _restore_channels(v, v_outliers, profile.v_outlier_idx)


def dequantize_kv(q: QuantizedKV, profile: KVQuantProfile) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `quantize_kv`: returns (k [N, H, D] fp32 pre-RoPE, v [N, H, D] fp32)."""
    return (dequantize_keys(q.k_codes, q.k_outliers, profile),
            dequantize_values(q.v_codes, q.v_scale, q.v_outliers, profile))


@dataclass(kw_only=True, slots=True)
class KVPages:
    """Paged quantized KV storage of one layer (layout in the module docstring).

    Fields: k_codes [NB, H, S, Pk] / v_codes [NB, H, S, P] uint8, v_scale [NB, S, H] fp16,
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
            "v_scale": ((nb, s, h), torch.float16),
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
            v_scale=torch.zeros(num_blocks, block_size, h, dtype=f16, device=device),
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


def effective_bits(
    profile: KVQuantProfile,
    *,
    num_tokens: int,
    block_size: int | None = None,
    num_full_precision_tokens: int = 0,
    full_precision_bytes: int = 2,
) -> float:
    """Effective bits per stored K or V element of one layer, counting every byte.

    Counted: packed K and V codes, fp16 V scales, fp16 K and V outlier values (per token); the profile's
    scales, zeros, codebooks and outlier indices (amortised over the tokens); the full-precision tokens
    (sink prefix, unsealed tail) at `full_precision_bytes` bytes per element. With `block_size`, quantized
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


# --- KIVI uniform baseline (arXiv 2402.02750) -------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class KiviQuantized:
    """KIVI-style uniform quantized K/V (arXiv 2402.02750), for benchmark comparison.

    Fields (N tokens, G = group_size, Gv = v_group_size): k_codes / v_codes [N, H, P] uint8 packed like
    `pack_codes`; k_scale / k_zero [N / G, H, D] fp16 (per channel, one group = G consecutive tokens);
    v_scale / v_zero [N, H, D / Gv] fp16 (per token, one group = Gv consecutive channels); bits; group_size;
    v_group_size.
    """

    bits: int
    group_size: int
    v_group_size: int
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor

    def effective_bits(self) -> float:
        """Bits per K/V element counting codes, scales and zeros."""
        n, h, p = self.k_codes.shape
        d = p * 8 // self.bits
        total = sum(t.numel() * t.element_size() for t in (self.k_codes, self.k_scale, self.k_zero,
                                                            self.v_codes, self.v_scale, self.v_zero))
        return total * 8.0 / (n * 2 * h * d)


def _uniform_group(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization with min/max over `dim`; returns codes, fp16 scale, fp16 zero."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    zero = lo.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
    scale = ((hi - lo) / ((1 << bits) - 1)).clamp(max=_FP16_MAX).to(torch.float16)
    s = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = torch.round((x - zero.float()) / s).clamp(0, (1 << bits) - 1).to(torch.int64)
    return codes, scale, zero


def kivi_quantize(k: torch.Tensor, v: torch.Tensor, *, bits: int, group_size: int = 32,
                  v_group_size: int | None = None) -> KiviQuantized:
    """Uniform KIVI quantization: keys per channel over groups of `group_size` tokens, values per token over
    groups of `v_group_size` channels, each group with fp16 scale and zero (KIVI, arXiv 2402.02750).

    Effective bits = bits + 16 / group_size (K) averaged with bits + 16 / v_group_size (V); larger groups
    are how the baseline is brought to a given bit budget (e.g. G = 128 tokens, Gv = 64 channels: bits + 0.375).

    Args:
        k, v: [N, H, D] float (KIVI quantizes post-RoPE keys; either works here).
        bits: 2, 3 or 4 bits per element.
        group_size: G tokens per key group; N must be a multiple of G (KIVI keeps the remainder in full
            precision).
        v_group_size: Gv channels per value group (default G); D must be a multiple of Gv.
    Returns:
        KiviQuantized.
    Raises:
        ValueError: shape mismatch, unsupported bits, a group size < 1, N not a multiple of group_size or D
            not a multiple of v_group_size.
    """
    _check_bits(bits)
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} must both be [N, H, D]")
    n, h, d = k.shape
    gv = group_size if v_group_size is None else v_group_size
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide N={n}")
    if gv < 1 or d % gv:
        raise ValueError(f"v_group_size={gv} must be >= 1 and divide D={d}")
    packed_bytes(d, bits)
    kg = k.float().reshape(n // group_size, group_size, h, d)
    k_codes, k_scale, k_zero = _uniform_group(kg, bits, dim=1)
    vg = v.float().reshape(n, h, d // gv, gv)
    v_codes, v_scale, v_zero = _uniform_group(vg, bits, dim=3)
    return KiviQuantized(
        bits=bits, group_size=group_size, v_group_size=gv,
        k_codes=pack_codes(k_codes.reshape(n, h, d), bits), k_scale=k_scale.squeeze(1), k_zero=k_zero.squeeze(1),
        v_codes=pack_codes(v_codes.reshape(n, h, d), bits), v_scale=v_scale.squeeze(3), v_zero=v_zero.squeeze(3),
    )


def kivi_dequantize(q: KiviQuantized) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `kivi_quantize`: returns (k, v), each [N, H, D] fp32."""
    n, h, p = q.k_codes.shape
    d, g, gv = p * 8 // q.bits, q.group_size, q.v_group_size
    kc = unpack_codes(q.k_codes, q.bits, d).float().reshape(n // g, g, h, d)
    k = kc * q.k_scale.float().unsqueeze(1) + q.k_zero.float().unsqueeze(1)
    vc = unpack_codes(q.v_codes, q.bits, d).float().reshape(n, h, d // gv, gv)
    v = vc * q.v_scale.float().unsqueeze(3) + q.v_zero.float().unsqueeze(3)
    return k.reshape(n, h, d), v.reshape(n, h, d)
