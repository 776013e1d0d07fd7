"""The C kernels' ABI in ctypes: argument structs (entry points of over 10 arguments) and every signature.

`SIGNATURES` holds each entry point's argument and result types; `_build` applies them when the library loads.
`f32_cpu` is the dtype / device check every wrapper makes before passing a tensor as a `float *`.

Invariant: each `*Args` class lists the fields of the C typedef named in its docstring, in the same order and
with the same C types (`P` a pointer, passed as an int address or None for 0; `L` C long = int64; `F` float;
`D` double), so the C function reads exactly what Python wrote. An entry point that takes a struct takes a
pointer to it: call it with `ctypes.byref(args)`.
"""
from __future__ import annotations

import ctypes

import torch

_L, _P, _F, _D = ctypes.c_long, ctypes.c_void_p, ctypes.c_float, ctypes.c_double
_TYPES = {"L": _L, "P": _P, "F": _F, "D": _D}


def _fields(spec: str) -> list[tuple[str, type]]:
    """`"P h, L sh"` -> `[("h", c_void_p), ("sh", c_long)]` (reads like the C declaration)."""
    return [(name, _TYPES[t]) for t, name in (f.split() for f in spec.split(","))]


class RmsNormArgs(ctypes.Structure):
    """`moeray_rms_norm_args` (kernels/csrc/rms_norm.c)."""
    _fields_ = _fields("P h, L sh, P delta, L sd, P h_out, L so, P w, P y, L sy, L M, L D, F eps")


class LinearArgs(ctypes.Structure):
    """`moeray_linear_args` (kernels/csrc/linear.c): one row-split share of a linear."""
    _fields_ = _fields("P x, L sx, P w, P wp, P b, P y, L sy, L M, L N, L K")


class DecodeAttentionArgs(ctypes.Structure):
    """`moeray_decode_attention_args` (kernels/csrc/decode_attention.c)."""
    _fields_ = _fields("P q, P kc, P vc, P bt, L mb, P ctx, P tok, P out, L B, L H, L Hkv, L Dh, L S, F scale")


class AttentionBlockArgs(ctypes.Structure):
    """`moeray_attention_block_args` (kernels/csrc/attention_block.c)."""
    _fields_ = _fields("P h, P delta, P in_norm_w, P h_out, P x_out, L T, L D, P wqkv, P wqkv_p, P bqkv, P wo, "
                       "P wo_p, P bo, P norm_w, F eps, P cos, P sin_signed, L P, P pos, P kc, P vc, L nslots, P slots, "
                       "P bt, L mb, P ctx, P tok, L B, L H, L Hkv, L Dh, L S, F scale")


class PrefillAttentionArgs(ctypes.Structure):
    """`moeray_prefill_attention_args` (kernels/csrc/prefill_attention.c): one task of a causal prefill."""
    _fields_ = _fields("P q, P kc, P vc, P bt, P kf, P vf, P hi, P out, L n, L ctx, L H, L Hkv, L Dh, L S, L lo, "
                       "L g_lo, L g_hi, L part, L parts, F scale")


class QuantDecodeArgs(ctypes.Structure):
    """`moeray_quant_decode_args` (kernels/csrc/quant_decode_attention.c)."""
    _fields_ = _fields("P q, P kc, P vc, P vs, P ko, P vo, L skc, L svc, L svs, L sko, L svo, "
                       "P bt, L mb, P ctx, P cosr, P sinr, P sk, P sv, "
                       "P slen, L ns, P tk, P tv, P tlen, L nt, P k_scale, P k_zero, P v_zero, P k_cb, P v_cb, P kw, "
                       "L k_grid, L vbits, L Pk, L P, P k_oidx, P v_oidx, L Ok, L Ov, P out, L B, L Hq, L H, L D, "
                       "L S, F scale, P vs_lut, P stk, P stv, P sslot, L srows, L sbs, L maxpos")


class QuantizeKVArgs(ctypes.Structure):
    """`moeray_quantize_kv_args` (kernels/csrc/kv_quantize.c)."""
    _fields_ = _fields("P k, P v, L N, L H, L D, P k_zero, P k_scale, P v_zero, P kw, L k_grid, P k_mids, L nk, "
                       "P v_mids, L nv, L vbits, P v_inlier, P vs_lut, P k_oidx, L Ok, P v_oidx, L Ov, "
                       "P k_codes, L Pk, P v_codes, L P, P v_scale16, P v_scale8, P k_out, P v_out, P codes")


class ExpertFFNArgs(ctypes.Structure):
    """`moeray_expert_ffn_bf16w_args` (kernels/csrc/expert_ffn.c)."""
    _fields_ = _fields("P x, L sx, P gu, P dn, P gup, P dnp, P ids, P wts, L R, L K, L E, L D, L I, P y, L sy")


class PackRowsArgs(ctypes.Structure):
    """`moeray_pack_rows_args` (kernels/csrc/pack_rows.c)."""
    _fields_ = _fields("P x, L D, P tok, P dest, P local, L V, L W, L C, P send, P slot, P counts")


class PackIdsArgs(ctypes.Structure):
    """`moeray_pack_ids_args` (kernels/csrc/pack_rows.c)."""
    _fields_ = _fields("P x, L D, P ids, L T, L K, P rank_of, P local_of, L E, L W, L C, P send, P slot, P counts")


class WeighRowsArgs(ctypes.Structure):
    """`moeray_weigh_rows_args` (kernels/csrc/pack_rows.c)."""
    _fields_ = _fields("P y, L D, L ys, P slot, P w, L T, L K, P out")


class EpDispatchArgs(ctypes.Structure):
    """`moeray_ep_dispatch_args` (kernels/csrc/ep_exchange.c)."""
    _fields_ = _fields("P base, L line, L W, L r, L slot_bytes, L call, P x, L sx, L D, P ids, L T, L K, P rank_of, "
                       "P local_of, L E, L C, P slot, P sent")


class EpExpertsArgs(ctypes.Structure):
    """`moeray_ep_experts_args` (kernels/csrc/ep_exchange.c)."""
    _fields_ = _fields("P base, L line, L W, L r, L slot_bytes, L call, L C, L D, L I, L E, P gu, P dn, P gup, P dnp, "
                       "L next, L spin_ns, L wait_ns, L yield_ns, L waited_ns")


class EpCombineArgs(ctypes.Structure):
    """`moeray_ep_combine_args` (kernels/csrc/ep_exchange.c)."""
    _fields_ = _fields("P base, L line, L W, L r, L slot_bytes, L call, L C, L D, P slot, P w, L T, L K, P out, "
                       "L spin_ns, L wait_ns, L yield_ns, L waited_ns")


class TopkSoftmaxArgs(ctypes.Structure):
    """`moeray_topk_softmax_args` (kernels/csrc/topk_softmax.c)."""
    _fields_ = _fields("P x, L sx, L T, L E, L K, L renorm, P bias, P w, P ids")


class DequantPackedArgs(ctypes.Structure):
    """`moeray_dequant_packed_args` (kernels/csrc/dequant_packed.c)."""
    _fields_ = _fields("P codes, L W, P s, P z, L G, L gs, P cb, L L, L rows_per_matrix, L R, L K, L bits, P out")


class PackedStack(ctypes.Structure):
    """`moeray_packed_stack` (kernels/csrc/packed_expert_ffn.c): one packed weight stack."""
    _fields_ = _fields("P codes, P scales, P zeros, P codebook, L W, L G, L gs, L bits")


class SharedExpertArgs(ctypes.Structure):
    """`moeray_shared_expert_args` (kernels/csrc/expert_ffn.c)."""
    _fields_ = _fields("P y, L sy, L off, L I, P dn, P dnp, P scale, L T, L D, P out")


class PackedExpertFFNArgs(ctypes.Structure):
    """`moeray_packed_expert_ffn_args` (kernels/csrc/packed_expert_ffn.c); gu, dn point at `PackedStack`s."""
    _fields_ = _fields("P x, L sx, P ids, L R, P gu, P dn, L D, L I, P y, L sy, P scratch")


class MarkovObserveArgs(ctypes.Structure):
    """`moeray_markov_observe_args` (kernels/csrc/predict.c)."""
    _fields_ = _fields("P freq, P inter, P intra, L E, L T, P ids, L K, P pl, L Kp, P pt, L Kt")


class MarkovProbsArgs(ctypes.Structure):
    """`moeray_markov_probs_args` (kernels/csrc/predict.c)."""
    _fields_ = _fields("P freq, P inter, P intra, L E, D alpha, D w0, D w1, D w2, L T, P pl, L Kp, P pt, L Kt, "
                       "P look, P out")


class PrefetchStepArgs(ctypes.Structure):
    """`moeray_prefetch_step_args` (kernels/csrc/predict.c); fields left unset are 0 (absent)."""
    _fields_ = _fields("P stats, P ids, L K, L T, P pred, L B, P pl, L Kp, P pt, L Kt, "
                       "P freq, P inter, P intra, L E, "
                       "P nfreq, P ninter, P nintra, D alpha, D w0, D w1, D w2, P npt, L Knt, "
                       "P h, L sh, L D, P norm, F eps, P gate, "
                       "L NB, P pred_out, P agg, P top, P scratch")


def _ptr(struct: type) -> list:
    return [ctypes.POINTER(struct)]


# entry point -> (argtypes, restype)
SIGNATURES = {
    "moeray_set_isa": ([_L], None),
    "moeray_isa": ([], _L),
    "moeray_linear_bf16w": ([_P, _L, _P, _P, _P, _L, _L, _L, _L], _L),
    "moeray_linear_panels": ([_P, _L, _P, _P, _P, _L, _L, _L, _L], None),
    "moeray_rms_norm": (_ptr(RmsNormArgs), None),
    "moeray_linear_task": (_ptr(LinearArgs), _L),
    "moeray_pool_start": ([_L], _L),
    "moeray_pool_run": ([_L, _P, _L, _L], _L),
    "moeray_pool_set_spin": ([_L], None),
    "moeray_pool_park": ([], None),
    "moeray_rope": ([_P, _L, _L, _P, _P, _P, _L, _P, _L, _L, _L], _L),
    "moeray_decode_attention": (_ptr(DecodeAttentionArgs), _L),
    "moeray_attention_block": (_ptr(AttentionBlockArgs), _L),
    "moeray_attention_in": ([ctypes.POINTER(AttentionBlockArgs), _P, _P, _P, _P], _L),
    "moeray_attention_out": ([ctypes.POINTER(AttentionBlockArgs), _P, _P], _L),
    "moeray_prefill_attention": (_ptr(PrefillAttentionArgs), _L),
    "moeray_quant_decode_attention": (_ptr(QuantDecodeArgs), _L),
    "moeray_quantize_kv": (_ptr(QuantizeKVArgs), None),
    "moeray_quant_dequant_rows": ([ctypes.POINTER(QuantDecodeArgs), _P, _P, _L, _L, _P, _P], _L),
    "moeray_expert_ffn_bf16w": (_ptr(ExpertFFNArgs), _L),
    "moeray_shared_expert": (_ptr(SharedExpertArgs), _L),
    "moeray_swiglu_f32w": ([_P, _L, _L, _P, _P, _L, _L, _P, _L, _P], None),
    "moeray_pack_rows": (_ptr(PackRowsArgs), ctypes.c_long),
    "moeray_pack_ids": (_ptr(PackIdsArgs), ctypes.c_long),
    "moeray_topk_softmax": (_ptr(TopkSoftmaxArgs), ctypes.c_long),
    "moeray_weigh_rows": (_ptr(WeighRowsArgs), None),
    "moeray_dequant_packed": (_ptr(DequantPackedArgs), None),
    "moeray_packed_expert_ffn": (_ptr(PackedExpertFFNArgs), None),
    "moeray_markov_observe": (_ptr(MarkovObserveArgs), None),
    "moeray_markov_probs": (_ptr(MarkovProbsArgs), None),
    "moeray_gate_logprobs": ([_P, _L, _L, _L, _P, _F, _P, _L, _P, _P], None),
    "moeray_prefetch_step": (_ptr(PrefetchStepArgs), None),
    "moeray_pack_codes_var": ([_P, _L, _L, _L, _P, _L, _P], None),
    "moeray_unpack_codes_var": ([_P, _L, _L, _L, _P, _L, _P], None),
    "moeray_shm_a2a_send": ([_P, _L, _L, _L, _L, _L, _P, _P, _L], None),
    "moeray_shm_a2a_recv": ([_P, _L, _L, _L, _L, _L, _P, _L, _L, _L, _L], _L),
    "moeray_shm_publish": ([_P, _L, _L, _L], None),
    "moeray_shm_wait": ([_P, _L, _L, _L, _L, _L, _L], _L),
    "moeray_ep_dispatch": (_ptr(EpDispatchArgs), _L),
    "moeray_ep_experts": (_ptr(EpExpertsArgs), _L),
    "moeray_ep_combine": (_ptr(EpCombineArgs), _L),
}

F32 = torch.float32
F16 = torch.float16


def f32_cpu(*ts: torch.Tensor) -> bool:
    """True when every tensor is fp32 on CPU: what a `float *` argument needs (strides are checked apart)."""
    for t in ts:  # a loop, not all(genexpr): this runs ~30 times per decode step
        if t.dtype is not F32 or t.device.type != "cpu":
            return False
    return True
