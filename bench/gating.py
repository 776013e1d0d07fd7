"""Gating policies on the served model: quality, expert and rank balance, router thrash, prefetch recall, speed.

One process, world size 1, fp32 on CPU, the model's held-out text (`<model>/heldout/{prose,code}.txt`).
Every policy (actors.moe.gating) routes the same sequences through `RankEngine.prompt_logits`,
one sequence after another, so per-sequence state (sticky, velocity) and the balancing bias evolve as they
do when a rank serves them. Per policy and domain:

- dppl: held-out perplexity change vs `exact`, in percent (1.0 = +1.0%);
- expert max/mean and coefficient of variation (std/mean) of token counts per expert, over consecutive
  4096-token windows of the domain's stream, averaged over windows and MoE layers;
- rank max/mean with 2 and 4 ranks (contiguous expert placement; rank load = sum of its experts' counts);
- thrash: mean Jaccard distance between consecutive tokens' expert sets (actors.moe.stats);
- experts/token: routed experts used per token (dynamic and velocity vary it);
- recall: prequential recall of the default prefetch predictor (seeded from the model's transition counts,
  with the hidden states its lookahead term reads) on the policy's routing, budget k + 1; for `sticky` as the
  engine predicts it, the previous token's experts first (`keep_previous_first`);
- decode ms/token: median batch-1 decode step time with the policy (noisy on a shared machine: compare
  within a run).

    python bench/gating.py --quick

Last stdout line: `RESULT exact_maxmean=.. balanced_maxmean=.. balanced_dppl=.. exact_thrash=.. sticky_thrash=..
sticky_dppl=..` (max/mean and thrash averaged over both domains; *_dppl the larger of the two domains).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.model.model import NoObserver
from cluster.config import DEFAULT_MODEL
from experts import decode_tpot, held_out_sequences
from actors.moe.gating import POLICIES, GatingConfig
from actors.moe.gating_router import GatingRouter
from router_service.routing.fitting import RoutingTrace
from actors.prefetch.predictors import DEFAULT_PREDICTOR, make_predictor
from actors.prefetch.transitions import TRANSITIONS_FILE, TransitionCounts
from router_service.routing.prequential import prequential_eval

WINDOW = 4096


def new_router(eng: RankEngine, gcfg: GatingConfig) -> GatingRouter:
    mc = eng.model_cfg
    return GatingRouter(gcfg, num_layers=mc.num_layers, num_experts=mc.num_experts, top_k=mc.top_k,
                        renormalize=mc.norm_topk_prob, hidden=mc.hidden_size, num_slots=eng.cfg.max_num_seqs + 1,
                        has_shared_expert=mc.has_shared_expert)


def run_policy(eng: RankEngine, seqs: list[list[int]], width: int,
               hidden: list | None = None) -> tuple[float, torch.Tensor]:
    """(mean NLL in nats, routing ids [N, L, width] of every token in order, -1 padded). With `hidden` (a list),
    appends per sequence the residual entering each layer's FFN, [T, L, D] fp32 (what lookahead prefetch sees)."""
    mc = eng.model_cfg
    cur: dict[int, torch.Tensor] = {}
    hid: dict[int, torch.Tensor] = {}

    class Recorder(NoObserver):
        def on_route(self, l, ids):
            cur[l] = ids.cpu()

        def on_hidden(self, l, h):
            if hidden is not None:
                hid[l] = h.detach().float().cpu()

    rec = Recorder()
    tot, n, traces = 0.0, 0, []
    for s in seqs:
        cur.clear()
        hid.clear()
        logits = eng.prompt_logits(s, observer=rec)[:-1]
        tot += float(torch.nn.functional.cross_entropy(logits, torch.tensor(s[1:]), reduction="sum"))
        n += len(s) - 1
        ids = torch.full((len(s), mc.num_layers, width), -1, dtype=torch.int64)
        for l, t in cur.items():
            ids[:, l, : t.shape[1]] = t
        traces.append(ids)
        if hidden is not None:
            h = torch.zeros(len(s), mc.num_layers, mc.hidden_size)
            for l, t in hid.items():
                h[:, l] = t
            hidden.append(h)
    return tot / n, torch.cat(traces)


def balance(ids_NLK: torch.Tensor, E: int, moe: list[int], ranks: int | None = None) -> tuple[float, float]:
    """(max/mean, coefficient of variation) of per-expert (or per-rank) counts over 4096-token windows,
    averaged over windows and MoE layers. A trailing partial window counts if it has >= half a window."""
    N = ids_NLK.shape[0]
    starts = [a for a in range(0, N, WINDOW) if N - a >= WINDOW // 2] or [0]
    mm, cv = [], []
    for a in starts:
        win = ids_NLK[a : a + WINDOW]
        for l in moe:
            x = win[:, l].reshape(-1)
            c = torch.bincount(x[x >= 0], minlength=E).double()
            if ranks:
                pl = ExpertPlacement.contiguous(1, E, ranks)
                c = torch.zeros(ranks, dtype=torch.float64).index_add_(0, torch.tensor(pl.rank_of[0]), c)
            m = c.mean()
            if m > 0:
                mm.append(float(c.max() / m))
                cv.append(float(c.std(unbiased=False) / m))
    return sum(mm) / len(mm), sum(cv) / len(cv)


def thrash(ids_NLK: torch.Tensor, lengths: list[int], E: int, moe: list[int]) -> float:
    from actors.moe.stats import jaccard_distance

    tot, n, a = 0.0, 0, 0
    for ln in lengths:
        seq = ids_NLK[a : a + ln]
        for l in moe:
            d = jaccard_distance(seq[1:, l], seq[:-1, l], E)
            tot += float(d.sum())
            n += d.numel()
        a += ln
    return tot / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true", help="one 4096-token window per domain, fewer decode steps")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="GatingConfig knob for every policy, e.g. --option sticky_margin=0.05")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode timing column")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    if a.threads:
        torch.set_num_threads(a.threads)
    opts = {}
    for kv in a.option:
        k, v = kv.split("=", 1)
        opts[k] = {"true": True, "false": False}.get(v.lower(), None)
        if opts[k] is None:
            opts[k] = int(v) if v.isdigit() else float(v)
    n_seq = (WINDOW // a.seq_len) * (1 if a.quick else 4)
    mc = ModelConfig.from_pretrained(a.model)
    E, K = mc.num_experts, mc.top_k
    moe = [l for l in range(mc.num_layers) if mc.moe_layers[l]]
    eng = RankEngine(EngineConfig(model=a.model, max_model_len=max(a.seq_len, 256), kv_cache_bytes=64 << 20),
                     ExpertPlacement.contiguous(mc.num_layers, E, 1))
    data = held_out_sequences(a.model, eng.tokenizer, n_seq, a.seq_len)
    tpath = os.path.join(a.model, TRANSITIONS_FILE)
    counts = TransitionCounts.load(tpath) if os.path.isfile(tpath) else None
    gates = [eng.model.w.get(f"layers.{l}.gate_w") for l in range(mc.num_layers)]
    norms = [eng.model.w.get(f"layers.{l}.post_norm") for l in range(mc.num_layers)]
    policies = [p for p in a.policies.split(",") if p]
    if "exact" not in policies:
        policies.insert(0, "exact")
    print(f"model {a.model}: E={E} top-{K}, {len(moe)} MoE layers; {n_seq} x {a.seq_len} held-out tokens per domain "
          f"({n_seq * a.seq_len // WINDOW} window(s) of {WINDOW}); options {opts or 'defaults'}; "
          f"prefetch predictor {DEFAULT_PREDICTOR} ({'seeded' if counts else 'unseeded'}), budget k+1")
    rows: dict[str, dict] = {}
    t_start = time.time()
    for pol in policies:
        gcfg = GatingConfig.from_options(pol, opts)
        r = {"nll": {}, "mm": {}, "cv": {}, "r2": {}, "r4": {}, "thrash": {}, "recall": {}, "ept": {}}
        for d, seqs in data.items():
            eng.model.gating_router = router = new_router(eng, gcfg)
            width = max(router.k_max, K)
            hid: list[torch.Tensor] = []
            nll, ids = run_policy(eng, seqs, width, hid)
            r["nll"][d] = nll
            r["mm"][d], r["cv"][d] = balance(ids, E, moe)
            r["r2"][d] = balance(ids, E, moe, ranks=2)[0]
            r["r4"][d] = balance(ids, E, moe, ranks=4)[0]
            r["thrash"][d] = thrash(ids, [len(s) for s in seqs], E, moe)
            r["ept"][d] = float((ids[:, moe] >= 0).sum()) / (ids.shape[0] * len(moe))
            pred = make_predictor(DEFAULT_PREDICTOR, num_layers=mc.num_layers, num_experts=E, top_k=K,
                                  moe_layers=mc.moe_layers, counts=counts, gate_weights=gates, norm_weights=norms,
                                  norm_eps=mc.rms_norm_eps)
            lens, traces, at = [len(s) for s in seqs], [], 0
            for i, ln in enumerate(lens[: max(1, len(lens) // 4)]):  # a quarter of the tokens (prequential is slow)
                traces.append(RoutingTrace(ids=ids[at : at + ln], hidden=hid[i]))
                at += ln
            # as the engine predicts for the policy (`sticky`: the previous token's experts first)
            st = prequential_eval({"p": pred}, traces, budget=K + 1, keep_previous=pol == "sticky")["p"].c
            r["recall"][d] = sum(v["pred_inter"] for v in st.values()) / max(sum(v["true_n"] for v in st.values()), 1)
        if not a.no_decode:
            eng.model.gating_router = new_router(eng, gcfg)
            prompts = [data["prose"][0][:32]]
            r["ms"] = decode_tpot(eng, prompts, 16 if a.quick else 48)
        else:
            r["ms"] = float("nan")
        rows[pol] = r
        print(f"  {pol}: done ({time.time() - t_start:.0f} s)", file=sys.stderr)

    base = rows["exact"]["nll"]
    def dppl(pol, d):
        return 100 * (math.exp(rows[pol]["nll"][d] - base[d]) - 1)

    print()
    hdr = (f"{'policy':<10} {'domain':<6} {'ppl':>8} {'dppl %':>7} {'exp max/mean':>12} {'exp CV':>7} "
           f"{'rank2 m/m':>9} {'rank4 m/m':>9} {'thrash':>7} {'exp/tok':>7} {'recall':>7} {'ms/tok':>7}")
    print(hdr)
    print("-" * len(hdr))
    for pol, r in rows.items():
        for d in data:
            print(f"{pol:<10} {d:<6} {math.exp(r['nll'][d]):8.2f} {dppl(pol, d):7.2f} {r['mm'][d]:12.3f} "
                  f"{r['cv'][d]:7.3f} {r['r2'][d]:9.3f} {r['r4'][d]:9.3f} {r['thrash'][d]:7.3f} {r['ept'][d]:7.2f} "
                  f"{r['recall'][d]:7.3f} {r['ms']:7.2f}")
    def avg(pol, key):
        if pol not in rows:
            return float("nan")
        return sum(rows[pol][key].values()) / len(rows[pol][key])
    def worst(pol):
        return max(dppl(pol, d) for d in data) if pol in rows else float("nan")
    res = {"exact_maxmean": avg("exact", "mm"), "balanced_maxmean": avg("balanced", "mm"),
           "balanced_dppl": worst("balanced"), "exact_thrash": avg("exact", "thrash"),
           "sticky_thrash": avg("sticky", "thrash"), "sticky_dppl": worst("sticky")}
    print("\nRESULT " + " ".join(f"{k}={v:.4f}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
