"""Builds the jsonl documents of the two local lm-eval tasks from the shipped model's held-out text.

`moeray_next_line_gen` (generate_until): the context is the 4 lines before a target line of
models/tiny-moe/heldout/{prose,code}.txt (never trained on), each ending in a newline; the model continues it
greedily until the next newline, and the target is the true line (exact match).
`moeray_next_line_mc` (multiple_choice): the same contexts (doc k of both tasks asks for the same line); the
choices are the true next line and 3 other lines of the same file and of similar length, in a seeded random order;
`label` is the true one's index. Sharing the contexts lets a server's prefix cache serve a generate_until request
from the blocks a multiple-choice request of the same doc left (lm-eval runs the request types in task order: name
the mc task first); the loglikelihood requests themselves score every prompt position, so they never read it.

Targets are lines of 20 to 80 characters (a sentence or a statement); docs alternate prose and code. The same
seed gives the same files: `python bench/lm_eval_tasks/make_tasks.py` rewrites bench/lm_eval_tasks/data/.
"""
from __future__ import annotations

import argparse
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HELDOUT = os.path.join(REPO, "models", "tiny-moe", "heldout")
CONTEXT_LINES = 4
MIN_CHARS, MAX_CHARS = 20, 80


def _targets(lines: list[str]) -> list[int]:
    """Indices of lines that can be a target: 20-80 characters, with CONTEXT_LINES lines before them."""
    return [i for i in range(CONTEXT_LINES, len(lines)) if MIN_CHARS <= len(lines[i]) <= MAX_CHARS]


def build(docs_per_domain: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(generate_until docs, multiple_choice docs), `docs_per_domain` of each from each held-out file.

    A gen doc: {domain, context, target}. An mc doc: {domain, context, choices (4 strings), label (int)}; doc k
    of both has the same context."""
    rng = random.Random(seed)
    gen, mc = [], []
    per_domain = {}
    for domain in ("prose", "code"):
        with open(os.path.join(HELDOUT, f"{domain}.txt"), encoding="utf-8") as f:
            lines = f.read().split("\n")
        cand = _targets(lines)
        out_gen, out_mc = [], []
        for i in rng.sample(cand, docs_per_domain):
            context, true = "\n".join(lines[i - CONTEXT_LINES:i]) + "\n", lines[i]
            out_gen.append({"domain": domain, "context": context, "target": true})
            others = [lines[j] for j in cand if abs(len(lines[j]) - len(true)) <= 10 and lines[j] != true]
            choices = rng.sample(others, 3) + [true]
            rng.shuffle(choices)
            out_mc.append({"domain": domain, "context": context, "choices": choices, "label": choices.index(true)})
        per_domain[domain] = (out_gen, out_mc)
    for k in range(docs_per_domain):  # alternate the domains, so the first few docs hold both
        for domain in ("prose", "code"):
            gen.append(per_domain[domain][0][k])
            mc.append(per_domain[domain][1][k])
    return gen, mc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs-per-domain", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "data"))
    a = ap.parse_args()
    gen, mc = build(a.docs_per_domain, a.seed)
    os.makedirs(a.out, exist_ok=True)
    for name, docs in (("next_line_gen.jsonl", gen), ("next_line_mc.jsonl", mc)):
        with open(os.path.join(a.out, name), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
        print(f"{len(docs)} docs -> {os.path.join(a.out, name)}")


if __name__ == "__main__":
    main()
