"""Expert placement changes (EPLB rebalancing) of one rank's engine: read the new shard, then switch to it.

`RankEngine` takes these methods from `PlacementMixin`. A change has two phases so that reading weights never
stalls the steps: `prepare_placement` reads this rank's experts under the new placement (any thread, the engine
keeps running), `apply_placement` swaps the model's experts (and their routing observer) and the dispatcher's
tables on the step thread, between steps, at the same step on every rank (`actors.rank.lockstep` agrees on it).
Sequences, KV cache and non-expert weights are untouched, so requests in flight continue under the new placement.

The mixin reads the engine's `cfg`, `model_cfg`, `rank`, `device`, `keep_bf16`, `model`, `dispatcher`,
`expert_runtime` and `_build_experts` (`actors.engine.engine.RankEngine`).

`regroup` is the elastic case: the EP group was formed anew over the survivors of a lost rank; this rank may
get a new rank number, group and transport, and a placement in which it holds the same experts in the same local
rows (the lost rank's replicas dropped, `cluster.placement.shrink_placement`), so no weight moves.
"""
from __future__ import annotations

import torch

from actors.model.model import NO_OBSERVER
from actors.moe.dispatch import AllToAllDispatcher
from actors.model.weights import CheckpointReader, load_expert_weights
from actors.moe.placement import ExpertPlacement


class PlacementMixin:
    """`prepare_placement` / `apply_placement` of `RankEngine`."""

    def prepare_placement(self, placement: ExpertPlacement) -> dict[str, torch.Tensor]:
        """Read this rank's experts under `placement` (full precision, stored as at start-up, on the device) without
        touching the running engine, so it may run on another thread while steps go on.

        Experts this rank already holds are copied from memory (plain path); the others are read from the
        checkpoint (`actors.model.weights`, only their slices). Returns {layers.{l}.w_gate_up [E_loc, 2I, D],
        layers.{l}.w_down [E_loc, D, I]} per MoE layer (E_loc = 0 for a packed checkpoint: the expert store
        reads those itself). Raises ValueError if the placement's world size or layer count does not match.
        """
        mc, dtype = self.model_cfg, self.cfg.torch_dtype
        old = self.dispatcher.placement
        if placement.world_size != old.world_size or placement.num_layers != mc.num_layers:
            raise ValueError(f"placement world_size={placement.world_size}, layers={placement.num_layers}; "
                             f"engine has world_size={old.world_size}, layers={mc.num_layers}")
        reader = CheckpointReader(self.cfg.model)
        out: dict[str, torch.Tensor] = {}
        for l in range(mc.num_layers):
            if not mc.moe_layers[l]:
                continue
            new = placement.local_experts(l, self.rank)
            key_gu, key_dn = f"layers.{l}.w_gate_up", f"layers.{l}.w_down"
            held = {g: i for i, g in enumerate(old.local_experts(l, self.rank))}
            if key_gu in self.model.w and self.model.w[key_gu].shape[0] == len(held) and all(g in held for g in new):
                rows = torch.tensor([held[g] for g in new], dtype=torch.int64, device=self.device)
                out[key_gu], out[key_dn] = self.model.w[key_gu][rows].clone(), self.model.w[key_dn][rows].clone()
                continue
            gu, dn = load_expert_weights(reader, mc, l, new, dtype, self.keep_bf16)
            out[key_gu], out[key_dn] = gu.to(self.device), dn.to(self.device)
        return out

    def apply_placement(self, placement: ExpertPlacement, prepared: dict[str, torch.Tensor] | None = None) -> None:
        """Switch this rank to `placement`: its expert shard, the experts seam and the dispatcher tables.

        Call on the step thread between steps, on every rank at the same step (`actors.rank.lockstep` does);
        sequences, KV cache and non-expert weights are untouched, so no request is lost. `prepared`: the
        result of `prepare_placement(placement)` (read now if None). The packed path (weight_bits or a
        packed checkpoint) rebuilds its expert store; its cache and prefetch statistics start over.
        """
        if prepared is None:
            prepared = self.prepare_placement(placement)
        mc = self.model_cfg
        local = [placement.local_experts(l, self.rank) for l in range(mc.num_layers)]
        if self.expert_runtime is not None:
            self.expert_runtime.wait_idle()
            self.expert_runtime.detach()
        else:
            self.model.w.update(prepared)
        experts, self.expert_runtime = self._build_experts(dict(prepared), local, self.model.gating_router)
        self.model.set_experts(experts, NO_OBSERVER if self.expert_runtime is None else self.expert_runtime)
        self.dispatcher.set_placement(placement)

    def regroup(self, placement: ExpertPlacement, rank: int, group, shm=None) -> None:
        """Join the survivors' new EP group between steps: new rank number `rank`, process `group` (None: alone),
        same-node transport `shm`, and `placement` (world size = the survivors). Sequences, KV cache and weights are
        untouched. Raises ValueError if `placement` would have this rank hold other experts than it holds now."""
        old = self.dispatcher.placement
        for l in range(self.model_cfg.num_layers):
            if self.model_cfg.moe_layers[l] and placement.local_experts(l, rank) != old.local_experts(l, self.rank):
                raise ValueError(f"regroup: layer {l} would hold experts {placement.local_experts(l, rank)} as rank "
                                 f"{rank}, this rank holds {old.local_experts(l, self.rank)}")
        self.rank, self.group = rank, group
        self.dispatcher = AllToAllDispatcher(placement, rank, group, device=self.device, shm=shm,
                                             max_experts_per_token=self.model.gating_router.state.k_max)
        self.model.set_dispatcher(self.dispatcher)
