"""`moeray calibrate`: fit a KV quantization profile (KVQuant, arXiv 2401.18079) for one text domain.

    moeray calibrate --domain prose --data a.txt b.txt --bits 3 models/tiny-moe/kv_profiles

runs the model on the text in non-overlapping windows, collects every layer's pre-RoPE keys and values,
fits per-channel key scales, outlier channels and non-uniform (k-means) codebooks per layer with the shipped
recipe for that width (`actors.kv.calibration.RECOMMENDED_FIT_OPTIONS`; flags override it), spends the width's
bits where they matter (each layer's value bits and key row bits allocated by measured sensitivity on the first
calibration windows, `actors.kv.layer_widths`; `--layer-widths uniform`: every layer the same), and writes
`<OUT>/<domain>-<bits>bit.safetensors` + `.json` (or exactly OUT, if it ends in `.safetensors`).
A progress bar (tqdm) goes to stderr.
"""
from __future__ import annotations

import os
import sys
import time

from cluster.config import DEFAULT_MODEL

SENSITIVITY_WINDOWS = 4  # calibration windows the layer-width sensitivity is measured on


def add_parser(sub) -> None:
    from moeray.cli import HelpFormatter

    p = sub.add_parser("calibrate", help="write a KV quantization profile for one text domain",
                       formatter_class=HelpFormatter)
    p.add_argument("out", metavar="OUT", help="profile folder (e.g. <model>/kv_profiles) or a .safetensors path")
    p.add_argument("--domain", required=True, help="profile name, e.g. prose or code")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE", help="calibration text files")
    p.add_argument("--bits", type=int, required=True, choices=[2, 3, 4], help="code width in bits per element")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model folder (HF layout)")
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens at most")
    p.add_argument("--window", type=int, default=1024, help="tokens per forward")
    # Fit options left unset take the shipped recipe for --bits (actors.kv.calibration.RECOMMENDED_FIT_OPTIONS).
    recipe = "(default: the shipped recipe for --bits)"
    p.add_argument("--n-outlier", type=int, default=None, help=f"key outlier channels per KV head kept in fp16 {recipe}")
    p.add_argument("--n-outlier-v", type=int, default=None,
                   help=f"value outlier channels per KV head kept in fp16 {recipe}")
    p.add_argument("--percentile", type=float, default=1.0, help="per-channel key range percentile, (0.5, 1]")
    p.add_argument("--codebook", default=None, choices=["kmeans", "uniform"], help=f"key codebook method {recipe}")
    p.add_argument("--codebook-v", default=None, choices=["kmeans", "uniform"],
                   help="value codebook method (default: --codebook if given, else the shipped recipe for --bits)")
    p.add_argument("--k-range", default=None, choices=["mse", "minmax"], help=f"per-channel key range fit {recipe}")
    p.add_argument("--no-v-zero", action="store_true", help="do not subtract the per-channel value mean")
    p.add_argument("--k-channel-bits", type=int, default=None, metavar="B",
                   help="per-channel key widths: B bits per head row allocated by query-energy-weighted key error "
                        "(kernels.kv_calibrate.fit_kv_profile); 0: one width for every channel. Default: the shipped "
                        "recipe for --bits (152 bits at 2 bits, 216 at 3, 320 at 4, per 64-channel row, scaled to the model's head_dim)")
    p.add_argument("--layer-widths", default="auto", choices=["auto", "uniform"],
                   help="auto: each layer's value bits and key row bits allocated by measured sensitivity on the "
                        "calibration text within the recipe's bits (actors.kv.layer_widths; where the recipe for "
                        "--bits does it and keys have per-channel widths); uniform: every layer the same")
    p.set_defaults(func=cmd_calibrate)


def recipe_options(a, head_dim: int) -> dict:
    """`fit_model_profile` options: the shipped recipe for `a.bits` (`RECOMMENDED_FIT_OPTIONS`, its per-channel
    key row budget, where it has one, scaled from 64 channels to `head_dim`), overridden by the flags given."""
    from actors.kv.calibration import RECOMMENDED_FIT_OPTIONS

    opts = dict(RECOMMENDED_FIT_OPTIONS[a.bits])
    if opts.get("k_channel_bits") is not None:
        opts["k_channel_bits"] = round(opts["k_channel_bits"] * head_dim / 64)
    given = {"n_outlier": a.n_outlier, "n_outlier_v": a.n_outlier_v, "codebook": a.codebook, "k_range": a.k_range,
             "codebook_v": a.codebook_v if a.codebook_v is not None else a.codebook}
    opts.update({k: v for k, v in given.items() if v is not None})
    if a.no_v_zero:
        opts["use_v_zero"] = False
    if a.k_channel_bits is not None:
        opts["k_channel_bits"] = a.k_channel_bits or None
    return opts


def cmd_calibrate(a) -> int:
    from tqdm import tqdm

    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.kv.calibration import (RECOMMENDED_LAYER_WIDTHS, collect_calibration_kv, fit_model_profile,
                                       model_effective_bits)
    from actors.kv.layer_widths import fit_allocated_profile
    from actors.kv.profiles import profile_filename, save_profile

    if a.tokens < 1 or a.window < 1:
        print(f"moeray: error: --tokens={a.tokens} and --window={a.window} must be >= 1", file=sys.stderr)
        return 2
    missing = [f for f in a.data if not os.path.isfile(f)]
    if missing:
        print(f"moeray: error: --data files not found: {missing}", file=sys.stderr)
        return 2
    try:
        mc = ModelConfig.from_pretrained(a.model)
        window = min(a.window, mc.max_position_embeddings)
        eng = RankEngine(EngineConfig(model=a.model, max_model_len=window, max_num_seqs=1),
                         ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    text = "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in a.data)
    ids = eng.tokenizer.encode(text).ids[: a.tokens]
    if not ids:
        print("moeray: error: --data holds no text", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tqdm(total=len(ids), unit="tok", desc=f"calibrate {a.domain} {a.bits}-bit", file=sys.stderr) as bar:
        k, v, qe = collect_calibration_kv(eng, ids, window=window, progress=bar.update, with_query_energy=True)
    meta = {"model": os.path.basename(os.path.abspath(a.model)),
            "calibration_files": [os.path.basename(f) for f in a.data], "calibration_tokens": len(ids)}
    opts = recipe_options(a, mc.head_dim)
    qe = qe if opts.get("k_channel_bits") is not None else None
    allocate = (a.layer_widths == "auto" and RECOMMENDED_LAYER_WIDTHS.get(a.bits)
                and opts.get("k_channel_bits") is not None)
    try:
        if allocate:  # sensitivity on the first windows of the calibration text (a few dozen forwards each)
            wins = [ids[j:j + window] for j in range(0, len(ids) - window + 1, window)][:SENSITIVITY_WINDOWS] or [ids]
            with tqdm(unit="fit", desc="layer widths", file=sys.stderr) as bar:
                prof = fit_allocated_profile(eng.model, k, v, wins, name=a.domain, bits=a.bits, meta=meta,
                                             percentile=a.percentile, query_energy=qe, progress=bar.update, **opts)
        else:
            prof = fit_model_profile(k, v, name=a.domain, bits=a.bits, meta=meta, percentile=a.percentile, **opts,
                                     query_energy=qe)
    except ValueError as e:
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    prof.meta["effective_bits_1024"] = round(model_effective_bits(prof, 1024), 4)
    out = a.out if a.out.endswith(".safetensors") else os.path.join(a.out, profile_filename(a.domain, a.bits))
    st, js = save_profile(prof, out)
    print(f"wrote {st} and {js} ({len(ids)} tokens, {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print(st)
    return 0
