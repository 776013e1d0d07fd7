"""The `balanced` gating bias of one rank's engine: this rank's expert load out, the EP group's sum in.

`RankEngine` takes these methods from `BalancingMixin`. The bias update of the `balanced` policy
(`actors.moe.gating_router`) reads the load of every rank's `balanced` tokens in the step: each rank hands its
counts (`take_balance_load`), the counts are summed over the EP group, and every rank applies the same sum
(`apply_balance_load`), so every rank holds the same bias after every step, whatever the rank count. The sum
rides in the lockstep loop's step agreement (`actors.rank.lockstep`: no collective of its own);
`RankEngine.step` (engines driven directly) sums with one all_reduce; alone, the engine applies its own load
at the end of `run` and `prompt_logits`.

The mixin reads the engine's `model` (its `gating_router`).
"""
from __future__ import annotations

import torch


class BalancingMixin:
    """`balance_width` / `take_balance_load` / `apply_balance_load` of `RankEngine`."""

    @property
    def balance_width(self) -> int:
        """L * E: the `balanced` load counters a step contributes to the EP group's sum."""
        return self.model.gating_router.bias.numel()

    def take_balance_load(self) -> torch.Tensor | None:
        """This rank's `balanced` expert load since the last call, flat [L * E] int64 on the engine's device, or
        None when it routed no `balanced` token (zeros, for the sum). Every rank of the group sums these after
        each step and hands the sum to `apply_balance_load`, so the bias is the same on every rank."""
        load = self.model.gating_router.take_balance_load()
        return None if load is None else load.view(-1)

    def apply_balance_load(self, load) -> None:
        """One bias step from the group's summed `balanced` load: flat [L * E] integer counts (a tensor or a
        numpy array); all zeros (no `balanced` token anywhere) changes nothing."""
        load = torch.as_tensor(load)
        if bool(load.any()):
            router = self.model.gating_router
            router.update_bias(load.view(router.bias.shape))

    def _update_bias_alone(self) -> None:
        load = self.model.gating_router.take_balance_load()
        if load is not None:
            self.model.gating_router.update_bias(load)
