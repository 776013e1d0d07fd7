"""SwiGLU experts with dense weights: bf16 stacks on any number of fp32 rows, one fp32 expert on a few.

C: kernels/csrc/expert_ffn.c. `expert_ffn` runs bf16 stacks as a grouped GEMM (rows counting-sorted by expert,
then per active expert one gate/up and one down GEMM over its rows: each expert's weights are read once per
call, as vLLM's fused_moe / SGLang's grouped experts do), on the stacks' packed panel copies
(`kernels.cpu.packing`, kernels/csrc/gemm_panel.c) once they have them; `swiglu_f32` one fp32 expert (a
cached dequantized one).

Shape legend: R = expert rows, D = hidden, I = expert intermediate, E = experts.

`f(x) = w_down (silu(gate x) * (up x))`, fp32 accumulation (bf16 weights widened exactly in registers): one call
instead of ~14 ops per expert. `shared_expert`: a Qwen2-MoE shared expert and its sigmoid gate from the layer's
fused input projection, in one call instead of six ops. Each returns None when it cannot run; the caller uses its
PyTorch path.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import tuning
from kernels.cpu import _build
from kernels.cpu._abi import ExpertFFNArgs, SharedExpertArgs, f32_cpu
from kernels.cpu.packing import panels
from kernels.cpu.parallel import TASK_EXPERT_FFN, row_ranges, run_kernel


def expert_ffn(x_TD: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor | None = None) -> torch.Tensor | None:
    """SwiGLU experts with bf16 weights for fp32 rows, in one call (grouped by expert inside).

    Args:
        x_TD: [T, D] fp32 token rows. ids: int64 expert of each (token, expert) pair, -1 for none: [T, K] (K pairs
            per token), or [R] (R rows of x, one pair each; with `weights`, x is [1, D] and the R pairs are that
            token's). w_gate_up: [E, 2I, D] bf16 (gate rows, then up rows), w_down: [E, D, I] bf16, contiguous.
        weights: optional fp32 routing weights, ids' shape: then each token's pairs are weighed and summed.
    Returns:
        fp32: without weights, [P, D] with row p = f_{ids_p}(x of p's token) (P pairs in ids' row-major order,
        zeros for id -1); with weights, [T, D] with row t = sum_k w[t, k] f_{ids[t, k]}(x[t]). None when the
        kernel cannot run (other dtypes/devices, more than `MAX_GEMM_ROWS` pairs): the caller's PyTorch path.
    Raises:
        RuntimeError: mismatched shapes. ValueError: an id >= E. MemoryError: no scratch.
    """
    lib = _build.lib()
    R = ids.numel()
    if (lib is None or R > tuning.MAX_GEMM_ROWS or w_gate_up.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16
            or not f32_cpu(x_TD) or not (w_gate_up.is_contiguous() and w_down.is_contiguous())
            or x_TD.stride(-1) != 1 or (weights is not None and not f32_cpu(weights))):
        return None
    E, I2, D = w_gate_up.shape
    if ids.dim() == 2:
        T, K = ids.shape
    else:
        T, K = (1, R) if weights is not None else (R, 1)
    if (x_TD.dim() != 2 or x_TD.shape != (T, D) or w_down.shape != (E, D, I2 // 2) or K < 1
            or (weights is not None and weights.numel() != R)):
        raise RuntimeError(f"expert_ffn: x {tuple(x_TD.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down "
                           f"{tuple(w_down.shape)}, ids {tuple(ids.shape)}"
                           f"{'' if weights is None else f', weights {tuple(weights.shape)}'} do not match")
    ids = ids if ids.dtype is torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()
    gup, dnp = panels(w_gate_up), panels(w_down)  # packed stacks (`kernels.cpu.packing`), once seen twice
    wts = None if weights is None else weights.contiguous()
    y = torch.empty(T if wts is not None else R, D, dtype=torch.float32)
    if not R:
        return y.zero_()
    # one share of the tokens (and their pairs) per compute thread (kernels.cpu.parallel)
    sx, xp, idp, yp, out_rows = x_TD.stride(0), x_TD.data_ptr(), ids.data_ptr(), y.data_ptr(), 1 if wts is not None else K
    args = [ExpertFFNArgs(xp + 4 * lo * sx, sx, w_gate_up.data_ptr(), w_down.data_ptr(),
                          gup.data_ptr() if gup is not None else None, dnp.data_ptr() if dnp is not None else None,
                          idp + 8 * lo * K, None if wts is None else wts.data_ptr() + 4 * lo * K, (hi - lo) * K, K, E, D,
                          I2 // 2, yp + 4 * lo * out_rows * D, D) for lo, hi in row_ranges(T)]
    rc = run_kernel(TASK_EXPERT_FFN, args) if len(args) > 1 else lib.moeray_expert_ffn_bf16w(ctypes.byref(args[0]))
    if rc == -2:
        raise ValueError(f"expert_ffn: an expert id in ids is >= num_experts={E}")
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


def shared_expert(y_TN: torch.Tensor, offset: int, w_down: torch.Tensor, scale_T: torch.Tensor | None
                  ) -> torch.Tensor | None:
    """A shared expert with its gate, from the layer's fused input projection, in one call.

    Args:
        y_TN: [T, N] fp32, unit column stride: columns [offset, offset + I) the shared expert's gate projection,
            [offset + I, offset + 2I) its up projection, offset + 2I its gate logit (`MoEModel.gate`'s y).
        offset: E, the router logits' width. w_down: [D, I] bf16 contiguous. scale_T: [T] fp32 or None (a gating
            policy's per-token scale of the shared expert).
    Returns:
        [T, D] fp32 = sigmoid(logit) * scale * w_down (silu(gate) * up), equal to the PyTorch ops up to fp32 rounding
        (SiLU and sigmoid through the kernels' exp, as the routed experts'); None when the kernel cannot run (other
        dtypes or devices, more than `MAX_GEMM_ROWS` rows).
    Raises:
        MemoryError: no scratch.
    """
    lib = _build.lib()
    T = y_TN.shape[0]
    if (lib is None or T > tuning.MAX_GEMM_ROWS or y_TN.dim() != 2 or not f32_cpu(y_TN) or y_TN.stride(1) != 1
            or w_down.dtype != torch.bfloat16 or w_down.dim() != 2 or not w_down.is_contiguous()
            or (scale_T is not None and not (f32_cpu(scale_T) and scale_T.is_contiguous()))):
        return None
    D, I = w_down.shape
    if y_TN.shape[1] < offset + 2 * I + 1:
        raise RuntimeError(f"shared_expert: y {tuple(y_TN.shape)} has no columns [{offset}, {offset + 2 * I}]")
    out = torch.empty(T, D, dtype=torch.float32)
    if T:
        dnp = panels(w_down)
        if lib.moeray_shared_expert(ctypes.byref(SharedExpertArgs(
                y_TN.data_ptr(), y_TN.stride(0), offset, I, w_down.data_ptr(), None if dnp is None else dnp.data_ptr(),
                None if scale_T is None else scale_T.data_ptr(), T, D, out.data_ptr()))):
            raise MemoryError(f"shared_expert: no scratch for {T} rows")
    return out
