"""Reference computations with `transformers` for correctness tests."""
from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by `transformers` (full recompute each step: no cache subtleties).

    Returns (generated ids, top-2 logit margin at each generated position).
    """
    ids = list(prompt_ids)
    out, margins = [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out, margins


def agree_until_small_margin(ours: list[int], ref: list[int], margins: list[float], eps: float = 1e-4) -> int:
    """Check ours == ref up to the first position whose reference top-2 margin is below eps.

    Returns the number of positions compared. Raises AssertionError at the first mismatch.
    """
    n = 0
    for i, (a, b) in enumerate(zip(ours, ref)):
        if margins[i] < eps:
            break
        assert a == b, f"token {i}: ours {a} != reference {b} (margin {margins[i]:.2e}); ours={ours} ref={ref}"
        n += 1
    return n
