"""Router selection in one compiled call per MoE layer (kernels/csrc/topk_softmax.c).

`select_experts` has `kernels.gating.select_experts_ref`'s contract (its reference): softmax over sanitized logits,
top-k of scores + bias with exact ties to the lowest expert id, weights = the chosen scores (renormalized on
request). On CPU fp32 logits it runs the kernel (decode: ~10 PyTorch ops a layer fewer; T = 1: 10.7 -> ~2 us,
T = 500: 69 -> ~10 us); anything else, and arguments the kernel does not take, go to the reference. Scores may
differ from the reference's by an ulp (expf against torch's vectorized exp); the ids are the same unless two
scores are within that ulp.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu import _build
from kernels.cpu._abi import TopkSoftmaxArgs
from kernels.gating import check_selection_args, select_experts_ref


def select_experts(logits_TE: torch.Tensor, k: int, renormalize: bool,
                   bias_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] float32, ids [T, K] int64) as `kernels.gating.select_experts_ref`.

    Args:
        logits_TE: [T, E] router logits (the kernel: fp32 on CPU, unit column stride). k: 1 <= k <= E.
        renormalize: divide the k weights by their sum. bias_E: optional [E] fp32 selection bias.
    Raises:
        ValueError: bad shapes or k outside [1, E] (as the reference).
    """
    lib = _build.lib()
    if (lib is None or logits_TE.device.type != "cpu" or logits_TE.dtype != torch.float32 or logits_TE.dim() != 2
            or logits_TE.stride(-1) != 1 or (bias_E is not None and (bias_E.dtype != torch.float32
                                                                     or bias_E.device.type != "cpu"))):
        return select_experts_ref(logits_TE, k, renormalize, bias_E)
    check_selection_args(logits_TE, k, bias_E)
    T, E = logits_TE.shape
    w = torch.empty(T, k, dtype=torch.float32)
    ids = torch.empty(T, k, dtype=torch.int64)
    bias = None if bias_E is None else bias_E.contiguous()
    rc = lib.moeray_topk_softmax(ctypes.byref(TopkSoftmaxArgs(
        logits_TE.data_ptr(), logits_TE.stride(0) if T else E, T, E, k, int(renormalize),
        None if bias is None else bias.data_ptr(), w.data_ptr(), ids.data_ptr())))
    if rc != 0:  # more experts than the kernel holds
        return select_experts_ref(logits_TE, k, renormalize, bias_E)
    return w, ids
