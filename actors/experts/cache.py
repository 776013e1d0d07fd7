"""The dequantized expert cache of one layer (`ExpertCache`) and the eviction choice it shares with the cold tier.

Shape legend: D = hidden, I = expert intermediate, E_loc = this rank's experts of a layer.

Eviction policies (EVICTION_POLICIES), the same for `ExpertCache` and `cold_tier.ColdExpertTier`: `lru` least
recently used; `lfu` least frequently used (ties: LRU); `predicted` the lowest score of the latest prediction
for the layer (ties: LRU). Under `predicted` a speculative (prefetch) fill must outscore the expert it evicts.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

EVICTION_POLICIES = ("lru", "lfu", "predicted")


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
