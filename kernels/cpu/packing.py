"""bf16 weights in the 32-column panel layout of the panel GEMM (kernels/csrc/gemm_panel.c), packed once per weight.

Shape legend: N = output features, K = input features, E = stacked matrices (experts), P = ceil(N / 32) panels.

Layout (`pack_panels`): panel p, row k holds 16 int32 words; word j = bf16 bits of w[32p + j, k] (low half) and
of w[32p + 16 + j, k] (high half); columns past N are zero. The kernel gets 32 columns per 64-byte load and
widens them exactly with one shift and one mask, and its outer-product micro-kernel needs no horizontal sums:
at decode sizes ~1.5-2x the throughput of the row-major kernel (BENCHMARKS.md).

Cache (`panels`): the weights stay where their owners keep them (row-major bf16, read by other code too); the
packed copy is kept beside them, keyed by the weight tensor object, and is used only while that object is alive
and unmodified (its in-place version counter unchanged). A weight is packed the second time it is seen, so a
tensor multiplied once (a temporary view) is never packed. Memory: one packed copy costs the weight's own bf16
bytes (N rounded up to 32); all copies together stay under `budget_bytes()` (`MOERAY_PANEL_CACHE_BYTES`, default
`tuning.PANEL_CACHE_BYTES`); past it, weights run the row-major kernel. Inference tensors (no version counter)
are not packed.
"""
from __future__ import annotations

import os
import threading
import weakref

import torch

from kernels import tuning

PANEL = 32


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """The panel layout of bf16 `w` [N, K] (or a stack [E, N, K]): int32 [P, K, 16] (or [E, P, K, 16]).

    Raises:
        ValueError: `w` is not a 2-D or 3-D bf16 tensor.
    """
    if w.dtype != torch.bfloat16 or w.dim() not in (2, 3):
        raise ValueError(f"pack_panels: weight dtype={w.dtype}, shape={tuple(w.shape)}: needs bf16 [N, K] or [E, N, K]")
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    E, N, K = w3.shape
    P = -(-N // PANEL)
    padded = torch.zeros(E, P * PANEL, K, dtype=torch.bfloat16)
    padded[:, :N] = w3
    # [E, P, half, j, K] -> [E, P, K, j, half]: the two bf16 of word j are columns j (low) and 16 + j (high)
    h = padded.view(torch.int16).view(E, P, 2, 16, K).permute(0, 1, 4, 3, 2).contiguous()
    out = h.view(torch.int32).view(E, P, K, 16)
    return out if w.dim() == 3 else out[0]


def budget_bytes() -> int:
    """Most bytes all packed copies may hold together (`MOERAY_PANEL_CACHE_BYTES`, else the tuning default)."""
    env = os.environ.get("MOERAY_PANEL_CACHE_BYTES")
    return int(env) if env else tuning.PANEL_CACHE_BYTES


class _Cache:
    """weight object id -> (weakref to it, its version when packed, packed copy or None if only seen once)."""

    def __init__(self):
        self.entries: dict[int, tuple[weakref.ref, int, torch.Tensor | None]] = {}
        self.used = 0
        self.lock = threading.Lock()

    def drop(self, key: int, ref: weakref.ref) -> None:
        with self.lock:
            e = self.entries.get(key)
            if e is not None and e[0] is ref:
                del self.entries[key]
                if e[2] is not None:
                    self.used -= e[2].nbytes

    def miss(self, w: torch.Tensor) -> torch.Tensor | None:
        if w.is_inference() or w.device.type != "cpu" or w.dtype != torch.bfloat16 or not w.is_contiguous():
            return None
        key = id(w)
        with self.lock:
            e = self.entries.get(key)
            version = w._version
            if e is not None and e[0]() is w and e[1] == version:
                if e[2] is not None:
                    return e[2]
                nbytes = -(-w.shape[-2] // PANEL) * PANEL * w.shape[-1] * 2 * (w.shape[0] if w.dim() == 3 else 1)
                if self.used + nbytes > budget_bytes():
                    return None
                packed = pack_panels(w)
                self.entries[key] = (e[0], version, packed)
                self.used += packed.nbytes
                return packed
            if e is not None and e[2] is not None:  # a dead object's id reused, or the weight changed in place
                self.used -= e[2].nbytes
            self.entries[key] = (weakref.ref(w, lambda r, k=key: self.drop(k, r)), version, None)
            return None


_cache = _Cache()


def panels(w: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of bf16 `w` ([N, K] or a stack [E, N, K], contiguous, on CPU) if it has one: made the second
    time `w` is seen (within the budget); None otherwise (the caller runs the row-major kernel)."""
    e = _cache.entries.get(id(w))
    if e is not None and e[2] is not None and e[0]() is w and e[1] == w._version:
        return e[2]
    return _cache.miss(w)


def cache_bytes() -> int:
    """Bytes the packed copies hold now."""
    return _cache.used
