"""Packed sub-4-bit expert weights on CPU: dequantize to fp32, and SwiGLU experts straight from the codes.

C: kernels/csrc/dequant_packed.c, kernels/csrc/packed_expert_ffn.c.

Shape legend: R = expert rows, D = hidden, I = expert intermediate, E = experts, N = matrix rows, K = inputs,
W = uint32 code words per row, G = groups per row.

Layout: `kernels/packed_format.py` (b-bit codes in uint32 words, fp16 scale and zero per group, optional fp16
codebook). `dequant_packed` is bit-identical to that module's PyTorch reference. `packed_expert_ffn` unpacks the
codes in registers with each group's scale and zero taken out of its sum, so ~4.5 bits per weight leave memory
instead of 32 for a dequantized fp32 copy; the engine therefore keeps no such copy by default on CPU
(`actors.experts.ops.fused_path_runs`). Every function returns None when it cannot run; the caller uses its
PyTorch path.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import tuning
from kernels.cpu import _build
from kernels.cpu._abi import F16, DequantPackedArgs, PackedExpertFFNArgs, PackedStack, f32_cpu


def dequant_packed(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, codebook: torch.Tensor | None,
                   bits: int, group_size: int, shape: tuple[int, ...], out: torch.Tensor | None = None
                   ) -> torch.Tensor | None:
    """Packed sub-4-bit weights to fp32 in one pass (`kernels.packed_weights.dequantize`'s CPU fast path).

    Args:
        codes: `[*, N, W]` int32 (layout of `kernels/packed_format.py`). scales / zeros: `[*, N, G]` fp16.
            codebook: None or `[*, 2**bits]` fp16 levels. bits: 2, 3 or 4. group_size: inputs per group.
            shape: `(N, K)` or `(E, N, K)`. out: optional fp32 contiguous tensor of `shape` to fill.
    Returns:
        fp32 `[*, N, K]` equal bit for bit to the PyTorch reference (`(level[q] - zero) * scale` in fp32), or None
        when the kernel cannot run (CUDA tensors, other dtypes, no compiled kernels).
    """
    lib = _build.lib()
    if (lib is None or codes.device.type != "cpu" or scales.dtype != F16 or zeros.dtype != F16
            or (codebook is not None and codebook.dtype != F16)
            or (out is not None and not (f32_cpu(out) and out.is_contiguous()))):
        return None
    K = shape[-1]
    R = codes.numel() // codes.shape[-1]
    c, s, z = codes.contiguous(), scales.contiguous(), zeros.contiguous()
    cb = codebook.contiguous() if codebook is not None else None
    y = out if out is not None else torch.empty(shape, dtype=torch.float32)
    lib.moeray_dequant_packed(ctypes.byref(DequantPackedArgs(
        c.data_ptr(), c.shape[-1], s.data_ptr(), z.data_ptr(), s.shape[-1], group_size,
        cb.data_ptr() if cb is not None else None, 1 << bits, shape[-2], R, K, bits, y.data_ptr())))
    return y


class PackedFFNArgs:
    """The raw arguments of one layer's packed SwiGLU expert stacks for `packed_expert_ffn`, prepared once.

    Holds references to the tensors, so the pointers stay valid while this object lives.

    Args:
        gate_up: a PackedWeight stack `[E, 2I, D]` (gate rows then up rows). down: a PackedWeight stack `[E, D, I]`.
            (Any objects with `codes`, `scales`, `zeros`, `codebook`, `bits`, `group_size`, `shape`.)
    Attributes:
        stacks: (gate_up, down) as `PackedStack` structs (pointers, W, G, group size, bits).
        ok: False when the kernels cannot read these tensors (CUDA, non-fp16 scales): every call then declines.
    Raises:
        ValueError: the stacks do not fit together (E, D or I differ).
    """

    def __init__(self, gate_up, down):
        E, I2, D = gate_up.shape
        if tuple(down.shape) != (E, D, I2 // 2) or I2 % 2:
            raise ValueError(f"gate_up.shape={tuple(gate_up.shape)} and down.shape={tuple(down.shape)} are not one "
                             "SwiGLU stack [E, 2I, D] / [E, D, I]")
        self.num_experts, self.hidden, self.intermediate = E, D, I2 // 2
        self._keep = []
        self.ok = all(t.device.type == "cpu" and t.dtype == F16
                      for pw in (gate_up, down) for t in (pw.scales, pw.zeros, pw.codebook) if t is not None)
        stacks = []
        for pw in (gate_up, down):
            ts = [pw.codes.contiguous(), pw.scales.contiguous(), pw.zeros.contiguous(),
                  None if pw.codebook is None else pw.codebook.contiguous()]
            self._keep += ts
            stacks.append(PackedStack(*[t.data_ptr() if t is not None else None for t in ts],
                                      pw.codes.shape[-1], pw.scales.shape[-1], pw.group_size, pw.bits))
        self.stacks = tuple(stacks)
        self._gu, self._dn = (ctypes.addressof(st) for st in stacks)
        self._groups = max(st.G for st in stacks)  # groups per row of gate_up, down
        self._shapes = [(pw.codes.shape[-2:], pw.scales.shape[-1], pw.shape[-1], pw.group_size, pw.bits)
                        for pw in (gate_up, down)]

    def dequantize(self, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Expert `e` dequantized to fp32: (`[2I, D]` gate_up, `[D, I]` down), bit-identical to
        `kernels.packed_weights.dequantize`, in two calls with no per-call tensor bookkeeping (the prefetch
        worker's fill). None when the kernel cannot run."""
        lib = _build.lib()
        if lib is None or not self.ok:
            return None
        out = []
        for st, ((N, W), G, K, gs, bits) in zip(self.stacks, self._shapes):
            c, sc, z, cb = st.codes, st.scales, st.zeros, st.codebook
            y = torch.empty(N, K, dtype=torch.float32)
            L = 1 << bits
            lib.moeray_dequant_packed(ctypes.byref(DequantPackedArgs(
                c + 4 * e * N * W, W, sc + 2 * e * N * G, z + 2 * e * N * G, G, gs,
                None if cb is None else cb + 2 * e * L, L, N, N, K, bits, y.data_ptr())))
            out.append(y)
        return out[0], out[1]


def packed_expert_ffn(x_RD: torch.Tensor, ids_R: list[int] | torch.Tensor, packed: PackedFFNArgs
                      ) -> torch.Tensor | None:
    """Rows through packed sub-4-bit SwiGLU experts without materialising the weights (fused dequant-GEMV).

    The codes are unpacked in registers and each group's scale and zero are taken out of its sum,
    `sum_g s_g (sum_k level_k x_k - z_g sum_k x_k)`, so only the packed bytes (~4.5 bits per weight at 4 bits,
    group 64) leave memory and no weight is materialised. The result equals the dequantize-then-matmul
    reference up to fp32 summation order (~1e-6 relative; the tests bound it at 1e-5).

    Args:
        x_RD: [R, D] fp32 rows; [1, D] with several ids is one token sent to each of those experts.
        ids_R: the R local expert ids (list or int64 tensor; -1: a zero row); rows of one expert should be
            consecutive (each run dequantizes the expert's rows once).
        packed: the layer's `PackedFFNArgs`.
    Returns:
        [R, D] fp32, or None when the kernel cannot run (no compiled kernels, CUDA or non-fp32 rows, more than
        `MAX_KERNEL_ROWS` rows, non-fp16 scales): the caller uses its PyTorch path.
    """
    lib = _build.lib()
    ids = ids_R if isinstance(ids_R, list) else ids_R.tolist()
    R = len(ids)
    if lib is None or not packed.ok or R > tuning.MAX_KERNEL_ROWS or not f32_cpu(x_RD) or x_RD.stride(-1) != 1:
        return None
    D, I = packed.hidden, packed.intermediate
    if x_RD.shape[-1] != D or (x_RD.shape[0] != R and x_RD.shape[0] != 1):
        raise ValueError(f"packed_expert_ffn: x shape={tuple(x_RD.shape)}, expected [{R}, {D}] or [1, {D}]")
    if R and max(ids) >= packed.num_experts:
        raise ValueError(f"packed_expert_ffn: expert id {max(ids)} >= num_experts={packed.num_experts}")
    y = torch.empty(R, D, dtype=torch.float32)
    if R:
        ids_a = (ctypes.c_long * R)(*ids)
        G = packed._groups
        scratch = torch.empty(max(D, I) + R * (G + 2 * I), dtype=torch.float32)
        sx = 0 if x_RD.shape[0] == 1 else x_RD.stride(0)
        lib.moeray_packed_expert_ffn(ctypes.byref(PackedExpertFFNArgs(
            x_RD.data_ptr(), sx, ctypes.addressof(ids_a), R, packed._gu, packed._dn, D, I, y.data_ptr(), D,
            scratch.data_ptr())))
    return y
