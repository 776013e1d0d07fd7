"""Layer widths by measured sensitivity: how many bits each layer's keys and values get within one profile's budget.

Why. One width for every layer spends the bits where they do least: on tiny-moe's 4k checkpoint, quantizing only
the last layer's keys at the 3-bit recipe (216 bits per head row) costs a mean KLD of 0.0137 against the
full-precision run, every other layer's keys 0.0002-0.0009 (BENCHMARKS.md, "Layer widths"). KVTuner (arXiv
2502.04420) searches layer-wise KV precision pairs by sensitivity; this is the same idea on our format, with an
exact solver instead of a search heuristic.

Method. On calibration windows (never the evaluation text), for each layer l alone: the KLD of the model's
next-token distribution against the full-precision run when only layer l's keys go through the recipe at key row
budget kb (values exact), for every kb of a grid, and when only its values go through at value width vb (keys
exact), for every vb of the recipe's value grid (`value_bits_grid`: {1, 2, 3, 4} at 2 bits, {2, 3, 4} above)
(`measure_sensitivity`, through `actors.kv.simulated.SimulatedCache`). Taking
the errors as additive over layers and between keys and values (measured: the sum of the single-layer KLDs
predicts the all-layer KLD within 20%), `allocate` picks one (vb, kb) per layer minimising the summed KLD subject
to the profile's mean bits per element (codes plus the fp16 value scale), by dynamic programming over the layers.
The result is stored in the profile itself (each layer's `bits` and `k_bits`): serving reads nothing else.

Shape legend: L = layers, N = calibration tokens, H = KV heads, D = head_dim.
"""
from __future__ import annotations

import torch

from actors.kv.simulated import SimulatedCache, window_logits

VALUE_BITS = (2, 3, 4)
# At 2 bits a layer's values may go down to 1 bit so that the most sensitive layer's values get 3: on the 4k
# tiny-moe checkpoint the last layer's values carry most of the 2-bit error (keeping them exact alone takes the
# mean KLD from 0.045 to 0.027; any other layer's keys or values exact: 0.036-0.044), while keys below 2 bits per
# channel cost far more than they free (layers 0-2 at 112 bits per key row: keys-only KLD 0.018 -> 0.038).
# BENCHMARKS.md, "1-bit values".
VALUE_BITS_2 = (1, 2, 3, 4)
SCALE_BITS = 16  # the fp16 per-token value scale of a head row (8 with an 8-bit log2 scale, `v_scale_bits`)


def value_bits_grid(bits: int) -> tuple[int, ...]:
    """Value widths the layers of a `bits`-bit recipe may take: (1, 2, 3, 4) at 2 bits, (2, 3, 4) otherwise."""
    return VALUE_BITS_2 if bits == 2 else VALUE_BITS


def key_bits_grid(head_dim: int) -> list[int]:
    """Key row budgets tried per layer: 2 to 6.5 bits per key channel, in steps of head_dim / 4 bits, then 8."""
    step = max(8, head_dim // 4 // 8 * 8)
    return list(range(2 * head_dim, int(6.5 * head_dim) + 1, step)) + [8 * head_dim]


def row_bits(value_bits: int, key_bits: int, head_dim: int, scale_bits: int = SCALE_BITS) -> int:
    """Bits of one token's K and V head rows: key codes, value codes, the fp16 value scale."""
    return key_bits + value_bits * head_dim + scale_bits


def allocate(key_kld: list[dict[int, float]], value_kld: list[dict[int, float]], head_dim: int,
             budget_bits: float, scale_bits: int = SCALE_BITS) -> list[tuple[int, int]]:
    """Per layer (value bits, key row bits) minimising sum_l key_kld[l][kb] + value_kld[l][vb] subject to
    mean_l row_bits(vb, kb, D, scale_bits) / (2 D) <= budget_bits (bits per K/V element, profile tensors not
    counted).

    Args:
        key_kld, value_kld: per layer {key row bits: KLD} / {value bits: KLD} (`measure_sensitivity`).
        head_dim: D. budget_bits: mean bits per element allowed (e.g. the uniform recipe's).
        scale_bits: bits of a head row's value scale (16: fp16; 8: the 8-bit log2 code).
    Returns:
        [(vb, kb)] per layer. Ties: the cheaper total, then the earlier grid entries.
    Raises:
        ValueError: mismatched layer counts, or no choice within the budget.
    """
    if len(key_kld) != len(value_kld) or not key_kld:
        raise ValueError(f"key_kld has {len(key_kld)} layers, value_kld {len(value_kld)}: need the same, >= 1")
    cap = int(budget_bits * 2 * head_dim * len(key_kld) + 1e-6)  # total row bits over layers
    best = {0: (0.0, [])}  # total row bits so far -> (summed KLD, choices)
    for kk, vk in zip(key_kld, value_kld):
        nxt = {}
        for used, (err, picks) in best.items():
            for vb, ve in sorted(vk.items()):
                for kb, ke in sorted(kk.items()):
                    tot = used + row_bits(vb, kb, head_dim, scale_bits)
                    if tot > cap:
                        continue
                    cand = (err + ve + ke, picks + [(vb, kb)])
                    if tot not in nxt or cand[0] < nxt[tot][0]:
                        nxt[tot] = cand
        best = nxt
        if not best:
            raise ValueError(f"no layer widths fit budget_bits={budget_bits} per element")
    return min(best.items(), key=lambda kv: (kv[1][0], kv[0]))[1][1]


@torch.inference_mode()
def measure_sensitivity(model, windows: list[list[int]], fit_layer, *, rope_theta: float, head_dim: int,
                        key_grid: list[int] | None = None, value_grid=VALUE_BITS):
    """Single-layer KLD curves on calibration windows (module docstring).

    Args:
        model: `actors.model.model.MoEModel` (full-precision reference and the runs). windows: token id lists.
        fit_layer(l, vb, kb) -> KVQuantProfile of layer l at value bits vb and key row bits kb (cached by caller).
        rope_theta, head_dim: the model's. key_grid: key row budgets (default `key_bits_grid`).
    Returns:
        (key_kld, value_kld): per layer {kb: mean KLD} with values exact, {vb: mean KLD} with keys exact, in nats.
    """
    from kernels.kv_quant import dequantize_kv, quantize_kv

    key_grid = key_grid or key_bits_grid(head_dim)
    max_tokens = max(len(w) for w in windows)
    exact = SimulatedCache(lambda l, k, v: (k, v), rope_theta, head_dim, max_tokens)
    ref = [torch.log_softmax(window_logits(model, exact, w), -1) for w in windows]
    n_layers = model.cfg.num_layers

    def kld(layer, part, vb, kb):
        prof = fit_layer(layer, vb, kb)

        def qdq(l, k, v):
            if l != layer:
                return k, v
            kq, vq = dequantize_kv(quantize_kv(k, v, prof), prof)
            return (kq, v) if part == "k" else (k, vq)
        cache = SimulatedCache(qdq, rope_theta, head_dim, max_tokens)
        tot = n = 0.0
        for w, lp in zip(windows, ref):
            lq = torch.log_softmax(window_logits(model, cache, w), -1)
            tot += float((lp.exp() * (lp - lq)).sum())
            n += lp.shape[0]
        return tot / n

    mid = sorted(value_grid)[len(value_grid) // 2]
    key_kld = [{kb: kld(l, "k", mid, kb) for kb in key_grid} for l in range(n_layers)]
    value_kld = [{vb: kld(l, "v", vb, key_grid[0]) for vb in value_grid} for l in range(n_layers)]
    return key_kld, value_kld


def recipe_budget(bits: int, key_row_bits: int | None, head_dim: int) -> float:
    """Mean bits per element of the uniform recipe (every layer at `bits` values, `key_row_bits` keys per head
    row, or `bits` per key channel without per-channel widths): the budget an allocation must stay within."""
    kb = key_row_bits if key_row_bits is not None else bits * head_dim
    return row_bits(bits, kb, head_dim) / (2 * head_dim)


def fit_allocated_profile(model, k_layers, v_layers, windows: list[list[int]], *, name: str, bits: int,
                          query_energy=None, meta: dict | None = None, progress=None, value_grid=None, **fit_kw):
    """`fit_model_profile` with layer widths allocated by `measure_sensitivity` on `windows` (calibration text)
    within the uniform recipe's budget (`recipe_budget`, counted with an fp16 value scale: with
    `v_scale_bits=8` in fit_kw the 8 bits each head row saves go to the layers too); the curves and the
    allocation go into the profile's meta ("layer_widths", "layer_sensitivity").

    Args: as `actors.kv.calibration.fit_model_profile`, plus model (`MoEModel`) and windows (token id lists of
        the calibration text); progress: optional callable(n) called once per measured configuration;
        value_grid: the value widths layers may take (default `value_bits_grid(bits)`).
    Raises:
        ValueError: from fit_kv_profile, or `fit_kw` without per-channel keys (`k_channel_bits`).
    """
    from actors.kv.calibration import fit_model_profile
    from kernels.kv_calibrate import fit_kv_profile

    if fit_kw.get("k_channel_bits") is None:
        raise ValueError("layer widths allocate per-channel key row bits: give k_channel_bits")
    head_dim = k_layers[0].shape[-1]
    qe = query_energy if query_energy is not None else [None] * len(k_layers)
    fitted = {}

    def fit_layer(l, vb, kb):
        if (l, vb, kb) not in fitted:
            fitted[(l, vb, kb)] = fit_kv_profile(k_layers[l], v_layers[l], query_energy=qe[l],
                                                 **{**fit_kw, "bits": vb, "k_channel_bits": kb})
            if progress is not None:
                progress(1)
        return fitted[(l, vb, kb)]

    # the recipe's own key row is on the grid, so the uniform recipe is one of the choices `allocate` weighs
    grid = sorted(set(key_bits_grid(head_dim)) | {fit_kw["k_channel_bits"]})
    key_kld, value_kld = measure_sensitivity(model, windows, fit_layer, rope_theta=model.cfg.rope_theta,
                                             head_dim=head_dim, key_grid=grid,
                                             value_grid=value_grid or value_bits_grid(bits))
    budget = recipe_budget(bits, fit_kw["k_channel_bits"], head_dim)
    widths = allocate(key_kld, value_kld, head_dim, budget, fit_kw.get("v_scale_bits", SCALE_BITS))
    sens = {"key": [{str(k): round(x, 6) for k, x in d.items()} for d in key_kld],
            "value": [{str(k): round(x, 6) for k, x in d.items()} for d in value_kld]}
    return fit_model_profile(k_layers, v_layers, name=name, bits=bits, query_energy=query_energy,
                             layer_widths=widths, meta={**(meta or {}), "layer_sensitivity": sens}, **fit_kw)
