"""Sampling parameters and the per-step sampler.

Shape legend: B = sequences sampled this step, V = vocab.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from router_service.routing.gating import POLICIES

MAX_STOP_STRINGS = 16


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to pick each next token of one request (vLLM-compatible names).

    temperature: 0 means greedy; otherwise in (0, 100]. top_k: 0 or -1 disables, else >= 1.
    top_p: in (0, 1]. max_tokens: >= 1 output tokens. seed: per-request RNG seed (None: random).
    stop: strings that end generation (not included in the text). stop_token_ids: extra ids that end
    it (included in token_ids only if they are not EOS). ignore_eos: keep going past EOS (benchmarks).
    gating: this request's gating policy (`router_service.routing.gating.POLICIES`), None = the deployment's.

    Raises:
        ValueError: naming the field, its value and the allowed range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    gating: str | None = None

    def __post_init__(self) -> None:
        if self.gating is not None and self.gating not in POLICIES:
            raise ValueError(f"gating={self.gating!r} must be one of {', '.join(POLICIES)}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (self.temperature == self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature={self.temperature} must be in [0, 100]")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1, 0 (disabled) or >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be an integer >= 1")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**d)


def sample(logits_BV: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row. Greedy rows use argmax; others temperature, top-k, top-p, then a
    draw from the row's own generator (so a seeded request is reproducible whatever its batch)."""
    out: list[int] = []
    greedy = logits_BV.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            out.append(greedy[i])
            continue
        x = logits_BV[i].float() / p.temperature
        if p.top_k and p.top_k > 0 and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = sp.cumsum(0) - sp < p.top_p  # smallest prefix whose mass reaches top_p
            sp = torch.where(keep, sp, torch.zeros_like(sp))
            probs = torch.zeros_like(probs).scatter_(0, si, sp)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out
