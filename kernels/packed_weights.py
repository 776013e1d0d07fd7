"""PyTorch reference ops on packed sub-4-bit weights: unpack, dequantize, GEMV, grouped GEMM, expert FFN.

Shape legend: E = experts, T = tokens, D = hidden, I = expert intermediate, K = input dim,
N = output dim, G = groups along K = ceil(K / group_size), W = int32 words per row = ceil(K * bits / 32),
L = codebook levels = 2**bits. A weight is `[N, K]` (or a stack `[E, N, K]`) and a layer computes `x @ w.T`.

The format (bit layout, `PackedWeight`, `PackedExperts`) is `kernels.packed_format`; weights are made by
`kernels.packed_quantize`. `kernels.packed_weights_triton` has the same functions with the same signatures
and results (the fast path); these are the readable reference and the CPU path (`dequantize` on CPU runs the
compiled `kernels.cpu.dequant_packed` pass when it can, bit-identical to the ops here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu import dequant_packed
from kernels.packed_format import PackedExperts, PackedWeight, _check_bits, words_per_row

__all__ = [
    "unpack_codes",
    "dequantize",
    "gemv",
    "grouped_gemm",
    "packed_expert_ffn",
    "expert_offsets_from",
]


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


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float32, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Unpack and dequantize: `(level[q] - zero) * scale` computed in fp32.

    Vectorised per matrix (`_unpack_int32`, then the group's zero and scale broadcast over its inputs rather
    than repeated per input).

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
