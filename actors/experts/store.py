"""Expert store of one rank: packed sub-4-bit routed experts, a dequantized expert cache, and prefetch.

Shape legend: R = token rows received for this rank's experts, D = hidden, I = expert intermediate,
E = routed experts of a layer (global), E_loc = this rank's experts of a layer, T = tokens of the step,
K = experts per token, B = prediction budget per token.

Per MoE layer the rank keeps
  * its E_loc experts packed (`kernels.packed_weights.PackedExperts`, fused gate_up), resident (all of them,
    unless the cold tier below is on);
  * an `ExpertCache` of up to C_loc of them dequantized in the compute dtype (C experts per layer overall,
    C_loc = ceil(C * E_loc / E) on this rank).
A layer call (`PackedLayerExperts`, the `actors.moe.experts.LocalExperts` contract) serves each expert it needs
from the cache when it is ready there (hit: a dense matmul) and otherwise runs the fused dequant path on the
packed weights directly (miss: `packed_expert_ffn`, Triton, the compiled CPU kernel
`kernels.cpu.packed_expert_ffn` for decode-sized rows, or the PyTorch reference). On CPU that kernel is
no slower than a hit, so the cache defaults to empty there (`fused_path_runs`). It never waits for a
load: experts become ready only through a `PrefetchWorker` thread, which fills the cache with the experts a
predictor expects at the next layer (and, after a miss, with the missed expert), overlapping the current
layer's compute. Both paths compute the same function of the same dequantized weights, so they agree to fp32
rounding (the tests check relative error < 1e-5 and identical greedy tokens at C = E and C = E / 4).

Cold tier (`resident_experts` = P < E, packed checkpoints only; for models whose packed experts exceed memory):
a layer keeps only P_loc = ceil(P * E_loc / E) packed experts resident, in a preallocated slot stack
(`ColdExpertTier`), and reads the others from the memory-mapped safetensors file (`PackedExpertReader`).
What a cache miss costs, by where the expert's packed bytes are:
  * resident in a slot: nothing extra; the fused dequant path runs on the slot (as above).
  * being read by the prefetch worker: the layer waits for that read (the bytes are on their way; reading them
    twice would only add traffic) and then runs the fused path.
  * only in the file (a cold miss): the layer reads that expert's bytes (a copy of just that expert's rows of each packed
    stack out of the map, the least any scheme must do) into a slot, evicting an unpinned one by the cache's policy, and runs
    the fused path on it. It never waits for a dequantized-cache fill or for other experts' reads.
The prefetch worker reads the predicted experts that the dequantized cache does not take into the slots ahead
of their layer, so a good prediction turns cold misses into resident hits. Both paths still compute the same
function of the same packed bytes: results equal the all-resident store to fp32 rounding.

Observer (`actors.model.model.RoutingObserver`: the engine gives the runtime to the model's constructor, or
`ExpertRuntime.attach` makes it a built model's observer): the model calls `begin_step(meta, T, gating)` first,
whose `AttentionMetadata` tells which token follows which in a sequence (the first KV block of a sequence is
its key while it runs), then `on_hidden(l, h)` before each FFN and `on_route(l, ids)` after each gate; the
runtime learns the routing online (Markov counts), predicts the next MoE layer's experts (k + 1 per token,
union over the batch), and submits their prefetch.

Sources: expert offloading with an LRU cache and lookahead prefetch (mixtral-offloading, arXiv 2312.17238);
Markov / affinity-based prefetch (ProMoE arXiv 2410.22134, ExFlow arXiv 2401.08383).
"""
from __future__ import annotations

import logging
import math
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from actors.model.config import ModelConfig
from actors.experts.checkpoint import (
    PackedExpertReader,
    is_packed_checkpoint,
    load_packed_experts,
    read_quant_config,
)
from kernels import tuning
from kernels.cpu import PackedFFNArgs, cpu_kernels_available, prefetch_step, swiglu_f32
from kernels.cpu import packed_expert_ffn as packed_expert_ffn_cpu
from kernels.packed_weights import PackedExperts, quantize
from actors.moe.experts import Experts
from actors.moe.gating import POLICIES, GatingBatch, GatingRouter
from actors.prefetch.predictors import (
    DEFAULT_PREDICTOR,
    PREDICTORS,
    TRANSITIONS_FILE,
    ExpertPredictor,
    MarkovPredictor,
    RoutingTrace,
    TransitionCounts,
    fit_lookahead_gates,
    fit_loglinear,
    keep_previous_first,
    make_predictor,
)
from actors.moe.stats import RoutingStats, jaccard_distance

log = logging.getLogger("moeray.experts")

EVICTION_POLICIES = ("lru", "lfu", "predicted")


# The Triton interpreter patches `triton.language` globally while a kernel runs, so two threads must not
# interpret kernels at once (the prefetch worker's dequantize would break the forward's GEMM).
_INTERPRETER_LOCK = threading.Lock()


def _serialized(fn: Callable) -> Callable:
    def run(*a, **kw):
        with _INTERPRETER_LOCK:
            return fn(*a, **kw)

    return run


def _kernel_ops(backend: str):
    """(packed_expert_ffn, dequantize) of the backend: "torch" (reference) or "triton"."""
    if backend == "torch":
        from kernels import packed_weights as k
    elif backend == "triton":
        from kernels import packed_weights_triton as k

        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            return _serialized(k.packed_expert_ffn), _serialized(k.dequantize)
    else:
        raise ValueError(f"kernel_backend={backend!r} must be torch or triton")
    return k.packed_expert_ffn, k.dequantize


def _pick_victim(policy: str, cands: list[int], last: list[int], uses: list[int], score: list[float]) -> int | None:
    """The candidate to evict under `policy` (lru / lfu / predicted, ties broken by LRU); None if no candidate."""
    if not cands:
        return None
    if policy == "lru":
        return min(cands, key=lambda e: last[e])
    if policy == "lfu":
        return min(cands, key=lambda e: (uses[e], last[e]))
    return min(cands, key=lambda e: (score[e], last[e]))


class ExpertCache:
    """Up to `capacity` experts of one layer dequantized and ready; thread-safe.

    Entries are immutable `(w_gate_up [2I, D], w_down [D, I])` pairs: a reader that took a reference keeps a
    valid tensor even if the entry is evicted meanwhile, so the forward never waits on the worker.

    Eviction (when full): `lru` least recently used; `lfu` least frequently used (ties: LRU); `predicted` the
    resident expert with the lowest score from the latest prediction for this layer (ties: LRU).

    Args:
        capacity: experts kept (>= 0). num_experts: E_loc. policy: one of EVICTION_POLICIES.
        loader: local expert id -> its dequantized pair (called outside the lock, on the worker thread).
    Raises:
        ValueError: capacity < 0 or unknown policy.
    """

    def __init__(self, capacity: int, num_experts: int, policy: str, loader: Callable[[int], tuple]):
        if capacity < 0:
            raise ValueError(f"expert cache capacity={capacity} must be >= 0")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy={policy!r} must be one of {EVICTION_POLICIES}")
        self.capacity, self.num_experts, self.policy, self.loader = capacity, num_experts, policy, loader
        self._ready: dict[int, tuple] = {}
        self._last = [0] * num_experts
        self._uses = [0] * num_experts
        self._score = [0.0] * num_experts
        self._tick = 0
        self._lock = threading.Lock()

    def __contains__(self, e: int) -> bool:
        return e in self._ready

    @property
    def resident(self) -> list[int]:
        with self._lock:
            return sorted(self._ready)

    def lookup(self, used: list[int]) -> dict[int, tuple]:
        """Mark `used` as used now; return the ready entries among them (the others are misses)."""
        with self._lock:
            self._tick += 1
            for e in used:
                self._last[e] = self._tick
                self._uses[e] += 1
            return {e: self._ready[e] for e in used if e in self._ready}

    def set_scores(self, scores: list[float]) -> None:
        """Latest predicted usefulness of each local expert (E_loc floats; for the `predicted` policy)."""
        self._score = scores  # one reference swap: readers see the old list or the new one

    @property
    def resident_bytes(self) -> int:
        """Bytes of the dequantized entries held now (compute dtype)."""
        with self._lock:
            return sum(t.numel() * t.element_size() for w in self._ready.values() for t in w
                       if isinstance(t, torch.Tensor))

    def put(self, e: int, w: tuple, protect: set[int] = frozenset()) -> bool:
        """Insert an entry the caller already dequantized (a miss on the reference path), evicting one not in
        `protect` if full. Returns True if it was inserted (False: resident already, capacity 0, or no victim)."""
        protect = set(protect)
        with self._lock:
            if e in self._ready or self.capacity == 0 or not self._admit(e, protect, False):
                return False
            if len(self._ready) >= self.capacity:
                del self._ready[self._victim(protect | {e})]
            self._ready[e] = w
            return True

    def _victim(self, exclude: set[int]) -> int | None:
        return _pick_victim(self.policy, [e for e in self._ready if e not in exclude], self._last, self._uses,
                            self._score)

    def _admit(self, e: int, protect: set[int], speculative: bool) -> bool:
        if len(self._ready) < self.capacity:
            return True
        v = self._victim(protect | {e})
        # A speculative (prefetch) fill under the `predicted` policy must be more useful than what it evicts.
        return v is not None and not (speculative and self.policy == "predicted" and self._score[e] <= self._score[v])

    def fill(self, e: int, protect: set[int] = frozenset(), speculative: bool = False) -> bool:
        """Make expert `e` ready, evicting one not in `protect` if full. Returns True if it was loaded now.

        `speculative` marks a prefetch: under the `predicted` policy it is dropped unless `e` scores higher
        than the expert it would evict.
        """
        protect = set(protect)
        with self._lock:
            if e in self._ready or self.capacity == 0 or not self._admit(e, protect, speculative):
                return False
        w = self.loader(e)
        with self._lock:
            if e in self._ready or not self._admit(e, protect, speculative):
                return False
            if len(self._ready) >= self.capacity:
                del self._ready[self._victim(protect | {e})]
            self._ready[e] = w
            return True


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
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy={policy!r} must be one of {EVICTION_POLICIES}")
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
        self._last = [0] * self.num_experts
        self._uses = [0] * self.num_experts
        self._score = [0.0] * self.num_experts
        self._tick = 0
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
        self._score = scores  # one reference swap: readers see the old list or the new one

    def _take_slot(self, e: int, exclude: set[int], speculative: bool) -> int | None:
        """A slot for `e` (under the lock): a free one, else the policy's victim among unpinned slots whose
        expert is not in `exclude`; None if there is none (or, for a speculative read under `predicted`, the
        victim scores at least as high as `e`)."""
        if -1 in self._owner:
            return self._owner.index(-1)
        cands = [o for s, o in enumerate(self._owner) if self._pins[s] == 0 and o not in exclude and o in self._slot]
        v = _pick_victim(self.policy, cands, self._last, self._uses, self._score)
        if v is None or (speculative and self.policy == "predicted" and self._score[e] <= self._score[v]):
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
            self._tick += 1
            if demand:
                for e in experts:
                    self._last[e] = self._tick
                    self._uses[e] += 1
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
                self._last[e] = max(self._last[e], self._tick)
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


def _run_fills(q: queue.Queue, stream) -> None:
    """`PrefetchWorker`'s thread: run queued fills in order until a None arrives."""
    while True:
        fn = q.get()
        try:
            if fn is None:
                return
            if stream is not None:
                with torch.cuda.stream(stream):
                    fn()
            else:
                fn()
        except Exception:
            log.exception("expert prefetch failed")
        finally:
            q.task_done()


class PrefetchWorker:
    """One background thread that runs cache fills in submission order (or inline when `sync`).

    On CUDA each fill runs on the worker's own stream and is complete (stream synchronised) before the
    entry is published, so the forward's stream can use it without an event wait. The thread holds only the
    queue and the stream, and ends when the worker is closed or garbage-collected (an engine dropped without
    `close()` does not leave its thread behind).
    """

    def __init__(self, sync: bool = False, device: torch.device | None = None):
        self.sync = sync
        self.device = device
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stream = None
        if not sync:
            if device is not None and device.type == "cuda":
                self._stream = torch.cuda.Stream(device)
            self._thread = threading.Thread(target=_run_fills, args=(self._q, self._stream), name="expert-prefetch",
                                            daemon=True)
            self._thread.start()
            weakref.finalize(self, self._q.put, None)

    def submit(self, fn: Callable[[], None]) -> None:
        if self.sync:
            fn()
        else:
            self._q.put(fn)

    def wait_idle(self) -> None:
        """Block until every submitted fill has run (tests, benchmarks)."""
        if not self.sync:
            self._q.join()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=5)


class PackedLayerExperts(Experts):
    """The experts of one layer on this rank: packed weights + expert cache (the `Experts` protocol; its
    `run_padded` and `combine_token` are the protocol's, on top of `__call__` / `run_token`).

    With a cold tier (`tier`, packed experts not all resident) a miss runs the same fused path on the tier's
    slot stack: the expert's packed bytes are pinned there, read from the memory-mapped checkpoint first when
    not resident (a cold miss must read them once; the layer reads them itself rather than queueing a load).
    When a step needs more experts than the tier has unpinned slots, they run in rounds of as many as fit.

    Args:
        layer: layer index. packed: PackedExperts with fused gate_up `(E_loc, 2I, D)` (None when E_loc = 0 or
            with a cold tier). tier: the layer's ColdExpertTier (None: every packed expert resident).
        capacity: cache size C_loc. policy: eviction policy. dtype: compute dtype of cached weights.
        backend: "torch" or "triton". worker: the rank's PrefetchWorker. stats: the rank's RoutingStats.
        demand_fill: after a miss, also queue the missed expert for the cache.
    Raises:
        ValueError: both `packed` and `tier` given.
    """

    def __init__(self, layer: int, packed: PackedExperts | None, *, capacity: int, policy: str,
                 dtype: torch.dtype, backend: str, worker: PrefetchWorker, stats: RoutingStats,
                 demand_fill: bool = True, tier: ColdExpertTier | None = None):
        if packed is not None and tier is not None:
            raise ValueError(f"layer {layer}: give packed experts or a cold tier, not both")
        self.layer, self.packed, self.dtype, self.worker, self.stats = layer, packed, dtype, worker, stats
        self.tier = tier
        src = tier or packed
        self.num_local = 0 if src is None else src.num_experts
        self.intermediate = 0 if src is None else src.intermediate_size
        self._ffn, self._deq = _kernel_ops(backend)
        # The reference miss path dequantizes the whole expert anyway: it computes on the dequantized pair and
        # hands it to the cache itself, so a demand fill costs nothing more (the worker would dequantize again).
        self.inline_fill = backend == "torch"
        # CPU: the compiled fused path (`kernels.cpu.packed_expert_ffn`) serves decode-sized misses straight
        # from the packed bytes, and the worker's fills dequantize through it; None where it cannot run.
        # With a cold tier the same kernel runs on the slot stack (slot ids for expert ids).
        self._cffn = None
        stack = tier.pool if tier is not None else packed
        if stack is not None and stack.fused and fused_path_runs(stack.gate_up.device, backend, dtype):
            self._cffn = PackedFFNArgs(stack.gate_up, stack.down)
            if not self._cffn.ok:
                self._cffn = None
        self.cache = ExpertCache(min(capacity, self.num_local), self.num_local, policy, self._load)
        self.demand_fill = demand_fill
        self._lock = threading.Lock()
        self._pending: set[int] = set()
        self._prefetched: set[int] = set()  # filled by prefetch since this layer's last call

    def _load(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cffn is not None and self.tier is None:
            w = self._cffn.dequantize(e)
            if w is not None:  # None: the compiled kernels went away (never cache None: dequantize below)
                return w
        if self.tier is not None:
            gu, dn = self.tier.dequantized(e, self._deq, self.dtype)
        else:
            gu = self._deq(self.packed.gate_up[e], self.dtype)
            dn = self._deq(self.packed.down[e], self.dtype)
        if gu.is_cuda:
            torch.cuda.current_stream(gu.device).synchronize()
        return gu, dn

    def request(self, experts: list[int], *, protect: set[int], prefetch: bool) -> None:
        """Queue cache fills for local `experts` (in priority order) on the worker; duplicates are dropped."""
        with self._lock:
            todo = [e for e in experts if e not in self._pending and e not in self.cache]
            self._pending.update(todo)
        if not todo:
            return

        def run() -> None:
            try:
                for e in todo:
                    if self.cache.fill(e, protect, speculative=prefetch):
                        with self._lock:
                            self.stats.add_fills(self.layer, 1)
                            if prefetch:
                                self._prefetched.add(e)
            finally:
                with self._lock:
                    self._pending.difference_update(todo)

        self.worker.submit(run)

    def request_packed(self, experts: list[int]) -> None:
        """Queue reads of local `experts` (priority order) into the cold tier's resident set (no-op without)."""
        if self.tier is None or not experts:
            return
        todo = [e for e in experts if e not in self.tier]
        if todo:
            self.worker.submit(lambda: self.tier.prefetch(todo))

    def warm(self, experts: list[int]) -> None:
        """Fill the cache synchronously (at start-up) with `experts`, up to capacity."""
        for e in experts[: self.cache.capacity]:
            self.cache.fill(e)

    def __call__(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor) -> torch.Tensor:
        """y[r] = expert[local_ids[r]](x[r]); rows in any order, R may be 0. Hits use cached weights, misses
        the fused dequant path on the packed weights."""
        R = x_RD.shape[0]
        if R == 0 or self.num_local == 0:
            return torch.empty_like(x_RD)
        counts = torch.bincount(local_ids_R, minlength=self.num_local)  # [E_loc]
        used = counts.nonzero().flatten().tolist()
        return self._run(x_RD, local_ids_R, counts, used, self._lookup(used))

    def run_token(self, x_1D: torch.Tensor, local_ids_K: torch.Tensor) -> torch.Tensor:
        """One token [1, D] through K distinct local experts (decode at batch 1): returns [K, D]. When all K are
        cached, each runs on the cached weights directly (no sort, scatter or bincount); otherwise, or with
        repeated ids, the general path."""
        ids = local_ids_K.tolist()
        if self.num_local == 0 or len(set(ids)) != len(ids):
            return self(x_1D.expand(len(ids), -1).contiguous(), local_ids_K)
        ready = self._lookup(ids)
        if len(ready) == len(ids):
            return torch.cat([self._cached_ffn(x_1D, *ready[e]) for e in ids])
        if self._cffn is not None and self.tier is None:
            # CPU: the misses in one compiled call on their packed bytes (no weight materialised); fills go to the
            # worker, as on a GPU
            miss = [e for e in ids if e not in ready]
            y_miss = packed_expert_ffn_cpu(x_1D, miss, self._cffn)
            if y_miss is None:
                return self._run(x_1D.expand(len(ids), -1).contiguous(), local_ids_K,
                                 torch.bincount(local_ids_K, minlength=self.num_local), ids, ready)
            if self.demand_fill and self.cache.capacity:
                self.request(miss, protect=set(ids), prefetch=False)
            if not ready:
                return y_miss
            it = iter(y_miss)
            return torch.cat([self._cached_ffn(x_1D, *ready[e]) if e in ready else next(it)[None] for e in ids])
        if self.inline_fill and self.tier is None:
            # Reference backend: a miss dequantizes its expert anyway, so each expert runs on its own dense pair
            # (hit: cached; miss: dequantized now and offered to the cache), with no sort / bincount / scatter:
            # the general path's bookkeeping cost ~0.4 ms per one-token call on CPU, half a dequantize.
            protect = set(ids)
            return torch.cat([self._cached_ffn(x_1D, *ready[e]) if e in ready else self._miss_inline(x_1D, e, protect)
                              for e in ids])
        counts = torch.bincount(local_ids_K, minlength=self.num_local)
        return self._run(x_1D.expand(len(ids), -1).contiguous(), local_ids_K, counts, ids, ready)

    def _lookup(self, used: list[int]) -> dict[int, tuple]:
        """Cache lookup of the `used` local experts, with the hit/prefetch counters."""
        ready = self.cache.lookup(used)
        with self._lock:
            self.stats.add_lookups(self.layer, len(ready), len(used))
            if self._prefetched:
                self.stats.add_prefetch(self.layer, len(self._prefetched), len(self._prefetched - set(used)))
                self._prefetched.clear()
        return ready

    def _miss_inline(self, x_RD: torch.Tensor, e: int, protect: set[int]) -> torch.Tensor:
        """Rows `x_RD` through local expert `e`, not cached: dequantize it (reference backend), compute as a hit
        would, and offer the pair to the cache (the demand fill costs nothing more)."""
        gu, dn = self._deq(self.packed.gate_up[e], self.dtype), self._deq(self.packed.down[e], self.dtype)
        y = self._cached_ffn(x_RD, gu, dn)
        if self.demand_fill and self.cache.put(e, (gu, dn), protect):
            with self._lock:
                self.stats.add_fills(self.layer, 1)
        return y

    def _cached_ffn(self, x: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
        y = swiglu_f32(x, gu, dn) if self._cffn is not None else None  # CPU, fp32, a few rows: one compiled call
        if y is not None:
            return y
        g, u = F.linear(x, gu).split(self.intermediate, dim=1)
        # The product is rounded once to the activation dtype, as on the packed path.
        if x.dtype == torch.float32:
            return F.linear(F.silu(g) * u, dn)
        return F.linear((F.silu(g.float()) * u.float()).to(x.dtype), dn)

    def _run(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor, counts: torch.Tensor, used: list[int],
             ready: dict[int, tuple]) -> torch.Tensor:
        """The general path: rows sorted by expert; hits on cached weights, misses on the packed weights."""
        misses = [e for e in used if e not in ready]
        order = torch.argsort(local_ids_R, stable=True)
        xs = x_RD[order]
        ys = torch.empty_like(xs)
        bounds = [0] + torch.cumsum(counts, 0).tolist()
        for e, (gu, dn) in ready.items():
            lo, hi = bounds[e], bounds[e + 1]
            ys[lo:hi] = self._cached_ffn(xs[lo:hi], gu, dn)
        if misses and self.tier is not None:
            self._cold_ffn(xs, ys, counts, bounds, misses)
            if self.demand_fill and self.cache.capacity:
                self.request(misses, protect=set(used), prefetch=False)
        elif (misses and self._cffn is not None and self.tier is None
              and sum(int(counts[e]) for e in misses) <= tuning.MAX_KERNEL_ROWS):
            rows = torch.cat([torch.arange(bounds[e], bounds[e + 1]) for e in misses])
            ys[rows] = packed_expert_ffn_cpu(xs[rows], [e for e in misses for _ in range(bounds[e + 1] - bounds[e])],
                                             self._cffn)
            if self.demand_fill and self.cache.capacity:
                self.request(misses, protect=set(used), prefetch=False)
        elif misses and self.inline_fill:
            protect = set(used)
            for e in misses:
                lo, hi = bounds[e], bounds[e + 1]
                ys[lo:hi] = self._miss_inline(xs[lo:hi], e, protect)
        elif misses:
            miss_counts = torch.zeros_like(counts)
            miss_counts[misses] = counts[misses]
            if len(misses) == len(used):
                ys = self._ffn(xs, miss_counts, self.packed)
            else:
                rows = torch.cat([torch.arange(bounds[e], bounds[e + 1]) for e in misses]).to(xs.device)
                ys[rows] = self._ffn(xs[rows], miss_counts, self.packed)
            if self.demand_fill and self.cache.capacity:
                self.request(misses, protect=set(used), prefetch=False)
        y = torch.empty_like(x_RD)
        y[order] = ys
        return y

    def _cold_ffn(self, xs: torch.Tensor, ys: torch.Tensor, counts: torch.Tensor, bounds: list[int],
                  misses: list[int]) -> None:
        """ys[rows of e] = expert e (xs[rows of e]) for each of `misses` (local ids), on the tier's slot stack.

        Rows are grouped by slot, in slot order, so one fused call serves every expert pinned this round.
        """
        tier = self.tier
        todo = list(misses)
        while todo:
            got = tier.acquire(todo, demand=True)
            if not got:  # every slot pinned by the prefetch worker: use this expert's bytes once, unslotted
                e = todo.pop(0)
                lo, hi = bounds[e], bounds[e + 1]
                ys[lo:hi] = self._ffn(xs[lo:hi], counts[e : e + 1], tier.read_transient(e))
                continue
            try:
                by_slot = sorted(got.items(), key=lambda es: es[1])
                slot_counts = torch.zeros(tier.capacity, dtype=counts.dtype, device=counts.device)  # [P_loc]
                for e, s in by_slot:
                    slot_counts[s] = counts[e]
                rows = torch.cat([torch.arange(bounds[e], bounds[e + 1]) for e, _ in by_slot]).to(xs.device)
                y = None
                if self._cffn is not None and len(rows) <= tuning.MAX_KERNEL_ROWS:  # CPU: the compiled fused kernel
                    y = packed_expert_ffn_cpu(xs[rows], [s for e, s in by_slot for _ in range(int(counts[e]))],
                                              self._cffn)
                ys[rows] = y if y is not None else self._ffn(xs[rows], slot_counts, tier.pool)
            finally:
                tier.release(got)
            todo = [e for e in todo if e not in got]


class ExpertRuntime:
    """Packed experts + caches + predictor + prefetch worker of one rank; the model's routing observer.

    Args:
        model_cfg: the model's configuration. local: per layer, the global expert ids on this rank (row order).
        packed: per layer PackedExperts of those experts (None for dense layers or E_loc = 0).
        dtype, device: compute dtype and device of cached weights.
        capacity: C, experts per layer kept dequantized over the whole layer (None: all).
        predictor: next-layer expert predictor (a NoPredictor disables prefetch).
        policy: eviction policy (default: `predicted` with a predictor, else `lru`).
        backend: "torch" | "triton". async_prefetch: fills on a worker thread (False: inline, deterministic).
        budget: experts predicted per token (default K + 1). demand_fill: queue a missed expert for the cache.
        warm_counts: calibration counts that order the initial cache fill (most frequent first).
        min_prefetch_prob: prefetch an expert only if some token's predicted probability of using it is at
            least this (0: every expert in the budget, as the issue's k + 1 rule says).
        cold: the packed folder's PackedExpertReader; with `resident` set, layers whose share of `resident`
            is below E_loc get a ColdExpertTier instead of `packed[l]` (which must then be None).
        resident: packed experts per layer kept in memory over the whole layer (None: all), P_loc =
            ceil(resident * E_loc / E) on this rank (`local_share`).
        gating_router: the model's gating router (its default policy tells which tokens `sticky` routes).
    Raises:
        ValueError: capacity < 0, resident < 1, unknown policy or backend, `resident` without `cold`, or a
            layer with neither packed experts nor a tier.
    """

    def __init__(self, *, model_cfg: ModelConfig, local: list[list[int]], packed: list[PackedExperts | None],
                 dtype: torch.dtype, device: torch.device, capacity: int | None, predictor: ExpertPredictor,
                 policy: str | None = None, backend: str = "torch", async_prefetch: bool = True,
                 budget: int | None = None, demand_fill: bool = True, warm_counts: TransitionCounts | None = None,
                 min_prefetch_prob: float = 0.0, cold: PackedExpertReader | None = None,
                 resident: int | None = None, gating_router: GatingRouter | None = None):
        mc = model_cfg
        if capacity is not None and capacity < 0:
            raise ValueError(f"expert_cache_capacity={capacity} must be >= 0")
        if resident is not None and (resident < 1 or cold is None):
            raise ValueError(f"resident_experts={resident} must be >= 1 and needs a packed checkpoint to read the "
                             "other experts from")
        self.cfg, self.local, self.predictor = mc, local, predictor
        self.num_experts = mc.num_experts
        self.prefetching = predictor.name != "none"
        self.policy = policy or ("predicted" if self.prefetching else "lru")
        # per-layer predictor bookkeeping (~20% of a batch-1 step on CPU) only when something reads it
        self._observing = self.prefetching or self.policy == "predicted"
        self.budget = min(mc.top_k + 1 if budget is None else budget, mc.num_experts)
        self.capacity = capacity
        self.min_prefetch_prob = min_prefetch_prob
        self.stats = RoutingStats()
        self.worker = PrefetchWorker(sync=not async_prefetch, device=device)
        self.local_of = [{g: i for i, g in enumerate(ids)} for ids in local]
        self.layers: list[PackedLayerExperts | None] = []
        for l in range(mc.num_layers):
            if not mc.moe_layers[l]:
                self.layers.append(None)
                continue
            n_loc = len(local[l])
            cap = local_share(capacity, n_loc, mc.num_experts)
            p_loc = local_share(resident, n_loc, mc.num_experts)
            tier = None
            if p_loc < n_loc:
                tier = ColdExpertTier(l, local[l], cold, capacity=p_loc, policy=self.policy, device=device)
            elif n_loc and packed[l] is None:
                raise ValueError(f"layer {l}: no packed experts for this rank's {n_loc} experts")
            self.layers.append(PackedLayerExperts(l, None if tier else packed[l], capacity=cap, policy=self.policy,
                                                  dtype=dtype, backend=backend, worker=self.worker,
                                                  stats=self.stats, demand_fill=demand_fill, tier=tier))
        moe = [l for l in range(mc.num_layers) if mc.moe_layers[l]]
        self.prev_moe = {l: (moe[i - 1] if i else None) for i, l in enumerate(moe)}
        self.next_moe = {l: (moe[i + 1] if i + 1 < len(moe) else None) for i, l in enumerate(moe)}
        self.first_moe = moe[0] if moe else None
        self._warm(warm_counts)
        self._last: dict[int, dict[int, torch.Tensor]] = {l: {} for l in moe}  # layer -> seq key -> ids [K]
        self._T = 0
        self.gating_router = gating_router
        self._model = None  # the model `attach` made this runtime the observer of

    def _warm(self, counts: TransitionCounts | None) -> None:
        """Start with the caches full: the calibration's most frequent experts first (else the lowest ids).

        With a cold tier its slots take the experts ranked after the dequantized cache's (read once each), so
        the two tiers start with different experts.
        """
        freq = counts or getattr(getattr(self.predictor, "markov", self.predictor), "counts", None)
        for l, store in enumerate(self.layers):
            if store is None:
                continue
            order = list(range(store.num_local))
            if freq is not None:
                f = freq.freq[l]
                order.sort(key=lambda i: -float(f[self.local[l][i]]))
            c = store.cache.capacity
            if store.tier is not None:
                store.tier.prefetch((order[c:] + order[:c])[: store.tier.capacity])
            if c:
                store.warm(order)

    # ------------------------------------------------------------------------ routing observer
    def attach(self, model) -> None:
        """Make this runtime the routing observer of a built `model` (`actors.model.model.MoEModel`), reading its
        gating router; the engine passes the runtime to the model's constructor instead."""
        self._model, self._saved = model, model.observer
        self.gating_router = model.gating_router
        model.observer = self

    def detach(self) -> None:
        """Undo `attach` (if attached: the model's previous observer is back) and stop the worker."""
        if self._model is not None:
            self._model.observer = self._saved
            self._model = None
        self.worker.close()

    def begin_step(self, meta, num_tokens: int, gating: GatingBatch | None = None) -> None:
        """Map the step's tokens to sequences: key (first KV block) per token, index of the previous token;
        predict and prefetch the first MoE layer from the previous tokens. `gating`: the step's per-token policies
        (tokens routed by `sticky` are predicted with their predecessor's experts first, `keep_previous_first`).

        The hooks do their bookkeeping on the forward thread (compiled calls for decode steps, ~50 us per layer
        on tiny-moe) and hand only the fills to the worker: queueing every hook on the worker cost more in thread
        wake-ups (~0.6 ms per step on 2 shared CPU cores, measured) than the bookkeeping itself."""
        T = num_tokens
        self._T = T
        self._ids: dict[int, torch.Tensor] = {}
        self._ids_t: dict[int, torch.Tensor] = {}  # the same routing as int64 tensors (compiled step)
        self._hidden: dict[int, torch.Tensor] = {}
        self._pred: dict[int, torch.Tensor] = {}
        self._sticky: list[bool] | None = None
        if T == 0 or not self._observing:
            return
        key = [-1] * T
        prev = [-1] * T
        for start, n, _, table in meta.prefills:
            k = int(table[0]) if len(table) else -1
            key[start : start + n] = [k] * n
            prev[start + 1 : start + n] = range(start, start + n - 1)
        self._decode = meta.decode_tokens.tolist()
        if self._decode:
            bt = meta.decode_block_tables
            first = bt[:, 0].tolist() if bt.shape[1] else [-1] * len(self._decode)
            for t, k in zip(self._decode, first):
                key[t] = int(k)
        # Small steps (decode) keep every piece of bookkeeping in Python lists: a few dozen tiny tensor ops per
        # layer cost more than the layer's experts at batch 1 (see `SMALL_STEP_CELLS`).
        self._small = T * self.num_experts <= tuning.SMALL_STEP_CELLS
        self._key = key
        self._prev = prev if self._small else torch.tensor(prev, dtype=torch.int64)
        self._sticky = self._sticky_tokens(gating, T)
        if self.prefetching and self.first_moe is not None and self._decode:
            l = self.first_moe
            if self._small:
                self._predict_small(l, None, self._prev_tok_lists(l, None), None)
            else:
                self._predict_and_prefetch(l, None, self._prev_token_ids(l, None), None)

    def _sticky_tokens(self, gating: GatingBatch | None, T: int) -> list[bool] | None:
        """Per token, True where the `sticky` policy routes it; None when no token is (the common case)."""
        router = self.gating_router
        if gating is None or router is None:
            return None
        if gating.policy_T is None:
            return [True] * T if router.cfg.policy == "sticky" else None
        flags = (gating.policy_T == POLICIES.index("sticky")).tolist()
        return flags if any(flags) else None

    def _keep_previous(self, pred: list[list[int]], prev_tok: list[list[int]], agg: list[float],
                       top: list[float]) -> tuple[list[list[int]], list[float], list[float]]:
        """The prediction for `sticky` tokens: their predecessor's experts first (`keep_previous_first`), each
        counted as a sure use in `agg` (expected uses in the batch) and `top` (best per-token probability)."""
        if self._sticky is None:
            return pred, agg, top
        agg, top, sure = list(agg), list(top), {}
        for t, on in enumerate(self._sticky):
            if on and prev_tok[t]:
                pred[t] = keep_previous_first(pred[t], prev_tok[t], self.budget)
                for g in prev_tok[t]:
                    if g >= 0:
                        sure[g] = sure.get(g, 0) + 1
        for g, n in sure.items():
            agg[g], top[g] = max(agg[g], float(n)), 1.0
        return pred, agg, top

    def _prev_tok_lists(self, l: int, ids: list[list[int]] | None) -> list[list[int]]:
        """Per token, its predecessor's experts at layer l ([] where unknown); the list form of
        `_prev_token_ids`."""
        last = self._last.get(l, {})
        out = [[] for _ in range(self._T)]
        if ids is not None:
            for t, p in enumerate(self._prev):
                if p >= 0:
                    out[t] = ids[p]
        for t in self._decode:
            v = last.get(self._key[t])
            if v is not None:
                out[t] = v
        return out

    def _prev_token_ids(self, l: int, ids_TK: torch.Tensor | None) -> torch.Tensor:
        """`[T, K]` experts of each token's predecessor at layer l (-1 where unknown)."""
        K = self.cfg.top_k
        out = torch.full((self._T, K), -1, dtype=torch.int64)
        if ids_TK is not None:
            has = self._prev >= 0
            out[has] = ids_TK[self._prev[has]]
        last = self._last.get(l, {})
        for t in self._decode:
            v = last.get(self._key[t])
            if v is not None:
                out[t] = torch.as_tensor(v, dtype=torch.int64)
        return out

    def on_hidden(self, l: int, h_TD: torch.Tensor) -> None:
        """Residual stream entering layer l's FFN (kept for the lookahead predictor)."""
        if self._T and self.prefetching:
            self._hidden[l] = h_TD

    def on_route(self, l: int, ids_TK: torch.Tensor) -> None:
        """Layer l just routed: score the prediction made for it, learn, predict the next MoE layer, prefetch.
        Without a prefetcher or predicted eviction there is nothing to learn or predict: it returns at once (the
        router thrash metric is the gating router's, `stats()["routing"]["thrash"]`)."""
        if self._T == 0 or ids_TK.shape[0] != self._T or not self._observing:
            return
        if self._small and self._compiled_step(l, ids_TK, self._hidden.get(l)):
            return
        if self._small:
            self._on_route_small(l, ids_TK.tolist())
            return
        ids = ids_TK.detach().to("cpu", torch.int64)
        prev_layer = self._ids.get(self.prev_moe.get(l))
        prev_tok = self._prev_token_ids(l, ids)
        if l in self._pred:
            self.stats.add_prediction(l, self._pred.pop(l), ids, self.num_experts)
        has = (prev_tok >= 0).any(1)
        if bool(has.any()):
            self.stats.add_thrashing(l, jaccard_distance(prev_tok[has], ids[has], self.num_experts))
        self.predictor.observe(l, ids, prev_layer, prev_tok)
        self._ids[l] = ids
        rows = ids.tolist()
        self._last[l] = {k: rows[t] for t, k in enumerate(self._key) if k >= 0}  # last token of each sequence wins
        nl = self.next_moe.get(l)
        if self.prefetching and nl is not None:
            self._predict_and_prefetch(nl, ids, self._prev_token_ids(nl, None), self._hidden.get(l))

    def _compiled_step(self, l: int, ids_TK: torch.Tensor, h_TD: torch.Tensor | None) -> bool:
        """`_on_route_small` for the Markov and hybrid predictors in one compiled call
        (`kernels.cpu.prefetch_step`: scoring, thrash, learning, the next layer's prediction and top-B);
        same counters, counts and predictions. False (nothing done) where it cannot run."""
        pred = self.predictor
        if pred.name not in ("markov", "hybrid") or ids_TK.dtype != torch.int64 or ids_TK.device.type != "cpu":
            return False
        m = getattr(pred, "markov", pred)
        if m._pending_tokens or m._pending[0]:
            m._flush()
        tabs = m._tables_c()
        if not tabs.ok:
            return False
        nl = self.next_moe.get(l) if self.prefetching else None
        look = None
        if nl is not None and pred.name == "hybrid" and h_TD is not None:
            look = pred.lookahead._compiled.ptrs(nl)
            if look is None or h_TD.dtype != torch.float32 or h_TD.device.type != "cpu" or h_TD.stride(-1) != 1:
                return False
        ids_TK = ids_TK.contiguous()  # read through its pointer here and, as the previous layer's, at the next
        ids = ids_TK.tolist()
        prev_tok = self._prev_tok_lists(l, ids)
        p_prev = self._pred.pop(l, None)
        next_prev = None if nl is None else self._prev_tok_lists(nl, None)
        res = prefetch_step(tabs, l, ids_TK, p_prev, self._ids_t.get(self.prev_moe.get(l)), prev_tok,
                            nl, m.alpha, MarkovPredictor._weights_list(pred, nl) if nl is not None else None,
                            next_prev, h_TD, look,
                            pred.lookahead.norm_eps if look is not None else 0.0, self.budget)
        if res is None:
            if p_prev is not None:
                self._pred[l] = p_prev
            return False
        st, nxt = res
        c = self.stats.c[l]
        if p_prev is not None:
            c["pred_inter"] += st[0]
            c["pred_n"] += st[1]
            c["true_n"] += st[2]
            c["pred_tokens"] += st[3]
        c["thrash_sum"] += st[4]
        c["thrash_n"] += st[5]
        m._observed_c(l, ids)
        self._ids[l], self._ids_t[l] = ids, ids_TK
        self._last[l] = {k: ids[t] for t, k in enumerate(self._key) if k >= 0}
        if nxt is not None:
            p_next, agg, top = nxt
            p_next, agg, top = self._keep_previous(p_next, next_prev, agg, top)
            self._pred[nl] = p_next
            self._prefetch(nl, sorted({g for r in p_next for g in r}), agg, top)
        return True

    def _on_route_small(self, l: int, ids: list[list[int]]) -> None:
        """`on_route` of a small step on Python lists (same counters, same learning, same prefetch)."""
        prev_layer = self._ids.get(self.prev_moe.get(l))
        prev_tok = self._prev_tok_lists(l, ids)
        c = self.stats.c[l]
        pred = self._pred.pop(l, None)
        true = [{e for e in row if e >= 0} for row in ids]
        if pred is not None:
            for p, t in zip(pred, true):
                ps = set(p)
                c["pred_inter"] += len(ps & t)
                c["pred_n"] += len(ps)
                c["true_n"] += len(t)
            c["pred_tokens"] += len(pred)
        for p, t in zip(prev_tok, true):
            a = {e for e in p if e >= 0}
            if a:
                c["thrash_sum"] += 1.0 - len(a & t) / len(a | t)
                c["thrash_n"] += 1
        self.predictor.observe_lists(l, ids, prev_layer, prev_tok)
        self._ids[l] = ids
        self._last[l] = {k: ids[t] for t, k in enumerate(self._key) if k >= 0}
        nl = self.next_moe.get(l)
        if self.prefetching and nl is not None:
            self._predict_small(nl, ids, self._prev_tok_lists(nl, None), self._hidden.get(l))

    def _predict_small(self, layer: int, prev_layer, prev_tok, hidden) -> None:
        """`_predict_and_prefetch` on Python lists: scores per token, top-`budget` by a stable sort (ties: the
        lower id, as the frequency predictor's tie-break intends)."""
        s = self.predictor.scores_lists(layer, prev_layer, prev_tok, hidden, self._T)  # T lists of E
        rng, B = range(self.num_experts), self.budget
        # sorted(reverse=True) is stable: equal scores keep the lower id first, as heapq.nlargest would (faster
        # at E <= a few hundred)
        pred = [sorted(rng, key=row.__getitem__, reverse=True)[:B] for row in s]
        if len(s) == 1:
            agg = top = s[0]
        else:
            agg = [sum(col) for col in zip(*s)]
            top = [max(col) for col in zip(*s)]
        pred, agg, top = self._keep_previous(pred, prev_tok, agg, top)
        self._pred[layer] = pred
        self._prefetch(layer, sorted({g for p in pred for g in p}), agg, top)

    def _predict_and_prefetch(self, layer: int, prev_layer, prev_tok, hidden) -> None:
        s = self.predictor.scores(layer, prev_layer, prev_tok, hidden, self._T)  # [T, E]
        # a stable sort, not topk: ties go to the lower id, as on the list path (topk's tie order is unspecified)
        pred = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, : self.budget]  # [T, B]
        store = self.layers[layer]
        fills = not (store is None or (store.cache.capacity == 0 and store.tier is None))
        agg = top = None
        if fills or self._sticky is not None:
            # [E] expected uses in the batch and best per-token probability, read back once each
            agg, top = s.sum(0).tolist(), s.max(0).values.tolist()
        if self._sticky is not None:
            rows, agg, top = self._keep_previous(pred.tolist(), prev_tok.tolist(), agg, top)
            pred = torch.tensor(rows, dtype=torch.int64)
        self._pred[layer] = pred
        if fills:
            self._prefetch(layer, ExpertPredictor.union(pred), agg, top)

    def _prefetch(self, layer: int, union: list[int], agg: list[float], top: list[float]) -> None:
        """Queue the predicted experts `union` (global ids) of `layer`: the likeliest (by `agg`, expected uses
        in the batch) to the dequantized cache, the next ones to the cold tier's packed slots."""
        store = self.layers[layer]
        if store is None or (store.cache.capacity == 0 and store.tier is None):
            return
        lo = self.local_of[layer]
        scores = [agg[g] for g in self.local[layer]]  # per local expert
        store.cache.set_scores(scores)
        want = [lo[g] for g in union if g in lo and top[g] >= self.min_prefetch_prob]
        want.sort(key=lambda i: -agg[self.local[layer][i]])
        c = store.cache.capacity
        if c:
            store.request(want[:c], protect=set(want[:c]), prefetch=True)
        if store.tier is not None:
            # The most likely experts go to the dequantized cache; the next ones to the packed slots, so a
            # predicted expert the cache cannot take is at least not a cold miss.
            store.tier.set_scores(scores)
            store.request_packed(want[c : c + store.tier.capacity])

    # ------------------------------------------------------------------------ reporting
    def wait_idle(self) -> None:
        self.worker.wait_idle()

    def summary(self) -> dict:
        """Per-layer metrics (stats.RoutingStats.summary) and totals: hit_rate, recall, precision, thrashing
        (prediction and thrashing are nan without a prefetcher or predicted eviction: nothing is observed)."""
        per = self.stats.summary()
        c = self.stats.c

        def tot(a: str, b: str) -> float:
            num = sum(v[a] for v in c.values())
            den = sum(v[b] for v in c.values())
            return num / den if den else float("nan")

        th = [v["thrashing"] for v in per.values() if not math.isnan(v["thrashing"])]
        return {"layers": per, "hit_rate": tot("hits", "lookups"), "recall": tot("pred_inter", "true_n"),
                "precision": tot("pred_inter", "pred_n"), "wasted_prefetch_frac": tot("wasted", "prefetched"),
                "thrashing": sum(th) / len(th) if th else float("nan"), "policy": self.policy,
                "predictor": self.predictor.name, "tiers": self.tier_stats()}

    def tier_stats(self) -> dict:
        """Memory and traffic per expert tier, summed over this rank's MoE layers (bytes are bytes held now):

        `cache`: dequantized experts (compute dtype): `experts`, `capacity`, `resident_bytes`, `hits`,
            `lookups` (experts looked up per layer call).
        `packed`: packed experts in memory: `experts`, `capacity`, `resident_bytes`, `allocated_bytes`,
            `budget_bytes` (all equal to the full packed size without a cold tier), `hits` (cache misses served
            from resident packed bytes).
        `cold`: the memory-mapped checkpoint (`enabled` False without one): `misses` (read on demand by the
            forward), `waits`, `prefetch_reads`, `transient_reads`, `evictions`, `bytes_read`.
        `layers`: {layer: {"cache_experts", "packed_experts", ColdExpertTier.stats() keys}}.
        """
        cache = dict.fromkeys(("experts", "capacity", "resident_bytes", "hits", "lookups"), 0)
        packed = dict.fromkeys(("experts", "capacity", "resident_bytes", "allocated_bytes", "budget_bytes",
                                "hits"), 0)
        cold = dict.fromkeys(("misses", "waits", "prefetch_reads", "transient_reads", "evictions", "bytes_read"), 0)
        layers: dict[int, dict] = {}
        c = self.stats.c
        for l, store in enumerate(self.layers):
            if store is None:
                continue
            n_cache = len(store.cache.resident)
            cache["experts"] += n_cache
            cache["capacity"] += store.cache.capacity
            cache["resident_bytes"] += store.cache.resident_bytes
            cache["hits"] += int(c.get(l, {}).get("hits", 0))
            cache["lookups"] += int(c.get(l, {}).get("lookups", 0))
            if store.tier is None:
                nb = 0 if store.packed is None else store.packed.nbytes
                packed["experts"] += store.num_local
                packed["capacity"] += store.num_local
                for k in ("resident_bytes", "allocated_bytes", "budget_bytes"):
                    packed[k] += nb
                layers[l] = {"cache_experts": n_cache, "packed_experts": store.num_local}
                continue
            t = store.tier.stats()
            packed["experts"] += t["resident_experts"]
            for k in ("capacity", "resident_bytes", "allocated_bytes", "budget_bytes", "hits"):
                packed[k] += t[k]
            for k in cold:
                cold[k] += t[k]
            layers[l] = {"cache_experts": n_cache, "packed_experts": t["resident_experts"], **t}
        cold["enabled"] = any(s is not None and s.tier is not None for s in self.layers)
        return {"cache": cache, "packed": packed, "cold": cold, "layers": layers}


# ---------------------------------------------------------------------------- building


def local_share(per_layer: int | None, n_loc: int, num_experts: int) -> int:
    """This rank's share of a per-layer expert count: ceil(per_layer * E_loc / E), capped at E_loc (None: E_loc).

    A rank with any experts gets at least one slot whenever `per_layer` >= 1.
    """
    if per_layer is None:
        return n_loc
    return min(n_loc, math.ceil(per_layer * n_loc / num_experts))


def quantize_local_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, *, bits: int, group_size: int = 64,
                           codebook: bool = False) -> PackedExperts | None:
    """Pack one layer's local experts `[E_loc, 2I, D]`, `[E_loc, D, I]` (None when E_loc = 0)."""
    if w_gate_up.shape[0] == 0:
        return None
    kw = {"bits": bits, "group_size": group_size, "codebook": codebook}
    return PackedExperts(gate_up=quantize(w_gate_up, **kw), down=quantize(w_down, **kw))


def fused_path_runs(device: torch.device | str, backend: str, dtype: torch.dtype) -> bool:
    """True where a decode-sized miss runs the compiled fused kernel on the packed bytes
    (`kernels.cpu.packed_expert_ffn`: CPU, the torch backend, fp32 activations, kernels built).

    There the dequantized expert cache does not pay, so `expert_cache_capacity` defaults to 0: the fused kernel
    reads ~4.5 bits per weight (4-bit, group 64) and unpacks in registers, while a cached fp32 copy is 32 bits per
    weight to read. Measured on tiny-moe, 4-bit, 2 shared EPYC cores: C = 0 runs at 0.89-1.08x (3 runs) the batch-1
    ms/token of C = E (every expert cached in fp32; `bench/experts.py`, back to back, median of 5 rounds), level
    with the full-precision bf16 experts at batch 1 (0.92x in an interleaved A/B) and 0.80x of them at batch 8.
    """
    return (torch.device(device).type == "cpu" and backend == "torch" and dtype == torch.float32
            and cpu_kernels_available())


def auto_prefetch(device: torch.device | str, full: bool, cold: bool = False) -> str:
    """The predictor `prefetch="auto"` picks: "none" when every expert fits (`full`); else DEFAULT_PREDICTOR on
    CUDA or with a cold tier (`cold`), and "none" for a CPU rank whose packed experts are all resident.

    Why: on CUDA a fill runs on the worker's own stream, overlapped with the forward, so a predicted expert
    arrives at no cost to the step. On CPU a miss runs the compiled fused kernel on the packed bytes, which is
    no slower than a hit on a dequantized fp32 copy (`fused_path_runs`), so a prefetch has nothing to hide: it
    only adds the prediction (one compiled call per layer) and fills, each a dequantize into a fresh fp32 copy
    (768 KiB per expert on tiny-moe, against ~110 KiB of packed bytes for the miss it replaces) that the forward
    then reads. Measured by `bench/experts.py` (2 shared EPYC cores, tiny-moe, 4-bit, batch 1, C = E/2 measured
    back to back with C = E, median of 5 rounds): without prefetch 1.12-1.16x, with hybrid prefetch 1.37-1.38x;
    with the prediction but no fills ~1.07-1.15x (in-process A/B). A cold tier keeps the predictor everywhere: a
    cold miss makes the forward wait for a read from the checkpoint file, which a prefetched read (a copy, no
    dequantize) hides.
    """
    if full:
        return "none"
    return DEFAULT_PREDICTOR if cold or torch.device(device).type == "cuda" else "none"


def build_runtime(*, model_cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                  device: torch.device, local: list[list[int]], packed: list[PackedExperts | None],
                  model_path: str | None, capacity: int | None, prefetch: str = "auto", policy: str | None = None,
                  backend: str = "torch", async_prefetch: bool = True,
                  counts: TransitionCounts | None = None, **runtime_kw) -> ExpertRuntime:
    """An ExpertRuntime for a model with `weights` (the rank's weight dict: router gates and post-attention norms
    feed the predictors), compute `dtype` and `device` (not attached to any model).

    `prefetch="auto"` picks `auto_prefetch(device, full)`: none when the cache (and, with a cold tier, the
    packed resident set) holds every local expert, else DEFAULT_PREDICTOR on CUDA and none on CPU.
    Markov counts come from `counts`, else `<model_path>/expert_transitions.safetensors` when present, else
    start at zero (learned online).
    Raises:
        ValueError: unknown prefetch name (names the field and the choices).
    """
    mc = model_cfg
    if prefetch not in PREDICTORS + ("auto",):
        raise ValueError(f"prefetch={prefetch!r} must be auto or one of {PREDICTORS}")
    if prefetch == "auto":
        resident = runtime_kw.get("resident")
        full = (capacity is None or capacity >= mc.num_experts) and (resident is None or resident >= mc.num_experts)
        prefetch = auto_prefetch(device, full, cold=resident is not None and resident < mc.num_experts)
    if counts is None and model_path and os.path.isfile(os.path.join(model_path, TRANSITIONS_FILE)):
        counts = TransitionCounts.load(os.path.join(model_path, TRANSITIONS_FILE))
        if counts.freq.shape != (mc.num_layers, mc.num_experts):
            log.warning("ignoring %s: shape %s does not match the model", TRANSITIONS_FILE, tuple(counts.freq.shape))
            counts = None
    w = weights
    gates = [w.get(f"layers.{l}.gate_w") for l in range(mc.num_layers)]
    norms = [w.get(f"layers.{l}.post_norm") for l in range(mc.num_layers)]
    pred = make_predictor(prefetch, num_layers=mc.num_layers, num_experts=mc.num_experts, top_k=mc.top_k,
                          moe_layers=mc.moe_layers, counts=counts, gate_weights=gates, norm_weights=norms,
                          norm_eps=mc.rms_norm_eps)
    return ExpertRuntime(model_cfg=mc, local=local, packed=packed, dtype=dtype, device=device,
                         capacity=capacity, predictor=pred, policy=policy, backend=backend,
                         async_prefetch=async_prefetch, warm_counts=counts, **runtime_kw)


def build_engine_experts(cfg, model_cfg: ModelConfig, weights: dict, local: list[list[int]], *, dtype: torch.dtype,
                         device: torch.device, gating_router: GatingRouter | None = None):
    """The engine seam (`RankEngine._build_experts`, before the model is built): returns an ExpertRuntime (the
    model's experts, `layers`, and its routing observer), or None to keep the full-precision `LocalExperts`.
    `weights`: the rank's weight dict (a load-time quantization takes the routed experts out of it); `dtype`,
    `device`: the model's compute dtype and device.

    Packed experts are used when `cfg.model` is a packed checkpoint (read: only this rank's experts) or
    `cfg.weight_bits` is set (quantized at load time, group size `cfg.weight_group_size`, uniform grid).
    With `cfg.resident_experts` below E (packed checkpoint only) a layer keeps only its share of packed experts
    in memory (`ColdExpertTier`) and reads the others from the memory-mapped checkpoint when needed; the
    dequantized cache then defaults to empty (`expert_cache_capacity` None -> 0), as it does wherever the
    compiled fused kernel serves misses (`fused_path_runs`: CPU); elsewhere None means every local expert.
    Raises:
        ValueError: weight_bits disagrees with a packed checkpoint's bits; expert_cache_capacity or an explicit
            prefetch predictor without packed experts; resident_experts without a packed checkpoint; unknown
            prefetch / kernel_backend.
    """
    mc = model_cfg
    resident = getattr(cfg, "resident_experts", None)
    packed_dir = is_packed_checkpoint(cfg.model)
    if resident is not None and not packed_dir:
        raise ValueError(f"resident_experts={resident} needs a packed checkpoint (moeray quantize) to read the "
                         f"other experts from; model={cfg.model!r} is not one")
    cold = None
    if packed_dir:
        qc = read_quant_config(cfg.model)
        if cfg.weight_bits is not None and cfg.weight_bits != qc["bits"]:
            raise ValueError(f"weight_bits={cfg.weight_bits} but model={cfg.model!r} is already packed at "
                             f"bits={qc['bits']}; quantize the full-precision checkpoint instead")
        from actors.model.weights import CheckpointReader

        reader = CheckpointReader(cfg.model)
        if resident is not None and resident < mc.num_experts:
            cold = PackedExpertReader(cfg.model, mc)
        # Layers served by a cold tier read nothing now (their slots fill when the runtime warms them).
        packed = [load_packed_experts(cfg.model, mc, l, local[l], reader).to(device)
                  if mc.moe_layers[l] and local[l] and local_share(resident, len(local[l]), mc.num_experts) >=
                  len(local[l]) else None for l in range(mc.num_layers)]
    elif cfg.weight_bits is not None:
        packed = []
        for l in range(mc.num_layers):
            if not mc.moe_layers[l]:
                packed.append(None)
                continue
            gu, dn = weights.pop(f"layers.{l}.w_gate_up"), weights.pop(f"layers.{l}.w_down")
            packed.append(quantize_local_experts(gu, dn, bits=cfg.weight_bits, group_size=cfg.weight_group_size))
    else:
        asked = [f"{k}={v!r}" for k, v, on in (
            ("expert_cache_capacity", cfg.expert_cache_capacity, cfg.expert_cache_capacity is not None),
            ("prefetch", cfg.prefetch, cfg.prefetch not in ("none", "auto"))) if on]
        if asked:
            raise ValueError(f"{' and '.join(asked)} apply to packed experts: set weight_bits or serve a packed "
                             "checkpoint (moeray quantize)")
        return None
    capacity = cfg.expert_cache_capacity
    if capacity is None and cold is not None:
        capacity = 0  # a model served from the cold tier does not fit dequantized: cache only when asked to
    if capacity is None and fused_path_runs(device, cfg.kernel_backend, dtype):
        capacity = 0  # CPU: the fused kernel on the packed bytes beats a dequantized copy (`fused_path_runs`)
    return build_runtime(model_cfg=mc, weights=weights, dtype=dtype, device=device, local=local, packed=packed,
                         model_path=cfg.model, capacity=capacity, prefetch=cfg.prefetch, backend=cfg.kernel_backend,
                         cold=cold, resident=resident if cold is not None else None, gating_router=gating_router)


# ---------------------------------------------------------------------------- calibration


class _RoutingRecorder:
    """The routing observer of `record_routing`: the model's own observer first, then a copy of ids and hidden."""

    def __init__(self, inner, ids_TLK: torch.Tensor, hid_TLD: torch.Tensor | None):
        self.inner, self.ids, self.hid = inner, ids_TLK, hid_TLD

    def begin_step(self, meta, num_tokens: int, gating) -> None:
        self.inner.begin_step(meta, num_tokens, gating)

    def on_route(self, l: int, t: torch.Tensor) -> None:
        self.inner.on_route(l, t)
        self.ids[:, l] = t.cpu()

    def on_hidden(self, l: int, h: torch.Tensor) -> None:
        self.inner.on_hidden(l, h)
        if self.hid is not None:
            self.hid[:, l] = h.float().cpu()


@torch.inference_mode()
def record_routing(engine, token_ids: list[int], *, with_hidden: bool = False) -> tuple[RoutingTrace, torch.Tensor]:
    """Run one sequence through `engine.prompt_logits` (world size 1) and record its routing.

    Returns:
        (RoutingTrace with ids `[T, L, K]` (-1 at dense layers) and hidden `[T, L, D]` float32 or None,
         logits `[T, V]` fp32).
    """
    model = engine.model
    mc = model.cfg
    T = len(token_ids)
    ids = torch.full((T, mc.num_layers, mc.top_k), -1, dtype=torch.int64)
    hid = torch.zeros(T, mc.num_layers, mc.hidden_size) if with_hidden else None
    logits = engine.prompt_logits(list(token_ids), observer=_RoutingRecorder(model.observer, ids, hid))
    return RoutingTrace(ids=ids, hidden=hid), logits


def transitions_from_traces(traces: list[RoutingTrace], num_layers: int, num_experts: int) -> TransitionCounts:
    """Markov counts of recorded sequences (layer-to-layer within a token, token-to-token within a layer)."""
    c = TransitionCounts.zeros(num_layers, num_experts)
    for tr in traces:
        moe = [l for l in range(num_layers) if bool((tr.ids[:, l] >= 0).any())]
        for i, l in enumerate(moe):
            cur = tr.ids[:, l]
            prev_tok = torch.cat([torch.full_like(cur[:1], -1), cur[:-1]])
            c.observe(l, cur, tr.ids[:, moe[i - 1]] if i else None, prev_tok)
    return c


def calibrate(engine, token_chunks: Iterable[list[int]], out_path: str | None = None,
              meta: dict | None = None) -> TransitionCounts:
    """Calibration run: route `token_chunks` through the model, count expert transitions, fit the lookahead
    gates (`fit_lookahead_gates`) and then the Markov / hybrid predictors' log-linear weights on them
    (`fit_loglinear`, block-prequential, with the fitted lookahead); optionally save all three (`out_path`,
    usually `<model>/expert_transitions.safetensors`)."""
    mc = engine.model.cfg
    traces = [record_routing(engine, ch, with_hidden=True)[0] for ch in token_chunks if len(ch) > 1]
    counts = transitions_from_traces(traces, mc.num_layers, mc.num_experts)
    w = engine.model.w
    gates = [w.get(f"layers.{l}.gate_w") for l in range(mc.num_layers)]
    gates = [g.float() if g is not None and mc.moe_layers[l] else None for l, g in enumerate(gates)]
    norms = [w.get(f"layers.{l}.post_norm") for l in range(mc.num_layers)]
    counts.lookahead_gates = fit_lookahead_gates(traces, gates, norms, mc.rms_norm_eps) or None
    look = make_predictor("lookahead", num_layers=mc.num_layers, num_experts=mc.num_experts, top_k=mc.top_k,
                          moe_layers=mc.moe_layers, counts=counts, gate_weights=gates, norm_weights=norms,
                          norm_eps=mc.rms_norm_eps)  # with the fitted gates, as served
    counts.weights = fit_loglinear(traces, mc.num_layers, mc.num_experts, mc.top_k, lookahead=look)
    if out_path:
        counts.save(out_path, meta)
    return counts
