"""Two-batch overlap (TBO): a decode step as two micro-batches, one's expert exchange in flight while the other
computes (SGLang's two-batch overlap, on the seams of `actors.moe.split_dispatch`).

Schedule per MoE layer l (a, b: the micro-batches; post / finish: a collective's start and its wait):
    attn(a) gate(a) dispatch-post(a)   attn(b) gate(b) dispatch-post(b)
    dispatch-finish(a) experts(a) combine-post(a) shared(a)   dispatch-finish(b) experts(b) combine-post(b) shared(b)
and layer l + 1 begins with combine-finish(a) attn(a) ... dispatch-post(a), then combine-finish(b): a's next
attention runs while b's results travel. At most two collectives are in flight and they finish in the order they
were posted (the TCP transport's rule, `actors.rank.tcp_collective.MAX_POSTED`). Dense layers make no collective.

Agreement. Every rank must make the same collectives in the same order, so whether a step runs here and each
micro-batch's capacity depend on agreed values only (`MoEModel.forward`: `StepContext.decode_only`,
`step_max_tokens` >= `two_batch_min`, the dispatcher `overlaps`), never on this rank's own T: micro-batch a is this
rank's first ceil(T / 2) sequences, b the rest, and both take the fixed capacity of ceil(step_max_tokens / 2)
tokens, which bounds either half on every rank. A rank with 1 token (b empty) or 0 (both empty) still makes both
micro-batches' calls, with zero rows.

Same tokens as one batch: exact routing is per token, attention per sequence, the experts per row, the gating
router's per-sequence state (`velocity`, `sticky`) keyed by sequence slot; the routing observer sees each layer's
whole step (both halves' hidden states and ids, in token order) once both are routed. The `capacity` policy caps
each expert per call, so under TBO it caps per micro-batch. Where it pays: when the all-to-all's wait is long against
a micro-batch's compute (cross-node links); on one node the shared-memory transport has no split form, so it is off.

Shape legend: T = tokens of this rank's step (one per decode sequence), Ta / Tb = the halves, D = hidden,
K' = widest routed row of a call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from actors.model.attention import AttentionMetadata
from actors.model.layers import rms_norm, swiglu_mlp
from actors.moe.gating import GatingBatch


@dataclass(slots=True)
class MicroBatch:
    """One half of the step: its token ids [Tm], positions [Tm], attention metadata, gating batch (None: exact
    routing), residual stream h [Tm, D] and normed input x [Tm, D]; between a layer's posts and finishes the
    in-flight dispatch / combine and what the layer's tail needs (weights, shared expert, dense output)."""

    ids: torch.Tensor
    pos: torch.Tensor
    meta: AttentionMetadata
    gating: GatingBatch | None
    h: torch.Tensor | None = None
    x: torch.Tensor | None = None
    y: Any = None  # the layer's output [Tm, D] (dense) or the pending combine (MoE)
    dispatch: Any = None
    topk_w: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    y_in: torch.Tensor | None = None  # the fused MoE input projection (shared expert inputs)
    shared_scale: torch.Tensor | None = None
    shared: tuple | None = None  # (g [Tm, 1], shared expert output [Tm, D]) or None

    @property
    def T(self) -> int:
        return self.ids.shape[0]


def split_gating(g: GatingBatch | None, n: int) -> tuple[GatingBatch | None, GatingBatch | None]:
    """The step's gating batch as the micro-batches' (tokens [0, n) and [n, T)), each naming `g` as its step (the
    gating router's per-step state treats them as one step); None stays None."""
    if g is None:
        return None, None
    pol = g.policy_T
    return (GatingBatch(slots_T=g.slots_T[:n], positions_T=g.positions_T[:n], policy_T=None if pol is None else pol[:n],
                        step=g),
            GatingBatch(slots_T=g.slots_T[n:], positions_T=g.positions_T[n:], policy_T=None if pol is None else pol[n:],
                        step=g))


def split_step(ids_T: torch.Tensor, pos_T: torch.Tensor, meta: AttentionMetadata,
               gating: GatingBatch | None) -> tuple[MicroBatch, MicroBatch]:
    """A decode-only step's tokens as two micro-batches: the first ceil(T / 2) sequences, then the rest.

    Raises:
        ValueError: the step has prefills (`AttentionMetadata.split`).
    """
    n = -(-ids_T.shape[0] // 2)
    meta_a, meta_b = meta.split(n)
    g_a, g_b = split_gating(gating, n)
    return (MicroBatch(ids_T[:n], pos_T[:n], meta_a, g_a), MicroBatch(ids_T[n:], pos_T[n:], meta_b, g_b))


def forward_two_batch(model, input_ids_T: torch.Tensor, positions_T: torch.Tensor, cache, meta: AttentionMetadata,
                      ctx, observer) -> torch.Tensor:
    """`MoEModel.forward` of a decode-only step as two overlapped micro-batches (schedule in the module docstring):
    final-normed hidden [T, D], equal to the one-batch forward's. `model`: the `actors.model.model.MoEModel`;
    ctx: its `StepContext` (step_max_tokens set: the agreed size), observer: the forward's routing observer
    (`begin_step` already called; None: none, and no whole-step tensors are built for it).

    Raises:
        ValueError: the step has prefills, or the dispatcher cannot overlap at this size.
    """
    cfg, w, eps = model.cfg, model.w, model.cfg.rms_norm_eps
    cap = -(-ctx.step_max_tokens // 2)  # tokens per micro-batch on any rank: the agreed capacity of both
    mbs = split_step(input_ids_T, positions_T, meta, ctx.gating)
    model._routed = []
    for mb in mbs:
        mb.h = mb.x = F.embedding(mb.ids, w["embed"]).to(model.dtype)
        if mb.T:
            mb.x = rms_norm(mb.h, w["layers.0.input_norm"], eps)
    for l in range(cfg.num_layers):
        for mb in mbs:
            _finish_layer(model, mb, l - 1)  # combine-finish of the layer before (a's, then b's)
            if mb.T:
                mb.h, mb.x = rms_norm(model.attention(l, mb.x, mb.pos, cache, mb.meta), w[f"layers.{l}.post_norm"],
                                      eps, residual=mb.h)
            if cfg.moe_layers[l]:
                _gate_and_post(model, l, mb, cap)
            elif mb.T:
                mb.y = swiglu_mlp(mb.x, w[f"layers.{l}.mlp_gate_up"], w[f"layers.{l}.mlp_down"])
        if cfg.moe_layers[l]:
            _observe(model, l, mbs, observer)
            for mb in mbs:
                rows, handle = model.dispatcher.dispatch_finish(mb.dispatch)
                y_RD = rows.run(model.experts[l], mb.topk_w)
                mb.y = model.dispatcher.combine_post(y_RD, handle, mb.topk_w)
                # while the results travel
                mb.shared = model.shared_expert(l, mb.y_in, mb.shared_scale) if mb.T else None
    for mb in mbs:
        _finish_layer(model, mb, cfg.num_layers - 1)
    model._count_load()
    return torch.cat([mbs[0].x, mbs[1].x])


def _gate_and_post(model, l: int, mb: MicroBatch, cap: int) -> None:
    """Route micro-batch `mb` at MoE layer l and post its dispatch (zero rows when it has no tokens)."""
    if mb.T:
        mb.y_in, mb.topk_w, mb.topk_ids, mb.shared_scale, may_pad = model.gate(l, mb.x, mb.gating)
        if mb.topk_ids.numel():
            model._routed.append((l, mb.topk_ids))
    else:
        K = max(model.cfg.top_k, 1)
        mb.topk_ids = torch.zeros(0, K, dtype=torch.int64, device=mb.x.device)
        mb.topk_w = torch.zeros(0, K, dtype=torch.float32, device=mb.x.device)
        may_pad = False
    mb.dispatch = model.dispatcher.dispatch_post(l, mb.x, mb.topk_ids, may_pad=may_pad, step_max_tokens=cap)


def _finish_layer(model, mb: MicroBatch, l: int) -> None:
    """Layer l's tail for `mb`: finish its combine (MoE: a collective, also with no tokens), add the shared
    expert, then the residual add and the next layer's input norm (or the final norm)."""
    if l < 0:
        return
    w, cfg = model.w, model.cfg
    y = model.dispatcher.combine_finish(mb.y) if cfg.moe_layers[l] else mb.y
    shared, mb.y, mb.dispatch, mb.shared = mb.shared, None, None, None
    if not mb.T:
        return
    if shared is not None:
        y = y + shared
    nxt = w[f"layers.{l + 1}.input_norm"] if l + 1 < cfg.num_layers else w["norm"]
    mb.h, mb.x = rms_norm(y, nxt, cfg.rms_norm_eps, residual=mb.h)


def _observe(model, l: int, mbs: tuple[MicroBatch, MicroBatch], observer) -> None:
    """The routing observer's calls for layer l over the whole step (token order: a's rows, then b's), once both
    halves are routed: `on_hidden` with the residual stream, `on_route` with the ids (the narrower half's rows
    padded with -1 to the wider's K')."""
    live = [mb for mb in mbs if mb.T]
    if not live or observer is None:
        return
    observer.on_hidden(l, live[0].h if len(live) == 1 else torch.cat([mb.h for mb in live]))
    width = max(mb.topk_ids.shape[1] for mb in live)
    ids = [mb.topk_ids if mb.topk_ids.shape[1] == width else
           torch.cat([mb.topk_ids, mb.topk_ids.new_full((mb.T, width - mb.topk_ids.shape[1]), -1)], dim=1)
           for mb in live]
    observer.on_route(l, ids[0] if len(ids) == 1 else torch.cat(ids))
