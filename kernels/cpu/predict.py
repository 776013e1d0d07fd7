"""The expert predictor's decode-step bookkeeping, one compiled call per layer (C: kernels/csrc/predict.c).

Markov counts (`MarkovTables`), the lookahead gate (`GateLogprobs`), and one MoE layer's whole step
(`prefetch_step`).

Shape legend: L = layers, E = experts, T = tokens, K = routed experts per token, D = hidden,
B = experts predicted per token.

The formulas are those of `actors/prefetch/predictors.py` (float64 counts, float32 probabilities). Id rows are
Python lists (ragged, -1 padded here into one C array) of at most 64 ids each; ids outside [0, E) are ignored as
-1 padding is. Every method returns None (or False) when the kernel cannot run; the caller keeps its Python path.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import tuning
from kernels.cpu import _build
from kernels.cpu._abi import F32, MarkovObserveArgs, MarkovProbsArgs, PrefetchStepArgs, f32_cpu

_F64 = torch.float64
_MAX_SET = 64  # the C predictor's bound on ids per token row


def _id_rows(rows: list[list[int]] | None) -> tuple[ctypes.Array | None, int]:
    """Ragged id rows as one -1-padded C long array and its row length (None, 0: no rows or all empty)."""
    if rows is None:
        return None, 0
    if len(rows) == 1:  # decode at batch 1
        r = rows[0]
        return ((ctypes.c_long * len(r))(*r), len(r)) if r else (None, 0)
    k = max(len(r) for r in rows) if rows else 0
    if k == 0:
        return None, 0
    flat = [e for r in rows for e in (list(r) + [-1] * (k - len(r)))]
    return (ctypes.c_long * len(flat))(*flat), k


def _addr(a: ctypes.Array | None) -> int | None:
    """A C array's address for a pointer field (None: 0); the caller keeps the array alive during the call."""
    return None if a is None else ctypes.addressof(a)


class MarkovTables:
    """Compiled decode-step access to Markov transition counts (`actors.prefetch.predictors`'s
    `TransitionCounts`): pointers checked and computed once, then one C call per layer and step.

    Args:
        freq_LE: `[L, E]`, inter_LEE / intra_LEE: `[L, E, E]` float64 contiguous CPU tensors (updated in place;
            this object keeps them alive).
    Attributes:
        ok: False when the kernels cannot run on these tensors (then every method returns None / False).
    """

    def __init__(self, freq_LE: torch.Tensor, inter_LEE: torch.Tensor, intra_LEE: torch.Tensor):
        self._keep = (freq_LE, inter_LEE, intra_LEE)
        self.ok = _build.lib() is not None and all(
            t.dtype is _F64 and t.device.type == "cpu" and t.is_contiguous() for t in self._keep)
        L, E = freq_LE.shape
        self.E = E
        if self.ok:
            self._f, self._i, self._t = freq_LE.data_ptr(), inter_LEE.data_ptr(), intra_LEE.data_ptr()

    def observe(self, layer: int, ids: list[list[int]], prev_layer: list[list[int]] | None,
                prev_tok: list[list[int]] | None) -> bool:
        """Layer `layer`'s counts updated from a step (`TransitionCounts.observe`'s rule: each token's distinct
        experts B get freq[b] += 1, inter[a, b] += 1 for a in its previous MoE layer's set, intra[a, b] += 1 for a
        in its predecessor's set here). Rows are lists of ids (-1 ignored; may be empty). Returns False (nothing
        done) when the kernel cannot run (no kernels, rows over 64 ids)."""
        if not self.ok:
            return False
        a, k = _id_rows(ids)
        pl, kp = _id_rows(prev_layer)
        pt, kt = _id_rows(prev_tok)
        if k > _MAX_SET or kp > _MAX_SET or kt > _MAX_SET:
            return False
        if a is not None:
            E = self.E
            _build.lib().moeray_markov_observe(ctypes.byref(MarkovObserveArgs(
                self._f + 8 * layer * E, self._i + 8 * layer * E * E, self._t + 8 * layer * E * E, E, len(ids),
                _addr(a), k, _addr(pl), kp, _addr(pt), kt)))
        return True

    def probs(self, layer: int, alpha: float, weights: list[float], prev_layer: list[list[int]] | None,
              prev_tok: list[list[int]] | None, num_tokens: int, look_TE: torch.Tensor | None = None
              ) -> list[list[float]] | None:
        """Per token the Markov (with `look_TE`, hybrid) expert distribution: softmax over E of
        log P(b) + w_inter * PMI_inter + w_intra * PMI_intra [+ w_look * look] (`MarkovPredictor`,
        `HybridPredictor`; additive smoothing `alpha`).

        Args:
            weights: (w_inter, w_intra[, w_look]). prev_layer / prev_tok: T rows of ids, or None.
            look_TE: optional `[T, E]` float32 contiguous lookahead log-probabilities.
        Returns:
            T lists of E probabilities, or None when the kernel cannot run.
        """
        if not self.ok:
            return None
        pl, kp = _id_rows(prev_layer)
        pt, kt = _id_rows(prev_tok)
        if kp > _MAX_SET or kt > _MAX_SET:
            return None
        E, T = self.E, num_tokens
        out = (ctypes.c_float * (T * E))()
        w2 = weights[2] if look_TE is not None else 0.0
        _build.lib().moeray_markov_probs(ctypes.byref(MarkovProbsArgs(
            self._f + 8 * layer * E, self._i + 8 * layer * E * E, self._t + 8 * layer * E * E, E, alpha, weights[0],
            weights[1], w2, T, _addr(pl), kp, _addr(pt), kt, None if look_TE is None else look_TE.data_ptr(),
            ctypes.addressof(out))))
        flat = list(out)
        return [flat[t * E : (t + 1) * E] for t in range(T)] if T > 1 else [flat]


class GateLogprobs:
    """The lookahead predictor's `log_softmax(gate_l(rmsnorm(h) * norm_l))` for a few rows in one call per layer,
    with the per-layer weights checked once.

    Args:
        gates: per layer `[E, D]` float32 router weights (None for dense layers). norms: per layer `[D]` float32
            RMSNorm weights or None. eps: RMSNorm epsilon.
    """

    def __init__(self, gates: list, norms: list, eps: float):
        self.eps = eps
        self._keep = []
        self._ptrs: list[tuple | None] = []
        for g, n in zip(gates, norms):
            ok = (g is not None and f32_cpu(g) and g.dim() == 2 and g.is_contiguous()
                  and (n is None or (f32_cpu(n) and n.is_contiguous() and n.shape == (g.shape[1],))))
            self._keep.append((g, n))
            self._ptrs.append((g.data_ptr(), None if n is None else n.data_ptr(), *g.shape) if ok else None)

    def ptrs(self, layer: int) -> tuple | None:
        """(gate pointer, norm pointer or None, E, D) of `layer`, or None where the kernel cannot run."""
        return self._ptrs[layer] if _build.lib() is not None else None

    def __call__(self, layer: int, h_TD: torch.Tensor) -> torch.Tensor | None:
        """`[T, E]` float32 log-probabilities for `h_TD` `[T, D]` float32 CPU rows, or None when the kernel
        cannot run (no kernels, other dtypes/devices, more than `MAX_KERNEL_ROWS` rows, a layer without gate)."""
        p = self._ptrs[layer]
        T = h_TD.shape[0]
        if p is None or _build.lib() is None or T > tuning.MAX_KERNEL_ROWS or h_TD.dtype is not F32 \
                or h_TD.device.type != "cpu" or h_TD.stride(-1) != 1:
            return None
        gp, npt, E, D = p
        out = torch.empty(T, E, dtype=torch.float32)
        scratch = (ctypes.c_float * D)()
        _build.lib().moeray_gate_logprobs(h_TD.data_ptr(), h_TD.stride(0), T, D, npt, self.eps, gp, E,
                                          out.data_ptr(), scratch)
        return out


def prefetch_step(tables: MarkovTables, layer: int, ids_TK: torch.Tensor, pred: list[list[int]] | None,
                  prev_layer_TK: torch.Tensor | None, prev_tok: list[list[int]] | None, next_layer: int | None,
                  alpha: float, weights: list[float] | None, next_prev_tok: list[list[int]] | None,
                  h_TD: torch.Tensor | None, look: tuple | None, eps: float, budget: int):
    """One MoE layer of a decode step's expert-prediction bookkeeping in one call (the C function
    `moeray_prefetch_step`): score `pred` against the routing, router thrash against the predecessors' sets,
    learn the layer's Markov counts, and predict `next_layer` (Markov, or hybrid with `look`).

    Args:
        tables: the predictor's `MarkovTables`. ids_TK: `[T, K]` int64 CPU contiguous routing of `layer` (-1 pad).
        pred: the prediction made for `layer` (T rows), or None. prev_layer_TK: the previous MoE layer's routing
            `[T, K']` int64 CPU contiguous, or None. prev_tok: T rows, each token's predecessor's set here.
        next_layer: the MoE layer to predict, or None. alpha, weights: the Markov smoothing and per-layer
            weights of `next_layer` (w_inter, w_intra[, w_look]). next_prev_tok: predecessors' sets there.
        h_TD: `[T, D]` float32 hidden state (for the lookahead term), look: `GateLogprobs.ptrs(next_layer)` or
            None (Markov only). eps: its RMSNorm epsilon. budget: experts predicted per token (B).
    Returns:
        (stats, next): stats = [pred hits, predicted, routed, tokens scored, thrash sum, thrash pairs];
        next = (T rows of B predicted ids, agg [E] summed probabilities, top [E] max probabilities) or None
        without `next_layer`. None when the kernel cannot run (rows over 64 ids, more than `MAX_KERNEL_ROWS`
        tokens).
    """
    if not tables.ok:
        return None
    T, K = ids_TK.shape
    E = tables.E
    pr, B = _id_rows(pred)
    pt, kt = _id_rows(prev_tok)
    npt, knt = _id_rows(next_prev_tok)
    if max(K, B, kt, knt) > _MAX_SET or T > tuning.MAX_KERNEL_ROWS or (pred is not None and B != len(pred[0])):
        return None
    stats = (ctypes.c_double * 6)()
    f, i, t = tables._f, tables._i, tables._t
    args = PrefetchStepArgs(  # steps 1-3; the fields of step 4 stay 0 (absent) without next_layer
        stats=ctypes.addressof(stats), ids=ids_TK.data_ptr(), K=K, T=T, pred=_addr(pr), B=B,
        pl=None if prev_layer_TK is None else prev_layer_TK.data_ptr(),
        Kp=0 if prev_layer_TK is None else prev_layer_TK.shape[1], pt=_addr(pt), Kt=kt,
        freq=f + 8 * layer * E, inter=i + 8 * layer * E * E, intra=t + 8 * layer * E * E, E=E)
    if next_layer is None:
        _build.lib().moeray_prefetch_step(ctypes.byref(args))
        return list(stats), None
    D = h_TD.shape[1] if look is not None else 0
    pred_out = (ctypes.c_long * (T * budget))()
    agg, top = (ctypes.c_float * E)(), (ctypes.c_float * E)()
    scratch = (ctypes.c_float * (D + 2 * T * E))()
    w2 = weights[2] if look is not None else 0.0
    nl = next_layer
    args.nfreq, args.ninter, args.nintra = f + 8 * nl * E, i + 8 * nl * E * E, t + 8 * nl * E * E
    args.alpha, args.w0, args.w1, args.w2 = alpha, weights[0], weights[1], w2
    args.npt, args.Knt = _addr(npt), knt
    if look is not None:
        args.h, args.sh, args.norm, args.gate = h_TD.data_ptr(), h_TD.stride(0), look[1], look[0]
    args.D, args.eps, args.NB = D, eps, budget
    args.pred_out, args.agg, args.top, args.scratch = (ctypes.addressof(a) for a in (pred_out, agg, top, scratch))
    _build.lib().moeray_prefetch_step(ctypes.byref(args))
    po = list(pred_out)
    return list(stats), ([po[r * budget : (r + 1) * budget] for r in range(T)], list(agg), list(top))
