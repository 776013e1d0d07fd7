"""Continuous batching on one rank: sequences, admission, KV-block budgeting and preemption.

Each step the scheduler admits waiting sequences (FIFO) while their whole prompt fits in free KV
blocks and the running set and token budget allow, and gives every running sequence a slot for
its next token. When a decode needs a new block and none is free, the most recently admitted
running sequence is preempted: its blocks are freed and it goes back to the front of the queue,
to be recomputed (prompt + tokens generated so far) when memory frees up. A sequence that could
never fit is failed, never left to wait forever.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
import random

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
    generator: random.Random | None = None  # its uniform stream (`sampling.make_generator`); None: greedy
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    arrival: float = 0.0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(kw_only=True, slots=True)
class ScheduledBatch:
    prefills: list[Sequence]  # whole (re)computed prompts this step
    decodes: list[Sequence]  # one new token each
    failed: list[tuple[Sequence, str]]  # could never be scheduled: (sequence, error message)


class Scheduler:
    """FIFO admission + decode slots with preemption by recompute.

    Args:
        allocator: the rank's KV block allocator. block_size: tokens per block.
        max_num_seqs: running sequences at most. max_batched_tokens: new tokens per step at most
        (a prompt longer than this is still admitted alone, so nothing starves).
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_batched_tokens: int):
        self.alloc = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
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
        """Release every KV block of `seq` (finished, aborted or preempted)."""
        self.alloc.free_all(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0

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
        failed: list[tuple[Sequence, str]] = []
        # 1) decode slots for running sequences, newest preempted first when blocks run out
        decodes: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below
            need = self._blocks_for(seq.length) - len(seq.block_table)
            while need > self.alloc.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            for _ in range(need):
                seq.block_table.append(self.alloc.allocate())
            decodes.append(seq)
        # 2) admit waiting sequences (FIFO) while blocks, slots and the token budget allow
        prefills: list[Sequence] = []
        budget = self.max_batched_tokens - len(decodes)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need_blocks = self._blocks_for(seq.length)
            if need_blocks > self.alloc.num_blocks:
                self.waiting.popleft()
                failed.append((seq, f"sequence of {seq.length} tokens needs {need_blocks} KV blocks; "
                                    f"the cache has {self.alloc.num_blocks}"))
                continue
            if need_blocks > self.alloc.num_free or (prefills and seq.length > budget):
                break
            self.waiting.popleft()
            seq.block_table = [self.alloc.allocate() for _ in range(need_blocks)]
            seq.num_cached = 0
            self.running.append(seq)
            prefills.append(seq)
            budget -= seq.length
        return ScheduledBatch(prefills=prefills, decodes=decodes, failed=failed)
