"""Builders of a rank's expert runtime: packing at load time, the prefetch default, and the engine seam
(`build_engine_experts`) that turns an `EngineConfig` into an attached `ExpertRuntime`."""
from __future__ import annotations

import logging
import os

import torch

from actors.experts.checkpoint import (
    PackedExpertReader,
    is_packed_checkpoint,
    load_packed_experts,
    read_quant_config,
)
from actors.experts.ops import fused_path_runs
from actors.experts.runtime import ExpertRuntime, local_share
from actors.model.config import ModelConfig
from actors.moe.gating_router import GatingRouter
from actors.prefetch.predictors import DEFAULT_PREDICTOR, PREDICTORS, make_predictor
from actors.prefetch.transitions import TRANSITIONS_FILE, TransitionCounts
from kernels.packed_format import PackedExperts
from kernels.packed_quantize import quantize

log = logging.getLogger("moeray.experts")


def quantize_local_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, *, bits: int, group_size: int = 64,
                           codebook: bool = False) -> PackedExperts | None:
    """Pack one layer's local experts `[E_loc, 2I, D]`, `[E_loc, D, I]` (None when E_loc = 0)."""
    if w_gate_up.shape[0] == 0:
        return None
    kw = {"bits": bits, "group_size": group_size, "codebook": codebook}
    return PackedExperts(gate_up=quantize(w_gate_up, **kw), down=quantize(w_down, **kw))


def auto_prefetch(device: torch.device | str, full: bool, cold: bool = False) -> str:
    """The predictor `prefetch="auto"` picks: "none" when every expert fits (`full`); else DEFAULT_PREDICTOR on
    CUDA or with a cold tier (`cold`), and "none" for a CPU rank whose packed experts are all resident.

    Why: on CUDA a fill runs on the worker's own stream, overlapped with the forward, so a predicted expert
    arrives at no cost to the step. On CPU a miss runs the compiled fused kernel on the packed bytes, which is
    no slower than a hit on a dequantized fp32 copy (`fused_path_runs`), so a prefetch has nothing to hide: it
    only adds the prediction (one compiled call per layer) and fills, each a dequantize into a fresh fp32 copy
    (768 KiB per expert on tiny-moe, against ~110 KiB of packed bytes for the miss it replaces) that the forward
    then reads (the measurements: BENCHMARKS.md, `bench/experts.py`). A cold tier keeps the predictor
    everywhere: a cold miss makes the forward wait for a read from the checkpoint file, which a prefetched read
    (a copy, no dequantize) hides.
    """
    if full:
        return "none"
    return DEFAULT_PREDICTOR if cold or torch.device(device).type == "cuda" else "none"


def build_runtime(*, model_cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                  device: torch.device, local: list[list[int]], packed: list[PackedExperts | None],
                  model_path: str | None, capacity: int | None, prefetch: str = "auto", policy: str | None = None,
                  backend: str = "torch", async_prefetch: bool = True,
                  counts: TransitionCounts | None = None, **runtime_kw) -> ExpertRuntime:
    """An ExpertRuntime for a model with `weights` (the rank's weight dict: router gates and post-attention norms
    feed the predictors), compute `dtype` and `device` (not attached to any model).

    `prefetch="auto"` picks `auto_prefetch(device, full)`: none when the cache (and, with a cold tier, the
    packed resident set) holds every local expert, else DEFAULT_PREDICTOR on CUDA and none on CPU.
    Markov counts come from `counts`, else `<model_path>/expert_transitions.safetensors` when present, else
    start at zero (learned online).
    Raises:
        ValueError: unknown prefetch name (names the field and the choices).
    """
    mc = model_cfg
    if prefetch not in PREDICTORS + ("auto",):
        raise ValueError(f"prefetch={prefetch!r} must be auto or one of {PREDICTORS}")
    if prefetch == "auto":
        resident = runtime_kw.get("resident")
        full = (capacity is None or capacity >= mc.num_experts) and (resident is None or resident >= mc.num_experts)
        prefetch = auto_prefetch(device, full, cold=resident is not None and resident < mc.num_experts)
    if counts is None and model_path and os.path.isfile(os.path.join(model_path, TRANSITIONS_FILE)):
        counts = TransitionCounts.load(os.path.join(model_path, TRANSITIONS_FILE))
        if counts.freq.shape != (mc.num_layers, mc.num_experts):
            log.warning("ignoring %s: shape %s does not match the model", TRANSITIONS_FILE, tuple(counts.freq.shape))
            counts = None
    w = weights
    gates = [w.get(f"layers.{l}.gate_w") for l in range(mc.num_layers)]
    norms = [w.get(f"layers.{l}.post_norm") for l in range(mc.num_layers)]
    pred = make_predictor(prefetch, num_layers=mc.num_layers, num_experts=mc.num_experts, top_k=mc.top_k,
                          moe_layers=mc.moe_layers, counts=counts, gate_weights=gates, norm_weights=norms,
                          norm_eps=mc.rms_norm_eps)
    return ExpertRuntime(model_cfg=mc, local=local, packed=packed, dtype=dtype, device=device,
                         capacity=capacity, predictor=pred, policy=policy, backend=backend,
                         async_prefetch=async_prefetch, warm_counts=counts, **runtime_kw)


def build_engine_experts(cfg, model_cfg: ModelConfig, weights: dict, local: list[list[int]], *, dtype: torch.dtype,
                         device: torch.device, gating_router: GatingRouter | None = None):
    """The engine seam (`RankEngine._build_experts`, before the model is built): returns an ExpertRuntime (the
    model's experts, `layers`, and its routing observer), or None to keep the full-precision `LocalExperts`.
    `weights`: the rank's weight dict (a load-time quantization takes the routed experts out of it); `dtype`,
    `device`: the model's compute dtype and device.

    Packed experts are used when `cfg.model` is a packed checkpoint (read: only this rank's experts) or
    `cfg.weight_bits` is set (quantized at load time, group size `cfg.weight_group_size`, uniform grid).
    With `cfg.resident_experts` below E (packed checkpoint only) a layer keeps only its share of packed experts
    in memory (`ColdExpertTier`) and reads the others from the memory-mapped checkpoint when needed; the
    dequantized cache then defaults to empty (`expert_cache_capacity` None -> 0), as it does wherever the
    compiled fused kernel serves misses (`fused_path_runs`: CPU); elsewhere None means every local expert.
    Raises:
        ValueError: weight_bits disagrees with a packed checkpoint's bits; expert_cache_capacity or an explicit
            prefetch predictor without packed experts; resident_experts without a packed checkpoint; unknown
            prefetch / kernel_backend.
    """
    mc = model_cfg
    resident = getattr(cfg, "resident_experts", None)
    packed_dir = is_packed_checkpoint(cfg.model)
    if resident is not None and not packed_dir:
        raise ValueError(f"resident_experts={resident} needs a packed checkpoint (moeray quantize) to read the "
                         f"other experts from; model={cfg.model!r} is not one")
    cold = None
    if packed_dir:
        qc = read_quant_config(cfg.model)
        if cfg.weight_bits is not None and cfg.weight_bits != qc["bits"]:
            raise ValueError(f"weight_bits={cfg.weight_bits} but model={cfg.model!r} is already packed at "
                             f"bits={qc['bits']}; quantize the full-precision checkpoint instead")
        from actors.model.weights import CheckpointReader

        reader = CheckpointReader(cfg.model)
        if resident is not None and resident < mc.num_experts:
            cold = PackedExpertReader(cfg.model, mc)
        # Layers served by a cold tier read nothing now (their slots fill when the runtime warms them).
        packed = [load_packed_experts(cfg.model, mc, l, local[l], reader).to(device)
                  if mc.moe_layers[l] and local[l] and local_share(resident, len(local[l]), mc.num_experts) >=
                  len(local[l]) else None for l in range(mc.num_layers)]
    elif cfg.weight_bits is not None:
        packed = []
        for l in range(mc.num_layers):
            if not mc.moe_layers[l]:
                packed.append(None)
                continue
            gu, dn = weights.pop(f"layers.{l}.w_gate_up"), weights.pop(f"layers.{l}.w_down")
            packed.append(quantize_local_experts(gu, dn, bits=cfg.weight_bits, group_size=cfg.weight_group_size))
    else:
        asked = [f"{k}={v!r}" for k, v, on in (
            ("expert_cache_capacity", cfg.expert_cache_capacity, cfg.expert_cache_capacity is not None),
            ("prefetch", cfg.prefetch, cfg.prefetch not in ("none", "auto"))) if on]
        if asked:
            raise ValueError(f"{' and '.join(asked)} apply to packed experts: set weight_bits or serve a packed "
                             "checkpoint (moeray quantize)")
        return None
    capacity = cfg.expert_cache_capacity
    if capacity is None and cold is not None:
        capacity = 0  # a model served from the cold tier does not fit dequantized: cache only when asked to
    if capacity is None and fused_path_runs(device, cfg.kernel_backend, dtype):
        capacity = 0  # CPU: the fused kernel on the packed bytes beats a dequantized copy (`fused_path_runs`)
    return build_runtime(model_cfg=mc, weights=weights, dtype=dtype, device=device, local=local, packed=packed,
                         model_path=cfg.model, capacity=capacity, prefetch=cfg.prefetch, backend=cfg.kernel_backend,
                         cold=cold, resident=resident if cold is not None else None, gating_router=gating_router)
