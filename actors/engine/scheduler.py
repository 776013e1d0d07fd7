"""Continuous batching on one rank: sequences, admission, chunked prefill, KV-block budgeting and preemption.

Each step computes at most `max_batched_tokens` new tokens (vLLM's `--max-num-batched-tokens`), and at most
`max_mixed_tokens` while any sequence decodes (a prompt arriving at an idle rank takes big chunks, one beside running
streams keeps their steps short: the budget exists for their inter-token latency), in this order:
  1. decodes: every running sequence with one token left to compute (its newest token) gets a slot. When
     one needs a new block and none is free, the most recently admitted running sequence is preempted: its
     blocks are freed and it goes back to the front of the queue, to be recomputed (prompt + tokens generated
     so far) when memory frees up;
  2. with `enable_chunked_prefill` (vLLM's `--enable-chunked-prefill`, the default), the rest of the budget
     goes to prefill chunks: first the running sequences part-way through their prefill (oldest first), then
     waiting sequences admitted FIFO while their whole length fits in free KV blocks and the running set
     allows. A chunk is the next min(tokens left, budget left) tokens of the sequence; the sequence holds
     its blocks across chunks, `num_cached` advances by the chunk once the step ran, and it gets no token
     until the step that computes its last position (whose logits are sampled). A sequence whose last chunk
     would be one token is scheduled as a decode of that token (same position, context and result).
     Without chunking, a waiting sequence's whole prompt is one prefill; one longer than the budget is
     still admitted when it is the step's first prefill, so nothing starves.
Admission allocates the blocks of the sequence's whole current length (so a sequence mid-prefill never
waits for blocks; only decode growth preempts it). A sequence that could never fit is failed, never left to
wait forever.
With a prefix cache (`prefix`: actors/kv/prefix_cache.py, actors/kv/quantized_prefix.py) admission first looks
up the sequence's longest cached prefix: its blocks are shared and the sequence starts at num_cached = the
cached tokens (at most length - 1, so the last position is computed and sampled); full blocks are committed
to the cache once computed (every `schedule`, and before a sequence's blocks are freed); cached blocks nobody
holds are evicted before any running sequence is preempted.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from actors.engine.detokenizer import IncrementalDetokenizer
from actors.kv.allocator import BlockAllocator
from actors.engine.sampling import SamplingParams


@dataclass(kw_only=True, slots=True, eq=False)
class Sequence:
    """One request on a rank: prompt and output token ids, its block table and sampling state."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    generator: random.Random | None = None  # its uniform stream (`sampler.make_generator`); None: greedy
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    num_scheduled: int = 0  # tokens this step computes: positions [num_cached, num_cached + num_scheduled)
    num_preemptions: int = 0
    arrival: float = 0.0
    # with `params.prompt_logprobs`: [None, then one `TokenLogprob` per prompt token scored so far]; else None
    prompt_lp: list | None = None
    controls: object | None = None  # its logit-control state (`actors.engine.penalties.SequenceControls`), or None
    grammar: object | None = None  # its grammar state (`actors.engine.grammar.GrammarState`), or None
    kv_profile: str | None = None  # the quantized cache's profile for this sequence (part of its block hashes)
    block_hashes: list = field(default_factory=list)  # prefix-cache hashes of its first full blocks
    num_committed: int = 0  # blocks (or cache units) committed to the prefix cache

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """(prompt_ids + output_ids)[start:end] without copying the whole sequence."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n):end - n]


@dataclass(kw_only=True, slots=True)
class ScheduledBatch:
    """One step's work; each sequence's `num_scheduled` says how many of its tokens the step computes."""

    prefills: list[Sequence]  # prefill chunks (continuing ones first, then new admissions), in that order
    decodes: list[Sequence]  # one token each
    failed: list[tuple[Sequence, str]]  # could never be scheduled: (sequence, error message)


class Scheduler:
    """FIFO admission, decode slots, chunked prefill under a per-step token budget, preemption by recompute.

    Args:
        allocator: the rank's KV block allocator. block_size: tokens per block.
        max_num_seqs: running sequences at most. max_batched_tokens: tokens computed per step at most
        (decodes + prefill chunks; without chunking, a prompt longer than this is still admitted alone).
        enable_chunked_prefill: split prefills into chunks that fit the budget left after the decodes.
        prefix: the rank's prefix cache (None: off). max_mixed_tokens: the step's budget while it has decodes
        (None: max_batched_tokens; taken within [max_num_seqs, max_batched_tokens]).
    Raises:
        ValueError: max_batched_tokens < max_num_seqs (a full decode batch must fit one step).
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_batched_tokens: int,
                 enable_chunked_prefill: bool = True, prefix=None, max_mixed_tokens: int | None = None):
        if max_batched_tokens < max_num_seqs:
            raise ValueError(f"max_batched_tokens={max_batched_tokens} must be >= max_num_seqs={max_num_seqs}")
        self.alloc = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_mixed_tokens = (max_batched_tokens if max_mixed_tokens is None
                                 else min(max_batched_tokens, max(max_mixed_tokens, max_num_seqs)))
        self.chunked = enable_chunked_prefill
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def free(self, seq: Sequence) -> None:
        """Release every KV block of `seq` (finished, aborted or preempted); its computed full blocks stay cached."""
        if self.prefix is not None and seq.block_table:
            self.prefix.commit(seq)
            self.prefix.release(seq)
        self.alloc.free_all(seq.block_table)
        seq.block_table = []
        seq.num_cached = seq.num_committed = 0

    def _room(self, need: int, keep=None) -> bool:
        """Whether `need` blocks can be allocated now, evicting unheld cached prefixes (not `keep`) if that helps."""
        while need > self.alloc.num_free:
            if self.prefix is None or not self.prefix.evict_one(keep):
                return False
        return True

    def abort(self, request_id: str) -> Sequence | None:
        for q in (self.running, self.waiting):
            for s in list(q):
                if s.request_id == request_id:
                    q.remove(s)
                    self.free(s)
                    return s
        return None

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.free(seq)

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.free(victim)
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> ScheduledBatch:
        """This step's decodes and prefill chunks (module docstring); sets each one's `num_scheduled`."""
        failed: list[tuple[Sequence, str]] = []
        if self.prefix is not None:
            for seq in self.running:  # the last step computed their K/V
                self.prefix.commit(seq)
        # 1) decode slots for running sequences, newest preempted first when blocks run out; sequences part-way
        #    through their prefill hold the blocks of their whole length already
        decodes: list[Sequence] = []
        partial: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below
            if seq.length - seq.num_cached > 1:
                partial.append(seq)
                continue
            need = self._blocks_for(seq.length) - len(seq.block_table)
            while need > 0 and not self._room(need):  # most steps need no block: no pool query per sequence
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            for _ in range(need):
                seq.block_table.append(self.alloc.allocate())
            seq.num_scheduled = 1
            decodes.append(seq)
        budget = (self.max_mixed_tokens if decodes else self.max_batched_tokens) - len(decodes)
        # 2) continue partial prefills (oldest first) within the budget
        prefills: list[Sequence] = []
        for seq in partial:
            if budget <= 0:
                break
            if seq in self.running:  # not preempted by a decode above
                seq.num_scheduled = min(seq.length - seq.num_cached, budget)
                budget -= seq.num_scheduled
                prefills.append(seq)
        # 3) admit waiting sequences (FIFO) while blocks, slots and the token budget allow
        while self.waiting and len(self.running) < self.max_num_seqs and (budget > 0 or not self.chunked):
            seq = self.waiting[0]
            need_blocks = self._blocks_for(seq.length)
            if need_blocks > self.alloc.num_blocks:
                self.waiting.popleft()
                failed.append((seq, f"sequence of {seq.length} tokens needs {need_blocks} KV blocks; "
                                    f"the cache has {self.alloc.num_blocks}"))
                continue
            cached, shared = self.prefix.match(seq) if self.prefix is not None else (0, [])
            extra = self.prefix.pin_cost(shared) if shared else 0
            if (not self._room(need_blocks - len(shared) + extra, keep=(cached, shared))
                    or (not self.chunked and prefills and seq.length - cached > budget)):
                break
            self.waiting.popleft()
            head = self.prefix.acquire(seq, cached, shared) if self.prefix is not None else []
            seq.block_table = head + [self.alloc.allocate() for _ in range(need_blocks - len(shared))]
            if self.prefix is not None:
                self.prefix.attach(seq, cached, self.running)
            seq.num_cached = cached
            seq.num_scheduled = min(seq.length - cached, budget) if self.chunked else seq.length - cached
            self.running.append(seq)
            prefills.append(seq)
            budget -= seq.num_scheduled
        return ScheduledBatch(prefills=prefills, decodes=decodes, failed=failed)
