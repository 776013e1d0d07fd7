"""How often `--kv-profile auto` picks the right KV quantization profile on the held-out texts.

The `auto` rule (`actors.kv.profile_choice.choose_profile`) reads the prompt text and picks `code` or `prose`.
This bench cuts the model's held-out texts (`<model>/heldout/{prose,code}.txt`, never trained on) into
consecutive, non-overlapping windows of N tokens (the model's tokenizer), N = 1024 (the model card's
perplexity windows) and the shorter, prompt-like 64 and 256, decodes each window back to text as the engine
does for a request's prompt (`RankEngine.add_request`), and counts the windows whose pick matches their
domain. Per length and domain: windows, correct picks, accuracy, and the code fraction (the rule's score)
of the windows it gets wrong. No model weights are loaded (tokenizer and rule only).

    python bench/profile_choice.py --quick

Last stdout line: `RESULT auto_accuracy=.. auto_accuracy_prose=.. auto_accuracy_code=..` (over every window of
every length; per length: `auto_accuracy_64=..` etc.).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenizers import Tokenizer

from actors.kv.profile_choice import AUTO, CODE_CHAR_THRESHOLD, choose_profile, code_fraction
from cluster.config import DEFAULT_MODEL

DOMAINS = ("prose", "code")
LENGTHS = (64, 256, 1024)


def windows(ids: list[int], n: int, limit: int | None) -> list[list[int]]:
    """Consecutive non-overlapping n-token windows of `ids` (the trailing partial one dropped), at most `limit`
    (spread evenly over the text when limited)."""
    out = [ids[i:i + n] for i in range(0, len(ids) - n + 1, n)]
    if limit is not None and len(out) > limit:
        step = len(out) / limit
        out = [out[int(j * step)] for j in range(limit)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true", help="at most 40 windows per length and domain")
    a = ap.parse_args(argv)
    tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    limit = 40 if a.quick else None
    stats: dict[tuple[int, str], tuple[int, int, list[float]]] = {}
    for d in DOMAINS:
        with open(os.path.join(a.model, "heldout", f"{d}.txt"), encoding="utf-8") as f:
            ids = tok.encode(f.read()).ids
        for n in LENGTHS:
            ok, wrong = 0, []
            ws = windows(ids, n, limit)
            for w in ws:
                text = tok.decode(w)
                if choose_profile(AUTO, ["prose", "code"], AUTO, text) == d:
                    ok += 1
                else:
                    wrong.append(code_fraction(text))
            stats[(n, d)] = (len(ws), ok, wrong)
    print(f"model {a.model}: `auto` picks code when code_fraction >= {CODE_CHAR_THRESHOLD}; "
          f"{'quick: <= 40' if a.quick else 'all'} windows per length and domain")
    print(f"{'tokens':>6} {'domain':<6} {'windows':>7} {'correct':>7} {'accuracy':>8}  code fraction of the misses")
    res: dict[str, float] = {}
    for n in LENGTHS:
        for d in DOMAINS:
            cnt, ok, wrong = stats[(n, d)]
            miss = ", ".join(f"{x:.3f}" for x in sorted(wrong)[:6]) + (" ..." if len(wrong) > 6 else "")
            print(f"{n:>6} {d:<6} {cnt:>7} {ok:>7} {ok / max(cnt, 1):>8.3f}  {miss or '-'}")
        cnt = sum(stats[(n, d)][0] for d in DOMAINS)
        res[f"auto_accuracy_{n}"] = sum(stats[(n, d)][1] for d in DOMAINS) / max(cnt, 1)
    for d in DOMAINS:
        cnt = sum(stats[(n, d)][0] for n in LENGTHS)
        res[f"auto_accuracy_{d}"] = sum(stats[(n, d)][1] for n in LENGTHS) / max(cnt, 1)
    cnt = sum(v[0] for v in stats.values())
    res["auto_accuracy"] = sum(v[1] for v in stats.values()) / max(cnt, 1)
    keys = ["auto_accuracy", "auto_accuracy_prose", "auto_accuracy_code"] + [f"auto_accuracy_{n}" for n in LENGTHS]
    print("RESULT " + " ".join(f"{k}={res[k]:.4f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
