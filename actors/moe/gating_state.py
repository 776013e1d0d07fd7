"""Per-sequence routing memory of the gating router, and the router-thrash metric computed from it.

Per-sequence state (previous expert set, previous layer input, velocity) lives in `RoutingState` slots
indexed by the engine's sequence slot; a token at position 0 starts fresh. The same state gives the
router-thrash metric (Jaccard distance, as `stats.jaccard_distance`, between consecutive tokens' expert
sets) for every policy. Invariant: whoever reads `prev_ids` / `prev_x` calls `flush()` first.

Shape legend: T = tokens in the call, K' = widest row of a call (>= 1), D = hidden, S = sequence slots,
L = layers, Kmax = the widest set any policy can choose.
"""
from __future__ import annotations

import threading

import torch

from actors.moe.gating import GatingBatch


class RoutingState:
    """Per-sequence routing memory, one slot per live sequence, plus thrash counters per layer.

    prev_ids [S, L, Kmax] int64 (-1 = none): the last routed token's final expert set.
    prev_x [S, L, D]: that token's MoE layer input (velocity; allocated on first use). velocity [S, L] fp32
    (nan = unset).

    Accounting is deferred: each step's final sets are queued (one small op per layer) and accounted together
    for up to `WINDOW` steps in one vectorised pass, since on the decode path a dozen ops per step cost more
    than the step's attention. Anything that reads `prev_ids` / `prev_x` calls `flush()` first (the
    `sticky` and `velocity` policies, `GatingRouter.stats`), so readers always see every routed token.
    """

    WINDOW = 32  # steps accounted together at most

    def __init__(self, num_slots: int, num_layers: int, num_experts: int, k_max: int, hidden: int,
                 device: torch.device | str = "cpu"):
        self.num_experts = num_experts
        self.k_max = k_max
        self.prev_ids = torch.full((num_slots, num_layers, k_max), -1, dtype=torch.int64, device=device)
        self.shape = (num_slots, num_layers, hidden)
        self.device = device
        self.prev_x: torch.Tensor | None = None  # allocated by the first velocity call (`inputs()`)
        self.velocity = torch.full((num_slots, num_layers), float("nan"), device=device)
        self.thrash_sum = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.thrash_n = torch.zeros(num_layers, dtype=torch.int64, device=device)
        # the current step (`GatingBatch.step_key`) and its routing per batch: [(batch, [(layer, ids [T, K'], x_last)])],
        # two batches under two-batch overlap (the step's micro-batches, their layers alternating), then the queued
        # earlier steps, accounted by `flush`
        self.step = None
        self.open: list[tuple[GatingBatch, list]] = []
        self.window: list[tuple[GatingBatch, list]] = []
        self._layer_idx: dict[tuple[int, ...], torch.Tensor] = {}
        self.lock = threading.Lock()  # stats() may flush from another thread

    def inputs(self) -> torch.Tensor:
        """prev_x [S, L, D] fp32, allocated on first use. A velocity request's predecessor input is stored from
        its own first call on, and a token at position 0 never reads it, so lazy allocation loses nothing."""
        if self.prev_x is None:
            self.prev_x = torch.zeros(*self.shape, dtype=torch.float32, device=self.device)
        return self.prev_x

    def record(self, layer: int, batch: GatingBatch, ids: torch.Tensor, x_TD: torch.Tensor) -> None:
        """Queue layer `layer`'s final expert sets of `batch` (and inputs, once a velocity policy asked for
        them); `flush` accounts them."""
        if self.step is not batch.step_key:
            with self.lock:
                self._close_step()
                full = len(self.window) >= self.WINDOW
            if full:
                self.flush()
        x_last = x_TD[batch.last_rows].float() if self.prev_x is not None and ids.numel() else None
        with self.lock:  # stats() may flush from another thread between these lines
            if self.step is not batch.step_key:
                self.step, self.open = batch.step_key, []
            pending = next((p for b, p in self.open if b is batch), None)
            if pending is None:
                pending = []
                self.open.append((batch, pending))
            if ids.numel():
                pending.append((layer, ids, x_last))

    def _close_step(self) -> None:
        """Move the current step's batches to the window, in the order they were first routed (caller holds the
        lock). A step's micro-batches hold disjoint sequences, so either order keeps each sequence's tokens in time
        order."""
        self.window += [(b, p) for b, p in self.open if p]
        self.step, self.open = None, []

    def flush(self) -> None:
        """Thrash accounting for every queued step, then store each sequence's last token's sets. Called before
        anything reads `prev_ids`/`prev_x` and by `GatingRouter.stats`. Flushing mid-step (from another
        thread) is safe: a layer reads its own `prev_ids` before its own record, and each layer's steps are
        accounted in time order."""
        with self.lock:
            self._close_step()
            window, self.window = self.window, []
        if not window:
            return
        with torch.inference_mode():  # stats() may flush outside the step's inference mode
            run: list = []
            for step in window:  # consecutive steps with the same layers and width are accounted together
                if run and _run_key(run[-1]) != _run_key(step):
                    self._account(run)
                    run = []
                run.append(step)
            self._account(run)

    def _account(self, steps: list) -> None:
        """Jaccard distance of each token's final set to its predecessor's, for steps with the same layers.

        A token's predecessor is the latest earlier token of its slot in these steps (tokens of a slot appear in
        time order: steps in order, a sequence's rows contiguous and in position order), else the slot's stored
        set; a token at position 0 has none."""
        key = tuple(l for l, _, _ in steps[0][1])
        layers = self._layer_idx.get(key)
        if layers is None:
            layers = self._layer_idx[key] = torch.tensor(key, dtype=torch.int64, device=self.prev_ids.device)
        width = max(c.shape[1] for _, c, _ in steps[0][1])
        cur = torch.cat([torch.stack([_pad(c, width) for _, c, _ in pend], dim=1) for _, pend in steps])  # [N, Lm, K']
        if width < self.k_max:
            cur = torch.cat([cur, cur.new_full((*cur.shape[:2], self.k_max - width), -1)], dim=2)
        if len(steps) == 1:
            slots, pos = steps[0][0].slots_T, steps[0][0].positions_T
        else:
            slots = torch.cat([b.slots_T for b, _ in steps])
            pos = torch.cat([b.positions_T for b, _ in steps])
        N = slots.numel()
        order = torch.argsort(slots, stable=True)  # slot groups, each in time order
        so = slots[order]
        same = torch.zeros(N, dtype=torch.bool, device=slots.device)
        same[1:] = so[1:] == so[:-1]
        pred = torch.empty_like(order)
        pred[order] = torch.where(same, order.roll(1), -1)  # [N] row of the predecessor in these steps, or -1
        inner = pred >= 0
        prev = torch.where(inner[:, None, None], cur[pred.clamp(min=0)], self.prev_ids[slots][:, layers])
        prev.masked_fill_((pos == 0)[:, None, None], -1)
        # Jaccard distance |A ^ B| / |A u B| per token and layer, by broadcasting over the K x K pairs
        vb = prev >= 0
        inter = ((cur[..., :, None] == prev[..., None, :]) & vb[..., None, :]).sum((2, 3))  # ids >= 0 never match -1
        na, nb = (cur >= 0).sum(2), vb.sum(2)
        has = nb > 0
        d = torch.where(has, 1 - inter / (na + nb - inter).clamp(min=1), 0.0)
        self.thrash_sum.index_add_(0, layers, d.sum(0).double())
        self.thrash_n.index_add_(0, layers, has.sum(0))
        is_last = torch.ones(N, dtype=torch.bool, device=slots.device)
        is_last[:-1] = ~same[1:]
        last = order[is_last]  # each slot's latest token
        self.prev_ids[slots[last][:, None], layers[None, :]] = cur[last]
        for b, pend in steps:
            for l, _, x_last in pend:
                if x_last is not None:
                    self.prev_x[b.slots_last, l] = x_last

    def thrash(self) -> list[float]:
        """Per-layer router thrash rate (mean Jaccard distance of consecutive tokens' sets; nan: no pairs)."""
        return [float(s) / int(n) if int(n) else float("nan") for s, n in zip(self.thrash_sum.tolist(), self.thrash_n.tolist())]


def _run_key(step: tuple) -> tuple:
    return tuple(l for l, _, _ in step[1]), max(c.shape[1] for _, c, _ in step[1])


def _pad(ids: torch.Tensor, width: int) -> torch.Tensor:
    if ids.shape[1] >= width:
        return ids[:, :width]
    return torch.cat([ids, ids.new_full((ids.shape[0], width - ids.shape[1]), -1)], dim=1)
