"""One rank's engine: scheduler + paged KV cache + model forward + sampling, one step at a time.

`step()` must be called on every rank of the EP group the same number of times (the all-to-all
collectives inside the MoE layers pair up across ranks); a rank with nothing scheduled runs the
forward with zero tokens. The lockstep loop that guarantees this lives in `actors.rank.lockstep`.

Construction order (everything a component needs arrives in its constructor): weights, then the gating router,
the routed experts and their routing observer (`actors.experts` for packed experts), the dispatcher
(with the rank's shared-memory transport, if any), and last the model that holds them. Per-step state (the
gating batch, the agreed step size) reaches the model as a `StepContext` argument. Step planning lives in
`actors.engine.step_plan`, expert placement changes in `actors.engine.eplb`.

Shape legend: T = tokens in the step, N = sequences needing logits, V = vocab.
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from actors.model.attention import AttentionMetadata
from actors.model.config import ModelConfig
from actors.engine.config import EngineConfig
from actors.engine.detokenizer import IncrementalDetokenizer, take_token
from actors.engine.balancing import BalancingMixin
from actors.engine.eplb import PlacementMixin
from actors.engine.grammar import grammar_state
from actors.engine.logprobs import step_logprobs
from actors.engine.penalties import SequenceControls
from actors.engine.step_plan import StepPlan, build_gating_batch, build_metadata, sampled_rows
from actors.moe.dispatch import AllToAllDispatcher
from actors.moe.experts import Experts, local_experts
from actors.moe.placement import ExpertPlacement
from actors.kv.builder import build_kv_cache, build_prefix_cache
from actors.engine.messages import GenerateRequest, TokenOutput
from actors.model.model import NO_OBSERVER, MoEModel, RoutingObserver, StepContext
from actors.engine.sampler import make_generator, sample
from actors.engine.sampling import KV_PROFILE_AUTO, SamplingParams
from actors.engine.scheduler import Scheduler, Sequence
from actors.model.weights import load_rank_weights
from kernels.cpu import cpu_kernels_available, parallel
from actors.moe.gating import GatingBatch
from actors.moe.gating_router import GatingRouter


class RankEngine(PlacementMixin, BalancingMixin):
    """Model shard, KV cache and scheduler of one rank.

    Args:
        cfg: engine settings. placement: which experts this rank holds. rank: this rank. group: the EP process
            group (None: world size 1, or the default group). shm: the rank's same-node shared-memory transport
            (`actors.rank.shm_collective.ShmAllToAll`, built by the rank actor; None: torch.distributed only).

    Thread-safety: `add_request`/`abort` may be called from other threads; `step` from one thread.

    Raises:
        ValueError: if the KV budget cannot hold one `max_model_len` sequence, or max_model_len
            exceeds the model's position limit.
    """

    def __init__(self, cfg: EngineConfig, placement: ExpertPlacement, rank: int = 0, group=None, *, shm=None):
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
        # one gating-state slot per concurrent sequence, plus a scratch slot for prompt scoring
        router = GatingRouter(
            cfg.gating_config(), num_layers=mc.num_layers, num_experts=max(mc.num_experts, 1), top_k=max(mc.top_k, 1),
            renormalize=mc.norm_topk_prob, hidden=mc.hidden_size, num_slots=cfg.max_num_seqs + 1,
            has_shared_expert=mc.has_shared_expert, device=self.device)
        experts, self.expert_runtime = self._build_experts(weights, local, router)
        self.dispatcher = AllToAllDispatcher(placement, rank, group, device=self.device, shm=shm,
                                             max_experts_per_token=router.state.k_max)
        self.model = MoEModel(mc, weights, self.dispatcher, experts, gating_router=router,
                              observer=NO_OBSERVER if self.expert_runtime is None else self.expert_runtime,
                              max_positions=cfg.max_model_len,
                              two_batch_min=cfg.tbo_min_batch if cfg.two_batch_overlap else None)
        self._free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        self.cache = build_kv_cache(cfg, mc, self.device)
        self.scheduler = Scheduler(self.cache.allocator, cfg.block_size, cfg.max_num_seqs, cfg.max_batched_tokens,
                                   cfg.enable_chunked_prefill, build_prefix_cache(cfg, self.cache),
                                   max_mixed_tokens=cfg.max_mixed_tokens)
        self.tokenizer = Tokenizer.from_file(f"{cfg.model}/tokenizer.json")
        self.eos = set(mc.eos_token_ids)
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self.outputs: list[TokenOutput] = []
        self._kv_profile_of: dict[str, str] = {}  # request id -> KV quantization profile (quantized cache only)
        self.timing = {"steps": 0, "forward_s": 0.0, "schedule_s": 0.0, "sample_s": 0.0, "sync_s": 0.0}

    # ------------------------------------------------------------------------ seams
    def _build_experts(self, weights: dict, local: list[list[int]], router: GatingRouter):
        """(per-layer `Experts`, None for dense layers; the runtime behind them or None), before the model.

        Packed experts + expert cache + prefetch (`actors.experts`) when weight_bits is set or the model
        folder is a packed checkpoint: the runtime holds them and is the model's routing observer. Otherwise
        full-precision `LocalExperts` over `weights` and no runtime.
        """
        from actors.experts.build import build_engine_experts

        rt = build_engine_experts(self.cfg, self.model_cfg, weights, local, dtype=self.cfg.torch_dtype,
                                  device=self.device, gating_router=router)
        experts: list[Experts | None] = local_experts(self.model_cfg.moe_layers, weights) if rt is None else rt.layers
        return experts, rt

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
        seq = Sequence(request_id=req.request_id, prompt_ids=list(req.prompt_ids), params=params,
                       generator=make_generator(params.seed) if params.temperature > 0 else None,
                       detok=IncrementalDetokenizer(self.tokenizer, params.stop, params.min_tokens), arrival=req.arrival,
                       prompt_lp=None if params.prompt_logprobs is None else [None],
                       kv_profile=self._kv_profile_of.get(req.request_id))
        seq.controls = SequenceControls.of(params, seq.prompt_ids, seq.output_ids, self.eos)
        if params.grammar is not None:  # built here, off the step thread (a large grammar takes milliseconds)
            seq.grammar = grammar_state(f"{self.cfg.model}/tokenizer.json", self.model_cfg.vocab_size,
                                        tuple(sorted(self.eos)), params.grammar)  # never raises
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

    def fail_all(self, err: str) -> list[TokenOutput]:
        """Fail every request this engine holds (queued, waiting or running) after a fatal error (a dead peer, a bug),
        freeing their KV blocks and per-request state. Returns one `finish_reason="error"` output with `err` each."""
        self._drain_inbox()
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        outs = []
        for s in seqs:
            self.scheduler.abort(s.request_id)
            self._release(s.request_id)
            outs.append(TokenOutput(request_id=s.request_id, finish_reason="error", error=err))
        return outs

    # ------------------------------------------------------------------------ step
    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Schedule, run one forward (possibly with zero tokens), sample, emit outputs. For callers that drive
        engines directly (tests, benchmarks): with a group, the `balanced` load is summed over it by one
        all_reduce here; the lockstep loop (`run`) carries it in its step agreement instead."""
        out = self.run(self.plan())
        if self.group is not None:
            load = self.take_balance_load()
            if load is None:
                load = torch.zeros(self.balance_width, dtype=torch.int64, device=self.device)
            dist.all_reduce(load, group=self.group)
            self.apply_balance_load(load)
        return out

    def plan(self, schedule: bool = True) -> StepPlan:
        """Take new requests and aborts, schedule the step and build its metadata. schedule=False: an empty step."""
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
        ids, pos, meta = build_metadata(prefills, decodes, self.cfg.block_size, self.device)
        seqs = prefills + decodes
        gating = build_gating_batch(seqs, pos, meta, slot_of=self._slot_of, free_slots=self._free_slots,
                                    running=self.scheduler.running, default=self.model.gating_router.cfg.policy,
                                    dev=self.device)
        sampled, rows, scored = sampled_rows(prefills, decodes, meta, self.device)
        plan = StepPlan(seqs=seqs, ids=ids, pos=pos, meta=meta, gating=gating, sampled=sampled, logit_rows=rows,
                        prompt_rows=scored)
        self.timing["schedule_s"] += time.perf_counter() - t0
        return plan

    @torch.inference_mode()
    def run(self, plan: StepPlan, max_tokens_per_rank: int | None = None, decode_only: bool = False
            ) -> list[TokenOutput]:
        """Forward the planned step, sample, return the outputs. `max_tokens_per_rank`: the largest token count
        of this step on any rank of the EP group (agreed by the lockstep loop), which lets the dispatcher use
        fixed-capacity all-to-alls; None: unknown (counts are exchanged). `decode_only`: agreed, no rank has a
        prefill in this step (two-batch overlap may run, `two_batch_overlap`)."""
        seqs, meta = plan.seqs, plan.meta
        ctx = StepContext(gating=plan.gating, step_max_tokens=max_tokens_per_rank, decode_only=decode_only)
        t1 = time.perf_counter()
        h = self.model.forward(plan.ids, plan.pos, self.cache, meta, ctx)
        t2 = time.perf_counter()
        for seq in seqs:
            seq.num_cached += seq.num_scheduled  # the step's K/V are in the cache now
        seqs = plan.sampled  # a sequence mid-prefill gets no token (and needs no logits) until its last chunk
        if seqs or plan.prompt_rows:
            if plan.logit_rows is not None:
                h = h[plan.logit_rows]
            # decode only: token i is sequence i's one new token, so every row is a last row, in order
            logits = self.model.logits(h).cpu()  # [N + Q, V]: sampled rows, then prompt-scoring rows
            toks, errors = sample(logits[:len(seqs)], [s.params for s in seqs], [s.generator for s in seqs],
                                  [s.controls for s in seqs],  # logit controls: `actors.engine.penalties`
                                  [s.grammar for s in seqs])  # token masks: `actors.engine.grammar`
            for i, err in errors.items():  # that request ends; the others keep their tokens (toks[i] = -1)
                self._end(seqs[i], err=err)
            lps = step_logprobs(logits, seqs, toks, plan.prompt_rows) or [None] * len(seqs)
            for seq, tok, lp in zip(seqs, toks, lps):
                self._append(seq, tok, lp)
        t3 = time.perf_counter()
        self.timing["steps"] += 1
        if self.group is None:  # alone: the step's `balanced` load is the group's (else see `take_balance_load`)
            self._update_bias_alone()
        self.timing["forward_s"] += t2 - t1
        self.timing["sample_s"] += t3 - t2
        parallel.park()  # the step's compute is done: helper threads stop spinning for its next call
        out, self.outputs = self.outputs, []
        return out

    def _append(self, seq: Sequence, tok: int, lp: list | None = None) -> None:
        """Emit `seq`'s sampled token (`take_token`'s rules) and its logprob entry `lp`, with the prompt's logprobs
        in its first output; tok < 0: the sampler failed the row, `run` ended it. max_tokens 0: the prompt only."""
        if tok < 0:
            return
        first, ids, text, reason = not seq.output_ids, [], "", "length"
        try:
            if seq.params.max_tokens:
                ids, text, reason = take_token(seq, tok, self.eos, self.cfg.max_model_len)
        except Exception as e:  # a bug in one sequence's state ends that request, never the step
            return self._end(seq, err=f"output handling failed: {e!r:.300}")
        out = TokenOutput(request_id=seq.request_id, token_ids=ids, text=text, finish_reason=reason,
                          prompt_tokens=len(seq.prompt_ids), num_preemptions=seq.num_preemptions,
                          logprobs=None if lp is None else [lp][:len(ids)], prompt_logprobs=seq.prompt_lp if first else None)
        if reason is not None:
            return self._end(seq, out)
        self.outputs.append(out)

    def _end(self, seq: Sequence, out: TokenOutput | None = None, err: str | None = None) -> None:
        """Finish `seq` (KV blocks, gating slot, KV profile freed) with its last output: `out`, or error `err`."""
        self._release(seq.request_id)
        self.scheduler.finish(seq)
        self.outputs.append(out or TokenOutput(request_id=seq.request_id, finish_reason="error", error=err,
                                               prompt_tokens=len(seq.prompt_ids), num_preemptions=seq.num_preemptions))

    # ------------------------------------------------------------------------ utilities
    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int], observer: RoutingObserver | None = None) -> torch.Tensor:
        """Logits [L, V] (fp32) at every prompt position, through the paged cache (world_size 1 only).
        `observer`: this forward's routing observer in place of the model's (calibration records routing)."""
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
            h = self.model.forward(torch.tensor(prompt_ids, device=dev), pos, self.cache, meta,
                                   StepContext(gating=scratch, observer=observer))
            self._update_bias_alone()  # one step of `balanced`: the prompt's load
            return self.model.logits(h).cpu()
        finally:
            self.cache.allocator.free_all(blocks)

    def stats(self) -> dict:
        """This rank's counters; `kv_memory` (bytes, blocks, effective bits: the cache's `memory_stats()`) only
        when the KV cache reports it (the quantized cache does). kv_blocks_free: blocks no sequence holds
        (free + used = total; all free when idle, except on a quantized cache with prefix caching: up to
        max_num_seqs ended sequences stay as prefix sources, `prefix_cache_sources`, until their pages are needed).
        kv_blocks_admissible: what the scheduler may hand out now;
        below kv_blocks_free on a quantized cache, whose page pool keeps a page in reserve."""
        a = self.cache.allocator
        out = {
            "rank": self.rank,
            "expert_load": self.model.expert_load.tolist(),
            "kv_blocks_total": a.num_blocks, "kv_blocks_free": a.num_blocks - a.num_used,
            "kv_blocks_admissible": a.num_free,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "comm_s": self.dispatcher.comm_s, "two_batch_steps": self.model.two_batch_steps, **self.timing,
            **(self.scheduler.prefix.stats() if self.scheduler.prefix is not None else {}),
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
