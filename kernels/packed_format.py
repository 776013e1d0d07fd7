"""The packed sub-4-bit weight format: bit layout, `pack_codes`, and the containers `PackedWeight` / `PackedExperts`.

Shape legend: E = experts, T = tokens, D = hidden, I = expert intermediate, K = input dim,
N = output dim, G = groups along K = ceil(K / group_size), W = int32 words per row = ceil(K * bits / 32),
L = codebook levels = 2**bits. A weight is `[N, K]` (or a stack `[E, N, K]`) and a layer computes `x @ w.T`.

Each row is cut along K into groups of `group_size` inputs (the last group is shorter when K is not a
multiple); each group has an fp16 `scale` s and an fp16 `zero` z (in code units), and

    w[n, k] ~= (level[q[n, k]] - z[n, g]) * s[n, g],      g = k // group_size

with `level[q] = q` on the uniform grid, or a per-matrix table of L fp16 levels in code units [0, L-1] (the
codebook). How codes, scales, zeros and levels are chosen: `kernels.packed_quantize`; the ops that read the
format: `kernels.packed_weights` (PyTorch reference) and `kernels.packed_weights_triton`.

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
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 3, 4)
SUPPORTED_GROUP_SIZES = (32, 64, 128)

__all__ = ["SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "PackedWeight", "PackedExperts", "words_per_row", "pack_codes"]


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
