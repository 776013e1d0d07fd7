"""KV-cache quantization quality: perplexity, KL divergence, same-top-1 and retrieval per KV width and context.

For each domain (prose, code) of `<model>/heldout/<domain>.txt`: the first `--calib-tokens` tokens calibrate
the profiles (never evaluated; forwards of 1024 tokens), then, for each context C of `--contexts` (default
1024 and 4096 where the model's max_position_embeddings allows, else its max; contexts beyond the model's are
listed as not run), non-overlapping C-token windows after them are evaluated. Every row runs the model over
each window with its keys and values written through a cache and read back as in decoding: token i attends to
keys quantized as soon as their block (ours) or group (KIVI) is complete at step i, and in full precision
otherwise (the prefill path of `QuantizedPagedKVCache` provably gives the decode numbers, see
tests/actors/kv/test_kv_quant_cache.py). Per row and context:
  * perplexity per domain and dppl, its increase over fp16-kv in percent;
  * KLD: mean KL(p_fp16 || p_row) per position in nats against the fp16-kv run's distribution, and top1: the
    share of positions where both runs' most likely token agree, in percent (llama.cpp `llama-perplexity
    --kl-divergence`, "same top p"), over every evaluated position of both domains (positions 0 .. C-2 of
    each window); in windows longer than 1024 also over the positions >= 1024 apart (">1k");
  * with `--retrieval`, for the rows fp16-kv, ours2/3/4, kivi2-m/kivi3-m: exact-match accuracy on retrieval
    records (scripts/retrieval_records.py: a 5-digit value planted in held-out text after the calibration
    head, asked for at the end) at 10 depths (10%-90%) x `--per-cell` records (half prose, half code, the
    same records for every row), a prompt of C - 6 tokens so that prompt and answer fit the context; the
    prompt is prefilled through the row's cache and up to 6 tokens decoded greedily, one decode step each
    (the quantized cache seals and reads its pages as in serving; bench/kv_eval.py); a 95% Wilson interval,
    and the accuracy as a fraction of fp16-kv's (defined as 0 when fp16-kv's accuracy is 0).

Rows:
  fp16-kv        the full-precision cache (reference; compute in fp32, counted as 16 bits)
  kivi<b>        KIVI-style uniform b-bit (arXiv 2402.02750): post-RoPE keys per channel over groups of 32
                 tokens, values per token over groups of 32 channels, fp16 scale + zero per group (b + 1
                 bits); the incomplete group stays in full precision
                 kivi5 / kivi6 / kivi8 (codes one per byte, counted at their width) run only when named in `--rows`:
                 the fidelity ladder, what KLD and same-top-1 a uniform cache reaches at each width on this model
  kivi<b>-m      the same at matched bits: key groups of 128 tokens, value groups of 64 channels (b + 0.375)
  ours<b>        KVQuant-style (arXiv 2401.18079), the shipped recipe `actors.kv.calibration.RECOMMENDED_FIT_OPTIONS`
                 through `QuantizedPagedKVCache`: b-bit codes for keys AND values ("b-bit configuration"), pre-RoPE
                 per-channel keys with calibrated ranges, per-token values with a scale (fp16; an 8-bit log2 code at 2
                 bits, `kernels.kv_quant`) and a per-channel mean, codebooks per layer, fp16 key outlier channels, no
                 sink, the unsealed block in full precision. 2 bits: per-channel key widths (2-8 bits, 152 bits per
                 head row, on a uniform grid over each channel's min/max range, allocated by query-energy-weighted key
                 error; no outlier channels), k-means value codebook; 3/4 bits the same at 216 / 320 key bits per row;
                 each layer's value bits (1-4 at 2 bits, 2-4 above) and key row bits then allocated within those bits
                 by sensitivity measured on the calibration head (`actors.kv.layer_widths`; never on the evaluated
                 windows)
  ours<b> uniform  the recipe with every layer at the same widths (before layer widths)
  ours<b> cross  domain-mismatched: each domain's windows through the OTHER domain's profile (KVQuant reports
                 cross-domain calibration gives similar results; this row measures it here)
  ours<b>X       one change to the recipe: `-mse` / `+mse` min/max / MSE-clipped key ranges; `-kmeans` uniform
                 grids for K and V; `+kmeansK` k-means codebooks for K and V; `-vzero` no value mean; `+sink`
                 1 fp16 sink token; `outN` N fp16 key outlier channels per head. At 2 bits (per-channel key
                 widths, where key codebook/range options do not apply): `k2out1` the previous recipe (one
                 2-bit uniform key grid + 1 fp16 outlier channel per head), `-qweight` widths allocated with
                 equal channel weights, `kbits144` 144 key bits per head row (the previous recipe's bytes)
  ... (sim)      storage formats the recipe does not use, simulated with the same quantize-dequantize and
                 visibility rule (numbers are what the format would give; `int8out2` the cache cannot hold):
                 `int8out2` 2 key outlier channels per head stored int8 with a calibrated per-channel
                 scale/zero (not at 2 bits, where a large channel gets up to 8 bits anyway); `vs8` the
                 per-token V scale as the cache's 8-bit log2 code (1/16 octave, rounded up; 3 and 4 bits only:
                 the 2-bit recipe stores it so)
Effective bits count everything stored for one window of the first context (1024 by default; a multiple of
the 16-token block, so without a sink nothing is left unsealed; with one, 15 tail tokens are): codes, fp16
scales, outlier values, full-precision sink/tail tokens at 16 bits, and the profile tensors amortised over
this one window. The per-sequence staging buffer (sink + one block of rows) is reserved by the cache whether or
not it holds live tokens and is not counted.

    python bench/kv_quality.py --quick --retrieval     # the shipped 4,096-token model: ~27 minutes on 2 CPU cores
    python bench/kv_quality.py --windows 8 --retrieval --contexts 1024,2048,4096

Last line: `RESULT bits3=.. dppl3_prose=.. dppl3_code=.. bits2=.. dppl2_prose=.. dppl2_code=.. uniform3_bits=..
uniform3_prose=.. uniform3_code=.. kivi3m_bits=.. kivi3m_prose=.. kivi3m_code=.. kivi2m_bits=.. kivi2m_prose=..
kivi2m_code=.. ppl_prose=.. ppl_code=..`, all at the first context (bitsN / dpplN_*: the row `oursN`, i.e. the
shipped N-bit recipe; uniform3: `kivi3`; kivi3m / kivi2m: `kivi3-m` / `kivi2-m`; ppl_*: fp16-kv's perplexity),
then for each tag T of 1k (1024 tokens) and 4k (4096 tokens): `kldN_T=.. top1_N_T=.. retrN_T=..` for N = 3, 2, 4
(row oursN), `kivi3m_kld_T=.. kivi3m_top1_T=.. kivi3m_retr_T=..`, the same for kivi2m, and `fp16_retr_T=..`
(KLD in nats, top1 in percent, retr as a fraction of fp16-kv's accuracy, 0 when that is 0; fp16_retr: fp16-kv's
own accuracy in [0, 1]). A tagged key is 0 when the model cannot run that context (the table says "4k: not run
(model context 1024)"), nan when it was not in --contexts, its row was not run (--rows) or retrieval was not
run; a key is never filled from another context.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.model.config import ModelConfig  # noqa: E402
from actors.moe.placement import ExpertPlacement  # noqa: E402
from actors.engine.config import EngineConfig  # noqa: E402
from actors.engine.engine import RankEngine  # noqa: E402
from actors.kv.allocator import BlockAllocator  # noqa: E402
from actors.kv.calibration import (RECOMMENDED_FIT_OPTIONS, RECOMMENDED_LAYER_WIDTHS,  # noqa: E402
                                   RECOMMENDED_SINK_TOKENS,
                                   collect_calibration_kv, fit_model_profile, model_effective_bits)
from actors.kv.interface import KVCache  # noqa: E402
from actors.kv.layer_widths import fit_allocated_profile  # noqa: E402
from actors.kv.profiles import ModelKVProfile  # noqa: E402
from actors.kv.quantized import QuantizedPagedKVCache  # noqa: E402
from actors.kv.simulated import SimulatedCache  # noqa: E402
from cluster.config import DEFAULT_MODEL  # noqa: E402
from bench.kv_eval import BLOCK, KiviCache, WindowStats, add_window, score_records, window_logits  # noqa: E402
from bench.kv_report import DOMAINS, Row, print_tables, result_line  # noqa: E402
from kernels.kv_quant import dequantize_kv, quantize_kv  # noqa: E402
from kernels.rope import apply_rope, rope_tables  # noqa: E402
from scripts.retrieval_records import build_eval_records  # noqa: E402

DEFAULT_CONTEXTS = (1024, 4096)
CALIB_WINDOW = 1024  # calibration forwards: the model card's window (or the model's context if shorter)
SENS_WINDOWS = 4  # calibration windows the layer-width sensitivity is measured on
TAIL_FROM = 1024  # KLD / same-top-1 of positions >= this are also reported apart in longer windows
DEPTHS = tuple(round(0.1 + i * 0.8 / 9, 4) for i in range(10))  # 10 depths, 10% .. 90% of the context
RETRIEVAL_NEW_TOKENS = 6  # greedy tokens at most: a 5-digit answer is 2-4 tokens here, then "."
LADDER_BITS = (5, 6, 8)  # KIVI rows wider than the cache's codes: run only when named in --rows
RETRIEVAL_ROWS = ("fp16-kv", "ours2", "ours3", "ours4", "kivi2-m", "kivi3-m")
# (row suffix, changes to the recipe, sink tokens or None for the recipe's)
ABLATIONS = [
    ("-mse", {"k_range": "minmax"}, None),
    ("+mse", {"k_range": "mse"}, None),
    ("-kmeans", {"codebook": "uniform", "codebook_v": "uniform"}, None),
    ("+kmeansK", {"codebook": "kmeans", "codebook_v": "kmeans"}, None),
    ("-vzero", {"use_v_zero": False}, None),
    ("+sink", {}, 1),
    ("out0", {"n_outlier": 0}, None),
    ("out1", {"n_outlier": 1}, None),
    ("out2", {"n_outlier": 2}, None),
]
# Rows of a per-channel-key recipe (suffix, changes, query-energy weights): the old 2-bit recipe (one 2-bit
# uniform key grid + 1 fp16 outlier channel per head), equal channel weights, and the old recipe's bytes.
PER_CHANNEL_ROWS = [
    (" k2out1 (2-bit K grid, 1 fp16 outlier/head)", {"k_channel_bits": None, "n_outlier": 1}, True),
    (" -qweight (equal channel weights)", {}, False),
    (" kbits144 (144 K bits/head)", {"k_channel_bits": 144}, True),
]
# fit options that only shape the shared key codebook / range, unused with per-channel key widths
K_GRID_OPTIONS = ("codebook", "k_range")
QUICK_ABLATION_BITS = (2,)
# KIVI at matched bits: key groups of 128 tokens, value groups of 64 channels -> bits + 0.375
KIVI_MATCHED = (128, 64)


def _int8_outlier_qdq(prof: ModelKVProfile, k_calib: list[torch.Tensor]):
    """Recipe quantization, then the key outlier channels replaced by int8 with a calibrated per-channel
    scale/zero (min/max of the calibration keys, 25% headroom): what an int8 outlier side array would give."""
    side = []
    for p, k in zip(prof.layers, k_calib):
        idx = p.k_outlier_idx.long()
        g = k.gather(2, idx.expand(k.shape[0], -1, -1))
        hi, lo = g.amax(0), g.amin(0)
        side.append((idx, (hi + lo) / 2, ((hi - lo) / 2 * 1.25 / 127).clamp_min(1e-8)))

    def qdq(layer, k, v):
        p = prof.layers[layer]
        k_dq, v_dq = dequantize_kv(quantize_kv(k, v, p), p)
        idx, zero, step = side[layer]
        ix = idx.expand(k.shape[0], -1, -1)
        q = ((k.gather(2, ix) - zero) / step).round().clamp(-127, 127)
        return k_dq.scatter(2, ix, q * step + zero), v_dq
    return qdq


def _vscale8_qdq(prof: ModelKVProfile):
    """Recipe quantization with the per-token V scale stored as the cache's 8-bit log2 code
    (`KVQuantProfile.v_scale_bits = 8`, `kernels.kv_quant.encode_value_scale`), the codebooks as fitted."""
    layers = [dataclasses.replace(p, v_scale_bits=8) for p in prof.layers]
    return lambda layer, k, v: dequantize_kv(quantize_kv(k, v, layers[layer]), layers[layer])


def parse_contexts(text: str) -> list[int]:
    """`--contexts 1024,4096` -> [1024, 4096] (sorted, unique). Raises SystemExit naming the bad value."""
    out = set()
    for part in text.split(","):
        try:
            c = int(part)
        except ValueError:
            raise SystemExit(f"--contexts: {part!r} is not an integer") from None
        if c < 4 * BLOCK or c % BLOCK:
            raise SystemExit(f"--contexts: {c} must be a multiple of {BLOCK} and >= {4 * BLOCK}")
        out.add(c)
    return sorted(out)


def default_contexts(model_max: int) -> list[int]:
    """1,024 and 4,096 where the model's max_position_embeddings allows, else its max."""
    return sorted({min(c, model_max) // BLOCK * BLOCK for c in DEFAULT_CONTEXTS})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true",
                    help="2 windows per domain and context, 4096 calibration tokens, ablations and simulated rows "
                         "at 2 bits only, 8 retrieval records per (context, depth)")
    ap.add_argument("--windows", type=int, default=8, help="evaluation windows per domain and context at most")
    ap.add_argument("--contexts", default=None, metavar="C1,C2",
                    help="window lengths in tokens (default: 1024,4096 where the model's max_position_embeddings "
                         "allows, else its max); contexts beyond the model's are reported as not run")
    ap.add_argument("--calib-tokens", type=int, default=8192, help="held-out head used for calibration")
    ap.add_argument("--retrieval", action="store_true",
                    help=f"retrieval exact match for the rows {', '.join(RETRIEVAL_ROWS)}")
    ap.add_argument("--per-cell", type=int, default=None,
                    help="retrieval records per (context, depth), half prose, half code (default 20; --quick: 8)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the retrieval records")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rows", nargs="+", default=None, metavar="NAME",
                    help="only these rows, by exact name (e.g. `--rows ours3 'ours3 cross'`); RESULT keys of "
                         "rows not run print nan")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    n_win = 2 if a.quick else a.windows
    per_cell = a.per_cell or (8 if a.quick else 20)
    if a.quick:
        a.calib_tokens = min(a.calib_tokens, 4096)
    abl_bits = QUICK_ABLATION_BITS if a.quick else (2, 3)
    t0 = time.perf_counter()
    mc = ModelConfig.from_pretrained(a.model)
    model_max = mc.max_position_embeddings
    asked = parse_contexts(a.contexts) if a.contexts else default_contexts(model_max)
    ctxs = [c for c in asked if c <= model_max]
    if not ctxs:
        raise SystemExit(f"--contexts {a.contexts}: every context exceeds the model's max_position_embeddings="
                         f"{model_max}")
    c0, maxt = ctxs[0], ctxs[-1]
    eng = RankEngine(EngineConfig(model=a.model, max_model_len=maxt, max_num_seqs=1, kv_cache_bytes=2**27),
                     ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))
    model, tok, fp_cache = eng.model, eng.tokenizer, eng.cache
    data, records, calib_windows = {}, {}, {}
    for i, dom in enumerate(DOMAINS):
        ids = tok.encode(open(os.path.join(a.model, "heldout", f"{dom}.txt")).read()).ids
        calib = ids[:a.calib_tokens]
        rest = ids[a.calib_tokens:]
        wins = {c: [rest[j:j + c] for j in range(0, len(rest) - c + 1, c)][:n_win] for c in ctxs}
        for c, w in wins.items():
            if not w:
                raise SystemExit(f"{dom}: {len(ids)} held-out tokens leave no {c}-token window after calibration")
        k, v, qe = collect_calibration_kv(eng, calib, window=min(CALIB_WINDOW, maxt), with_query_energy=True)
        data[dom] = (wins, k, v, qe)
        calib_windows[dom] = [calib[j:j + CALIB_WINDOW] for j in range(0, len(calib) - CALIB_WINDOW + 1, CALIB_WINDOW)][:SENS_WINDOWS]
        if a.retrieval:  # from the held-out text after the calibration head; prompt + answer fit the context
            n_dom = per_cell // 2 + (per_cell % 2 if i == 0 else 0)
            records[dom] = build_eval_records(tok, tok.decode(rest), [c - RETRIEVAL_NEW_TOKENS for c in ctxs],
                                              DEPTHS, n_dom, seed=a.seed)
    # the full-precision reference: log-probabilities of every window (also the fp16-kv row, KLD 0 by definition)
    ref = {dom: {c: [] for c in ctxs} for dom in DOMAINS}
    rows: list[Row] = []

    def evaluate(name, bits, make_cache, bits_of):
        if rows and a.rows and name not in a.rows:
            return
        stats = {c: {} for c in ctxs}
        retr = {c: [0, 0] for c in ctxs} if a.retrieval and name in RETRIEVAL_ROWS else {}
        eb = []
        for dom in DOMAINS:
            cache = make_cache(dom)
            for c in ctxs:
                st = stats[c][dom] = WindowStats()
                for j, w in enumerate(data[dom][0][c]):
                    logits = window_logits(model, cache, w)
                    if not rows:  # the reference row itself
                        ref[dom][c].append(torch.log_softmax(logits, dim=-1))
                    add_window(st, logits, torch.tensor(w[1:]), ref[dom][c][j], TAIL_FROM if c > TAIL_FROM else None)
                if c == c0:
                    eb.append(bits_of(dom, cache))
            if retr:
                for r, hit in zip(records[dom], score_records(model, cache, tok, records[dom],
                                                              RETRIEVAL_NEW_TOKENS, eng.eos)):
                    cell = retr[r.context + RETRIEVAL_NEW_TOKENS]
                    cell[0], cell[1] = cell[0] + hit, cell[1] + 1
        rows.append(Row(name, bits, sum(eb) / len(eb), stats, retr))
        print(f"  {name:<24} {rows[-1].eff_bits:.3f} bits  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)

    def kivi_bits(dom, c):
        return sum(c.eff_bits) / len(c.eff_bits)

    evaluate("fp16-kv", 16, lambda dom: fp_cache, lambda dom, c: 16.0)
    for bits in (2, 3, 4) + tuple(b for b in LADDER_BITS if a.rows and f"kivi{b}" in a.rows):
        evaluate(f"kivi{bits}", bits, lambda dom, b=bits: KiviCache(b, max_tokens=maxt), kivi_bits)
    for bits in (2, 3):
        evaluate(f"kivi{bits}-m", bits, lambda dom, b=bits: KiviCache(b, *KIVI_MATCHED, max_tokens=maxt), kivi_bits)

    profiles: dict = {}

    widths: dict = {}

    def layer_widths(dom, bits):
        """The recipe's allocation for this domain and width, measured on its calibration head (never the
        evaluated windows); None where the recipe keeps one width for every layer."""
        if not RECOMMENDED_LAYER_WIDTHS.get(bits):
            return None
        if (dom, bits) not in widths:
            _, k, v, qe = data[dom]
            widths[(dom, bits)] = fit_allocated_profile(
                model, k, v, calib_windows[dom], name=dom, bits=bits, query_energy=qe,
                **RECOMMENDED_FIT_OPTIONS[bits]).layer_widths()
            print(f"  layer widths {dom} {bits}-bit (value bits, key row bits): {widths[(dom, bits)]}",
                  file=sys.stderr, flush=True)
        return widths[(dom, bits)]

    def profile(dom, bits, qweight=True, uniform=False, **change):
        key = (dom, bits, qweight, uniform, tuple(sorted(change.items())))
        if key not in profiles:
            _, k, v, qe = data[dom]
            opts = {**RECOMMENDED_FIT_OPTIONS[bits], **change}
            qe = qe if qweight and opts.get("k_channel_bits") is not None else None
            # ablations of the recipe keep its layer widths unless they change the key row budget
            lw = None if uniform or "k_channel_bits" in change else layer_widths(dom, bits)
            profiles[key] = fit_model_profile(k, v, name=dom, bits=bits, query_energy=qe, layer_widths=lw, **opts)
        return profiles[key]

    def ours(dom, prof, sink):
        return QuantizedPagedKVCache(
            num_layers=mc.num_layers, num_blocks=maxt // BLOCK + 1, block_size=BLOCK,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, profiles={dom: prof}, default_profile=dom,
            max_sequences=1, sink_tokens=sink, rope_theta=mc.rope_theta, max_positions=maxt)

    def sim(qdq_of):
        return lambda dom: SimulatedCache(qdq_of(dom), mc.rope_theta, mc.head_dim, maxt)

    ns0 = RECOMMENDED_SINK_TOKENS
    for bits in (2, 3, 4):
        evaluate(f"ours{bits}", bits, lambda dom, b=bits: ours(dom, profile(dom, b), ns0),
                 lambda dom, c, b=bits: model_effective_bits(profile(dom, b), c0, sink_tokens=ns0))
        if RECOMMENDED_LAYER_WIDTHS.get(bits):  # the recipe before layer widths: every layer the same width
            evaluate(f"ours{bits} uniform", bits, lambda dom, b=bits: ours(dom, profile(dom, b, uniform=True), ns0),
                     lambda dom, c, b=bits: model_effective_bits(profile(dom, b, uniform=True), c0, sink_tokens=ns0))
        if bits in (2, 3):  # domain-mismatched profile: prose windows through the code profile and vice versa
            other = {"prose": "code", "code": "prose"}
            evaluate(f"ours{bits} cross", bits, lambda dom, b=bits: ours(dom, profile(other[dom], b), ns0),
                     lambda dom, c, b=bits: model_effective_bits(profile(other[dom], b), c0, sink_tokens=ns0))
        if bits not in abl_bits:
            continue
        per_channel = RECOMMENDED_FIT_OPTIONS[bits].get("k_channel_bits") is not None
        for suffix, change, sink in ABLATIONS:
            ns = ns0 if sink is None else sink
            if per_channel:  # key codebook and range options do not apply to per-channel key widths
                change = {k: x for k, x in change.items() if k not in K_GRID_OPTIONS}
            if ns == ns0 and all(RECOMMENDED_FIT_OPTIONS[bits].get(k) == x for k, x in change.items()):
                continue  # the recipe itself
            evaluate(f"ours{bits}{suffix}", bits,
                     lambda dom, b=bits, c=change, n=ns: ours(dom, profile(dom, b, **c), n),
                     lambda dom, _, b=bits, c=change, n=ns: model_effective_bits(profile(dom, b, **c), c0,
                                                                              sink_tokens=n))
        if per_channel:  # the per-channel key recipe against its parts
            for suffix, change, qw in PER_CHANNEL_ROWS:
                evaluate(f"ours{bits}{suffix}", bits,
                         lambda dom, b=bits, c=change, q=qw: ours(dom, profile(dom, b, q, **c), ns0),
                         lambda dom, _, b=bits, c=change, q=qw: model_effective_bits(profile(dom, b, q, **c), c0,
                                                                                  sink_tokens=ns0))
        # simulated formats; bits = the servable profile's bits minus what the cheaper field saves per element
        # (one int8 instead of fp16 outlier: 8 bits per token and head over 2 * D elements; likewise the V scale)
        save = 8.0 / (2 * mc.head_dim)
        if not per_channel:  # per-channel key widths already give a large channel up to 8 bits
            evaluate(f"ours{bits} int8out2 (sim)", bits,
                     sim(lambda dom, b=bits: _int8_outlier_qdq(profile(dom, b, n_outlier=2), data[dom][1])),
                     lambda dom, _, b=bits: model_effective_bits(profile(dom, b, n_outlier=2), c0, sink_tokens=0)
                     - 2 * save)
        if RECOMMENDED_FIT_OPTIONS[bits].get("v_scale_bits", 16) == 16:  # else the recipe stores 8-bit scales
            evaluate(f"ours{bits} vs8 (sim)", bits, sim(lambda dom, b=bits: _vscale8_qdq(profile(dom, b))),
                     lambda dom, _, b=bits: model_effective_bits(profile(dom, b), c0, sink_tokens=0) - save)

    n_w = {c: f"{len(data['prose'][0][c])}/{len(data['code'][0][c])}" for c in ctxs}
    header = (f"model {a.model} (max_position_embeddings {model_max})  contexts run: {', '.join(map(str, ctxs))}  "
              f"windows/domain (prose/code): {', '.join(f'{n_w[c]} x {c}' for c in ctxs)}  calibration "
              f"{a.calib_tokens} tokens/domain  bits/elem at {c0} tokens  ({time.perf_counter() - t0:.0f} s)")
    note = None
    if a.retrieval:
        n_rec = {c: rows[0].retr[c][1] for c in ctxs}
        note = (f"retrieval: exact match of the 5-digit value, greedy, <= {RETRIEVAL_NEW_TOKENS} new tokens decoded "
                f"through each row's cache; prompt = context - {RETRIEVAL_NEW_TOKENS} tokens; records per context "
                f"{', '.join(f'{c}: {n_rec[c]}' for c in ctxs)} ({len(DEPTHS)} depths {DEPTHS[0]:.2f}-{DEPTHS[-1]:.2f}"
                f" x {per_cell}, prose and code, seed {a.seed}); 95% Wilson interval; x fp16 = accuracy / fp16-kv's"
                f" (0 when fp16-kv's is 0)")
    if a.contexts and len(ctxs) < len(asked):
        print(f"contexts not run (beyond model context {model_max}): "
              f"{', '.join(str(c) for c in asked if c > model_max)}")
    print_tables(rows, ctxs, model_max, header, TAIL_FROM, note)
    print(result_line(rows, ctxs, model_max))
    return 0


if __name__ == "__main__":
    sys.exit(main())
