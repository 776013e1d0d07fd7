"""KV-cache quantization quality: held-out perplexity per domain vs effective bits per element.

For each domain (prose, code) of `<model>/heldout/<domain>.txt`: the first `--calib-tokens` tokens calibrate
the profiles (never evaluated), then non-overlapping 1024-token windows after them are evaluated. Every
row runs the model over each window with its keys and values written through a cache and read back as in
decoding: token i attends to keys quantized as soon as their block (ours) or group (KIVI) is complete at
step i, and in full precision otherwise (the prefill path of `QuantizedPagedKVCache` provably gives the
decode numbers, see tests/actors/kv/test_kv_quant_cache.py).

Rows:
  fp16-kv        the full-precision cache (reference; compute in fp32, counted as 16 bits)
  kivi<b>        KIVI-style uniform b-bit (arXiv 2402.02750): post-RoPE keys per channel over groups of 32
                 tokens, values per token over groups of 32 channels, fp16 scale + zero per group (b + 1
                 bits); the incomplete group stays in full precision
  kivi<b>-m      the same at matched bits: key groups of 128 tokens, value groups of 64 channels (b + 0.375)
  ours<b>        KVQuant-style (arXiv 2401.18079), the shipped recipe `actors.kv.calibration.RECOMMENDED_FIT_OPTIONS`
                 through `QuantizedPagedKVCache`: b-bit codes for keys AND values ("b-bit configuration"),
                 pre-RoPE per-channel keys with calibrated ranges, per-token values with an fp16 scale and a
                 per-channel mean, codebooks per layer, fp16 key outlier channels, no sink, the unsealed block
                 in full precision. 2 bits: per-channel key widths (2-8 bits, 152 bits per head row, on a
                 uniform grid over each channel's min/max range, allocated by query-energy-weighted key error;
                 no outlier channels), k-means value codebook; 3/4 bits: k-means codebooks, MSE-clipped key
                 ranges, no outliers
  ours<b> cross  domain-mismatched: each domain's windows through the OTHER domain's profile (KVQuant reports
                 cross-domain calibration gives similar results; this row measures it here)
  ours<b>X       one change to the recipe: `-mse` / `+mse` min/max / MSE-clipped key ranges; `-kmeans` uniform
                 grids for K and V; `+kmeansK` k-means codebooks for K and V; `-vzero` no value mean; `+sink`
                 1 fp16 sink token; `outN` N fp16 key outlier channels per head. At 2 bits (per-channel key
                 widths, where key codebook/range options do not apply): `k2out1` the previous recipe (one
                 2-bit uniform key grid + 1 fp16 outlier channel per head), `-qweight` widths allocated with
                 equal channel weights, `kbits144` 144 key bits per head row (the previous recipe's bytes)
  ... (sim)      storage formats the cache cannot hold yet, simulated with the same quantize-dequantize and
                 visibility rule (numbers are what the format would give; not servable):
                 `int8out2` 2 key outlier channels per head stored int8 with a calibrated per-channel
                 scale/zero (not at 2 bits, where a large channel gets up to 8 bits anyway); `vs8` the
                 per-token V scale as an 8-bit log2 code (1/16 octave, rounded up)
Effective bits count everything stored for one 1024-token window at the end of the window (1024 is a multiple
of the 16-token block, so without a sink nothing is left unsealed; with one, 15 tail tokens are): codes, fp16
scales, outlier values, full-precision sink/tail tokens at 16 bits, and the profile tensors amortised over
this one window. The per-sequence staging buffer (sink + one block of rows) is reserved by the cache whether or
not it holds live tokens and is not counted. dppl = perplexity increase over fp16-kv in percent.

    python bench/kv_quality.py --quick        # ~5 minutes on 2 CPU cores
    python bench/kv_quality.py --windows 8

Last line: `RESULT bits3=.. dppl3_prose=.. dppl3_code=.. bits2=.. dppl2_prose=.. dppl2_code=.. uniform3_bits=..
uniform3_prose=.. uniform3_code=.. kivi3m_bits=.. kivi3m_prose=.. kivi3m_code=.. kivi2m_bits=.. kivi2m_prose=..
kivi2m_code=..` (bitsN / dpplN_*: the row `oursN`, i.e. the shipped N-bit recipe; uniform3: `kivi3`;
kivi3m / kivi2m: `kivi3-m` / `kivi2-m`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.model.attention import AttentionMetadata  # noqa: E402
from actors.model.config import ModelConfig  # noqa: E402
from actors.moe.placement import ExpertPlacement  # noqa: E402
from actors.engine.config import EngineConfig  # noqa: E402
from actors.engine.engine import RankEngine  # noqa: E402
from actors.kv.allocator import BlockAllocator  # noqa: E402
from actors.kv.calibration import (RECOMMENDED_FIT_OPTIONS, RECOMMENDED_SINK_TOKENS,  # noqa: E402
                                   collect_calibration_kv, fit_model_profile, model_effective_bits)
from actors.kv.interface import KVCache  # noqa: E402
from actors.kv.profiles import ModelKVProfile  # noqa: E402
from actors.kv.quantized import QuantizedPagedKVCache, mixed_causal_attention  # noqa: E402
from cluster.config import DEFAULT_MODEL  # noqa: E402
from bench.kivi import kivi_dequantize, kivi_quantize  # noqa: E402
from kernels.kv_quant import dequantize_kv, nearest_level, quantize_kv  # noqa: E402
from kernels.rope import apply_rope, rope_tables  # noqa: E402

WINDOW = 1024
BLOCK = 16
DOMAINS = ("prose", "code")
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


class KiviCache(KVCache):
    """KIVI-style uniform quantization of one prefill sequence, read back as decoding would see it."""

    def __init__(self, bits: int, group: int = 32, v_group: int | None = None):
        self.bits, self.group, self.v_group = bits, group, v_group or group
        self.allocator = BlockAllocator(WINDOW)
        self.block_size, self.num_blocks = BLOCK, WINDOW
        self.eff_bits: list[float] = []

    def attend(self, layer, q_THD, k_THD, v_THD, positions_T, meta, rotary, scale):
        (start, n, ctx, _), = meta.prefills
        if n != ctx:
            raise ValueError("KiviCache evaluates whole windows only")
        k = rotary.apply(k_THD, positions_T).float()  # KIVI quantizes post-RoPE keys
        v = v_THD.float()
        g = self.group
        nq = ctx // g * g  # complete groups are quantized, the rest stays full precision
        k_dq, v_dq = k.clone(), v.clone()
        if nq:
            qz = kivi_quantize(k[:nq], v[:nq], bits=self.bits, group_size=g, v_group_size=self.v_group)
            k_dq[:nq], v_dq[:nq] = kivi_dequantize(qz)
            if layer == 0:
                self.eff_bits.append((qz.effective_bits() * nq + 16.0 * (ctx - nq)) / ctx)
        pos = positions_T.to(torch.int64)
        hi = (pos + 1) // g * g
        return mixed_causal_attention(q_THD, k, v, k_dq, v_dq, pos, 0, hi, scale).to(q_THD.dtype)


class SimulatedCache(KVCache):
    """Our quantization through a quantize-dequantize function `qdq(layer, k_pre [C,H,D], v) -> (k, v)`, with
    the visibility rule of `QuantizedPagedKVCache` (no sink: key j is quantized for query p iff j < 16 *
    ((p + 1) // 16)). For storage formats the cache cannot hold yet."""

    def __init__(self, qdq, rope_theta: float, head_dim: int):
        self.qdq = qdq
        self.cos, self.sin = rope_tables(WINDOW, head_dim, base=rope_theta)
        self.allocator = BlockAllocator(WINDOW)
        self.block_size, self.num_blocks = BLOCK, WINDOW

    def attend(self, layer, q_THD, k_THD, v_THD, positions_T, meta, rotary, scale):
        (start, n, ctx, _), = meta.prefills
        if n != ctx:
            raise ValueError("SimulatedCache evaluates whole windows only")
        k, v = k_THD.float(), v_THD.float()
        k_dq, v_dq = self.qdq(layer, k, v)
        pos = positions_T.to(torch.int64)
        cos, sin = self.cos[:ctx], self.sin[:ctx]
        hi = (pos + 1) // BLOCK * BLOCK
        return mixed_causal_attention(q_THD, apply_rope(k, cos, sin), v, apply_rope(k_dq, cos, sin), v_dq,
                                      pos, 0, hi, scale).to(q_THD.dtype)


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
    """Recipe quantization with the per-token V scale rounded up to 2**(j / 16) (an 8-bit log2 code)."""
    def qdq(layer, k, v):
        p = prof.layers[layer]
        k_dq, v_dq = dequantize_kv(quantize_kv(k, v, p), p)
        vc = v - p.v_zero
        mask = torch.ones_like(p.v_zero, dtype=torch.bool)
        if p.n_outlier_v:
            mask.scatter_(1, p.v_outlier_idx.long(), False)
        mag = torch.where(mask, vc.abs(), torch.zeros(())).amax(-1).clamp_min(1e-8)
        sc = torch.exp2(torch.ceil(torch.log2(mag) * 16) / 16)
        v_hat = p.v_codebook[nearest_level(vc / sc[..., None], p.v_codebook)] * sc[..., None] + p.v_zero
        if p.n_outlier_v:
            ix = p.v_outlier_idx.long().expand(v.shape[0], -1, -1)
            v_hat = v_hat.scatter(2, ix, v_dq.gather(2, ix))
        return k_dq, v_hat
    return qdq


def window_nll(engine: RankEngine, cache, ids: list[int]) -> tuple[float, int]:
    """Summed next-token NLL (nats) and token count of one window through `cache`."""
    bs = cache.block_size
    n = len(ids)
    blocks = [cache.allocator.allocate() for _ in range(-(-n // bs))]
    try:
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([blocks[i // bs] * bs + i % bs for i in range(n)], dtype=torch.int64),
            decode_tokens=torch.zeros(0, dtype=torch.int64), decode_block_tables=torch.zeros(0, 0, dtype=torch.int64),
            decode_context_lens=torch.zeros(0, dtype=torch.int64),
            prefills=[(0, n, n, torch.tensor(blocks, dtype=torch.int64))])
        with torch.inference_mode():
            h = engine.model.forward(torch.tensor(ids), torch.arange(n), cache, meta)
            logits = engine.model.logits(h[:-1])
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
        return float(nll), n - 1
    finally:
        cache.allocator.free_all(blocks)


def ppl(engine, cache, windows) -> float:
    tot = cnt = 0
    for w in windows:
        a, b = window_nll(engine, cache, w)
        tot, cnt = tot + a, cnt + b
    return math.exp(tot / cnt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true",
                    help="2 windows per domain, 4096 calibration tokens, ablations and simulated rows at 2 bits only")
    ap.add_argument("--windows", type=int, default=8, help="evaluation windows per domain at most")
    ap.add_argument("--calib-tokens", type=int, default=8192, help="held-out head used for calibration")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rows", nargs="+", default=None, metavar="NAME",
                    help="only these rows, by exact name (e.g. `--rows ours3 'ours3 cross'`); RESULT keys of "
                         "rows not run print nan")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    n_win = 2 if a.quick else a.windows
    if a.quick:
        a.calib_tokens = min(a.calib_tokens, 4096)
    abl_bits = QUICK_ABLATION_BITS if a.quick else (2, 3)
    t0 = time.perf_counter()
    mc = ModelConfig.from_pretrained(a.model)
    eng = RankEngine(EngineConfig(model=a.model, max_model_len=WINDOW, max_num_seqs=1, kv_cache_bytes=2**27),
                     ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))
    fp_cache = eng.cache
    data = {}
    for dom in DOMAINS:
        ids = eng.tokenizer.encode(open(os.path.join(a.model, "heldout", f"{dom}.txt")).read()).ids
        calib = ids[:a.calib_tokens]
        rest = ids[a.calib_tokens:]
        windows = [rest[i:i + WINDOW] for i in range(0, len(rest) - WINDOW + 1, WINDOW)][:n_win]
        if not windows:
            raise SystemExit(f"{dom}: {len(ids)} held-out tokens leave no {WINDOW}-token window after calibration")
        k, v, qe = collect_calibration_kv(eng, calib, window=WINDOW, with_query_energy=True)
        data[dom] = (windows, k, v, qe)
    rows: list[tuple[str, int, float, dict]] = []  # (name, bits, effective bits, {domain: ppl})

    def add_row(name, bits, make_cache, bits_of):
        if a.rows and name not in a.rows:
            return
        res, eb = {}, []
        for dom in DOMAINS:
            cache = make_cache(dom)
            res[dom] = ppl(eng, cache, data[dom][0])
            eb.append(bits_of(dom, cache))
        rows.append((name, bits, sum(eb) / len(eb), res))
        print(f"  {name:<24} {rows[-1][2]:.3f} bits  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    base = {dom: ppl(eng, fp_cache, data[dom][0]) for dom in DOMAINS}
    rows.append(("fp16-kv", 16, 16.0, base))
    for bits in (2, 3, 4):
        add_row(f"kivi{bits}", bits, lambda dom, b=bits: KiviCache(b), lambda dom, c: sum(c.eff_bits) / len(c.eff_bits))
    for bits in (2, 3):
        add_row(f"kivi{bits}-m", bits, lambda dom, b=bits: KiviCache(b, *KIVI_MATCHED),
                lambda dom, c: sum(c.eff_bits) / len(c.eff_bits))

    profiles: dict = {}

    def profile(dom, bits, qweight=True, **change):
        key = (dom, bits, qweight, tuple(sorted(change.items())))
        if key not in profiles:
            _, k, v, qe = data[dom]
            opts = {**RECOMMENDED_FIT_OPTIONS[bits], **change}
            qe = qe if qweight and opts.get("k_channel_bits") is not None else None
            profiles[key] = fit_model_profile(k, v, name=dom, bits=bits, query_energy=qe, **opts)
        return profiles[key]

    def ours(dom, prof, sink):
        return QuantizedPagedKVCache(
            num_layers=mc.num_layers, num_blocks=WINDOW // BLOCK + 1, block_size=BLOCK,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, profiles={dom: prof}, default_profile=dom,
            max_sequences=1, sink_tokens=sink, rope_theta=mc.rope_theta, max_positions=WINDOW)

    def sim(qdq_of):
        return lambda dom: SimulatedCache(qdq_of(dom), mc.rope_theta, mc.head_dim)

    ns0 = RECOMMENDED_SINK_TOKENS
    for bits in (2, 3, 4):
        add_row(f"ours{bits}", bits, lambda dom, b=bits: ours(dom, profile(dom, b), ns0),
                lambda dom, c, b=bits: model_effective_bits(profile(dom, b), WINDOW, sink_tokens=ns0))
        if bits in (2, 3):  # domain-mismatched profile: prose windows through the code profile and vice versa
            other = {"prose": "code", "code": "prose"}
            add_row(f"ours{bits} cross", bits, lambda dom, b=bits: ours(dom, profile(other[dom], b), ns0),
                    lambda dom, c, b=bits: model_effective_bits(profile(other[dom], b), WINDOW, sink_tokens=ns0))
        if bits not in abl_bits:
            continue
        per_channel = RECOMMENDED_FIT_OPTIONS[bits].get("k_channel_bits") is not None
        for suffix, change, sink in ABLATIONS:
            ns = ns0 if sink is None else sink
            if per_channel:  # key codebook and range options do not apply to per-channel key widths
                change = {k: x for k, x in change.items() if k not in K_GRID_OPTIONS}
            if ns == ns0 and all(RECOMMENDED_FIT_OPTIONS[bits].get(k) == x for k, x in change.items()):
                continue  # the recipe itself
            add_row(f"ours{bits}{suffix}", bits, lambda dom, b=bits, c=change, n=ns: ours(dom, profile(dom, b, **c), n),
                    lambda dom, _, b=bits, c=change, n=ns: model_effective_bits(profile(dom, b, **c), WINDOW,
                                                                             sink_tokens=n))
        if per_channel:  # the per-channel key recipe against its parts
            for suffix, change, qw in PER_CHANNEL_ROWS:
                add_row(f"ours{bits}{suffix}", bits,
                        lambda dom, b=bits, c=change, q=qw: ours(dom, profile(dom, b, q, **c), ns0),
                        lambda dom, _, b=bits, c=change, q=qw: model_effective_bits(profile(dom, b, q, **c), WINDOW,
                                                                                 sink_tokens=ns0))
        # simulated formats; bits = the servable profile's bits minus what the cheaper field saves per element
        # (one int8 instead of fp16 outlier: 8 bits per token and head over 2 * D elements; likewise the V scale)
        save = 8.0 / (2 * mc.head_dim)
        if not per_channel:  # per-channel key widths already give a large channel up to 8 bits
            add_row(f"ours{bits} int8out2 (sim)", bits,
                    sim(lambda dom, b=bits: _int8_outlier_qdq(profile(dom, b, n_outlier=2), data[dom][1])),
                    lambda dom, _, b=bits: model_effective_bits(profile(dom, b, n_outlier=2), WINDOW, sink_tokens=0)
                    - 2 * save)
        add_row(f"ours{bits} vs8 (sim)", bits, sim(lambda dom, b=bits: _vscale8_qdq(profile(dom, b))),
                lambda dom, _, b=bits: model_effective_bits(profile(dom, b), WINDOW, sink_tokens=0) - save)

    def dppl(r, dom):
        return 100.0 * (r[3][dom] / base[dom] - 1.0)

    print(f"model {a.model}  windows/domain {len(data['prose'][0])}/{len(data['code'][0])} x {WINDOW} tokens  "
          f"calibration {a.calib_tokens} tokens/domain  ({time.perf_counter() - t0:.0f} s)")
    print(f"{'config':<24}{'bits/elem':>10}{'ppl prose':>11}{'dppl%':>8}{'ppl code':>10}{'dppl%':>8}")
    for r in rows:
        print(f"{r[0]:<24}{r[2]:>10.3f}{r[3]['prose']:>11.3f}{dppl(r, 'prose'):>8.2f}{r[3]['code']:>10.3f}"
              f"{dppl(r, 'code'):>8.2f}")

    nan_row = ("", 0, float("nan"), {d: float("nan") for d in DOMAINS})

    def row(name):
        return next((r for r in rows if r[0] == name), nan_row)  # a row left out by --rows

    def keys(key, r):
        return f"{key}_bits={r[2]:.3f} {key}_prose={dppl(r, 'prose'):.3f} {key}_code={dppl(r, 'code'):.3f}"

    b3, b2 = row("ours3"), row("ours2")
    print(f"RESULT bits3={b3[2]:.3f} dppl3_prose={dppl(b3, 'prose'):.3f} dppl3_code={dppl(b3, 'code'):.3f} "
          f"bits2={b2[2]:.3f} dppl2_prose={dppl(b2, 'prose'):.3f} dppl2_code={dppl(b2, 'code'):.3f} "
          f"{keys('uniform3', row('kivi3'))} {keys('kivi3m', row('kivi3-m'))} {keys('kivi2m', row('kivi2-m'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
