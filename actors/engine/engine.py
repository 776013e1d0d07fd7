"""One rank's engine: scheduler + paged KV cache + model forward + sampling, one step at a time.

`step()` must be called on every rank of the EP group the same number of times (the all-to-all
collectives inside the MoE layers pair up across ranks); a rank with nothing scheduled runs the
forward with zero tokens. The lockstep loop that guarantees this lives in `actors.rank.worker`.

Shape legend: T = tokens in the step, N = sequences needing logits, V = vocab.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from actors.model.attention import AttentionMetadata
from actors.model.config import ModelConfig
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.moe.dispatch import AllToAllDispatcher, ExpertPlacement
from actors.kv.paged import PagedKVCache
from actors.engine.messages import GenerateRequest, TokenOutput
from actors.model.model import MoEModel
from actors.engine.sampling import KV_PROFILE_AUTO, SamplingParams, sample
from actors.engine.scheduler import Scheduler, Sequence
from actors.model.weights import load_rank_weights
from kernels.cpu import cpu_kernels_available
from actors.moe.gating import POLICIES, GatingBatch, GatingConfig, GatingRouter

# engine steps between averagings of the `balanced` gating bias over the EP group (see `_sync_balancing_bias`)
BIAS_SYNC_STEPS = 16


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Per-rank engine settings (validated).

    kv_cache_bytes: KV memory budget of this rank in bytes. block_size: tokens per KV block.
    max_model_len: prompt + output tokens per sequence at most. dtype: compute dtype name.
    weight_storage: "auto" keeps the weight matrices of a bf16 checkpoint in bf16 when computing in fp32 on
    CPU and the bf16-weight kernel is available (`kernels.cpu`: same values, half the bytes read per
    decode step); "compute" casts every weight to `dtype`.
    """

    model: str
    dtype: str = "float32"
    weight_storage: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 64 * 2**20
    max_model_len: int = 1024
    max_num_seqs: int = 64
    max_batched_tokens: int = 4096
    num_threads: int = 0  # 0: leave torch's default
    kernel_backend: str = "torch"  # "torch" (PyTorch reference) | "triton"
    # KV cache: kv_bits None = full precision; 2/3/4 = quantized with profile `kv_profile`
    kv_bits: int | None = None
    kv_profile: str | None = None
    # further widths served from the same page pool; a request picks one by naming "<profile>-<b>bit"
    kv_extra_bits: tuple[int, ...] = ()
    # routed experts: weight_bits None = as in the checkpoint; 2/3/4 = packed at load time
    weight_bits: int | None = None
    weight_group_size: int = 64
    expert_cache_capacity: int | None = None  # experts per layer kept dequantized (None: 0 on CPU, else all)
    prefetch: str = "none"  # expert prefetch predictor name
    # packed experts per layer kept in memory (None: all); fewer are read on demand from the memory-mapped
    # packed checkpoint (the cold tier, actors.experts.store.ColdExpertTier)
    resident_experts: int | None = None
    # gating policy of the deployment (actors.moe.gating.POLICIES) and its knobs (GatingConfig)
    gating: str = "exact"
    gating_options: dict | None = None
    device: str = "auto"  # "auto": cuda if available (the actor's visible GPU), else cpu

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if self.weight_storage not in ("auto", "compute"):
            raise ValueError(f"weight_storage={self.weight_storage!r} must be auto or compute")
        if self.kernel_backend not in ("torch", "triton"):
            raise ValueError(f"kernel_backend={self.kernel_backend!r} must be torch or triton")
        for name in ("kv_bits", "weight_bits"):
            b = getattr(self, name)
            if b is not None and b not in (2, 3, 4):
                raise ValueError(f"{name}={b} must be 2, 3 or 4 (or unset for full precision)")
        self.kv_extra_bits = tuple(self.kv_extra_bits or ())
        if any(b not in (2, 3, 4) for b in self.kv_extra_bits):
            raise ValueError(f"kv_extra_bits={list(self.kv_extra_bits)}: each must be 2, 3 or 4")
        if self.kv_extra_bits and self.kv_bits is None:
            raise ValueError("kv_extra_bits needs kv_bits (the default width) to be set")
        if self.resident_experts is not None and self.resident_experts < 1:
            raise ValueError(f"resident_experts={self.resident_experts} must be >= 1 (or unset: all resident)")
        for name in ("block_size", "kv_cache_bytes", "max_model_len", "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        self.gating_config()  # validates policy and options

    def gating_config(self) -> GatingConfig:
        """The deployment's `GatingConfig` (the fused selection kernel follows `kernel_backend`).

        Raises:
            ValueError: unknown policy or option, or an out-of-range knob.
        """
        return GatingConfig.from_options(self.gating, self.gating_options, backend=self.kernel_backend)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass(kw_only=True, slots=True)
class StepPlan:
    """One scheduled step: its sequences (prefills first), flattened token ids [T] and positions [T] (int64),
    attention metadata and gating batch. `num_tokens` = T."""

    seqs: list[Sequence]
    ids: torch.Tensor
    pos: torch.Tensor
    meta: AttentionMetadata
    gating: GatingBatch

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()


class RankEngine:
    """Model shard, KV cache and scheduler of one rank.

    Thread-safety: `add_request`/`abort` may be called from other threads; `step` from one thread.

    Raises:
        ValueError: if the KV budget cannot hold one `max_model_len` sequence, or max_model_len
            exceeds the model's position limit.
    """

    def __init__(self, cfg: EngineConfig, placement: ExpertPlacement, rank: int = 0, group=None):
        self.cfg = cfg
        self.rank = rank
        self.model_cfg = ModelConfig.from_pretrained(cfg.model)
        mc = self.model_cfg
        if cfg.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        dtype = cfg.torch_dtype
        local = [placement.local_experts(l, rank) for l in range(mc.num_layers)]
        self.device = cfg.torch_device
        self.keep_bf16 = (cfg.weight_storage == "auto" and dtype == torch.float32 and self.device.type == "cpu"
                          and cpu_kernels_available())
        weights = {k: v.to(self.device) for k, v in load_rank_weights(cfg.model, mc, local, dtype, self.keep_bf16).items()}
        self.group = group
        self.dispatcher = AllToAllDispatcher(placement, rank, group, device=self.device)
        self.model = MoEModel(mc, weights, self.dispatcher, max_positions=cfg.max_model_len)
        self.model.experts = self._build_experts(weights, local)
        # one gating-state slot per concurrent sequence, plus a scratch slot for prompt scoring
        self.model.gating_router = GatingRouter(
            cfg.gating_config(), num_layers=mc.num_layers, num_experts=max(mc.num_experts, 1), top_k=max(mc.top_k, 1),
            renormalize=mc.norm_topk_prob, hidden=mc.hidden_size, num_slots=cfg.max_num_seqs + 1,
            has_shared_expert=mc.has_shared_expert, device=self.device)
        self.dispatcher.max_experts_per_token = self.model.gating_router.state.k_max
        self._free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        self.cache = self._build_kv_cache()
        self.scheduler = Scheduler(self.cache.allocator, cfg.block_size, cfg.max_num_seqs, cfg.max_batched_tokens)
        self.tokenizer = Tokenizer.from_file(f"{cfg.model}/tokenizer.json")
        self.eos = set(mc.eos_token_ids)
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self.outputs: list[TokenOutput] = []
        self._kv_profile_of: dict[str, str] = {}  # request id -> KV quantization profile (quantized cache only)
        self.timing = {"steps": 0, "forward_s": 0.0, "schedule_s": 0.0, "sample_s": 0.0, "sync_s": 0.0}

    # ------------------------------------------------------------------------ seams
    def _build_kv_cache(self):
        """The KV cache behind `actors.kv.paged.KVCache` (full precision unless kv_bits is set)."""
        cfg, mc, dtype = self.cfg, self.model_cfg, self.cfg.torch_dtype
        if cfg.kv_bits is not None:
            from actors.kv.quantized import build_engine_kv_cache

            return build_engine_kv_cache(cfg, mc)
        per_block = PagedKVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        num_blocks = cfg.kv_cache_bytes // per_block
        need = -(-cfg.max_model_len // cfg.block_size)
        if num_blocks < need:
            raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} holds {num_blocks} blocks of {per_block} bytes; "
                             f"one max_model_len={cfg.max_model_len} sequence needs {need}")
        return PagedKVCache(mc.num_layers, num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim, dtype, self.device)

    def _build_experts(self, weights: dict, local: list[list[int]]) -> list:
        """Per-layer callables `(x [R, D], local_ids [R]) -> y [R, D]` (None for dense layers).

        Packed experts + expert cache + prefetch (`actors.experts.store`) when weight_bits is set or the model
        folder is a packed checkpoint; `self.expert_runtime` then holds them (None otherwise).
        """
        from actors.experts.store import build_engine_experts

        self.expert_runtime = build_engine_experts(self.cfg, self.model_cfg, self.model, weights, local)
        if self.expert_runtime is None:
            return self.model.experts
        return self.expert_runtime.layers

    # ------------------------------------------------------------------------ expert placement (EPLB)
    def prepare_placement(self, placement: ExpertPlacement) -> dict[str, torch.Tensor]:
        """Read this rank's experts under `placement` (full precision, stored as at start-up, on the device) without
        touching the running engine, so it may run on another thread while steps go on.

        Experts this rank already holds are copied from memory (plain path); the others are read from the
        checkpoint (`actors.model.weights`, only their slices). Returns {layers.{l}.w_gate_up [E_loc, 2I, D],
        layers.{l}.w_down [E_loc, D, I]} per MoE layer (E_loc = 0 for a packed checkpoint: the expert store
        reads those itself). Raises ValueError if the placement's world size or layer count does not match.
        """
        from actors.model.weights import CheckpointReader, load_expert_weights

        mc, dtype = self.model_cfg, self.cfg.torch_dtype
        old = self.dispatcher.placement
        if placement.world_size != old.world_size or placement.num_layers != mc.num_layers:
            raise ValueError(f"placement world_size={placement.world_size}, layers={placement.num_layers}; "
                             f"engine has world_size={old.world_size}, layers={mc.num_layers}")
        reader = CheckpointReader(self.cfg.model)
        out: dict[str, torch.Tensor] = {}
        for l in range(mc.num_layers):
            if not mc.moe_layers[l]:
                continue
            new = placement.local_experts(l, self.rank)
            key_gu, key_dn = f"layers.{l}.w_gate_up", f"layers.{l}.w_down"
            held = {g: i for i, g in enumerate(old.local_experts(l, self.rank))}
            if key_gu in self.model.w and self.model.w[key_gu].shape[0] == len(held) and all(g in held for g in new):
                rows = torch.tensor([held[g] for g in new], dtype=torch.int64, device=self.device)
                out[key_gu], out[key_dn] = self.model.w[key_gu][rows].clone(), self.model.w[key_dn][rows].clone()
                continue
            gu, dn = load_expert_weights(reader, mc, l, new, dtype, self.keep_bf16)
            out[key_gu], out[key_dn] = gu.to(self.device), dn.to(self.device)
        return out

    def apply_placement(self, placement: ExpertPlacement, prepared: dict[str, torch.Tensor] | None = None) -> None:
        """Switch this rank to `placement`: its expert shard, the experts seam and the dispatcher tables.

        Call on the step thread between steps, on every rank at the same step (`actors.rank.worker` does);
        sequences, KV cache and non-expert weights are untouched, so no request is lost. `prepared`: the
        result of `prepare_placement(placement)` (read now if None). The packed path (weight_bits or a
        packed checkpoint) rebuilds its expert store; its cache and prefetch statistics start over.
        """
        from actors.moe.experts import LocalExperts

        if prepared is None:
            prepared = self.prepare_placement(placement)
        mc = self.model_cfg
        local = [placement.local_experts(l, self.rank) for l in range(mc.num_layers)]
        if self.expert_runtime is not None:
            self.expert_runtime.wait_idle()
            self.expert_runtime.detach()
        else:
            self.model.w.update(prepared)
        self.model.experts = [LocalExperts(prepared[f"layers.{l}.w_gate_up"], prepared[f"layers.{l}.w_down"])
                              if mc.moe_layers[l] else None for l in range(mc.num_layers)]
        self.model.experts = self._build_experts(dict(prepared), local)
        self.dispatcher.set_placement(placement)

    # ------------------------------------------------------------------------ requests
    def add_request(self, req: GenerateRequest) -> None:
        """Queue one request (any thread). `params.kv_profile` picks the sequence's KV quantization profile
        (None: the engine's `kv_profile`; "auto": by the prompt text); the choice holds until it finishes.

        Raises:
            ValueError: bad sampling params; `kv_profile` not loaded, or a named one on a full-precision cache.
        """
        params = SamplingParams.from_dict(req.params)
        if hasattr(self.cache, "choose_profile"):
            auto = (params.kv_profile or self.cache.default_profile) == KV_PROFILE_AUTO
            text = self.tokenizer.decode(list(req.prompt_ids)) if auto else None  # only `auto` reads the text
            self._kv_profile_of[req.request_id] = self.cache.choose_profile(params.kv_profile, text)
        elif params.kv_profile not in (None, KV_PROFILE_AUTO):
            raise ValueError(f"kv_profile={params.kv_profile!r} needs a quantized KV cache (kv_bits is unset)")
        gen = None
        if params.temperature > 0:
            gen = torch.Generator()
            gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))
        seq = Sequence(request_id=req.request_id, prompt_ids=list(req.prompt_ids), params=params,
                       detok=IncrementalDetokenizer(self.tokenizer, params.stop), generator=gen, arrival=req.arrival)
        with self._lock:
            self._inbox.append(seq)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts) or self.scheduler.has_work

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for rid in aborts:
            self._release(rid)
        for seq in inbox:
            if seq.request_id in aborts:
                aborts.discard(seq.request_id)
                self.outputs.append(TokenOutput(request_id=seq.request_id, finish_reason="abort"))
                continue
            self.scheduler.add(seq)
        for rid in aborts:
            if self.scheduler.abort(rid) is not None:
                self.outputs.append(TokenOutput(request_id=rid, finish_reason="abort"))

    def _release(self, rid: str) -> None:
        """Per-request state off the KV cache: the KV profile and the gating slot."""
        self._kv_profile_of.pop(rid, None)
        slot = self._slot_of.pop(rid, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _gating_batch(self, seqs: list[Sequence], pos: torch.Tensor, meta: AttentionMetadata) -> GatingBatch:
        """Token -> gating slot (and per-request policy) for this step; tokens are laid out as in `_metadata`."""
        counts = [n for _, n, _, _ in meta.prefills] + [1] * (len(seqs) - len(meta.prefills))
        slots, pols, default = [], [], self.model.gating_router.cfg.policy
        for seq in seqs:
            slot = self._slot_of.get(seq.request_id)
            if slot is None:
                if not self._free_slots:  # preempted sequences restart at position 0: their slots are stale
                    live = {s.request_id for s in self.scheduler.running} | {s.request_id for s in seqs}
                    for rid in [r for r in self._slot_of if r not in live]:
                        self._free_slots.append(self._slot_of.pop(rid))
                slot = self._slot_of[seq.request_id] = self._free_slots.pop()
            slots.append(slot)
            pols.append(POLICIES.index(seq.params.gating or default))
        dev = self.device
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

    # ------------------------------------------------------------------------ step
    def _metadata(self, prefills: list[Sequence], decodes: list[Sequence]):
        bs = self.cfg.block_size
        ids, pos, slots = [], [], []
        pf_meta = []
        for seq in prefills:
            toks = seq.all_ids
            start = len(ids)
            ids += toks
            pos += range(len(toks))
            slots += [seq.block_table[i // bs] * bs + i % bs for i in range(len(toks))]
            pf_meta.append((start, len(toks), len(toks), torch.tensor(seq.block_table, dtype=torch.int64)))
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
        dev = self.device
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

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Schedule, run one forward (possibly with zero tokens), sample, emit outputs."""
        return self.run(self.plan())

    def plan(self, schedule: bool = True) -> StepPlan:
        """Take new requests and aborts, schedule this step's batch and build its metadata. schedule=False: an
        empty step (a rank that joins the others' collectives while taking nothing new)."""
        t0 = time.perf_counter()
        if schedule:
            self._drain_inbox()
            batch = self.scheduler.schedule()
            for seq, err in batch.failed:
                self._release(seq.request_id)
                self.outputs.append(TokenOutput(request_id=seq.request_id, finish_reason="error", error=err))
            for seq in batch.prefills:
                if seq.request_id in self._kv_profile_of:
                    self.cache.bind(seq.block_table[0], self._kv_profile_of[seq.request_id])
            prefills, decodes = batch.prefills, batch.decodes
        else:
            prefills, decodes = [], []
        ids, pos, meta = self._metadata(prefills, decodes)
        seqs = prefills + decodes
        plan = StepPlan(seqs=seqs, ids=ids, pos=pos, meta=meta, gating=self._gating_batch(seqs, pos, meta))
        self.timing["schedule_s"] += time.perf_counter() - t0
        return plan

    @torch.inference_mode()
    def run(self, plan: StepPlan, max_tokens_per_rank: int | None = None) -> list[TokenOutput]:
        """Forward the planned step, sample, return the outputs. `max_tokens_per_rank`: the largest token count
        of this step on any rank of the EP group (agreed by the lockstep loop), which lets the dispatcher use
        fixed-capacity all-to-alls; None: unknown (counts are exchanged)."""
        seqs, meta = plan.seqs, plan.meta
        self.dispatcher.step_max_tokens = max_tokens_per_rank
        t1 = time.perf_counter()
        h = self.model.forward(plan.ids, plan.pos, self.cache, meta, plan.gating)
        t2 = time.perf_counter()
        if seqs:
            if meta.prefills:
                last = [s + n - 1 for s, n, _, _ in meta.prefills] + meta.decode_tokens.tolist()
                h = h[torch.tensor(last, dtype=torch.int64, device=self.device)]
            # decode only: token i is sequence i's one new token, so every row is a last row, in order
            logits = self.model.logits(h).cpu()
            toks = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            for seq, tok in zip(seqs, toks):
                seq.num_cached = seq.length
                self._append(seq, tok)
        t3 = time.perf_counter()
        self.timing["steps"] += 1
        if self.group is not None and self.timing["steps"] % BIAS_SYNC_STEPS == 0:
            self._sync_balancing_bias()
        self.timing["forward_s"] += t2 - t1
        self.timing["sample_s"] += t3 - t2
        out, self.outputs = self.outputs, []
        return out

    def _sync_balancing_bias(self) -> None:
        """Average the `balanced` policy's per-expert bias over the EP group (one all_reduce of [L, E] fp32).

        Each rank updates its bias from the loads of its own tokens; averaging every BIAS_SYNC_STEPS steps makes
        the correction follow the cluster's expert load (what the experts, sharded over all ranks, actually
        see) and keeps every rank's selection bias the same. Every rank runs the same number of steps, so
        every rank joins this collective at the same step."""
        bias = self.model.gating_router.bias
        dist.all_reduce(bias, op=dist.ReduceOp.SUM, group=self.group)
        bias /= dist.get_world_size(self.group)

    def _append(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        is_eos = tok in self.eos and not p.ignore_eos
        reason = None
        text = ""
        if is_eos:
            reason = "stop"
        else:
            seq.output_ids.append(tok)
            text, stopped = seq.detok.add(tok)
            if stopped or tok in p.stop_token_ids:
                reason = "stop"
            elif len(seq.output_ids) >= p.max_tokens or seq.length >= self.cfg.max_model_len:
                reason = "length"
        if reason is not None:
            self._release(seq.request_id)
            if not seq.detok.stopped:
                text += seq.detok.flush()
            self.scheduler.finish(seq)
        self.outputs.append(TokenOutput(request_id=seq.request_id, token_ids=[] if is_eos else [tok], text=text,
                                        finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
                                        num_preemptions=seq.num_preemptions))

    # ------------------------------------------------------------------------ utilities
    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [L, V] (fp32) at every prompt position, through the paged cache (world_size 1 only)."""
        bs, dev = self.cfg.block_size, self.device
        n = len(prompt_ids)
        blocks = [self.cache.allocator.allocate() for _ in range(-(-n // bs))]
        try:
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([blocks[i // bs] * bs + i % bs for i in range(n)], dtype=torch.int64, device=dev),
                decode_tokens=torch.zeros(0, dtype=torch.int64, device=dev),
                decode_block_tables=torch.zeros(0, 0, dtype=torch.int64, device=dev),
                decode_context_lens=torch.zeros(0, dtype=torch.int64, device=dev),
                prefills=[(0, n, n, torch.tensor(blocks, dtype=torch.int64, device=dev))])
            pos = torch.arange(n, device=dev)
            scratch = GatingBatch(slots_T=torch.full((n,), self.cfg.max_num_seqs, dtype=torch.int64, device=dev),
                                  positions_T=pos)
            h = self.model.forward(torch.tensor(prompt_ids, device=dev), pos, self.cache, meta, scratch)
            return self.model.logits(h).cpu()
        finally:
            self.cache.allocator.free_all(blocks)

    def stats(self) -> dict:
        """This rank's counters; `kv_memory` (bytes, blocks, effective bits: the cache's `memory_stats()`) only
        when the KV cache reports it (the quantized cache does). kv_blocks_free: blocks no sequence holds
        (free + used = total; all free when idle). kv_blocks_admissible: what the scheduler may hand out now;
        below kv_blocks_free on a quantized cache, whose page pool keeps a page in reserve."""
        a = self.cache.allocator
        out = {
            "rank": self.rank,
            "expert_load": self.model.expert_load.tolist(),
            "kv_blocks_total": a.num_blocks, "kv_blocks_free": a.num_blocks - a.num_used,
            "kv_blocks_admissible": a.num_free,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "comm_s": self.dispatcher.comm_s, **self.timing,
            "routing": self.model.gating_router.stats(),
        }
        if hasattr(self.cache, "memory_stats"):
            for _ in range(3):  # the step thread may add or drop a sequence mid-read: read again
                try:
                    out["kv_memory"] = self.cache.memory_stats()
                    break
                except RuntimeError:
                    continue
        return out
