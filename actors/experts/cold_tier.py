"""The cold tier of one layer: a bounded set of resident packed experts over the memory-mapped checkpoint.

Used when `resident_experts` = P < E (packed checkpoints only; for models whose packed experts exceed memory):
a layer keeps only P_loc = ceil(P * E_loc / E) packed experts resident, in a preallocated slot stack
(`ColdExpertTier`), and reads the others from the memory-mapped safetensors file (`PackedExpertReader`).
What a cache miss costs, by where the expert's packed bytes are:
  * resident in a slot: nothing extra; the fused dequant path runs on the slot.
  * being read by the prefetch worker: the layer waits for that read (the bytes are on their way; reading them
    twice would only add traffic) and then runs the fused path.
  * only in the file (a cold miss): the layer reads that expert's bytes (a copy of just that expert's rows of
    each packed stack out of the map, the least any scheme must do) into a slot, evicting an unpinned one by the
    cache's policy, and runs the fused path on it. It never waits for a dequantized-cache fill or for other
    experts' reads.
The prefetch worker reads the predicted experts that the dequantized cache does not take into the slots ahead
of their layer, so a good prediction turns cold misses into resident hits. Both paths still compute the same
function of the same packed bytes: results equal the all-resident store to fp32 rounding.

Invariants: the bytes held never exceed `budget_bytes` (the slot stack is allocated once); only unpinned slots
are evicted; an expert is in at most one slot, and a read in flight is never started twice.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from actors.experts.cache import EvictionClock
from actors.experts.checkpoint import PackedExpertReader
from kernels.packed_format import PackedExperts


class ColdExpertTier:
    """Packed experts of one layer on this rank when they do not all fit: a bounded resident set over the
    memory-mapped checkpoint (the cold tier).

    `capacity` slots (P_loc) of a preallocated packed stack (`PackedExpertReader.empty`, on the compute device)
    hold the resident packed experts; the others stay in the checkpoint file and are read on demand
    (`PackedExpertReader.read_into`: only that expert's bytes are copied out of the map). The slot stack is
    allocated once, so the bytes this tier holds never exceed `budget_bytes = capacity * expert_bytes`.

    A user pins the slots it computes on (`acquire` ... `release`); only unpinned slots are evicted, by the same
    policies as `ExpertCache` (`lru`, `lfu`, `predicted`: lowest latest predicted score; ties LRU). A freshly read
    expert counts as just used, so a prefetched expert is not the next LRU victim before its layer runs.

    Counters (`stats`): `hits` (a cache miss found its packed bytes resident), `misses` (read on demand by the
    forward: a cold miss), `waits` (the forward needed an expert the prefetcher was reading and waited for that
    read rather than reading the bytes twice), `prefetch_reads`, `transient_reads` (read for one use without a
    slot: no slot was free of pins, or a dequantized-cache fill of an expert not resident), `evictions`,
    `bytes_read`.

    Args:
        layer: layer index. local: global expert ids of this rank's experts (local id = index).
        reader: the packed folder's PackedExpertReader. capacity: slots (1 <= capacity; capped at E_loc).
        policy: one of EVICTION_POLICIES. device: where the slots live (the compute device).
    Raises:
        ValueError: capacity < 1 or unknown policy.
    """

    def __init__(self, layer: int, local: list[int], reader: PackedExpertReader, *, capacity: int, policy: str,
                 device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"resident_experts: layer {layer} would keep capacity={capacity} packed experts; "
                             "must be >= 1")
        self._clock = EvictionClock(len(local), policy)
        self.layer, self.local, self.reader, self.policy = layer, list(local), reader, policy
        self.device = torch.device(device)
        self.num_experts = len(self.local)
        self.capacity = min(capacity, self.num_experts)
        self.pool = reader.empty(layer, self.capacity, self.device)  # gate_up (P, 2I, D), down (P, D, I)
        self.expert_bytes = reader.expert_nbytes(layer)
        self.intermediate_size = self.pool.intermediate_size
        self._slot: dict[int, int] = {}  # local expert -> its slot, ready to read
        self._loading: dict[int, threading.Event] = {}  # local expert -> set when its read finished
        self._owner = [-1] * self.capacity  # slot -> local expert (-1: free)
        self._pins = [0] * self.capacity
        # CUDA: an event per slot recorded after the last kernels that read it were queued; a read into the slot
        # waits for it, because pins drop when the kernels are queued, not when they finish.
        self._read_done: list = [None] * self.capacity
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(("hits", "misses", "waits", "prefetch_reads", "transient_reads", "evictions",
                                       "bytes_read"), 0)

    def __contains__(self, e: int) -> bool:
        return e in self._slot

    @property
    def resident(self) -> list[int]:
        """Local ids of the experts resident now (sorted)."""
        with self._lock:
            return sorted(self._slot)

    @property
    def budget_bytes(self) -> int:
        """Bytes of the slot stack: the most this tier ever holds."""
        return self.capacity * self.expert_bytes

    def set_scores(self, scores: list[float]) -> None:
        """Latest predicted usefulness of each local expert (E_loc floats; for the `predicted` policy)."""
        self._clock.set_scores(scores)

    def _take_slot(self, e: int, exclude: set[int], speculative: bool) -> int | None:
        """A slot for `e` (under the lock): a free one, else the policy's victim among unpinned slots whose
        expert is not in `exclude`; None if there is none (or, for a speculative read under `predicted`, the
        victim scores at least as high as `e`)."""
        if -1 in self._owner:
            return self._owner.index(-1)
        cands = [o for s, o in enumerate(self._owner) if self._pins[s] == 0 and o not in exclude and o in self._slot]
        v = self._clock.victim_for(e, cands, speculative)
        if v is None:
            return None
        s = self._slot.pop(v)
        self.counters["evictions"] += 1
        return s

    def acquire(self, experts: list[int], *, demand: bool) -> dict[int, int]:
        """Pin local `experts` in slots, reading the non-resident ones from the map; returns `{expert: slot}` for
        those obtained (every one unless there were fewer unpinned slots than experts: the caller computes on
        these, `release`s them and asks again for the rest).

        `demand`: the forward needs them now (counts as use, a read is a cold miss); else a prefetch (reads are
        speculative: under `predicted` they must outscore their victim).
        """
        got: dict[int, int] = {}
        reads: list[tuple[int, int, threading.Event]] = []
        waits: list[tuple[int, threading.Event]] = []
        with self._lock:
            self._clock.touch(experts if demand else ())
            for e in experts:
                if e in self._slot:
                    s = got[e] = self._slot[e]
                    self._pins[s] += 1
                    self.counters["hits"] += demand
                elif e in self._loading:
                    waits.append((e, self._loading[e]))
            busy = set(experts)
            for e in experts:
                if e in got or e in self._loading:
                    continue
                s = self._take_slot(e, busy, speculative=not demand)
                if s is None:
                    continue
                self._owner[s], self._pins[s] = e, 1
                ev = self._loading[e] = threading.Event()
                reads.append((e, s, ev))
        for i, (e, s, ev) in enumerate(reads):
            try:
                done = self._read_done[s]
                if done is not None:
                    done.synchronize()
                n = self.reader.read_into(self.layer, self.local[e], self.pool, s)
            except BaseException:
                self._abandon(reads[i:])
                self.release(got)
                raise
            with self._lock:
                self._slot[e] = got[e] = s
                self._loading.pop(e, None)
                self._clock.refresh(e)
                self.counters["misses" if demand else "prefetch_reads"] += 1
                self.counters["bytes_read"] += n
            ev.set()
        for e, ev in waits:
            if demand:
                ev.wait()
            with self._lock:
                s = self._slot.get(e)
                if s is not None:
                    self._pins[s] += 1
                    got[e] = s
                    self.counters["waits"] += demand
        return got

    def _abandon(self, reads: list[tuple[int, int, threading.Event]]) -> None:
        """Free the slots of reads that did not happen (a read raised) and wake anyone waiting on them."""
        with self._lock:
            for e, s, _ in reads:
                self._owner[s], self._pins[s] = -1, 0
                self._loading.pop(e, None)
        for _, _, ev in reads:
            ev.set()

    def release(self, got: dict[int, int]) -> None:
        """Unpin the slots `acquire` returned (on CUDA after the current stream's queued reads of them)."""
        done = None
        if got and self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        with self._lock:
            for s in got.values():
                self._pins[s] -= 1
                if done is not None:
                    self._read_done[s] = done

    def prefetch(self, experts: list[int]) -> None:
        """Make local `experts` resident (in priority order, as slots allow) without pinning them."""
        self.release(self.acquire(experts, demand=False))

    def read_transient(self, e: int) -> PackedExperts:
        """Local expert `e` as a one-expert stack on the device, read from the map and kept nowhere."""
        pe = self.reader.read_one(self.layer, self.local[e], self.device)
        with self._lock:
            self.counters["transient_reads"] += 1
            self.counters["bytes_read"] += self.expert_bytes
        return pe

    def dequantized(self, e: int, deq: Callable, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w_gate_up [2I, D], w_down [D, I])` of local expert `e` in `dtype` (for the dequantized cache): from
        its slot when resident (pinned meanwhile), else from a transient read (no slot is taken: the cache,
        not this tier, will hold it)."""
        with self._lock:
            s = self._slot.get(e)
            if s is not None:
                self._pins[s] += 1
        if s is None:
            pe = self.read_transient(e)
            return deq(pe.gate_up[0], dtype), deq(pe.down[0], dtype)
        try:
            return deq(self.pool.gate_up[s], dtype), deq(self.pool.down[s], dtype)
        finally:
            self.release({e: s})

    def stats(self) -> dict:
        """Counters (see the class docstring) plus `resident_experts`, `capacity`, `expert_bytes`,
        `resident_bytes` (slots filled), `allocated_bytes` (the slot stack) and `budget_bytes`."""
        with self._lock:
            n = len(self._slot)
            out = dict(self.counters)
        out.update(resident_experts=n, capacity=self.capacity, expert_bytes=self.expert_bytes,
                   resident_bytes=n * self.expert_bytes, allocated_bytes=self.pool.nbytes,
                   budget_bytes=self.budget_bytes)
        return out
