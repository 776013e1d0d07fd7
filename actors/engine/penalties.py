"""Logit controls of the batched sampler: `logit_bias`, `min_tokens`, `repetition_penalty`, `presence_penalty`
and `frequency_penalty` (`actors.engine.sampling.SamplingParams`), applied on the rank to the rows that use them.

Method, in vLLM v1's order (its sampler: the non-argmax-invariant logits processors `LogitBiasLogitsProcessor`
and `MinTokensLogitsProcessor`, then `apply_penalties`), per row of raw logits x [V] (fp32):
  1. x[t] += logit_bias[t];
  2. while fewer than min_tokens tokens were generated, x[t] = -inf for EOS (unless ignore_eos) and every
     stop_token_ids id (HF's `MinNewTokensLengthLogitsProcessor`);
  3. for every token t of prompt + output: x[t] = x[t] / r if x[t] > 0 else x[t] * r (r = repetition_penalty;
     Keskar et al., "CTRL", 2019, sec. 4.1; HF's `RepetitionPenaltyLogitsProcessor`);
  4. x[t] -= frequency * count[t] + presence * (count[t] > 0), count over the generated tokens (OpenAI's API
     reference, "Frequency and presence penalties").
Per-sequence state (`SequenceControls`) is kept incrementally: the tokens generated since the last step update
dense [V] fp32 token counts and step 4's term (frequency * count + presence * (count > 0), recomputed only for
the new tokens), and a [V] bool mask of the prompt + output tokens (step 3, applied to the masked tokens only,
gathered and scattered), so a step costs O(V) per controlled row whatever the output length. Rows without
controls are not touched: the sampler skips this module entirely when no row of the step has any.
Shape legend: P = controlled rows, V = vocab.
"""
from __future__ import annotations

import numpy as np


class SequenceControls:
    """One sequence's logit-control state. `output_ids` is the sequence's own list, read in place (the engine
    appends to it); the dense arrays are allocated at the first step, when V is known.

    Args:
        params: the request's `SamplingParams` (`has_logit_controls` true). prompt_ids, output_ids: its tokens.
        eos: the model's EOS ids (masked by min_tokens unless `params.ignore_eos`).
    """

    __slots__ = ("params", "prompt_ids", "output_ids", "stop_ids", "bias_ids", "bias_vals", "seen", "counts", "pen", "done", "V")

    def __init__(self, params, prompt_ids: list[int], output_ids: list[int], eos: set[int]):
        self.params, self.prompt_ids, self.output_ids = params, prompt_ids, output_ids
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        self.stop_ids = np.asarray(sorted(stop), dtype=np.int64)
        lb = params.logit_bias or {}
        self.bias_ids = np.asarray(list(lb), dtype=np.int64)
        self.bias_vals = np.asarray(list(lb.values()), dtype=np.float32)
        self.seen = None  # [V] bool: prompt + output tokens (repetition_penalty)
        self.counts = self.pen = None  # [V] fp32: output token counts; frequency * count + presence * (count > 0)
        self.done = 0  # output tokens already counted
        self.V = 0  # vocab size the arrays were built for (0: not yet)

    @classmethod
    def of(cls, params, prompt_ids: list[int], output_ids: list[int], eos: set[int]) -> "SequenceControls | None":
        """The state for a request, or None when it uses no logit control (the common path costs nothing)."""
        return cls(params, prompt_ids, output_ids, eos) if params.has_logit_controls else None

    def update(self, V: int) -> None:
        """Count the tokens generated since the last call: O(new tokens) (O(V + prompt) the first time).
        Raises IndexError: a token id outside [0, V)."""
        p = self.params
        if self.V != V:
            self.V, self.done = V, 0
            self.stop_ids = self.stop_ids[self.stop_ids < V]  # an id outside the vocabulary is never sampled
            if p.repetition_penalty != 1.0:
                self.seen = np.zeros(V, dtype=bool)
                self.seen[np.asarray(self.prompt_ids, dtype=np.int64)] = True
            if p.presence_penalty or p.frequency_penalty:  # counts are over the output only
                self.counts, self.pen = np.zeros(V, dtype=np.float32), np.zeros(V, dtype=np.float32)
        new = self.output_ids[self.done:]
        if not new:
            return
        self.done += len(new)
        if self.seen is not None:
            self.seen[new] = True
        if self.counts is not None:
            fr, pr = np.float32(p.frequency_penalty), np.float32(p.presence_penalty)
            for t in new:  # each new token's term, recomputed from its count
                self.counts[t] += 1
                self.pen[t] = fr * self.counts[t] + pr


def apply_controls(x: np.ndarray, rows: list[int], ctl: list[SequenceControls]) -> None:
    """Apply each row's controls to x [B, V] (fp32, modified in place), batched over the P controlled rows
    (`rows`, their states `ctl`), in the module's order. Raises (IndexError, ValueError) on bad state; the
    caller then applies the rows one by one to find the failing one."""
    V = x.shape[1]
    for c in ctl:
        c.update(V)
    r = np.asarray(rows, dtype=np.int64)
    xp = x[r]  # [P, V] copy
    b = [j for j, c in enumerate(ctl) if c.bias_ids.size]
    if b:  # ids are distinct within a row (dict keys), so a fancy-indexed add adds each once
        ri = np.concatenate([np.full(ctl[j].bias_ids.size, j) for j in b])
        ci = np.concatenate([ctl[j].bias_ids for j in b])
        xp[ri, ci] += np.concatenate([ctl[j].bias_vals for j in b])
    m = [j for j, c in enumerate(ctl) if len(c.output_ids) < c.params.min_tokens and c.stop_ids.size]
    if m:
        ri = np.concatenate([np.full(ctl[j].stop_ids.size, j) for j in m])
        xp[ri, np.concatenate([ctl[j].stop_ids for j in m])] = -np.inf
    rp = [j for j, c in enumerate(ctl) if c.seen is not None]
    if rp:  # on the seen tokens only: gather, divide or multiply, scatter
        whole = len(rp) == len(ctl)
        sub = xp if whole else xp[rp]
        flat = sub.reshape(-1)
        at = np.flatnonzero(np.stack([ctl[j].seen for j in rp]))
        pen = np.asarray([ctl[j].params.repetition_penalty for j in rp], dtype=np.float32)[at // V]
        v = flat[at]
        flat[at] = np.where(v > 0, v / pen, v * pen)
        if not whole:
            xp[rp] = sub
    fp = [j for j, c in enumerate(ctl) if c.pen is not None]
    if fp:
        pen = np.stack([ctl[j].pen for j in fp])  # [F, V] fp32
        if len(fp) == len(ctl):
            xp -= pen
        else:
            xp[fp] -= pen
    x[r] = xp
