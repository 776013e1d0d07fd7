"""How KV quantization profiles are made: the shipped recipe, K/V collection from the model, per-layer fitting.

`moeray calibrate` (moeray/cli_calibrate.py) runs `collect_calibration_kv` on a text domain, fits one
`KVQuantProfile` per layer with `fit_model_profile` (the recipe `RECOMMENDED_FIT_OPTIONS` for the width,
unless flags override it) and writes the result with `actors.kv.profiles.save_profile`.
`model_effective_bits` is the storage cost of one sequence under a profile (sealed tokens quantized, sink and
tail in full precision), the figure the calibration report prints.
"""
from __future__ import annotations

import torch

from actors.kv.profiles import ModelKVProfile

# Key bits per head row of the 2-bit recipe (per-channel key widths, `kernels.kv_quant` module docstring):
# 152 bits = 19 bytes for D = 64, i.e. 2.375 bits per key element on average, the bytes the old recipe spent
# on 2-bit codes plus one fp16 outlier channel (18) plus one. Each channel gets 2-8 bits by query-energy-weighted
# key error; with query energies from calibration (bench/kv_quality.py and `moeray calibrate` collect them).
K_CHANNEL_BITS_2 = 152
# The 4-bit recipe uses the same per-channel widths, at 5 bits per key element on average (320 bits = 40 bytes
# per head row for D = 64) with 4-bit values: the keys carry the error. On the 4k tiny-moe checkpoint (teacher-
# forced top-1 agreement with full-precision KV, mean of 4 held-out 512-token slices, prose / code): keys at 256
# bits 0.963 / 0.940, at 288 0.971 / 0.953, at 320 0.974 / 0.964, at 512 (8 bits) 0.981 / 0.972; values in full
# precision instead (keys at 256) 0.972 / 0.951. 256 bits met the 97% bar on the stage-4 checkpoint (0.971).
K_CHANNEL_BITS_4 = 320
# The 3-bit recipe too, at 216 bits per head row (27 bytes for D = 64: 3.375 bits per key element), which keeps the
# 3-bit cache at 3.33 bits per element at 4,096 tokens (<= 3.4, issue 21). On the 4k tiny-moe checkpoint
# (bench/kv_quality.py --quick --retrieval, 4,096-token windows) the per-channel keys took the 3-bit cache's mean
# KLD from 0.075 (one k-means key codebook) to 0.027 at 200 bits and 0.015 at 232, and retrieval from 0.68 to
# 0.97 of fp16's. An MSE clip search on the per-channel ranges (`k_range="mse"`) lowered KLD a little more at
# every width but cost retrieval (2 bits: 0.86 -> 0.54 of fp16's): the rare large keys that decide where
# attention goes are the ones clipping hurts, so every recipe keeps the calibrated min/max range.
K_CHANNEL_BITS_3 = 216
# The 2-bit recipe stores the per-token value scale as an 8-bit log2 code (1/16-octave steps, rounded up;
# `kernels.kv_quant`) instead of fp16: 8 bits fewer per token and head, which the layer widths spend elsewhere within
# the same budget. On the 4k tiny-moe checkpoint the code alone changes the 2-bit cache's mean KLD from 0.0454 to
# 0.0449 (held-out probe windows), and with the bits re-allocated (and 1-bit value layers) the bench's 4k KLD went
# from 0.054 to 0.040 (BENCHMARKS.md, "1-bit values and 8-bit value scales"). The 3- and 4-bit recipes keep fp16
# scales: at 3 bits the freed bits moved KLD 0.0079 -> 0.0070 and same-top-1 94.0 -> 94.4%, inside the noise,
# while retrieval at 4k read 73 of 80 records against 75 before.
V_SCALE_BITS = 8
# The shipped recipe per code width (what models/tiny-moe/kv_profiles/ was calibrated with and what
# bench/kv_quality.py reports as `ours<b>`): `kernels.kv_calibrate.fit_kv_profile` options. Chosen on tiny-moe's
# held-out text (BENCHMARKS.md, KV section): at 3 and 4 bits fp16 key outlier channels buy nothing
# measurable and cost 0.125 bits/element per channel and head, so there are none; at 2 bits the keys carry
# most of the error (2-bit keys alone: +1.5% prose / +6% code; 2-bit values alone: +0.6% / -0.8%), so keys
# get per-channel widths (2-8 bits on a uniform grid over each channel's min/max range, allocated by
# query-energy-weighted error, 152 bits per head row) instead of one fp16 outlier channel, and values a
# k-means codebook (measured best of the codebook / range combinations, 24 windows per domain).
RECOMMENDED_FIT_OPTIONS = {
    2: dict(n_outlier=0, n_outlier_v=0, codebook="uniform", codebook_v="kmeans", use_v_zero=True,
            k_range="minmax", k_channel_bits=K_CHANNEL_BITS_2, v_scale_bits=V_SCALE_BITS),
    3: dict(n_outlier=0, n_outlier_v=0, codebook="uniform", codebook_v="kmeans", use_v_zero=True,
            k_range="minmax", k_channel_bits=K_CHANNEL_BITS_3),
    4: dict(n_outlier=0, n_outlier_v=0, codebook="uniform", codebook_v="kmeans", use_v_zero=True,
            k_range="minmax", k_channel_bits=K_CHANNEL_BITS_4),
}
# Widths whose recipe allocates layer widths by measured sensitivity (`actors.kv.layer_widths`) within the uniform
# recipe's bits: on the 4k tiny-moe checkpoint the last layer's keys carry most of the error, and the allocation
# took the 3-bit cache's mean KLD at 1k from 0.021 to 0.009 and the 2-bit one's from 0.14 to 0.06 at the same bits
# (BENCHMARKS.md, "Layer widths").
RECOMMENDED_LAYER_WIDTHS = {2: True, 3: True, 4: True}
# Full-precision sink tokens the recipe was measured with. A sink shifts the 16-token blocks by one, so at a
# block-multiple length 15 tail tokens stay unsealed in fp16 (0.2 bits/element at 1024 tokens) while quality
# does not measurably change on tiny-moe.
RECOMMENDED_SINK_TOKENS = 0


def collect_calibration_kv(engine, token_ids: list[int], *, window: int = 1024, progress=None,
                           with_query_energy: bool = False):
    """Run the model on `token_ids` in non-overlapping windows and collect every layer's pre-RoPE K and V.

    Args:
        engine: an `actors.engine.engine.RankEngine` (world size 1) holding the model; its cache is used for
            attention (full precision is what calibration should see).
        token_ids: the calibration text, tokenized.
        window: tokens per forward (<= the engine's max_model_len).
        progress: optional callable `(tokens_done)` called after each window (e.g. a tqdm update).
        with_query_energy: also return, per layer, the query energy of each key channel ([H, D] fp32):
            the mean over tokens of (q_d**2 + q_{d +- D/2}**2) / 2 summed over the KV head's query heads,
            from the post-RoPE queries (the pair sum is rotation-invariant). It weights key errors in
            `kernels.kv_calibrate.fit_kv_profile(query_energy=...)`.
    Returns:
        (k, v) or, with_query_energy, (k, v, q_energy): per layer, k / v [N, H, D] fp32 tensors on CPU,
        N = len(token_ids); q_energy [H, D] fp32.
    Raises:
        ValueError: empty token_ids or window < 1.
    """
    if not token_ids or window < 1:
        raise ValueError(f"need token_ids (got {len(token_ids)}) and window={window} >= 1")
    num_layers = engine.model_cfg.num_layers
    ks: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    vs: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    qe: list[torch.Tensor | None] = [None] * num_layers
    cache = engine.cache
    orig_attend = cache.attend

    def recording_attend(layer, q, k, v, positions, meta, rotary, scale):
        ks[layer].append(k.detach().float().cpu())
        vs[layer].append(v.detach().float().cpu())
        if with_query_energy:
            h, d = k.shape[1], k.shape[2]
            e = q.detach().float().cpu().reshape(q.shape[0], h, -1, d).pow(2).sum(dim=(0, 2))  # [H, D]
            pair = (e[:, : d // 2] + e[:, d // 2:]) * 0.5
            e = torch.cat([pair, pair], dim=1)
            qe[layer] = e if qe[layer] is None else qe[layer] + e
        return orig_attend(layer, q, k, v, positions, meta, rotary, scale)

    cache.attend = recording_attend  # instance attribute shadows the method only during calibration
    try:
        for start in range(0, len(token_ids), window):
            chunk = token_ids[start:start + window]
            engine.prompt_logits(chunk)
            if progress is not None:
                progress(len(chunk))
    finally:
        del cache.attend
    k_out, v_out = [torch.cat(x) for x in ks], [torch.cat(x) for x in vs]
    if with_query_energy:
        return k_out, v_out, [e / len(token_ids) for e in qe]
    return k_out, v_out


def fit_model_profile(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], *, name: str, bits: int,
                      meta: dict | None = None, query_energy: list[torch.Tensor] | None = None,
                      layer_widths: list[tuple[int, int]] | None = None, **fit_kw) -> ModelKVProfile:
    """Fit one KVQuantProfile per layer (`kernels.kv_calibrate.fit_kv_profile`, keyword options in `fit_kw`).

    Args:
        k_layers, v_layers: per layer [N, H, D] pre-RoPE keys and values (from collect_calibration_kv).
        name: profile name (domain). bits: 2, 3 or 4. meta: extra JSON metadata.
        query_energy: optional per-layer [H, D] key-channel weights (collect_calibration_kv with
            with_query_energy=True), used by per-channel key widths (`k_channel_bits`).
        layer_widths: optional per-layer (value bits, key row bits) (`actors.kv.layer_widths.allocate`):
            layer l is fitted at those instead of `bits` / `k_channel_bits`; `bits` stays the profile's width.
    Raises:
        ValueError: from fit_kv_profile (shapes, bits, option ranges), or query_energy / layer_widths of the
            wrong length.
    """
    from kernels.kv_calibrate import fit_kv_profile

    if query_energy is not None and len(query_energy) != len(k_layers):
        raise ValueError(f"query_energy has {len(query_energy)} layers; k_layers has {len(k_layers)}")
    qe = query_energy if query_energy is not None else [None] * len(k_layers)
    if layer_widths is not None and len(layer_widths) != len(k_layers):
        raise ValueError(f"layer_widths has {len(layer_widths)} layers; k_layers has {len(k_layers)}")
    widths = layer_widths or [(bits, fit_kw.get("k_channel_bits"))] * len(k_layers)
    layers = [fit_kv_profile(k, v, query_energy=e, **{**fit_kw, "bits": vb, "k_channel_bits": kb})
              for k, v, e, (vb, kb) in zip(k_layers, v_layers, qe, widths)]
    opts = dict(fit_kw)
    if layer_widths is not None:
        opts["layer_widths"] = [list(w) for w in layer_widths]
    if fit_kw.get("k_channel_bits") is not None:
        opts["query_energy"] = query_energy is not None
    return ModelKVProfile(name=name, bits=bits, layers=layers, meta={**(meta or {}), "fit_options": opts})


def model_effective_bits(profile: ModelKVProfile, num_tokens: int, *, block_size: int = 16,
                         sink_tokens: int = 1, full_precision_bytes: int = 2) -> float:
    """Effective bits per K/V element of one sequence of `num_tokens` tokens in the quantized paged cache.

    Counts, per layer: sealed tokens at quantized size (codes, V scales, outlier values), the sink and the
    unsealed tail at `full_precision_bytes` bytes per element, and the profile's tensors amortised over this
    one sequence (a pessimistic bound: they are shared by every sequence). Layers hold equal element counts,
    so the model figure is the mean over layers (`kernels.kv_profile.effective_bits`).

    Raises: ValueError if num_tokens < 1.
    """
    from kernels.kv_profile import effective_bits

    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens} must be >= 1")
    sealed = max(0, num_tokens - sink_tokens) // block_size * block_size
    bits = [effective_bits(p, num_tokens=sealed, num_full_precision_tokens=num_tokens - sealed,
                           full_precision_bytes=full_precision_bytes) for p in profile.layers]
    return sum(bits) / len(bits)
