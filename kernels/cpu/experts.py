"""SwiGLU experts with dense weights: bf16 stacks on any number of fp32 rows, one fp32 expert on a few.

C: kernels/csrc/expert_ffn.c. `expert_ffn` runs bf16 stacks as a grouped GEMM (rows counting-sorted by expert,
then per active expert one gate/up and one down GEMM over its rows: each expert's weights are read once per
call, as vLLM's fused_moe / SGLang's grouped experts do), on the stacks' packed panel copies
(`kernels.cpu.packing`, kernels/csrc/gemm_panel.c) once they have them; `swiglu_f32` one fp32 expert (a
cached dequantized one).

Shape legend: R = expert rows, D = hidden, I = expert intermediate, E = experts.

`f(x) = w_down (silu(gate x) * (up x))`, fp32 accumulation (bf16 weights widened exactly in registers): one call
instead of ~14 ops per expert. Both return None when they cannot run; the caller uses its PyTorch path.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import tuning
from kernels.cpu import _build
from kernels.cpu._abi import ExpertFFNArgs, f32_cpu
from kernels.cpu.packing import panels


def expert_ffn(x_RD: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ids_R: torch.Tensor,
               weights_R: torch.Tensor | None = None) -> torch.Tensor | None:
    """SwiGLU experts with bf16 weights for fp32 rows, in one call (grouped by expert inside).

    Args:
        x_RD: [R, D] fp32 rows (with `weights_R`, [1, D] is one token sent to every expert of ids_R).
        w_gate_up: [E, 2I, D] bf16 (gate rows, then up rows), w_down: [E, D, I] bf16, contiguous.
        ids_R: int64 [R] expert of each row (-1: none, a zero row or no contribution).
        weights_R: optional fp32 [R] routing weights: then the result is `sum_r w_r f_{ids_r}(x)` [1, D].
    Returns:
        [R, D] (or [1, D]) fp32, or None when the kernel cannot run (other dtypes/devices, more than
        `MAX_GEMM_ROWS` rows): the caller uses its PyTorch path.
    Raises:
        RuntimeError: mismatched shapes. ValueError: an id >= E. MemoryError: no scratch.
    """
    lib = _build.lib()
    R = ids_R.numel()
    if (lib is None or R > tuning.MAX_GEMM_ROWS or w_gate_up.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16
            or not f32_cpu(x_RD) or not (w_gate_up.is_contiguous() and w_down.is_contiguous())
            or x_RD.stride(-1) != 1 or (weights_R is not None and not f32_cpu(weights_R))):
        return None
    E, I2, D = w_gate_up.shape
    if x_RD.shape[-1] != D or w_down.shape != (E, D, I2 // 2) or (weights_R is None and x_RD.shape[0] != R):
        raise RuntimeError(f"expert_ffn: x {tuple(x_RD.shape)}, w_gate_up {tuple(w_gate_up.shape)}, "
                           f"w_down {tuple(w_down.shape)}, {R} ids do not match")
    ids = ids_R if ids_R.dtype is torch.int64 and ids_R.is_contiguous() else ids_R.to(torch.int64).contiguous()
    gup, dnp = panels(w_gate_up), panels(w_down)  # packed stacks (`kernels.cpu.packing`), once seen twice
    gup_p, dnp_p = (gup.data_ptr() if gup is not None else None), (dnp.data_ptr() if dnp is not None else None)
    if weights_R is not None:
        wts = weights_R.reshape(-1).contiguous()
        y = torch.empty(1, D, dtype=torch.float32)
        args = ExpertFFNArgs(x_RD.data_ptr(), 0, w_gate_up.data_ptr(), w_down.data_ptr(), gup_p, dnp_p,
                             ids.data_ptr(), wts.data_ptr(), R, E, D, I2 // 2, y.data_ptr(), D)
    else:
        y = torch.empty(R, D, dtype=torch.float32)
        if not R:
            return y
        args = ExpertFFNArgs(x_RD.data_ptr(), x_RD.stride(0), w_gate_up.data_ptr(), w_down.data_ptr(), gup_p, dnp_p,
                             ids.data_ptr(), None, R, E, D, I2 // 2, y.data_ptr(), D)
    rc = lib.moeray_expert_ffn_bf16w(ctypes.byref(args))
    if rc == -2:
        raise ValueError(f"expert_ffn: an expert id in ids_R is >= num_experts={E}")
    if rc:
        raise MemoryError(f"expert_ffn: no scratch for {R} rows")
    return y


def swiglu_f32(x_RD: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor | None:
    """One SwiGLU expert with fp32 weights for a few fp32 rows: `w_down (silu(gate x) * (up x))` in one call.

    Args:
        x_RD: [R, D] fp32. w_gate_up: [2I, D] fp32 (gate rows, then up rows). w_down: [D, I] fp32; contiguous.
    Returns:
        [R, D] fp32, or None when the kernel cannot run (other dtypes/devices, more than `MAX_KERNEL_ROWS` rows).
    """
    lib = _build.lib()
    R = x_RD.shape[0]
    if (lib is None or R > tuning.MAX_KERNEL_ROWS or not f32_cpu(x_RD, w_gate_up, w_down) or x_RD.stride(-1) != 1
            or not (w_gate_up.is_contiguous() and w_down.is_contiguous())):
        return None
    I2, D = w_gate_up.shape
    y = torch.empty(R, D, dtype=torch.float32)
    if R:
        scratch = torch.empty(R * I2, dtype=torch.float32)
        lib.moeray_swiglu_f32w(x_RD.data_ptr(), x_RD.stride(0), R, w_gate_up.data_ptr(), w_down.data_ptr(), D,
                               I2 // 2, y.data_ptr(), D, scratch.data_ptr())
    return y
