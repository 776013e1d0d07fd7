"""Gating vocabulary: the policies and their knobs, one call's routing decision, a step's token layout.

The model calls `actors.moe.gating_router.GatingRouter.route(layer, logits, hidden, batch)` once per MoE
layer of every step, with the step's `GatingBatch`, and gets a `Routing`. A policy (one of `POLICIES`, the
rules in `actors.moe.gating_router`) is chosen per deployment (`GatingConfig.policy`) and may be overridden
per request (`SamplingParams.gating`); tokens of one step that use different policies are routed group by
group.

Contract of every policy: for any input, including rows of NaN/inf logits, unique in-range expert ids and
finite weights; ids of -1 with weight 0 pad rows that use fewer experts than the widest row.

Shape legend: T = tokens in the call, E = routed experts, K = experts per token (config top-k),
K' = widest row of a call (>= 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

POLICIES = ("exact", "balanced", "capacity", "dynamic", "velocity", "sticky")


@dataclass(kw_only=True)
class GatingConfig:
    """Deployment-wide gating settings (every policy's knobs; only the chosen ones matter; the rules they
    tune are in `actors.moe.gating_router`).

    Raises:
        ValueError: unknown policy or an out-of-range knob (the message names the field and its limit).
    """

    policy: str = "exact"
    backend: str = "torch"  # fused selection kernel: "torch" (reference) | "triton"
    balance_rate: float = 2e-3  # u, in score (probability) units per bias step
    # a step's bias moves ceil(tokens / balance_tokens) * u (tokens over the EP group). 256 on the 4k tiny-moe
    # (bench/gating.py --no-decode, balanced max/mean, full / quick): 64 1.180 / 1.168, 128 - / 1.118, 256 1.136 /
    # 1.092, 512 (one u per step up to 512 tokens) 1.128 / 1.096; exact routing 1.161 / 1.139
    balance_tokens: int = 256
    capacity_factor: float = 1.25
    top_p: float = 0.6
    k_min: int = 1
    k_max: int | None = None  # None: 2 * top_k, capped at E
    velocity_beta: float = 0.5
    velocity_fast: float = 0.95  # about the top 7% of velocities on the shipped model (held-out text)
    velocity_slow: float = 0.3  # about the bottom 2-3%
    velocity_k: int = 1
    velocity_shared_boost: float = 0.5
    # the largest swept margin within +1% on the 4k tiny-moe (bench/gating.py --no-decode, thrash / dppl, full and
    # quick): 0.09 0.443 @ +0.97% / 0.441 @ +0.74%, 0.1 0.417 @ +1.03% / 0.414 @ +0.85%, exact 0.80; halving it
    # (0.11: 0.392 @ +1.21%) now costs more than 1%. 0.235 on the 1k checkpoint: 0.16 @ +2.3% here.
    sticky_margin: float = 0.09

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"gating policy={self.policy!r} must be one of {', '.join(POLICIES)}")
        if self.backend not in ("torch", "triton"):
            raise ValueError(f"gating backend={self.backend!r} must be torch or triton")
        checks = {"balance_rate": self.balance_rate >= 0, "balance_tokens": self.balance_tokens >= 1,
                  "capacity_factor": self.capacity_factor >= 1.0, "top_p": 0 < self.top_p <= 1,
                  "k_min": self.k_min >= 1, "velocity_beta": 0 <= self.velocity_beta < 1,
                  "velocity_k": self.velocity_k >= 1, "velocity_shared_boost": self.velocity_shared_boost >= 0,
                  "sticky_margin": self.sticky_margin >= 0,
                  "velocity_slow": 0 <= self.velocity_slow <= self.velocity_fast}
        limits = {"balance_rate": ">= 0", "balance_tokens": ">= 1", "capacity_factor": ">= 1.0",
                  "top_p": "in (0, 1]", "k_min": ">= 1", "velocity_beta": "in [0, 1)", "velocity_k": ">= 1",
                  "velocity_shared_boost": ">= 0", "sticky_margin": ">= 0",
                  "velocity_slow": "in [0, velocity_fast]"}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"gating {name}={getattr(self, name)} must be {limits[name]}")
        if self.k_max is not None and self.k_max < self.k_min:
            raise ValueError(f"gating k_max={self.k_max} must be >= k_min={self.k_min}")

    @classmethod
    def from_options(cls, policy: str = "exact", options: dict | None = None, backend: str = "torch") -> "GatingConfig":
        """Build from a policy name and a dict of knobs (unknown keys raise ValueError naming them)."""
        options = dict(options or {})
        unknown = sorted(set(options) - {f for f in cls.__dataclass_fields__} - {"policy", "backend"})
        if unknown:
            raise ValueError(f"unknown gating option(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        options.setdefault("policy", policy)
        options.setdefault("backend", backend)
        return cls(**options)


@dataclass(kw_only=True, slots=True)
class Routing:
    """One call's decision. weights [T, K'] fp32 (0 on padding), ids [T, K'] int64 (-1 = padding),
    shared_scale [T] fp32 multiplier of the shared expert's output, or None (1 everywhere).
    may_pad: whether any id can be -1 (only `dynamic` and `velocity` pad)."""

    weights: torch.Tensor
    ids: torch.Tensor
    shared_scale: torch.Tensor | None = None
    may_pad: bool = False


class GatingBatch:
    """Where the step's tokens come from (built by the engine once per step).

    slots_T: [T] int64 sequence state slot of each token. positions_T: [T] int64 position in its sequence.
    Tokens of one sequence are contiguous and in position order. policy_T: [T] int64 index into
    `POLICIES` per token, or None when every token uses the deployment policy.

    The derived fields (`prev_row_T`, `last_rows`, `slots_last`, `fresh_T`, `has_inner`) are computed on
    first use: only the policies with per-sequence recurrences (`velocity`, `sticky`) read them, so an
    `exact` decode step pays none of their ops. step: the whole step's batch when this one is a micro-batch of
    it (two-batch overlap, `actors.model.two_batch`; None: this batch is the step); `step_key` names the step.
    """

    __slots__ = ("slots_T", "positions_T", "policy_T", "_derived", "waves", "step")

    def __init__(self, *, slots_T: torch.Tensor, positions_T: torch.Tensor, policy_T: torch.Tensor | None = None,
                 step: "GatingBatch | None" = None):
        self.slots_T = slots_T
        self.positions_T = positions_T
        self.policy_T = policy_T
        self.step = step
        self._derived: tuple | None = None
        self.waves: list[torch.Tensor] = []  # computed lazily by `wave_list`

    def _derive(self) -> tuple:
        if self._derived is None:
            T = self.slots_T.numel()
            dev = self.slots_T.device
            rows = torch.arange(T, device=dev)
            same = torch.zeros(T, dtype=torch.bool, device=dev)
            if T > 1:
                same[1:] = (self.slots_T[1:] == self.slots_T[:-1]) & (self.positions_T[1:] == self.positions_T[:-1] + 1)
            prev_row = torch.where(same, rows - 1, torch.full_like(rows, -1))
            is_last = torch.ones(T, dtype=torch.bool, device=dev)
            if T > 1:
                is_last[:-1] = ~same[1:]
            last_rows = rows[is_last]
            self._derived = (prev_row, last_rows, self.slots_T[last_rows], self.positions_T == 0,
                             bool(same.any()) if T > 1 else False)
        return self._derived

    @property
    def step_key(self) -> "GatingBatch":
        """The step this batch routes in: its whole-step batch, or itself."""
        return self if self.step is None else self.step

    @property
    def prev_row_T(self) -> torch.Tensor:
        """[T] int64: the row of the previous token of the same sequence in this step (-1 if none)."""
        return self._derive()[0]

    @property
    def last_rows(self) -> torch.Tensor:
        """Rows that are the last of their sequence in this step."""
        return self._derive()[1]

    @property
    def slots_last(self) -> torch.Tensor:
        return self._derive()[2]

    @property
    def fresh_T(self) -> torch.Tensor:
        """[T] bool: first token of a sequence (position 0: no predecessor)."""
        return self._derive()[3]

    @property
    def has_inner(self) -> bool:
        return self._derive()[4]

    def wave_list(self) -> list[torch.Tensor]:
        """Rows grouped by their offset inside their sequence's chunk: wave j depends on wave j-1 only."""
        if not self.waves and self.slots_T.numel():
            T = self.slots_T.numel()
            start = torch.where(self.prev_row_T < 0, torch.arange(T, device=self.slots_T.device), 0)
            start = torch.cummax(start, 0).values
            offset = torch.arange(T, device=self.slots_T.device) - start
            order = torch.argsort(offset, stable=True)
            counts = torch.bincount(offset).tolist()
            self.waves = list(torch.split(order, counts))
        return self.waves

    @classmethod
    def single(cls, positions_T: torch.Tensor) -> "GatingBatch":
        """All tokens from one sequence in slot 0 (prompt scoring, benchmarks)."""
        return cls(slots_T=torch.zeros_like(positions_T), positions_T=positions_T)
