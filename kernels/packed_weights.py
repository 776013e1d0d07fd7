"""Packed sub-4-bit expert weights: quantize, pack, unpack, dequantize, and the PyTorch reference ops.

Shape legend: E = experts, T = tokens, D = hidden, I = expert intermediate, K = input dim,
N = output dim, G = groups along K = ceil(K / group_size), W = int32 words per row = ceil(K * bits / 32),
L = codebook levels = 2**bits. A weight is `[N, K]` (or a stack `[E, N, K]`) and a layer computes `x @ w.T`.

Method
------
Group-wise asymmetric quantization, as in GPTQ / AWQ-style inference kernels: each row is cut along K into
groups of `group_size` inputs (the last group is shorter when K is not a multiple), and each group has an
fp16 `scale` s and an fp16 `zero` z (in code units), so that

    w[n, k] ~= (level[q[n, k]] - z[n, g]) * s[n, g],      g = k // group_size

With the uniform grid, `level[q] = q` for integer codes q in [0, L-1]. With a codebook, `level` is a per-matrix
table of L fp16 values in code units [0, L-1], fitted by Lloyd-Max / 1-D k-means on the group-normalised
weights `w / s + z` (the non-uniform, sensitivity-free variant of SqueezeLLM, arXiv 2306.07629). The group
range is widened to include 0 (as GPTQ's quantizer does), which keeps `z` inside [0, L-1]: it never overflows
fp16 and keeps about 3 decimal digits, whatever the sign of the group.

Bit layout of `codes` (int32 words, `[*, N, W]`, W = ceil(K * bits / 32))
----------------------------------------------------------------------
Each row is its own little-endian bit stream: code k of a row occupies stream bits [k*bits, k*bits + bits),
and stream bit p is bit (p % 32) of word p // 32 of that row (bit 0 = least significant; the words are
stored as int32 but read as uint32). Rows start on a word boundary and the < 32 spare bits at the end of a
row are zero. So 2- and 4-bit codes never straddle words (16 and 8 per word), and 3-bit codes cost exactly
3 bits: 32 codes fill 3 words, codes 10 and 21 of each such run straddle two words.

Why this layout: one formula unpacks all of b = 2, 3, 4 with two 32-bit loads and 32-bit shifts only,

    lo = word[(k*b) >> 5], hi = word[(k*b + b - 1) >> 5], off = (k*b) & 31
    q  = ((lo >> off) | ((hi << 1) << (31 - off))) & (2**b - 1)

(the split shift keeps every shift amount in [0, 31], where GPU shifts are defined; when the code does not
straddle, `hi`'s bits land above bit b - 1 and the mask drops them). Word-aligned rows let a kernel address
any (row, k) directly, split the output rows over programs, and concatenate matrices along N (fused
gate_up) without repacking. The alternatives cost more: 10 codes per int32 wastes 2 bits in 32 (3.2 bits
per weight), and 8 codes in 3 bytes needs byte gathers and three shift patterns.

Storage per weight (bits): codes 32 * W / K (= b when K * b is a multiple of 32), plus 32 / group_size for
the fp16 scale and zero, plus 16 * L / (N * K) for a codebook; `PackedWeight.effective_bits` counts them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kernels.codebook import lloyd_max
from kernels.cpu import dequant_packed
import torch.nn.functional as F

SUPPORTED_BITS = (2, 3, 4)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# Smallest normal fp16: a group whose range is below (L - 1) * this is rounded on a coarser grid rather
# than letting the stored scale flush to zero.
_MIN_SCALE = 2.0**-14
_FP16_MAX = 65504.0

__all__ = [
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "PackedWeight",
    "PackedExperts",
    "words_per_row",
    "pack_codes",
    "unpack_codes",
    "fit_codebook",
    "quantize",
    "quantize_experts",
    "dequantize",
    "gemv",
    "grouped_gemm",
    "packed_expert_ffn",
    "expert_offsets_from",
]


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported (expected one of {SUPPORTED_BITS})")


def _check_group_size(group_size: int) -> None:
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size={group_size} is not supported (expected one of {SUPPORTED_GROUP_SIZES})")


def words_per_row(k: int, bits: int) -> int:
    """Number of int32 words W that hold one row of `k` codes of `bits` bits: ceil(k * bits / 32)."""
    return (k * bits + 31) // 32


def _code_word_index(k: int, bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For codes 0..k-1 of a row: first word `[k]`, last word `[k]`, bit offset in the first word `[k]` (int64)."""
    bit = torch.arange(k, device=device, dtype=torch.int64) * bits
    return bit >> 5, (bit + bits - 1) >> 5, bit & 31


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes into the row-aligned bit stream described in the module docstring.

    Args:
        codes: `[*, K]` integer tensor (any int dtype), values in [0, 2**bits - 1].
        bits: 2, 3 or 4.
    Returns:
        `[*, W]` int32, W = ceil(K * bits / 32); the spare high bits of a row's last word are zero.
    Raises:
        ValueError: `bits` unsupported, `codes` not integer, or a code outside [0, 2**bits - 1].
    """
    _check_bits(bits)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got dtype={codes.dtype}")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}] for bits={bits}, "
                         f"got [{int(c.min())}, {int(c.max())}]")
    k = c.shape[-1]
    w0, w1, off = _code_word_index(k, bits, c.device)
    words = torch.zeros(*c.shape[:-1], words_per_row(k, bits), dtype=torch.int64, device=c.device)
    # The bit fields of different codes are disjoint, so adding them is the same as OR-ing them.
    words.index_add_(-1, w0, (c << off) & 0xFFFFFFFF)
    straddle = w1 != w0
    if bool(straddle.any()):
        idx = straddle.nonzero().squeeze(-1)
        words.index_add_(-1, w1[idx], c[..., idx] >> (32 - off[idx]))
    # Reinterpret uint32 as int32 (two's complement) so the storage is a plain int32 tensor.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32)


_SHIFTS: dict = {}  # (bits, device) -> shift amounts of `_unpack_int32`


def _unpack_shifts(bits: int, device: torch.device):
    """Shift amounts for `_unpack_int32`, cached per (bits, device): `[32 // bits]` int32 for 2 and 4 bits; for
    3 bits the in-word codes of each of a 96-bit run's three words, `([10], [10], [10])` (see there)."""
    key = (bits, str(device))
    t = _SHIFTS.get(key)
    if t is None:
        if bits == 3:
            t = tuple(torch.arange(first, 30, 3, dtype=torch.int32, device=device) for first in (0, 1, 2))
        else:
            t = torch.arange(0, 32, bits, dtype=torch.int32, device=device)
        _SHIFTS[key] = t
    return t


def _unpack_int32(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """`[*, W]` int32 packed rows -> `[*, K]` int32 codes (no checks; the layout of the module docstring).

    Vectorised over whole words in int32 (a handful of ops per matrix, no int64 gather): 2- and 4-bit codes
    never straddle words, so code j of a word is `(word >> bits * j) & mask`; 3-bit codes repeat every 96 bits
    (3 words, 32 codes): each word holds 10 whole codes (at bit offsets 0, 1, 2 of words 0, 1, 2 of the run)
    and codes 10 and 21 straddle words 0-1 and 1-2. An arithmetic right shift only fills bits above the ones
    the mask keeps, so the int32 sign does not matter.
    """
    m = (1 << bits) - 1
    if bits != 3:
        return ((words.unsqueeze(-1) >> _unpack_shifts(bits, words.device)) & m).flatten(-2)[..., :k]
    n_words = words.shape[-1]
    runs = -(-n_words // 3)
    if n_words != 3 * runs:
        words = F.pad(words, (0, 3 * runs - n_words))
    w = words.unflatten(-1, (runs, 3))
    w0, w1, w2 = w[..., 0:1], w[..., 1:2], w[..., 2:3]
    s0, s1, s2 = _unpack_shifts(3, words.device)
    c10 = ((w0 >> 30) & 3) | ((w1 & 1) << 2)
    c21 = ((w1 >> 31) & 1) | ((w2 & 3) << 1)
    return torch.cat([(w0 >> s0) & m, c10, (w1 >> s1) & m, c21, (w2 >> s2) & m], -1).flatten(-2)[..., :k]


def unpack_codes(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of `pack_codes`.

    Args:
        words: `[*, W]` int32 packed rows.
        bits: 2, 3 or 4.
        k: number of codes per row K; needs W == ceil(K * bits / 32).
    Returns:
        `[*, K]` uint8 codes in [0, 2**bits - 1].
    Raises:
        ValueError: `bits` unsupported, `words` not int32, or W does not match `k`.
    """
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"words must be int32, got dtype={words.dtype}")
    if words.shape[-1] != words_per_row(k, bits):
        raise ValueError(f"words has {words.shape[-1]} words per row, expected {words_per_row(k, bits)} "
                         f"for k={k}, bits={bits}")
    return _unpack_int32(words, bits, k).to(torch.uint8)


def fit_codebook(u: torch.Tensor, bits: int, *, iters: int = 30, max_samples: int = 1 << 18) -> torch.Tensor:
    """Fit 2**bits non-uniform levels to normalised weights by Lloyd-Max (1-D k-means, squared error).

    Source: Lloyd (1982) / Max (1960) scalar quantizer; SqueezeLLM (arXiv 2306.07629) uses the same
    k-means over weight values (there weighted by Fisher information; here unweighted).

    Args:
        u: any-shape float tensor of group-normalised weights in code units, nominally in [0, 2**bits - 1].
        bits: 2, 3 or 4.
        iters: Lloyd iterations (each: assign to nearest level, move level to its cluster mean).
        max_samples: above this many values a deterministic strided subsample is fitted (the levels are
            a 1-D distribution summary; 2**18 samples pin them to ~1e-3 code units).
    Returns:
        `[2**bits]` float32 levels, sorted ascending.
    Raises:
        ValueError: `bits` unsupported, `u` empty, or `iters` < 1.
    """
    _check_bits(bits)
    if u.numel() == 0:
        raise ValueError("u is empty: cannot fit a codebook to zero weights")
    if iters < 1:
        raise ValueError(f"iters={iters} must be >= 1")
    v = u.detach().reshape(-1).float()
    if v.numel() > max_samples:
        v = v[:: math.ceil(v.numel() / max_samples)]
    return lloyd_max(v, 1 << bits, iters)


def _nearest_level(u: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted `levels` `[L]` for each value of `u` (int64, same shape)."""
    return torch.bucketize(u, (levels[1:] + levels[:-1]) / 2)


@dataclass(kw_only=True, slots=True)
class PackedWeight:
    """One packed matrix `[N, K]`, or a stack of E matrices `[E, N, K]` (one per expert).

    Fields:
        codes: `[*, N, W]` int32, W = ceil(K * bits / 32), layout in the module docstring.
        scales: `[*, N, G]` fp16, G = ceil(K / group_size) (> 0 when made by `quantize`; not checked here).
        zeros: `[*, N, G]` fp16, zero point in code units (in [0, 2**bits - 1] when made by `quantize`).
        codebook: None (uniform grid) or `[*, 2**bits]` fp16 levels in code units, one table per matrix.
        bits: bits per code, 2, 3 or 4.
        group_size: inputs per scale/zero group, 32, 64 or 128.
        shape: logical shape, `(N, K)` or `(E, N, K)`.
    Raises (in `__post_init__`): ValueError naming the field whose dtype, shape, device or value is off.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    codebook: torch.Tensor | None = None
    bits: int
    group_size: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_group_size(self.group_size)
        self.shape = tuple(int(s) for s in self.shape)
        if len(self.shape) not in (2, 3) or min(self.shape) < 1:
            raise ValueError(f"shape={self.shape} must be (N, K) or (E, N, K) with every size >= 1")
        *lead, n, k = self.shape
        g = -(-k // self.group_size)
        expect = {
            "codes": (self.codes, torch.int32, (*lead, n, words_per_row(k, self.bits))),
            "scales": (self.scales, torch.float16, (*lead, n, g)),
            "zeros": (self.zeros, torch.float16, (*lead, n, g)),
        }
        if self.codebook is not None:
            expect["codebook"] = (self.codebook, torch.float16, (*lead, 1 << self.bits))
        for name, (t, dtype, shape) in expect.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise ValueError(f"{name}.dtype={t.dtype}, expected {dtype}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}.shape={tuple(t.shape)}, expected {shape} for shape={self.shape}, "
                                 f"bits={self.bits}, group_size={self.group_size}")
            if t.device != self.codes.device:
                raise ValueError(f"{name}.device={t.device} differs from codes.device={self.codes.device}")

    @property
    def out_features(self) -> int:
        """N."""
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        """K."""
        return self.shape[-1]

    @property
    def num_experts(self) -> int | None:
        """E for a stack `[E, N, K]`, None for a single matrix."""
        return self.shape[0] if len(self.shape) == 3 else None

    @property
    def num_groups(self) -> int:
        """G = ceil(K / group_size)."""
        return self.scales.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def __getitem__(self, e: int) -> PackedWeight:
        """Expert `e` of a stack, as a `[N, K]` PackedWeight sharing storage. Raises ValueError on a 2-D weight."""
        if self.num_experts is None:
            raise ValueError(f"cannot index a single matrix of shape={self.shape}; only stacks (E, N, K)")
        return PackedWeight(codes=self.codes[e], scales=self.scales[e], zeros=self.zeros[e],
                            codebook=None if self.codebook is None else self.codebook[e],
                            bits=self.bits, group_size=self.group_size, shape=self.shape[1:])

    def to(self, device: torch.device | str) -> PackedWeight:
        """Copy to `device` (dtypes kept)."""
        return PackedWeight(codes=self.codes.to(device), scales=self.scales.to(device), zeros=self.zeros.to(device),
                            codebook=None if self.codebook is None else self.codebook.to(device),
                            bits=self.bits, group_size=self.group_size, shape=self.shape)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.zeros, self.codebook) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes + scales + zeros + codebook."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def effective_bits(self) -> float:
        """Stored bits per weight: 8 * nbytes / numel(shape), counting codes (with row padding), the fp16
        scales and zeros and the fp16 codebook. E.g. bits=3, group_size=64, K a multiple of 64 and no
        codebook: 3 + 2 * 16 / 64 = 3.5."""
        return 8 * self.nbytes / math.prod(self.shape)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Flat `{name: tensor}` for `safetensors.torch.save_file`.

        Keys: `{prefix}.qcodes`, `.qscales`, `.qzeros`, `.qcodebook` (only with a codebook) and `.qmeta`, an
        int64 `[2 + len(shape)]` tensor `[bits, group_size, *shape]` so the file alone rebuilds the weight.
        The tensors are the stored ones (no copy); `.contiguous()` views of a stack may share storage.
        """
        out = {f"{prefix}.qcodes": self.codes.contiguous(), f"{prefix}.qscales": self.scales.contiguous(),
               f"{prefix}.qzeros": self.zeros.contiguous(),
               f"{prefix}.qmeta": torch.tensor([self.bits, self.group_size, *self.shape], dtype=torch.int64)}
        if self.codebook is not None:
            out[f"{prefix}.qcodebook"] = self.codebook.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str) -> PackedWeight:
        """Rebuild from `to_tensors(prefix)` output (e.g. `safetensors.torch.load_file`).

        Raises:
            ValueError: a required key `{prefix}.q*` is missing or the tensors disagree with `.qmeta`.
        """
        keys = ("qcodes", "qscales", "qzeros", "qmeta")
        missing = [f"{prefix}.{k}" for k in keys if f"{prefix}.{k}" not in tensors]
        if missing:
            raise ValueError(f"missing packed-weight tensors {missing}")
        meta = [int(v) for v in tensors[f"{prefix}.qmeta"].tolist()]
        return cls(codes=tensors[f"{prefix}.qcodes"], scales=tensors[f"{prefix}.qscales"],
                   zeros=tensors[f"{prefix}.qzeros"], codebook=tensors.get(f"{prefix}.qcodebook"),
                   bits=meta[0], group_size=meta[1], shape=tuple(meta[2:]))


def _quantize_matrix(w: torch.Tensor, bits: int, group_size: int, codebook: bool, kmeans_iters: int):
    """One `[N, K]` fp32 matrix -> (codes `[N, W]` int32, scales `[N, G]` fp16, zeros `[N, G]` fp16,
    codebook `[L]` fp16 or None)."""
    n, k = w.shape
    n_levels = 1 << bits
    g = -(-k // group_size)
    # Zero padding of the tail group is harmless because the range includes 0 anyway.
    wg = F.pad(w, (0, g * group_size - k)).reshape(n, g, group_size)
    lo = wg.amin(-1).clamp(max=0)
    hi = wg.amax(-1).clamp(min=0)
    scale = ((hi - lo) / (n_levels - 1)).clamp(min=_MIN_SCALE)
    if float(scale.max()) > _FP16_MAX:
        raise ValueError(f"weight range {float((hi - lo).max()):.4g} needs a scale above the fp16 maximum {_FP16_MAX}")
    scale16 = scale.half()
    zero16 = (-lo / scale16.float()).clamp(0, n_levels - 1).half()
    # Normalise with the stored fp16 values so the codes are optimal for what dequantize will read.
    s = scale16.float().repeat_interleave(group_size, -1)[:, :k]
    z = zero16.float().repeat_interleave(group_size, -1)[:, :k]
    u = w / s + z  # [N, K], code units
    levels16 = None
    if codebook:
        levels16 = fit_codebook(u, bits, iters=kmeans_iters).half()
        levels16, _ = torch.sort(levels16)
        q = _nearest_level(u, levels16.float())
    else:
        q = torch.round(u).clamp_(0, n_levels - 1)
    return pack_codes(q.to(torch.int64), bits), scale16, zero16, levels16


def quantize(w: torch.Tensor, *, bits: int = 4, group_size: int = 128, codebook: bool = False,
             kmeans_iters: int = 30) -> PackedWeight:
    """Quantize and pack a weight matrix (or a stack of expert matrices) group-wise along K.

    Source: group-wise asymmetric min/max quantization (GPTQ / AWQ-style kernels' storage format, without
    their error-compensating updates); optional per-matrix non-uniform codebook by Lloyd-Max k-means on the
    group-normalised weights (SqueezeLLM, arXiv 2306.07629, unweighted).

    Args:
        w: `[N, K]` or `[E, N, K]` float (fp32 / fp16 / bf16; computed in fp32), finite.
        bits: bits per code, 2, 3 or 4.
        group_size: inputs per scale/zero group, 32, 64 or 128; K need not be a multiple (short tail group).
        codebook: fit a 2**bits-level codebook per matrix (per expert for a stack) instead of the uniform grid.
        kmeans_iters: Lloyd iterations when `codebook` is set.
    Returns:
        PackedWeight with `shape == tuple(w.shape)`, on `w.device`.
    Raises:
        ValueError: `bits` / `group_size` unsupported, `w` not 2-D/3-D, empty, not floating point, not
        finite, or so large that a group scale exceeds the fp16 maximum 65504.
    """
    _check_bits(bits)
    _check_group_size(group_size)
    if w.dim() not in (2, 3) or w.numel() == 0:
        raise ValueError(f"w must be a non-empty [N, K] or [E, N, K] tensor, got shape={tuple(w.shape)}")
    if not w.dtype.is_floating_point:
        raise ValueError(f"w must be floating point, got dtype={w.dtype}")
    wf = w.detach().float()
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("w contains inf or nan")
    # One matrix at a time: bounds the int64 packing temporaries and gives each expert its own codebook.
    parts = [_quantize_matrix(m, bits, group_size, codebook, kmeans_iters) for m in wf.reshape(-1, *w.shape[-2:])]
    codes, scales, zeros, books = (list(x) for x in zip(*parts))
    if w.dim() == 2:
        return PackedWeight(codes=codes[0], scales=scales[0], zeros=zeros[0], codebook=books[0],
                            bits=bits, group_size=group_size, shape=tuple(w.shape))
    return PackedWeight(codes=torch.stack(codes), scales=torch.stack(scales), zeros=torch.stack(zeros),
                        codebook=torch.stack(books) if codebook else None,
                        bits=bits, group_size=group_size, shape=tuple(w.shape))


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float32, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Unpack and dequantize: `(level[q] - zero) * scale` computed in fp32.

    Vectorised per matrix (`_unpack_int32`, then the group's zero and scale broadcast over its inputs rather
    than repeated per input): about 3 ns per weight on one CPU core, 12x the old per-code int64 gather.

    Args:
        pw: PackedWeight of shape `(N, K)` or `(E, N, K)`.
        dtype: output dtype.
        out: optional preallocated `[N, K]` / `[E, N, K]` tensor of `dtype` on `pw.device` to write into (a
            cache slot); returned.
    Returns:
        `[N, K]` or `[E, N, K]` tensor of `dtype` on `pw.device`.
    Raises:
        ValueError: `out` of the wrong shape, dtype or device.
    """
    k, gs = pw.in_features, pw.group_size
    if out is not None and (tuple(out.shape) != pw.shape or out.dtype != dtype or out.device != pw.device):
        raise ValueError(f"out has shape={tuple(out.shape)}, dtype={out.dtype}, device={out.device}; expected "
                         f"shape={pw.shape}, dtype={dtype}, device={pw.device}")
    if dtype == torch.float32:  # CPU: one compiled pass, bit-identical to the ops below
        fast = dequant_packed(pw.codes, pw.scales, pw.zeros, pw.codebook, pw.bits, gs, pw.shape, out)
        if fast is not None:
            return fast
    q = _unpack_int32(pw.codes, pw.bits, k)  # [*, N, K] int32
    if pw.codebook is None:
        lv = q.float()
    else:
        cb = pw.codebook.float()
        if cb.dim() == 1:
            lv = cb[q.long()]
        else:
            lv = torch.gather(cb[:, None, :].expand(-1, q.shape[1], -1), -1, q.long())
    g = pw.num_groups
    if g * gs != k:  # a tail group: pad to whole groups, cut after
        lv = F.pad(lv, (0, g * gs - k))
    z, s = pw.zeros.float().unsqueeze(-1), pw.scales.float().unsqueeze(-1)  # [*, N, G, 1]
    w = lv.unflatten(-1, (g, gs)).sub_(z).mul_(s).flatten(-2)[..., :k]
    if out is not None:
        return out.copy_(w)
    return w.to(dtype).contiguous()


def _check_x(x: torch.Tensor, pw: PackedWeight, ndim: int, name: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape={tuple(x.shape)}")
    if x.shape[-1] != pw.in_features:
        raise ValueError(f"{name}.shape[-1]={x.shape[-1]} does not match the weight's K={pw.in_features}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating point, got dtype={x.dtype}")
    if x.device != pw.device:
        raise ValueError(f"{name}.device={x.device} differs from the weight's device {pw.device}")


def gemv(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """One token through one packed matrix: `dequantize(pw) @ x` with fp32 accumulation.

    Args:
        x: `[K]` float (fp32 / fp16 / bf16).
        pw: PackedWeight of shape `(N, K)`.
    Returns:
        `[N]` tensor of `x.dtype`.
    Raises:
        ValueError: `pw` is a stack, `x` not 1-D, K mismatch, or device mismatch.
    """
    if pw.num_experts is not None:
        raise ValueError(f"gemv needs a single (N, K) weight, got shape={pw.shape}")
    _check_x(x, pw, 1, "x")
    return (dequantize(pw) @ x.float()).to(x.dtype)


def expert_offsets_from(routing: torch.Tensor, num_experts: int, num_tokens: int, *,
                        check: bool = True) -> torch.Tensor:
    """Normalise the token-to-expert split to offsets `[E+1]` int64 (offsets[e]:offsets[e+1] are expert e's rows).

    Args:
        routing: `[E+1]` cumulative offsets starting at 0, or `[E]` tokens per expert (told apart by length).
        num_experts: E.
        num_tokens: T, which the split must cover exactly.
        check: validate the values (reads them on the host; the Triton path skips this on CUDA to stay
            free of device syncs).
    Returns:
        `[E+1]` int64 on `routing.device`.
    Raises:
        ValueError: wrong length, non-integer dtype, negative counts / decreasing offsets, offsets[0] != 0,
        or a total different from T.
    """
    if routing.dim() != 1 or routing.shape[0] not in (num_experts, num_experts + 1):
        raise ValueError(f"expert_offsets must be [E+1]={num_experts + 1} offsets or [E]={num_experts} "
                         f"tokens per expert, got shape={tuple(routing.shape)}")
    if routing.dtype.is_floating_point or routing.dtype == torch.bool:
        raise ValueError(f"expert_offsets must be an integer tensor, got dtype={routing.dtype}")
    r = routing.to(torch.int64)
    if r.shape[0] == num_experts:
        offsets = F.pad(torch.cumsum(r, 0), (1, 0))
        counts = r
    else:
        offsets = r
        counts = r[1:] - r[:-1]
    if check:
        if int(offsets[0]) != 0:
            raise ValueError(f"expert_offsets[0]={int(offsets[0])} must be 0")
        if num_experts and int(counts.min()) < 0:
            raise ValueError(f"tokens per expert must be >= 0 (offsets non-decreasing), got {counts.tolist()}")
        if int(offsets[-1]) != num_tokens:
            raise ValueError(f"expert offsets cover {int(offsets[-1])} tokens but x has T={num_tokens}")
    return offsets


def grouped_gemm(x: torch.Tensor, expert_offsets: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """Many tokens through their experts: rows offsets[e]:offsets[e+1] of `x` times `dequantize(pw[e]).T`.

    Args:
        x: `[T, K]` float, rows sorted by expert (T may be 0).
        expert_offsets: `[E+1]` int offsets (from 0 to T) or `[E]` int tokens per expert; experts may have 0.
        pw: PackedWeight stack of shape `(E, N, K)`.
    Returns:
        `[T, N]` tensor of `x.dtype` (fp32 accumulation).
    Raises:
        ValueError: `pw` not a stack, `x` not `[T, K]`, or a bad split (see `expert_offsets_from`).
    """
    if pw.num_experts is None:
        raise ValueError(f"grouped_gemm needs a stacked (E, N, K) weight, got shape={pw.shape}")
    _check_x(x, pw, 2, "x")
    offsets = expert_offsets_from(expert_offsets, pw.num_experts, x.shape[0]).tolist()
    out = torch.zeros(x.shape[0], pw.out_features, dtype=torch.float32, device=x.device)
    for e in range(pw.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            out[lo:hi] = x[lo:hi].float() @ dequantize(pw[e]).T
    return out.to(x.dtype)


@dataclass(kw_only=True, slots=True)
class PackedExperts:
    """The packed weights of E routed experts of one MoE layer.

    Either separate `gate` `(E, I, D)` and `up` `(E, I, D)`, or one fused `gate_up` `(E, 2I, D)` whose rows
    [0, I) are gate and [I, 2I) are up; plus `down` `(E, D, I)`. The expert computes
    `down(act(gate x) * up x)`.
    Raises (in `__post_init__`): ValueError when both or neither of (gate and up) / gate_up are given,
    a field is not a stack, or E, D, I disagree between fields.
    """

    down: PackedWeight
    gate: PackedWeight | None = None
    up: PackedWeight | None = None
    gate_up: PackedWeight | None = None

    def __post_init__(self) -> None:
        separate = self.gate is not None or self.up is not None
        if separate == (self.gate_up is not None) or (separate and (self.gate is None or self.up is None)):
            raise ValueError("give either both gate and up, or gate_up alone")
        for name in ("gate", "up", "gate_up", "down"):
            pw = getattr(self, name)
            if pw is not None and pw.num_experts is None:
                raise ValueError(f"{name} must be a stacked (E, N, K) PackedWeight, got shape={pw.shape}")
        e, d, i = self.down.shape
        if self.gate_up is not None:
            want = {"gate_up": (e, 2 * i, d)}
        else:
            want = {"gate": (e, i, d), "up": (e, i, d)}
        for name, shape in want.items():
            got = getattr(self, name).shape
            if got != shape:
                raise ValueError(f"{name}.shape={got} does not match down.shape={self.down.shape} (expected {shape})")
            if getattr(self, name).device != self.down.device:
                raise ValueError(f"{name} is on {getattr(self, name).device} but down is on {self.down.device}")

    @property
    def num_experts(self) -> int:
        return self.down.shape[0]

    @property
    def hidden_size(self) -> int:
        """D."""
        return self.down.shape[1]

    @property
    def intermediate_size(self) -> int:
        """I."""
        return self.down.shape[2]

    @property
    def fused(self) -> bool:
        return self.gate_up is not None

    def _parts(self) -> dict[str, PackedWeight]:
        names = ("gate_up", "down") if self.fused else ("gate", "up", "down")
        return {n: getattr(self, n) for n in names}

    @property
    def nbytes(self) -> int:
        """Bytes stored over all projections."""
        return sum(pw.nbytes for pw in self._parts().values())

    def effective_bits(self) -> float:
        """Stored bits per weight over all projections (codes, scales, zeros, codebooks)."""
        numel = sum(math.prod(pw.shape) for pw in self._parts().values())
        return 8 * self.nbytes / numel

    def to(self, device: torch.device | str) -> PackedExperts:
        return PackedExperts(**{n: pw.to(device) for n, pw in self._parts().items()})

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Flat dict for safetensors: `PackedWeight.to_tensors(f"{prefix}.{name}")` for each projection
        (name in gate, up, down or gate_up, down)."""
        out: dict[str, torch.Tensor] = {}
        for name, pw in self._parts().items():
            out.update(pw.to_tensors(f"{prefix}.{name}"))
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str) -> PackedExperts:
        """Inverse of `to_tensors`; fused when `{prefix}.gate_up.qmeta` is present.
        Raises ValueError on missing keys or inconsistent shapes."""
        names = ("gate_up", "down") if f"{prefix}.gate_up.qmeta" in tensors else ("gate", "up", "down")
        return cls(**{n: PackedWeight.from_tensors(tensors, f"{prefix}.{n}") for n in names})


def quantize_experts(gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor, *, bits: int = 4,
                     group_size: int = 128, codebook: bool = False, fuse_gate_up: bool = False,
                     kmeans_iters: int = 30) -> PackedExperts:
    """Quantize stacked full-precision expert weights (see `quantize` for the method and errors).

    Args:
        gate_proj: `[E, I, D]` float.
        up_proj: `[E, I, D]` float.
        down_proj: `[E, D, I]` float.
        bits, group_size, codebook, kmeans_iters: as in `quantize`, applied to every projection.
        fuse_gate_up: store gate and up as one `[E, 2I, D]` matrix per expert (one codebook for both),
            so a kernel reads one weight and launches once for the two projections.
    Returns:
        PackedExperts.
    Raises:
        ValueError: shapes not `[E, I, D]`, `[E, I, D]`, `[E, D, I]`, plus everything `quantize` raises.
    """
    if gate_proj.dim() != 3 or up_proj.shape != gate_proj.shape:
        raise ValueError(f"gate_proj and up_proj must both be [E, I, D], got {tuple(gate_proj.shape)} and "
                         f"{tuple(up_proj.shape)}")
    e, i, d = gate_proj.shape
    if tuple(down_proj.shape) != (e, d, i):
        raise ValueError(f"down_proj.shape={tuple(down_proj.shape)}, expected [E, D, I]={(e, d, i)}")
    kw = dict(bits=bits, group_size=group_size, codebook=codebook, kmeans_iters=kmeans_iters)
    down = quantize(down_proj, **kw)
    if fuse_gate_up:
        return PackedExperts(gate_up=quantize(torch.cat([gate_proj, up_proj], dim=1), **kw), down=down)
    return PackedExperts(gate=quantize(gate_proj, **kw), up=quantize(up_proj, **kw), down=down)


def _check_ffn_input(x_sorted: torch.Tensor, experts: PackedExperts) -> None:
    if x_sorted.dim() != 2 or x_sorted.shape[1] != experts.hidden_size:
        raise ValueError(f"x_sorted must be [T, D={experts.hidden_size}], got shape={tuple(x_sorted.shape)}")


def packed_expert_ffn(x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor, experts: PackedExperts, *,
                      act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """Expert FFN over tokens sorted by expert: for expert e's rows, `down(act(gate x) * up x)`.

    Args:
        x_sorted: `[T, D]` float, rows grouped by expert in expert order (T may be 0).
        tokens_per_expert: `[E]` int tokens per expert (or `[E+1]` offsets); zeros allowed.
        experts: PackedExperts with E experts.
        act: elementwise activation applied to the gate projection (SwiGLU's silu by default).
    Returns:
        `[T, D]` tensor of `x_sorted.dtype`; the `[T, I]` intermediate is rounded to that dtype.
    Raises:
        ValueError: `x_sorted` not `[T, D]` or a bad split (see `expert_offsets_from`).
    """
    _check_ffn_input(x_sorted, experts)
    offsets = expert_offsets_from(tokens_per_expert, experts.num_experts, x_sorted.shape[0])
    if experts.fused:
        g, u = grouped_gemm(x_sorted, offsets, experts.gate_up).split(experts.intermediate_size, dim=1)
    else:
        g, u = grouped_gemm(x_sorted, offsets, experts.gate), grouped_gemm(x_sorted, offsets, experts.up)
    # The product is formed in fp32 and rounded once to the activation dtype, as HF MoE blocks do.
    h = (act(g.float()) * u.float()).to(x_sorted.dtype)  # [T, I]
    return grouped_gemm(h, offsets, experts.down)
