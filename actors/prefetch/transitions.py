"""Expert transition counts: the Markov predictors' statistics, their calibration file and its format.

Shape legend: L = layers, E = routed experts, K = experts per token, D = hidden. Expert ids are int64 global
ids; -1 = none. Counts are float64 so online updates never overflow.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from actors.moe.stats import multi_hot
from actors.prefetch.pre_attention import PreAttentionMLP

TRANSITIONS_FILE = "expert_transitions.safetensors"


@dataclass(kw_only=True, slots=True)
class TransitionCounts:
    """Expert co-occurrence counts (float64 so online updates never overflow).

    inter: `[L, E, E]`, inter[l, a, b] = tokens that used a at the previous MoE layer and b at l.
    intra: `[L, E, E]`, intra[l, a, b] = (previous token used a, token used b) at layer l, same sequence.
    freq: `[L, E]`, freq[l, b] = tokens that used b at layer l.
    tokens: tokens observed (at any one layer).
    weights: log-linear weights fitted on the calibration run (`fit_loglinear`): predictor name ("markov",
        "hybrid") -> per layer a list of floats; saved in the file's metadata; None when not fitted.
    lookahead_gates: fitted lookahead gates (`fit_lookahead_gates`): MoE layer -> `[E, D]` float32, used by
        the lookahead (and hybrid) predictor in place of that layer's router weights; None when not fitted.
    pre_attention: trained pre-attention MLPs (`fit_pre_attention`): MoE layer -> PreAttentionMLP predicting
        that layer's experts (`actors.prefetch.pre_attention`); saved as `pre_attention.<layer>.<w1|b1|w2|b2>`.
    pre_attention_prev: trained two-state MLPs (`fit_pre_attention(..., prev_token=True)`, parts = 2): MoE layer
        -> PreAttentionMLP (`actors.prefetch.pre_attention_prev`); saved as `pre_attention_prev.<layer>.<name>`.
    Raises (in `__post_init__`): ValueError naming a field whose shape disagrees with `freq`.
    """

    inter: torch.Tensor
    intra: torch.Tensor
    freq: torch.Tensor
    tokens: int = 0
    weights: dict | None = None
    lookahead_gates: dict[int, torch.Tensor] | None = None
    pre_attention: dict[int, PreAttentionMLP] | None = None
    pre_attention_prev: dict[int, PreAttentionMLP] | None = None

    def __post_init__(self) -> None:
        L, E = self.freq.shape
        for name in ("inter", "intra"):
            if tuple(getattr(self, name).shape) != (L, E, E):
                raise ValueError(f"{name}.shape={tuple(getattr(self, name).shape)}, expected {(L, E, E)}")
        for l, g in (self.lookahead_gates or {}).items():
            if not 0 <= l < L or g.dim() != 2 or g.shape[0] != E:
                raise ValueError(f"lookahead_gates[{l}].shape={tuple(g.shape)}: expected layer in [0, {L}) and [E={E}, D]")
        for name in ("pre_attention", "pre_attention_prev"):
            for l, m in (getattr(self, name) or {}).items():
                if not 0 <= l < L or m.dims[2] != E:
                    raise ValueError(f"{name}[{l}] predicts {m.dims[2]} experts: expected layer in [0, {L}) and E={E}")

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int) -> TransitionCounts:
        z = torch.float64
        return cls(inter=torch.zeros(num_layers, num_experts, num_experts, dtype=z),
                   intra=torch.zeros(num_layers, num_experts, num_experts, dtype=z),
                   freq=torch.zeros(num_layers, num_experts, dtype=z))

    @property
    def num_layers(self) -> int:
        return self.freq.shape[0]

    @property
    def num_experts(self) -> int:
        return self.freq.shape[1]

    def clone(self) -> TransitionCounts:
        return TransitionCounts(inter=self.inter.clone(), intra=self.intra.clone(), freq=self.freq.clone(),
                                tokens=self.tokens, weights=self.weights, lookahead_gates=self.lookahead_gates,
                                pre_attention=self.pre_attention, pre_attention_prev=self.pre_attention_prev)

    def observe(self, layer: int, ids_TK: torch.Tensor, prev_layer_ids_TK: torch.Tensor | None,
                prev_token_ids_TK: torch.Tensor | None) -> None:
        """Add one layer's routing of T tokens (arguments as for `ExpertPredictor.observe`, `actors.prefetch.base`)."""
        E = self.num_experts
        cur = multi_hot(ids_TK.cpu(), E).double()  # [T, E]
        self.freq[layer] += cur.sum(0)
        if prev_layer_ids_TK is not None:
            self.inter[layer] += multi_hot(prev_layer_ids_TK.cpu(), E).double().T @ cur
        if prev_token_ids_TK is not None:
            self.intra[layer] += multi_hot(prev_token_ids_TK.cpu(), E).double().T @ cur
        if layer == 0 or not bool(self.freq[:layer].any()):
            self.tokens += ids_TK.shape[0]  # counted once per token: at the first layer that routes

    def save(self, path: str, meta: dict | None = None) -> None:
        """Write a safetensors file (counts, fitted lookahead gates as `lookahead_gate.<layer>`, pre-attention MLPs
        as `pre_attention.<layer>.<name>`, and json metadata: layers, experts, tokens, fitted weights, `meta`)."""
        from safetensors.torch import save_file

        md = {"num_layers": str(self.num_layers), "num_experts": str(self.num_experts), "tokens": str(self.tokens),
              "meta": json.dumps(meta or {})}
        if self.weights:
            md["weights"] = json.dumps(self.weights)
        tensors = {"inter": self.inter.contiguous(), "intra": self.intra.contiguous(), "freq": self.freq.contiguous()}
        for l, g in (self.lookahead_gates or {}).items():
            tensors[f"lookahead_gate.{l}"] = g.detach().float().contiguous()
        for prefix in ("pre_attention", "pre_attention_prev"):
            for l, m in (getattr(self, prefix) or {}).items():
                for k, t in m.tensors().items():
                    tensors[f"{prefix}.{l}.{k}"] = t.detach().float().contiguous()
        save_file(tensors, path, metadata=md)
        os.chmod(path, 0o644)  # safetensors writes 0600; ranks may run as another user

    @classmethod
    def load(cls, path: str) -> TransitionCounts:
        """Read `save`'s file. Raises FileNotFoundError, or ValueError on inconsistent shapes."""
        from safetensors import safe_open

        if not os.path.isfile(path):
            raise FileNotFoundError(f"no expert-transition file at {path!r}")
        with safe_open(path, "pt") as f:
            md = f.metadata() or {}
            t = {k: f.get_tensor(k).double() for k in ("inter", "intra", "freq")}
            gates = {int(k.split(".")[1]): f.get_tensor(k).float() for k in f.keys() if k.startswith("lookahead_gate.")}
            pa: dict[str, dict[int, dict]] = {"pre_attention": {}, "pre_attention_prev": {}}
            for k in f.keys():
                prefix, _, rest = k.partition(".")
                if prefix in pa:
                    l, name = rest.split(".")
                    pa[prefix].setdefault(int(l), {})[name] = f.get_tensor(k).float()
        w = json.loads(md["weights"]) if "weights" in md else None
        mlps = {l: PreAttentionMLP(**v) for l, v in pa["pre_attention"].items()}
        prev = {l: PreAttentionMLP(**v, parts=2) for l, v in pa["pre_attention_prev"].items()}
        return cls(**t, tokens=int(md.get("tokens", 0)), weights=w, lookahead_gates=gates or None,
                   pre_attention=mlps or None, pre_attention_prev=prev or None)
