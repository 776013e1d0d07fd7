"""Decoder-only MoE forward for one rank: attention -> gate -> dispatch -> experts -> combine.

The math knows nothing of parallelism: attention runs on this rank's own sequences (data
parallel), and the MoE block hands its (token, expert) pairs to a `Dispatcher`, which may send
them to other ranks, runs this rank's `Experts` on the rows it receives, and combines the results.
Supports Qwen2-MoE (shared expert with sigmoid gate, q/k/v bias), Qwen3-MoE
(per-head q/k RMSNorm), Mixtral, OLMoE (full-width q/k RMSNorm, clip_qkv).

Wiring: the model receives every component in its constructor (dispatcher, per-layer experts, gating router,
routing observer) and per-step state as an argument (`StepContext`); nothing outside sets per-step attributes
on it. A `RoutingObserver` (the expert store's prefetch runtime, a calibration recorder) sees each forward:
`begin_step` first, then per MoE layer `on_hidden` (the residual stream entering the FFN) and `on_route`
(the layer's routed ids).

On CPU each layer's attention block (the residual add and input norm through the post-attention norm) runs as
compiled calls (`attention_block`, bit-identical to the op-by-op path: one call for a decode step over full-precision
pages, two around any other cache's `attend`) and the shared expert as one more (`shared_expert`): a decode step is
bound by per-op overhead, ~10-25 us of Python per op here.

Two-batch overlap (`two_batch_min`, `actors.model.two_batch`): a decode-only step of agreed size may run as two
micro-batches whose expert exchanges overlap the other's compute; `forward` decides from agreed values only.

Shape legend: T = tokens in the step (all sequences flattened), D = hidden, H = query heads,
Hkv = KV heads, Dh = head_dim, E = routed experts, K = experts per token, V = vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from actors.model.attention import AttentionMetadata
from actors.model.config import ModelConfig
from actors.moe.dispatch import Dispatcher
from actors.moe.experts import Experts
from actors.kv.interface import KVCache
from actors.model.layers import Rotary, attention_block, rms_norm, swiglu_mlp
from kernels.cpu import linear, shared_expert
from kernels.cpu.routing import select_experts
from actors.moe.gating import GatingBatch
from actors.moe.gating_router import GatingRouter
from actors.model.two_batch import forward_two_batch


class RoutingObserver(Protocol):
    """Sees the routing of every forward (called on the forward's thread, in this order)."""

    def begin_step(self, meta: AttentionMetadata, num_tokens: int, gating: GatingBatch | None) -> None:
        """Before any layer: the step's attention metadata, its token count T (may be 0) and gating batch."""

    def on_hidden(self, layer: int, h_TD: torch.Tensor) -> None:
        """MoE layer `layer`: the residual stream [T, D] entering its FFN (T > 0)."""

    def on_route(self, layer: int, ids_TK: torch.Tensor) -> None:
        """MoE layer `layer` just routed its tokens: ids [T, K'] int64 (-1: padding; T > 0)."""


class NoObserver:
    """The default `RoutingObserver`: nothing to see."""

    def begin_step(self, meta, num_tokens, gating) -> None:
        pass

    def on_hidden(self, layer, h_TD) -> None:
        pass

    def on_route(self, layer, ids_TK) -> None:
        pass


NO_OBSERVER = NoObserver()


@dataclass(frozen=True, kw_only=True, slots=True)
class StepContext:
    """Per-step inputs of `MoEModel.forward` besides the tokens, positions, KV cache and attention metadata.

    gating: which gating slot (and policy) each token has (None: the model's own exact top-k routing, no
        per-sequence state). step_max_tokens: the largest token count of this step on any rank of the EP group,
        agreed by the lockstep loop (the dispatcher's fixed capacity; None: unknown, counts are exchanged).
    observer: this forward's routing observer in place of the model's (None: the model's). decode_only: agreed by
        the lockstep loop, no rank of the group has a prefill in this step (two-batch overlap may run).
    """

    gating: GatingBatch | None = None
    step_max_tokens: int | None = None
    observer: RoutingObserver | None = None
    decode_only: bool = False


NO_CONTEXT = StepContext()


class MoEModel:
    """Weights of one rank (replicated dense part + its expert shard) and the forward pass.

    Args:
        cfg: model configuration. weights: dict from `actors.model.weights.load_rank_weights`.
        dispatcher: how routed-expert pairs reach the experts (local or all-to-all).
        experts: per layer, this rank's routed experts of that layer (None for dense layers).
        gating_router: a `actors.moe.gating_router.GatingRouter`; it picks the experts when `forward` gets a gating
            batch (otherwise, or without a router, the model's own top-k routing, `exact`, runs).
        observer: the `RoutingObserver` of every forward (default: none).
        max_positions: RoPE table length (default: the config's max_position_embeddings).
        two_batch_min: two-batch overlap (`actors.model.two_batch`) for decode-only steps whose agreed largest token
            count is at least this, when the dispatcher `overlaps` (None: off). `two_batch_steps` counts them.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dispatcher: Dispatcher,
                 experts: list[Experts | None], *, gating_router: GatingRouter | None = None,
                 observer: RoutingObserver = NO_OBSERVER, max_positions: int | None = None,
                 two_batch_min: int | None = None):
        self.cfg = cfg
        self.two_batch_min = two_batch_min
        self.two_batch_steps = 0
        self.w = weights
        # compute dtype: the norms are always in it; matrices may be stored bf16 (`actors.model.weights`, keep_bf16)
        self.dtype = weights["norm"].dtype
        self.device = weights["norm"].device
        self.dispatcher = dispatcher
        self.gating_router = gating_router
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, max_positions or cfg.max_position_embeddings,
                             self.dtype, self.device)
        self.scale = cfg.head_dim ** -0.5
        self._fuse_projections()
        self.experts = list(experts)
        self.observer = observer
        # per-layer routed-expert token counts of this rank's tokens, [L, E] int64 (routing statistics)
        self.expert_load = torch.zeros(cfg.num_layers, max(cfg.num_experts, 1), dtype=torch.int64, device=self.device)
        self._routed: list[tuple[int, torch.Tensor]] = []  # (layer, ids [T, K]) of this forward, for expert_load

    def set_experts(self, experts: list[Experts | None], observer: RoutingObserver = NO_OBSERVER) -> None:
        """Use `experts` (per layer) and their `observer` from the next forward on: between steps, when the rank's
        expert shard changes (an expert placement change, `actors.engine.eplb`)."""
        self.experts = list(experts)
        self.observer = observer

    def set_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Use `dispatcher` from the next forward on: between steps, when the EP group is formed anew over the
        survivors of a lost rank (`actors.engine.eplb.PlacementMixin.regroup`)."""
        self.dispatcher = dispatcher

    def _fuse_projections(self) -> None:
        """One GEMM where the checkpoint has several reading the same input (decode is launch-bound:
        49 -> 33 matmuls per token on a 4-layer Qwen2-MoE): q/k/v -> `qkv_w` [(H + 2 Hkv) Dh, D] (+ `qkv_b`),
        and router gate + shared expert gate/up + shared gate -> `moe_in_w` [E + 2 I_s + 1, D]. The original
        keys stay as views into the fused tensors, so readers of `gate_w` etc. see the same weights."""
        cfg, w = self.cfg, self.w
        for l in range(cfg.num_layers):
            p = f"layers.{l}."
            parts = [w[p + k] for k in ("q_w", "k_w", "v_w")]
            fused = torch.cat(parts)
            biases = [w.get(p + k) for k in ("q_b", "k_b", "v_b")]
            if any(b is not None for b in biases):
                bias = torch.cat([b if b is not None else fused.new_zeros(t.shape[0]) for b, t in zip(biases, parts)])
                w[p + "qkv_b"] = bias
                for k, b in zip(("q_b", "k_b", "v_b"), bias.split([t.shape[0] for t in parts])):
                    w[p + k] = b
            w[p + "qkv_w"] = fused
            for k, v in zip(("q_w", "k_w", "v_w"), fused.split([t.shape[0] for t in parts])):
                w[p + k] = v
            if cfg.moe_layers[l]:
                keys = ["gate_w"] + (["shared_gate_up", "shared_gate_w"] if cfg.has_shared_expert else [])
                parts = [w[p + k] for k in keys]
                fused = torch.cat(parts)
                w[p + "moe_in_w"] = fused
                for k, v in zip(keys, fused.split([t.shape[0] for t in parts])):
                    w[p + k] = v
                # the router weight is also applied to hidden states outside the forward (lookahead prefetch,
                # calibration): keep it in the compute dtype even when the fused matrix is stored bf16
                w[p + "gate_w"] = w[p + "gate_w"].to(self.dtype)
        self.qkv_split = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]

    # ------------------------------------------------------------------------------ blocks
    def attention(self, l: int, x_TD: torch.Tensor, positions_T: torch.Tensor, cache: KVCache,
                  meta: AttentionMetadata) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{l}."
        T = x_TD.shape[0]
        q, k, v = linear(x_TD, w[p + "qkv_w"], w.get(p + "qkv_b")).split(self.qkv_split, dim=-1)
        if cfg.qk_norm == "full":
            q, k = rms_norm(q, w[p + "q_norm"], cfg.rms_norm_eps), rms_norm(k, w[p + "k_norm"], cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(T, cfg.num_heads, cfg.head_dim)
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "per_head":
            q, k = rms_norm(q, w[p + "q_norm"], cfg.rms_norm_eps), rms_norm(k, w[p + "k_norm"], cfg.rms_norm_eps)
        q = self.rotary.apply(q, positions_T)
        o = cache.attend(l, q, k, v, positions_T, meta, self.rotary, self.scale)  # k pre-RoPE
        return linear(o.reshape(T, cfg.num_heads * cfg.head_dim), w[p + "o_w"], w.get(p + "o_b"))

    def attention_block(self, l: int, h_TD: torch.Tensor, delta_TD: torch.Tensor | None, positions_T: torch.Tensor,
                        cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer l's residual add of `delta` (the previous layer's output) and input norm, attention, residual add and
        post-attention norm in compiled calls where they apply (`actors.model.layers.attention_block`): (h, x), each
        [T, D], or None (the caller goes op by op)."""
        if self.device.type != "cpu":
            return None
        return attention_block(self.cfg, self.w, l, self.rotary, self.scale, h_TD, delta_TD, positions_T, cache, meta)

    def moe(self, l: int, x_TD: torch.Tensor, ctx: StepContext = NO_CONTEXT,
            observer: RoutingObserver = NO_OBSERVER) -> torch.Tensor:
        """Routed experts (+ shared expert) of MoE layer l. Ids of -1 (policies with fewer experts for
        some tokens) carry weight 0 and are never dispatched."""
        y, topk_w, topk_ids, shared_scale, may_pad = self.gate(l, x_TD, ctx.gating)
        if topk_ids.numel():
            self._routed.append((l, topk_ids))
            observer.on_route(l, topk_ids)
        rows, handle = self.dispatcher.dispatch(l, x_TD, topk_ids, may_pad=may_pad,
                                                step_max_tokens=ctx.step_max_tokens)
        y_RD = rows.run(self.experts[l], topk_w)  # this rank's experts, on the rows every rank sent them
        # before `combine`: computed while the other ranks' results travel
        shared = self.shared_expert(l, y, shared_scale)
        out = self.dispatcher.combine(y_RD, handle, topk_w)  # [T, D]
        return out if shared is None else out + shared

    def gate(self, l: int, x_TD: torch.Tensor, gating: GatingBatch | None):
        """MoE layer l's router on x [T, D]: (y [T, E (+ 2 I_s + 1)]: the fused input projection (router logits,
        shared expert gate/up, shared gate), topk_w [T, K'] fp32, topk_ids [T, K'] int64 (-1: padding), shared_scale
        [T] or None, may_pad). The gating router picks when there is a gating batch, else exact top-k."""
        w, p, E = self.w, f"layers.{l}.", self.cfg.num_experts
        y = linear(x_TD, w[p + "moe_in_w"])
        logits = y[:, :E]
        if self.gating_router is not None and gating is not None:
            r = self.gating_router.route(l, logits, x_TD, gating)
            return y, r.weights, r.ids, r.shared_scale, r.may_pad  # [T, K'], [T]
        topk_w, topk_ids = select_experts(logits, self.cfg.top_k, self.cfg.norm_topk_prob)  # [T, K]
        return y, topk_w, topk_ids, None, False

    def shared_expert(self, l: int, y: torch.Tensor, shared_scale: torch.Tensor | None) -> torch.Tensor | None:
        """Layer l's shared expert times its sigmoid gate (and a policy's per-token scale) [T, D], from `gate`'s fused
        projection y, or None without a shared expert; the layer's output is combine + this. One compiled call on
        CPU fp32 with bf16 weights (`kernels.cpu.shared_expert`), else the PyTorch ops."""
        if not self.cfg.has_shared_expert:
            return None
        E, w_down = self.cfg.num_experts, self.w[f"layers.{l}.shared_down"]
        scale = None if shared_scale is None else shared_scale.to(torch.float32)
        out = shared_expert(y, E, w_down, scale) if y.dtype == torch.float32 and y.device.type == "cpu" else None
        if out is not None:
            return out
        sg, su = y[:, E:-1].chunk(2, dim=-1)
        g = torch.sigmoid(y[:, -1:])
        if shared_scale is not None:
            g = g * shared_scale[:, None].to(g.dtype)
        return g * linear(F.silu(sg) * su, w_down)

    # ------------------------------------------------------------------------------ forward
    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, ctx: StepContext = NO_CONTEXT) -> torch.Tensor:
        """Run every layer on the step's flattened tokens; returns final-normed hidden [T, D].

        T may be 0 (a rank with no work still joins every layer's all-to-all). `ctx`: the step's gating batch
        (which sequence each token belongs to), agreed step size and routing observer (`StepContext`).
        """
        cfg, w = self.cfg, self.w
        observer = self.observer if ctx.observer is None else ctx.observer
        observer.begin_step(meta, input_ids_T.shape[0], ctx.gating)
        if (self.two_batch_min is not None and ctx.decode_only and ctx.step_max_tokens is not None
                and ctx.step_max_tokens >= self.two_batch_min and self.dispatcher.overlaps(ctx.step_max_tokens)):
            self.two_batch_steps += 1  # agreed values only: every rank takes this branch together
            return forward_two_batch(self, input_ids_T, positions_T, cache, meta, ctx,
                                     None if observer is NO_OBSERVER else observer)
        h = F.embedding(input_ids_T, w["embed"]).to(self.dtype)
        if h.shape[0] == 0:  # a rank with no tokens only serves its experts to the others: no other op
            return self._forward_empty(h, ctx)
        self._routed = []
        eps = cfg.rms_norm_eps
        y = None  # the previous layer's MLP / MoE output, not yet added to the residual stream h
        for l in range(cfg.num_layers):
            p = f"layers.{l}."
            # a decode step's residual add, input norm, attention, residual add and post-attention norm in one call
            # where it applies (`attention_block`); else each residual add + norm is one call (`kernels.cpu.rms_norm`)
            hx = self.attention_block(l, h, y, positions_T, cache, meta)
            if hx is None:
                h, x = (h, rms_norm(h, w[p + "input_norm"], eps)) if y is None else rms_norm(
                    y, w[p + "input_norm"], eps, residual=h)
                hx = rms_norm(self.attention(l, x, positions_T, cache, meta), w[p + "post_norm"], eps, residual=h)
            h, x = hx
            if cfg.moe_layers[l]:
                observer.on_hidden(l, h)
                y = self.moe(l, x, ctx, observer)
            else:
                y = swiglu_mlp(x, w[p + "mlp_gate_up"], w[p + "mlp_down"])
        self._count_load()
        return rms_norm(y, w["norm"], eps, residual=h)[1]

    def _forward_empty(self, h_0D: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """T == 0: join every MoE layer's dispatch (the collectives pair up across ranks) and run the rows other
        ranks send to this rank's experts; attention, norms and routing of zero tokens are skipped."""
        ids = torch.zeros(0, max(self.cfg.top_k, 1), dtype=torch.int64, device=h_0D.device)
        wts = torch.zeros(0, ids.shape[1], dtype=torch.float32, device=h_0D.device)
        for l in range(self.cfg.num_layers):
            if self.cfg.moe_layers[l]:
                rows, handle = self.dispatcher.dispatch(l, h_0D, ids, may_pad=False,
                                                        step_max_tokens=ctx.step_max_tokens)
                self.dispatcher.combine(rows.run(self.experts[l], wts), handle, wts)
        return h_0D

    def _count_load(self) -> None:
        """Add the step's routed ids of every layer to `expert_load` in one bincount (not one per layer).
        Ids of -1 (padding) land in each layer's bin 0 and are dropped."""
        if not self._routed:
            return
        E1 = self.cfg.num_experts + 1
        flat = torch.cat([ids.reshape(-1) + (l * E1 + 1) for l, ids in self._routed])
        self.expert_load += torch.bincount(flat, minlength=self.cfg.num_layers * E1).view(-1, E1)[:, 1:]
        self._routed = []

    @torch.inference_mode()
    def warm_up(self, rows: int) -> None:
        """Run this rank's kernels once on `rows` rows of zeros and drop the results (vLLM's start-up dummy run,
        without any model state): each dense weight's linear twice (the second packs its panel copy,
        `kernels.cpu.packing`), the local experts' grouped kernel, RMSNorm and a causal attention of that length, so
        the first long prompt a server sees does not pay first-use costs (measured: a first 500-token prefill
        37 ms against ~27 warm). Routing, load counters, KV cache and expert caches are untouched."""
        if rows < 1 or self.device.type != "cpu":
            return
        cfg = self.cfg
        for w in self.w.values():
            if w.dim() == 2 and w.dtype != torch.float32 and w.shape[0] > 1:
                x = torch.zeros(rows, w.shape[1], dtype=self.dtype)
                linear(x, w), linear(x, w)
        x = torch.zeros(rows, cfg.hidden_size, dtype=self.dtype)
        rms_norm(x, torch.ones(cfg.hidden_size, dtype=self.dtype), cfg.rms_norm_eps)
        ids = torch.zeros(rows, 1, dtype=torch.int64)
        for e in self.experts:
            if hasattr(e, "combine_tokens") and getattr(e, "w_gate_up", None) is not None:
                e.combine_tokens(x, ids, torch.ones(rows, 1, dtype=self.dtype))
        q = torch.zeros(1, cfg.num_heads, rows, cfg.head_dim, dtype=self.dtype)
        kv = torch.zeros(1, cfg.num_kv_heads, rows, cfg.head_dim, dtype=self.dtype)
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=cfg.num_kv_heads != cfg.num_heads)

    def logits(self, h_ND: torch.Tensor) -> torch.Tensor:
        """[N, D] final hidden -> [N, V] logits in fp32."""
        return linear(h_ND, self.w["lm_head"]).float()
