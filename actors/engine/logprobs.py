"""Log-probabilities of an engine step, for the requests that ask (`SamplingParams.logprobs`, `prompt_logprobs`):
each sampled token's, and those of the prompt tokens its prefill chunk predicts, with their top-k alternatives.

Method: the rows that ask, gathered from the step's logits [N + Q, V] (sampled rows, then the prompt-scoring rows
of `actors.engine.step_plan.sampled_rows`), go through one log_softmax in fp32 over the raw logits (before
temperature, top-k, top-p: vLLM's default `raw_logprobs`), one `torch.topk` with the largest k any of them asks
for, a gather of each row's target token (the sampled one, or the next prompt token) and its rank (1 + the number
of tokens strictly more probable). A step where no request asks costs one pass over its sequences' params.
Shape legend: N = sampled rows, Q = prompt-scoring rows, R = rows that ask, V = vocab, K = the largest k.
"""
from __future__ import annotations

import torch

from actors.engine.scheduler import Sequence


def token_logprobs(logits_RV: torch.Tensor, targets: list[int], ks: list[int]) -> list[list]:
    """Per row of `logits_RV` [R, V] (any float dtype; computed in fp32): [logprob of `targets[r]` (float),
    its rank (int, 1 = most probable), the `ks[r]` most probable ids (descending), their logprobs]: the
    `TokenLogprob` of `actors.engine.messages.TokenOutput`. Raises IndexError: a target outside [0, V)."""
    lp = torch.log_softmax(logits_RV.float(), dim=-1)
    tgt = torch.tensor(targets, dtype=torch.int64, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, tgt)  # [R, 1]
    rank = ((lp > chosen).sum(dim=1) + 1).tolist()
    K = max(ks, default=0)
    if K:
        top = torch.topk(lp, K, dim=1)  # sorted, descending
        ids, vals = top.indices.tolist(), top.values.tolist()
    else:
        ids = vals = [[] for _ in ks]
    return [[c, r, i[:k], v[:k]] for c, r, i, v, k in zip(chosen[:, 0].tolist(), rank, ids, vals, ks)]


def step_logprobs(logits: torch.Tensor, seqs: list[Sequence], toks: list[int],
                  prompt_rows: list[tuple[Sequence, int, int]]) -> list[list | None] | None:
    """The step's logprobs: per sampled sequence (`seqs`, rows 0..N-1 of `logits` [N + Q, V], sampled `toks`,
    -1 for a failed row) its token's `TokenLogprob`, or None where it did not ask; None when none did. The
    prompt-scoring chunks (`prompt_rows`, rows N.. in order: (sequence, first position, count)) extend their
    sequence's `prompt_lp` in place."""
    rows, targets, ks = [], [], []
    for i, (s, t) in enumerate(zip(seqs, toks)):
        if s.params.logprobs is not None and t >= 0 and s.params.max_tokens > 0:
            rows.append(i), targets.append(t), ks.append(s.params.logprobs)
    n_sampled = len(rows)
    if not n_sampled and not prompt_rows:
        return None
    r = len(seqs)
    for s, p, c in prompt_rows:
        rows += range(r, r + c)
        targets += s.prompt_ids[p + 1:p + 1 + c]
        ks += [s.params.prompt_logprobs] * c
        r += c
    x = logits if len(rows) == logits.shape[0] else logits.index_select(0, torch.tensor(rows, device=logits.device))
    entries = token_logprobs(x, targets, ks)
    at = n_sampled
    for s, p, c in prompt_rows:
        s.prompt_lp += entries[at:at + c]
        at += c
    out: list[list | None] = [None] * len(seqs)
    for i, e in zip(rows[:n_sampled], entries):
        out[i] = e
    return out
