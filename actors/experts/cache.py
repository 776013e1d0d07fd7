"""The dequantized expert cache of one layer (`ExpertCache`) and the eviction bookkeeping (`EvictionClock`) that
it and the cold tier (`cold_tier.ColdExpertTier`) both use.

Shape legend: D = hidden, I = expert intermediate, E_loc = this rank's experts of a layer.

Eviction policies (EVICTION_POLICIES), the same for `ExpertCache` and `cold_tier.ColdExpertTier`: `lru` least
recently used; `lfu` least frequently used (ties: LRU); `predicted` the lowest score of the latest prediction
for the layer (ties: LRU). Under `predicted` a speculative (prefetch) fill must outscore the expert it evicts.
Each cache and each tier owns one clock: a use is counted where it happened (a cache lookup, a tier demand).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

EVICTION_POLICIES = ("lru", "lfu", "predicted")


class EvictionClock:
    """The eviction bookkeeping of one layer's E_loc experts, one per `ExpertCache` and per `ColdExpertTier`:
    a tick per use, each expert's last use and use count, the latest predicted scores, and the victim choice.

    Not locked: its owner calls it under its own lock, except `set_scores` (one reference swap: readers see the
    old list or the new one). Candidates are passed in the owner's order, which breaks the remaining ties.
    Raises:
        ValueError: unknown policy.
    """

    def __init__(self, num_experts: int, policy: str):
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy={policy!r} must be one of {EVICTION_POLICIES}")
        self.policy = policy
        self.last = [0] * num_experts
        self.uses = [0] * num_experts
        self.score = [0.0] * num_experts
        self.tick = 0

    def touch(self, used: Iterable[int]) -> None:
        """Advance one tick and mark each of `used` as used at it (a use count per occurrence)."""
        self.tick += 1
        for e in used:
            self.last[e] = self.tick
            self.uses[e] += 1

    def refresh(self, e: int) -> None:
        """Count `e` as recent at the current tick, without a use (a freshly read expert is not the next LRU
        victim)."""
        self.last[e] = max(self.last[e], self.tick)

    def set_scores(self, scores: list[float]) -> None:
        """Latest predicted usefulness of each local expert (E_loc floats; for the `predicted` policy)."""
        self.score = scores

    def victim(self, cands: list[int]) -> int | None:
        """The candidate to evict under the policy (ties broken by LRU, then candidate order); None if none."""
        if not cands:
            return None
        last, uses, score = self.last, self.uses, self.score
        if self.policy == "lru":
            return min(cands, key=lambda e: last[e])
        if self.policy == "lfu":
            return min(cands, key=lambda e: (uses[e], last[e]))
        return min(cands, key=lambda e: (score[e], last[e]))

    def victim_for(self, e: int, cands: list[int], speculative: bool) -> int | None:
        """The victim that makes room for `e`; None if there is no candidate or, for a speculative (prefetch)
        fill under `predicted`, `e` does not score higher than the victim."""
        v = self.victim(cands)
        if v is None or (speculative and self.policy == "predicted" and self.score[e] <= self.score[v]):
            return None
        return v


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
        self._clock = EvictionClock(num_experts, policy)
        self.capacity, self.num_experts, self.policy, self.loader = capacity, num_experts, policy, loader
        self._ready: dict[int, tuple] = {}
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
            self._clock.touch(used)
            return {e: self._ready[e] for e in used if e in self._ready}

    def set_scores(self, scores: list[float]) -> None:
        """Latest predicted usefulness of each local expert (E_loc floats; for the `predicted` policy)."""
        self._clock.set_scores(scores)

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

    def _cands(self, exclude: set[int]) -> list[int]:
        return [e for e in self._ready if e not in exclude]

    def _victim(self, exclude: set[int]) -> int | None:
        return self._clock.victim(self._cands(exclude))

    def _admit(self, e: int, protect: set[int], speculative: bool) -> bool:
        if len(self._ready) < self.capacity:
            return True
        return self._clock.victim_for(e, self._cands(protect | {e}), speculative) is not None

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
