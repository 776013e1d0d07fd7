"""What one engine step runs: the scheduled sequences flattened into token ids, positions, attention metadata
and the gating batch (`StepPlan`), built from the scheduler's prefills and decodes.

Token layout (every consumer relies on it): the prefill chunks first, in scheduling order, each the
contiguous positions [num_cached, num_cached + num_scheduled) of its sequence (a whole prompt when it fits
the budget, else a chunk: `actors.engine.scheduler`), then one token per decode sequence, in order; so
decode token i of a decode-only step is sequence i's new token. `meta.prefills[i]` = (first row, chunk
length n, context length after the chunk, block table): the chunk's queries attend to the sequence's cached
K/V of earlier chunks plus, causally, the chunk itself. Only sequences whose last position is in the step
need logits (`StepPlan.sampled`, rows `logit_rows`): a prefill whose chunk ends the sequence, every decode;
plus, for a request with `prompt_logprobs`, every row of its chunk that predicts a prompt token not scored yet
(`StepPlan.prompt_rows`, rows after the sampled ones in `logit_rows`).

Shape legend: T = tokens in the step, M = most KV blocks of a decode sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.scheduler import Sequence
from actors.model.attention import AttentionMetadata
from actors.moe.gating import POLICIES, GatingBatch


@dataclass(kw_only=True, slots=True)
class StepPlan:
    """One scheduled step: its sequences (prefills first), flattened token ids [T] and positions [T] (int64),
    attention metadata and gating batch. `num_tokens` = T. `sampled`: the sequences that get a token this step
    (those whose last position is computed), in `seqs` order; `logit_rows`: [N] int64 rows of the step's hidden
    states they sample from, then the `prompt_rows` ones, or None when every row is one (a decode-only step).
    `prompt_rows`: (sequence, first position p, count c) per prefill chunk scoring prompt tokens p+1 .. p+c
    (`SamplingParams.prompt_logprobs`), in row order."""

    seqs: list[Sequence]
    ids: torch.Tensor
    pos: torch.Tensor
    meta: AttentionMetadata
    gating: GatingBatch
    sampled: list[Sequence]
    logit_rows: torch.Tensor | None
    prompt_rows: list[tuple[Sequence, int, int]]

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()


def build_metadata(prefills: list[Sequence], decodes: list[Sequence], bs: int, dev: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(token ids [T], positions [T], attention metadata) of a step; `bs`: tokens per KV block. A prefill
    covers its sequence's positions [num_cached, num_cached + num_scheduled)."""
    ids, pos, slots = [], [], []
    pf_meta = []
    for seq in prefills:
        a, n = seq.num_cached, seq.num_scheduled
        start = len(ids)
        ids += seq.token_ids(a, a + n)
        pos += range(a, a + n)
        slots += [seq.block_table[i // bs] * bs + i % bs for i in range(a, a + n)]
        pf_meta.append((start, n, a + n, torch.tensor(seq.block_table, dtype=torch.int64)))
    dec_tok = []
    for seq in decodes:
        i = seq.length - 1
        dec_tok.append(len(ids))
        ids.append(seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1])  # no O(length) copy
        pos.append(i)
        slots.append(seq.block_table[i // bs] * bs + i % bs)
    M = max((len(s.block_table) for s in decodes), default=0)
    # one tensor from padded host lists (not one small tensor op per sequence)
    tables = torch.tensor([s.block_table + [0] * (M - len(s.block_table)) for s in decodes],
                          dtype=torch.int64).view(len(decodes), M)
    lens = [s.length for s in decodes]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        decode_tokens=torch.tensor(dec_tok, dtype=torch.int64, device=dev),
        decode_block_tables=tables.to(dev),
        decode_context_lens=torch.tensor(lens, dtype=torch.int64, device=dev),
        prefills=[(a, b, c, t.to(dev)) for a, b, c, t in pf_meta],
        decode_context_lens_host=lens,
    )
    return torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev), meta


def sampled_rows(prefills: list[Sequence], decodes: list[Sequence], meta: AttentionMetadata, dev: torch.device
                 ) -> tuple[list[Sequence], torch.Tensor | None, list[tuple[Sequence, int, int]]]:
    """(sequences that get a token this step, the logit rows [N + Q] int64 or None = every row, decode-only, and
    the prompt-scoring chunks, `StepPlan.prompt_rows`): a prefill whose chunk reaches its sequence's length, then
    every decode (layout of `build_metadata`), then the Q rows of prompt positions p whose next prompt token
    p + 1 has no logprob yet (`Sequence.prompt_lp`; a recomputed prefix after preemption is not scored again)."""
    if not prefills:
        return list(decodes), None, []
    done = [(s, start + n - 1) for s, (start, n, _, _) in zip(prefills, meta.prefills)
            if s.num_cached + n == s.length]
    first_decode = sum(n for _, n, _, _ in meta.prefills)  # decode tokens follow the prefill chunks
    rows = [r for _, r in done] + list(range(first_decode, first_decode + len(decodes)))
    scored = []
    for s, (start, n, _, _) in zip(prefills, meta.prefills):
        if s.prompt_lp is not None:
            a = s.num_cached
            p, end = max(a, len(s.prompt_lp) - 1), min(a + n, len(s.prompt_ids) - 1)
            if end > p:
                scored.append((s, p, end - p))
                rows += range(start + p - a, start + end - a)
    return [s for s, _ in done] + decodes, torch.tensor(rows, dtype=torch.int64, device=dev), scored


def build_gating_batch(seqs: list[Sequence], pos: torch.Tensor, meta: AttentionMetadata, *, slot_of: dict[str, int],
                       free_slots: list[int], running: list[Sequence], default: str, dev: torch.device) -> GatingBatch:
    """Token -> gating slot (and per-request policy) for this step; tokens are laid out as in `build_metadata`.

    A sequence without a slot takes one from `free_slots` into `slot_of` (both updated in place); when none is
    free, the slots of requests neither in `running` nor in this step go back first (preempted sequences restart
    at position 0: their slots are stale). A sequence keeps its slot across its prefill chunks (it stays in
    `running`), so per-sequence gating state (`sticky`, `velocity`) carries from one chunk to the next exactly
    as from one token to the next. `default`: the deployment's gating policy."""
    counts = [n for _, n, _, _ in meta.prefills] + [1] * (len(seqs) - len(meta.prefills))
    slots, pols = [], []
    for seq in seqs:
        slot = slot_of.get(seq.request_id)
        if slot is None:
            if not free_slots:  # preempted sequences restart at position 0: their slots are stale
                live = {s.request_id for s in running} | {s.request_id for s in seqs}
                for rid in [r for r in slot_of if r not in live]:
                    free_slots.append(slot_of.pop(rid))
            slot = slot_of[seq.request_id] = free_slots.pop()
        slots.append(slot)
        pols.append(POLICIES.index(seq.params.gating or default))
    if meta.prefills:
        rep = torch.tensor(counts, dtype=torch.int64)
        expand = lambda vals: torch.repeat_interleave(torch.tensor(vals, dtype=torch.int64), rep).to(dev)  # noqa: E731
    else:  # decode only: one token per sequence
        expand = lambda vals: torch.tensor(vals, dtype=torch.int64, device=dev)  # noqa: E731
    slot_T = expand(slots)
    policy_T = None
    if any(p != pols[0] for p in pols) or (pols and POLICIES[pols[0]] != default):
        policy_T = expand(pols)
    return GatingBatch(slots_T=slot_T, positions_T=pos, policy_T=policy_T)
