"""KV-cache quantization quality: held-out perplexity per domain vs effective bits per element.

For each domain (prose, code) of `<model>/heldout/<domain>.txt`: the first `--calib-tokens` tokens calibrate
the profiles (never evaluated), then non-overlapping 1024-token windows after them are evaluated. Every
row runs the model over each window with its keys and values written through a cache and read back as in
decoding: token i attends to keys quantized as soon as their block (ours) or group (KIVI) is complete at
step i, and in full precision otherwise (the prefill path of `QuantizedPagedKVCache` provably gives the
decode numbers, see tests/actors/test_kv_quant_cache.py).

Rows:
  fp16-kv        the full-precision cache (reference; compute in fp32, counted as 16 bits)
  kivi<b>        KIVI-style uniform b-bit (arXiv 2402.02750): post-RoPE keys per channel over groups of 32
                 tokens, values per token over groups of 32 channels, fp16 scale + zero per group; the
                 incomplete group stays in full precision
  ours<b> ...    KVQuant-style (arXiv 2401.18079): pre-RoPE per-channel keys, per-token values, k-means
                 codebook, 2 fp16 key outlier channels per head, 1 sink token, per-channel value mean, the
                 unsealed block in full precision; `-X` rows switch one ingredient off
Effective bits count everything stored for one 1024-token window: codes, fp16 scales, outlier values,
full-precision sink/tail tokens at 16 bits, and the profile tensors amortised over this one window.
dppl = perplexity increase over fp16-kv in percent.

    python bench/kv_quality.py --quick        # < 5 minutes on 2 CPU cores
    python bench/kv_quality.py --windows 8

Last line: `RESULT bits3=.. dppl3_prose=.. dppl3_code=.. bits2=.. dppl2_prose=.. dppl2_code=.. uniform3_bits=..
uniform3_prose=.. uniform3_code=..` (bitsN / dpplN_*: our best N-bit row by mean dppl over the domains).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.attention import AttentionMetadata  # noqa: E402
from actors.config import ModelConfig  # noqa: E402
from actors.dispatch import ExpertPlacement  # noqa: E402
from actors.engine import EngineConfig, RankEngine  # noqa: E402
from actors.kv_cache import BlockAllocator, KVCache  # noqa: E402
from actors.kv_profiles import collect_calibration_kv, fit_model_profile, model_effective_bits  # noqa: E402
from actors.kv_quant_cache import QuantizedPagedKVCache, mixed_causal_attention  # noqa: E402
from cluster.config import DEFAULT_MODEL  # noqa: E402
from kernels.kv_quant import kivi_dequantize, kivi_quantize  # noqa: E402

WINDOW = 1024
DOMAINS = ("prose", "code")
FULL = dict(n_outlier=2, codebook="kmeans", use_v_zero=True)
# (row suffix, fit options, sink tokens): ingredients switched off one at a time
ABLATIONS = [
    ("", FULL, 1),
    ("-kmeans", {**FULL, "codebook": "uniform"}, 1),
    ("-outliers", {**FULL, "n_outlier": 0}, 1),
    ("-sink", FULL, 0),
    ("-vzero", {**FULL, "use_v_zero": False}, 1),
]
QUICK_ABLATION_BITS = (3,)


class KiviCache(KVCache):
    """KIVI-style uniform quantization of one prefill sequence, read back as decoding would see it."""

    def __init__(self, bits: int, group: int = 32):
        self.bits, self.group = bits, group
        self.allocator = BlockAllocator(WINDOW)
        self.block_size, self.num_blocks = 16, WINDOW
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
            qz = kivi_quantize(k[:nq], v[:nq], bits=self.bits, group_size=g)
            k_dq[:nq], v_dq[:nq] = kivi_dequantize(qz)
            if layer == 0:
                self.eff_bits.append((qz.effective_bits() * nq + 16.0 * (ctx - nq)) / ctx)
        pos = positions_T.to(torch.int64)
        hi = (pos + 1) // g * g
        return mixed_causal_attention(q_THD, k, v, k_dq, v_dq, pos, 0, hi, scale).to(q_THD.dtype)


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
                    help="2 windows per domain, 4096 calibration tokens, ablations at 3 bits only")
    ap.add_argument("--windows", type=int, default=8, help="evaluation windows per domain at most")
    ap.add_argument("--calib-tokens", type=int, default=8192, help="held-out head used for calibration")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    n_win = 2 if a.quick else a.windows
    if a.quick:
        a.calib_tokens = min(a.calib_tokens, 4096)
    abl_bits = QUICK_ABLATION_BITS if a.quick else (2, 3, 4)
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
        k, v = collect_calibration_kv(eng, calib, window=WINDOW)
        data[dom] = (windows, k, v)
    rows: list[tuple[str, int, float, dict]] = []  # (name, bits, effective bits, {domain: ppl})

    base = {dom: ppl(eng, fp_cache, data[dom][0]) for dom in DOMAINS}
    rows.append(("fp16-kv", 16, 16.0, base))
    for bits in (2, 3, 4):
        res, eb = {}, []
        for dom in DOMAINS:
            kc = KiviCache(bits)
            res[dom] = ppl(eng, kc, data[dom][0])
            eb += kc.eff_bits
        rows.append((f"kivi{bits}", bits, sum(eb) / len(eb), res))
    for bits in (2, 3, 4):
        for suffix, fit_kw, sink in ABLATIONS:
            if suffix and bits not in abl_bits:
                continue
            res, eb = {}, []
            for dom in DOMAINS:
                windows, k, v = data[dom]
                prof = fit_model_profile(k, v, name=dom, bits=bits, **fit_kw)
                cache = QuantizedPagedKVCache(
                    num_layers=mc.num_layers, num_blocks=WINDOW // 16 + 1, block_size=16,
                    num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, profiles={dom: prof}, default_profile=dom,
                    max_sequences=1, sink_tokens=sink, rope_theta=mc.rope_theta, max_positions=WINDOW)
                res[dom] = ppl(eng, cache, windows)
                eb.append(model_effective_bits(prof, WINDOW, sink_tokens=sink))
            rows.append((f"ours{bits}{suffix}", bits, sum(eb) / len(eb), res))

    def dppl(r, dom):
        return 100.0 * (r[3][dom] / base[dom] - 1.0)

    print(f"model {a.model}  windows/domain {len(data['prose'][0])}/{len(data['code'][0])} x {WINDOW} tokens  "
          f"calibration {a.calib_tokens} tokens/domain  ({time.perf_counter() - t0:.0f} s)")
    print(f"{'config':<18}{'bits/elem':>10}{'ppl prose':>11}{'dppl%':>8}{'ppl code':>10}{'dppl%':>8}")
    for r in rows:
        print(f"{r[0]:<18}{r[2]:>10.3f}{r[3]['prose']:>11.3f}{dppl(r, 'prose'):>8.2f}{r[3]['code']:>10.3f}"
              f"{dppl(r, 'code'):>8.2f}")

    def best(bits):
        cands = [r for r in rows if r[0].startswith(f"ours{bits}")]
        return min(cands, key=lambda r: dppl(r, "prose") + dppl(r, "code"))

    b3, b2 = best(3), best(2)
    u3 = next(r for r in rows if r[0] == "kivi3")
    print(f"best 3-bit: {b3[0]}  best 2-bit: {b2[0]}")
    print(f"RESULT bits3={b3[2]:.3f} dppl3_prose={dppl(b3, 'prose'):.3f} dppl3_code={dppl(b3, 'code'):.3f} "
          f"bits2={b2[2]:.3f} dppl2_prose={dppl(b2, 'prose'):.3f} dppl2_code={dppl(b2, 'code'):.3f} "
          f"uniform3_bits={u3[2]:.3f} uniform3_prose={dppl(u3, 'prose'):.3f} uniform3_code={dppl(u3, 'code'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
