"""Expert-prefetch predictors: which experts will the next MoE layer use for these tokens?

Shape legend: T = tokens, K = experts per token (top-k), B = prediction budget per token (k + 1 by default),
E = routed experts, L = layers, D = hidden. Expert ids are int64 global ids; -1 = unknown / none.

Every predictor answers `scores(layer, prev_layer_ids, prev_token_ids, hidden) -> [T, E]` (higher = more
likely to be used by that token at `layer`) from what is known before `layer` routes:
  prev_layer_ids `[T, K]`: the same tokens' experts at the previous MoE layer (None at the first one);
  prev_token_ids `[T, K]`: each token's predecessor in its sequence, its experts at `layer` (-1 rows: none);
  hidden `[T, D]`: the residual stream entering the previous MoE layer's FFN (for lookahead).
`predict` keeps the top `budget` per token; `union` is what a rank makes ready for a batch. `observe`
feeds the true routing back (online update); the engine calls it right after each layer's gate.

Predictors (all evaluated prequentially by `prequential_eval`: each prediction is made before the token is
routed at that layer, and the predictor learns from the truth right after):
  none      - predicts nothing (baseline: every non-resident expert is a miss).
  frequent  - the layer's most used experts so far (calibration counts + online counts).
  markov    - first-order Markov chains over expert sets: P(b at l | set at the previous MoE layer, same token)
              and P(b at l | set at l, previous token), combined log-linearly (summed PMI terms, naive-Bayes
              style) with per-layer weights fitted on calibration text (`fit_loglinear`); counts seeded from
              a calibration run on training text (a prior worth at most 256 tokens) and updated online (ProMoE
              arXiv 2410.22134 and "Exploiting inter-layer expert affinity" arXiv 2401.08383 report these
              chains are strongly non-uniform; the layer-to-layer chain is the one ExFlow uses).
  lookahead - the next layer's gate applied to the current hidden state (mixtral-offloading, Eliseev &
              Mazur 2023, arXiv 2312.17238: hidden states change little between adjacent layers); where the
              calibration file carries fitted lookahead gates (`fit_lookahead_gates`: a least-squares pre-gate,
              after Pre-gated MoE, Hwang et al. 2024, arXiv 2308.12066), those replace the next layer's gate.
  hybrid    - markov and lookahead in one log-linear model (a product of experts), weights fitted per layer.
"""
from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu import GateLogprobs, MarkovTables
from actors.moe.stats import RoutingStats, multi_hot

PREDICTORS = ("none", "frequent", "markov", "lookahead", "hybrid")
# Chosen by measurement (bench/experts.py, prequential recall on held-out prose and code of the tiny-moe model).
DEFAULT_PREDICTOR = "hybrid"
TRANSITIONS_FILE = "expert_transitions.safetensors"


def _moe_layer_list(num_layers: int, moe_layers: list[bool] | None) -> list[bool]:
    return list(moe_layers) if moe_layers is not None else [True] * num_layers


def _ids_tensor(rows: list[list[int]] | None) -> torch.Tensor | None:
    """Ragged id lists -> `[T, max len]` int64, padded with -1 (None stays None)."""
    if rows is None:
        return None
    k = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [-1] * (k - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), k)


def _id_set(row) -> list[int]:
    """Distinct valid (>= 0) ids of one token, in first-seen order (a multi-hot row's members)."""
    return list(dict.fromkeys(e for e in row if e >= 0))


def _softmax(v: list[float]) -> list[float]:
    m = max(v)
    ex = [math.exp(x - m) for x in v]
    t = sum(ex)
    return [x / t for x in ex]


def _loglinear(logf: torch.Tensor, feats: list, weights, num_tokens: int) -> torch.Tensor:
    """`[T, E]` log-linear score: the prior `logf` ([1, E] or [T, E]) plus sum_i weights[i] * feats[i] over the
    features present (None: that source has nothing for these tokens)."""
    s = logf.expand(num_tokens, -1).clone()
    for i, f in enumerate(feats):
        if f is not None:
            s += float(weights[i]) * f
    return s


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
    Raises (in `__post_init__`): ValueError naming a field whose shape disagrees with `freq`.
    """

    inter: torch.Tensor
    intra: torch.Tensor
    freq: torch.Tensor
    tokens: int = 0
    weights: dict | None = None
    lookahead_gates: dict[int, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        L, E = self.freq.shape
        for name in ("inter", "intra"):
            if tuple(getattr(self, name).shape) != (L, E, E):
                raise ValueError(f"{name}.shape={tuple(getattr(self, name).shape)}, expected {(L, E, E)}")
        for l, g in (self.lookahead_gates or {}).items():
            if not 0 <= l < L or g.dim() != 2 or g.shape[0] != E:
                raise ValueError(f"lookahead_gates[{l}].shape={tuple(g.shape)}: expected layer in [0, {L}) and [E={E}, D]")

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
                                tokens=self.tokens, weights=self.weights, lookahead_gates=self.lookahead_gates)

    def observe(self, layer: int, ids_TK: torch.Tensor, prev_layer_ids_TK: torch.Tensor | None,
                prev_token_ids_TK: torch.Tensor | None) -> None:
        """Add one layer's routing of T tokens (see the module docstring for the arguments)."""
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
        """Write a safetensors file (counts, fitted lookahead gates as `lookahead_gate.<layer>`, and json metadata:
        layers, experts, tokens, fitted weights, `meta`)."""
        from safetensors.torch import save_file

        md = {"num_layers": str(self.num_layers), "num_experts": str(self.num_experts), "tokens": str(self.tokens),
              "meta": json.dumps(meta or {})}
        if self.weights:
            md["weights"] = json.dumps(self.weights)
        tensors = {"inter": self.inter.contiguous(), "intra": self.intra.contiguous(), "freq": self.freq.contiguous()}
        for l, g in (self.lookahead_gates or {}).items():
            tensors[f"lookahead_gate.{l}"] = g.detach().float().contiguous()
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
        w = json.loads(md["weights"]) if "weights" in md else None
        return cls(**t, tokens=int(md.get("tokens", 0)), weights=w, lookahead_gates=gates or None)


# Log-linear weights used when the calibration file has none: naive Bayes over the previous layer's set (1.0),
# the previous token's set at half weight (consecutive tokens share under half their experts on tiny-moe), and
# the lookahead at the weight the calibration fit found on tiny-moe (about 2: the gate is sharper than its softmax).
DEFAULT_WEIGHTS = {"markov": (1.0, 0.5), "hybrid": (1.0, 0.5, 2.0)}


def _layer_weights(name: str, num_layers: int, num_features: int, weights, counts) -> torch.Tensor:
    """`[L, F]` float32 log-linear weights: given, else fitted in `counts`, else DEFAULT_WEIGHTS[name]."""
    if weights is None and counts is not None and counts.weights and name in counts.weights:
        weights = counts.weights[name]
    if weights is None:
        weights = [DEFAULT_WEIGHTS[name]] * num_layers
    w = torch.as_tensor(weights, dtype=torch.float32)
    if tuple(w.shape) != (num_layers, num_features):
        raise ValueError(f"{name} weights shape={tuple(w.shape)}, expected (num_layers, {num_features}) = "
                         f"{(num_layers, num_features)}")
    return w


class ExpertPredictor(ABC):
    """Scores the experts a layer will use, from what is known before it routes (module docstring).

    Args:
        num_layers: L. num_experts: E. top_k: K (the default budget is K + 1).
        moe_layers: `[L]` bool, True where the layer has routed experts (default: all).
    """

    name = "base"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, moe_layers: list[bool] | None = None):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.moe_layers = _moe_layer_list(num_layers, moe_layers)

    @abstractmethod
    def scores(self, layer: int, prev_layer_ids_TK: torch.Tensor | None, prev_token_ids_TK: torch.Tensor | None,
               hidden_TD: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
        """`[T, E]` float32 scores (higher = more likely); T = `num_tokens`."""

    def observe(self, layer: int, ids_TK: torch.Tensor, prev_layer_ids_TK: torch.Tensor | None,
                prev_token_ids_TK: torch.Tensor | None) -> None:
        """Learn from the true routing of `layer` (default: stateless)."""

    def predict(self, layer: int, prev_layer_ids_TK: torch.Tensor | None, prev_token_ids_TK: torch.Tensor | None,
                hidden_TD: torch.Tensor | None, num_tokens: int, budget: int | None = None) -> torch.Tensor:
        """Top-`budget` expert ids per token, `[T, B]` int64 (B = min(budget, E); default budget K + 1)."""
        b = min(self.top_k + 1 if budget is None else budget, self.num_experts)
        s = self.scores(layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens)
        return torch.topk(s, b, dim=-1).indices

    def scores_lists(self, layer: int, prev_layer: list[list[int]] | None, prev_tok: list[list[int]],
                     hidden_TD: torch.Tensor | None, num_tokens: int) -> list[list[float]]:
        """`scores` for a small batch given as Python lists: per token its E scores.

        `prev_layer` / `prev_tok`: per token the expert ids (any length; empty or -1 entries: unknown). The
        default converts to `[T, K]` tensors and calls `scores`; predictors with per-token state in Python
        (`MarkovPredictor`, `HybridPredictor`) answer without tensor ops, which at decode batch 1 costs
        ~10x less than the few dozen tiny tensor ops of `scores` (bench/experts.py decode table).
        """
        return self.scores(layer, _ids_tensor(prev_layer), _ids_tensor(prev_tok), hidden_TD, num_tokens).tolist()

    def observe_lists(self, layer: int, ids: list[list[int]], prev_layer: list[list[int]] | None,
                      prev_tok: list[list[int]]) -> None:
        """`observe` for a small batch given as Python lists (same conventions as `scores_lists`)."""
        self.observe(layer, _ids_tensor(ids), _ids_tensor(prev_layer), _ids_tensor(prev_tok))

    @staticmethod
    def union(pred_TB: torch.Tensor) -> list[int]:
        """Sorted distinct expert ids predicted for the batch."""
        return sorted(int(e) for e in torch.unique(pred_TB) if e >= 0)


class NoPredictor(ExpertPredictor):
    """Predicts nothing: `predict` returns `[T, 0]`."""

    name = "none"

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        return torch.zeros(num_tokens, self.num_experts)

    def predict(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens, budget=None):
        return torch.zeros(num_tokens, 0, dtype=torch.int64)


class FrequencyPredictor(ExpertPredictor):
    """The layer's most frequently used experts (calibration counts + online counts), same for every token.

    Seed counts are a prior worth at most `prior_tokens` tokens (scaled down when the calibration run saw
    more), so that online evidence from the served text takes over after a few hundred tokens: calibration
    text is never exactly the served domain (measured on tiny-moe: an unscaled 4096-token seed cost 0.12
    recall on held-out code against no seed; scaled to 256 tokens it keeps the cold start and loses ~0.03).
    """

    name = "frequent"

    def __init__(self, num_layers, num_experts, top_k, moe_layers=None, counts: TransitionCounts | None = None,
                 prior_tokens: float | None = 256):
        super().__init__(num_layers, num_experts, top_k, moe_layers)
        self._counts = counts.clone() if counts is not None else TransitionCounts.zeros(num_layers, num_experts)
        if counts is not None and prior_tokens is not None and counts.tokens > prior_tokens:
            s = prior_tokens / counts.tokens
            self._counts.inter *= s
            self._counts.intra *= s
            self._counts.freq *= s
        # The list path (`observe_lists`) keeps a Python copy of the counts it touches (`_py`) and queues its
        # increments (`_pending`: flat indices into freq / inter / intra, tokens) for the tensors; reading
        # `counts` applies them (three index_add_ ops for any number of steps).
        self._py: dict[int, dict] = {}
        self._pending: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._pending_tokens = 0
        self._layer_seen: list[bool] | None = None

    def _tables_c(self) -> MarkovTables:
        """The compiled view of the current count tensors (rebuilt when `counts` is replaced)."""
        c, t = self._counts, getattr(self, "_ctab", None)
        if t is None or t._keep[0] is not c.freq or t._keep[1] is not c.inter or t._keep[2] is not c.intra:
            t = self._ctab = MarkovTables(c.freq, c.inter, c.intra)
        return t

    def _observed_c(self, layer: int, ids: list[list[int]]) -> None:
        """After the compiled tables learned a step at `layer` (`ids`: its T rows): the token count (once per
        token, at the first layer that routes) and the caches derived from the counts."""
        c = self._counts
        if self._layer_seen is None:  # only layers below `layer` matter here, which this step has not touched
            self._layer_seen = c.freq.any(1).tolist()
        if layer == 0 or not any(self._layer_seen[:layer]):
            c.tokens += len(ids)
        if any(e >= 0 for row in ids for e in row):
            self._layer_seen[layer] = True
        self._py.pop(layer, None)
        self._counts_changed()

    @property
    def counts(self) -> TransitionCounts:
        """The transition counts, with every observation so far applied."""
        if self._pending_tokens or self._pending[0]:
            self._flush()
        return self._counts

    @counts.setter
    def counts(self, c: TransitionCounts) -> None:
        self._pending, self._pending_tokens, self._py, self._layer_seen = ([], [], []), 0, {}, None
        self._counts = c

    def _flush(self) -> None:
        c, (fi, ii, ti) = self._counts, self._pending
        for t, idx in ((c.freq, fi), (c.inter, ii), (c.intra, ti)):
            if idx:
                t.view(-1).index_add_(0, torch.tensor(idx, dtype=torch.int64), torch.ones(len(idx), dtype=t.dtype))
        c.tokens += self._pending_tokens
        self._pending, self._pending_tokens = ([], [], []), 0
        self._counts_changed()

    def _counts_changed(self) -> None:
        """Hook: the tensors changed (subclasses drop tables derived from them)."""

    def _py_layer(self, layer: int) -> dict:
        """Python copy of one layer's counts: freq `[E]`, its sum, inter / intra `[E][E]` and row sums."""
        d = self._py.get(layer)
        if d is None:
            c = self.counts
            d = {"freq": c.freq[layer].tolist(), "inter": c.inter[layer].tolist(), "intra": c.intra[layer].tolist()}
            d["fsum"] = sum(d["freq"])
            d["inter_sum"] = [sum(r) for r in d["inter"]]
            d["intra_sum"] = [sum(r) for r in d["intra"]]
            d["dirty"] = set(range(2 * self.num_experts)) | {-1}  # rows (inter a, intra E + a) and logf (-1)
            self._py[layer] = d
        return d

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        f = self.counts.freq[layer].float()
        # A deterministic tie-break towards low ids keeps predictions reproducible before any data.
        f = f - 1e-6 * torch.arange(self.num_experts, dtype=torch.float32)
        return f.expand(num_tokens, -1)

    def scores_lists(self, layer, prev_layer, prev_tok, hidden_TD, num_tokens):
        f = self._py_layer(layer)["freq"]
        row = [x - 1e-6 * b for b, x in enumerate(f)]
        return [row] * num_tokens

    def observe(self, layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK):
        self.counts.observe(layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK)
        self._py, self._layer_seen = {}, None
        self._counts_changed()

    def observe_lists(self, layer, ids, prev_layer, prev_tok):
        """`TransitionCounts.observe` on Python lists: one compiled call on the count tensors where the CPU
        kernels run (`kernels.cpu.MarkovTables`), else the Python copy now and the tensors on `counts`."""
        _ = self.counts  # applies any queued increments first
        if self._tables_c().observe(layer, ids, prev_layer, prev_tok):
            self._observed_c(layer, ids)
            return
        E, d = self.num_experts, self._py_layer(layer)
        fi, ii, ti = self._pending
        if self._layer_seen is None:
            self._layer_seen = self._counts.freq.any(1).tolist()
        if layer == 0 or not any(self._layer_seen[:layer]):
            self._pending_tokens += len(ids)
        base, base2 = layer * E, layer * E * E
        dirty, freq = d["dirty"], d["freq"]
        for t, row in enumerate(ids):
            cur = _id_set(row)
            if not cur:
                continue
            self._layer_seen[layer] = True
            dirty.add(-1)
            for b in cur:
                freq[b] += 1.0
                fi.append(base + b)
            d["fsum"] += len(cur)
            for src, name, off, idx in ((prev_layer, "inter", 0, ii), (prev_tok, "intra", E, ti)):
                if src is None:
                    continue
                m, ms = d[name], d[name + "_sum"]
                for a in _id_set(src[t]):
                    ra = m[a]
                    for b in cur:
                        ra[b] += 1.0
                        idx.append(base2 + a * E + b)
                    ms[a] += len(cur)
                    dirty.add(off + a)


class MarkovPredictor(FrequencyPredictor):
    """Markov chains over expert sets, layer-to-layer (same token) and token-to-token (same layer), combined
    log-linearly with per-layer weights fitted on calibration text.

    For a token whose previous MoE layer used the set A and whose predecessor (same layer) used the set B:
        score(b) = log P(b) + w_inter * sum_{a in A} PMI_inter(a, b) + w_intra * sum_{a in B} PMI_intra(a, b)
    with PMI(a, b) = log P(b | a) - log P(b) from the count matrices (additive smoothing `alpha`) and P(b) the
    layer's expert frequency. With w = 1 this is the naive-Bayes estimate of P(b | A, B) (set members
    treated as independent evidence); the fitted weights (`fit_loglinear`, saved with the calibration counts)
    correct for their dependence. A missing context contributes nothing (a token with neither context gets
    the frequency ranking). Measured on tiny-moe held-out text (quick bench): the log-linear set model
    recalls 0.81 at budget k + 1, the old mean of per-expert rows 0.73: a top-k set carries more information
    jointly than its members do on average.

    Args (beyond FrequencyPredictor): weights: `[L, 2]` (w_inter, w_intra) per layer, else
        `counts.weights["markov"]` when the calibration fitted them, else DEFAULT_WEIGHTS["markov"].
        alpha: additive smoothing of every count row (> 0).
    Raises:
        ValueError: alpha <= 0, or weights not of shape `[L, 2]`.
    """

    name = "markov"
    num_features = 2

    def __init__(self, num_layers, num_experts, top_k, moe_layers=None, counts: TransitionCounts | None = None,
                 weights=None, alpha: float = 0.5, prior_tokens: float | None = 256):
        super().__init__(num_layers, num_experts, top_k, moe_layers, counts, prior_tokens)
        if alpha <= 0:
            raise ValueError(f"alpha={alpha} must be > 0")
        self.alpha = alpha
        self.weights = _layer_weights(self.name, num_layers, self.num_features, weights, counts)
        self._pmi_cache: dict[int, tuple] = {}
        self._version = [0] * num_layers

    def _tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log P(b) `[E]`, PMI_inter `[E, E]`, PMI_intra `[E, E]`) float32, rebuilt only after new counts."""
        hit = self._pmi_cache.get(layer)
        if hit is not None and hit[0] == self._version[layer]:
            return hit[1]
        c, a = self.counts, self.alpha
        f = c.freq[layer] + a
        logf = (f / f.sum()).log()
        out = [logf.float()]
        for m in (c.inter[layer], c.intra[layer]):
            m = m + a
            out.append(((m / m.sum(-1, keepdim=True)).log() - logf).float())
        self._pmi_cache[layer] = (self._version[layer], tuple(out))
        return tuple(out)

    def features(self, layer, prev_layer_ids_TK, prev_token_ids_TK, num_tokens) -> tuple[torch.Tensor, list]:
        """(log P(b) `[E]`, [g_inter `[T, E]` or None, g_intra `[T, E]` or None]): the summed PMI terms."""
        logf, pmi_inter, pmi_intra = self._tables(layer)
        g = []
        for ids, pmi in ((prev_layer_ids_TK, pmi_inter), (prev_token_ids_TK, pmi_intra)):
            g.append(None if ids is None else multi_hot(ids.cpu(), self.num_experts).float() @ pmi)
        return logf, g

    def logits(self, layer, prev_layer_ids_TK, prev_token_ids_TK, num_tokens) -> torch.Tensor:
        """`[T, E]` float32 unnormalised log-probabilities (the formula in the class docstring)."""
        logf, g = self.features(layer, prev_layer_ids_TK, prev_token_ids_TK, num_tokens)
        return _loglinear(logf, g, self.weights[layer], num_tokens)

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        """`[T, E]` float32 probabilities (softmax of `logits`)."""
        return torch.softmax(self.logits(layer, prev_layer_ids_TK, prev_token_ids_TK, num_tokens), dim=-1)

    def _counts_changed(self) -> None:
        self._pmi_cache.clear()

    def _py_tables(self, layer: int) -> dict:
        """`_tables` as Python lists (log P(b), log P(b | a) rows), recomputed only for rows with new counts."""
        d = self._py_layer(layer)
        dirty = d["dirty"]
        if dirty:
            E, a = self.num_experts, self.alpha
            if -1 in dirty:
                tot = d["fsum"] + E * a
                d["logf"] = [math.log((f + a) / tot) for f in d["freq"]]
            lp = d.setdefault("lp", [None] * (2 * E))
            for r in dirty:
                if r < 0:
                    continue
                name, i = ("inter", r) if r < E else ("intra", r - E)
                tot = d[name + "_sum"][i] + E * a
                lp[r] = [math.log((m + a) / tot) for m in d[name][i]]
            dirty.clear()
        return d

    def _logits_lists(self, layer, prev_layer, prev_tok, num_tokens, weights) -> list[list[float]]:
        """Per token the E log-linear logits (class docstring), from the Python tables; `weights`: per feature."""
        d = self._py_tables(layer)
        E, logf, lp = self.num_experts, d["logf"], d["lp"]
        out = []
        for t in range(num_tokens):
            s = list(logf)
            for src, off, w in ((prev_layer, 0, weights[0]), (prev_tok, E, weights[1])):
                if src is None:
                    continue
                for a in _id_set(src[t]):
                    row = lp[off + a]
                    for b in range(E):
                        s[b] += w * (row[b] - logf[b])
            out.append(s)
        return out

    def _weights_list(self, layer: int) -> list[float]:
        """`weights[layer]` as floats (cached; rebuilt if `weights` is replaced)."""
        if getattr(self, "_wl", (None,))[0] is not self.weights:
            self._wl = (self.weights, self.weights.tolist())
        return self._wl[1][layer]

    def scores_lists(self, layer, prev_layer, prev_tok, hidden_TD, num_tokens):
        w = self._weights_list(layer)
        if self._pending_tokens or self._pending[0]:
            self._flush()
        p = self._tables_c().probs(layer, self.alpha, w, prev_layer, prev_tok, num_tokens)
        if p is not None:  # the compiled path (same formula)
            return p
        return [_softmax(r) for r in self._logits_lists(layer, prev_layer, prev_tok, num_tokens, w)]

    def observe(self, layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK):
        super().observe(layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK)
        self._version[layer] += 1

    def probabilities(self, *a) -> torch.Tensor:
        """`scores` (already a distribution over E per token)."""
        return self.scores(*a)


class LookaheadPredictor(ExpertPredictor):
    """The next layer's router applied to the current hidden state: softmax(gate_l(rmsnorm_l(h))).

    Args:
        gate_weights: per layer `[E, D]` router weights (None for dense layers).
        norm_weights: per layer `[D]` post-attention RMSNorm weights (None: no norm weight).
        norm_eps: RMSNorm epsilon.
    Raises:
        ValueError: `gate_weights` does not have one entry per layer.
    """

    name = "lookahead"

    def __init__(self, num_layers, num_experts, top_k, moe_layers=None, *, gate_weights: list, norm_weights=None,
                 norm_eps: float = 1e-6):
        super().__init__(num_layers, num_experts, top_k, moe_layers)
        if len(gate_weights) != num_layers:
            raise ValueError(f"gate_weights has {len(gate_weights)} entries, expected num_layers={num_layers}")
        self.gate = [None if g is None else g.detach().float().cpu() for g in gate_weights]
        self.norm = [None if n is None else n.detach().float().cpu() for n in (norm_weights or [None] * num_layers)]
        self.norm_eps = norm_eps
        self._compiled = GateLogprobs(self.gate, self.norm, norm_eps)

    def log_probs(self, layer: int, hidden_TD: torch.Tensor) -> torch.Tensor:
        """`[T, E]` float32 log softmax(gate_l(rmsnorm_l(h))) (layer must have a gate)."""
        fast = self._compiled(layer, hidden_TD)
        if fast is not None:
            return fast
        h = hidden_TD.detach().float().cpu()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        if self.norm[layer] is not None:
            h = h * self.norm[layer]
        return torch.log_softmax(h @ self.gate[layer].T, dim=-1)

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        if hidden_TD is None or self.gate[layer] is None:
            return torch.full((num_tokens, self.num_experts), 1.0 / self.num_experts)
        return self.log_probs(layer, hidden_TD).exp()


class HybridPredictor(ExpertPredictor):
    """Markov chains and lookahead in one log-linear model (a product of experts, not a mixture):

        score(b) = log P(b) + w_inter * g_inter(b) + w_intra * g_intra(b) + w_look * log p_lookahead(b)

    with the Markov terms of `MarkovPredictor` and p_lookahead the next gate's softmax on the current hidden
    state; per-layer weights fitted on calibration text (`fit_loglinear`). A product keeps an expert only if
    both sources find it plausible, so each vetoes the other's confident mistakes; a mixture only averages
    them (measured on tiny-moe held-out text, quick bench: product 0.89-0.91 recall, mixture 0.88). Without
    a hidden state (the first MoE layer) it is the Markov predictor with the hybrid's weights.

    Args:
        markov, lookahead: the two sources (share L, E, K). weights: `[L, 3]`, else `counts.weights["hybrid"]`,
            else DEFAULT_WEIGHTS["hybrid"]. counts: the calibration counts (for their fitted weights).
    Raises:
        ValueError: weights not of shape `[L, 3]`.
    """

    name = "hybrid"
    num_features = 3

    def __init__(self, markov: MarkovPredictor, lookahead: LookaheadPredictor, weights=None,
                 counts: TransitionCounts | None = None):
        super().__init__(markov.num_layers, markov.num_experts, markov.top_k, markov.moe_layers)
        self.markov, self.lookahead = markov, lookahead
        self.weights = _layer_weights(self.name, markov.num_layers, self.num_features, weights, counts)

    def logits(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens) -> torch.Tensor:
        """`[T, E]` float32 unnormalised log-probabilities (class docstring)."""
        logf, g = self.markov.features(layer, prev_layer_ids_TK, prev_token_ids_TK, num_tokens)
        if hidden_TD is not None and self.lookahead.gate[layer] is not None:
            g.append(self.lookahead.log_probs(layer, hidden_TD))
        return _loglinear(logf, g, self.weights[layer], num_tokens)

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        """`[T, E]` float32 probabilities (softmax of `logits`)."""
        return torch.softmax(self.logits(layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens), -1)

    def scores_lists(self, layer, prev_layer, prev_tok, hidden_TD, num_tokens):
        w = MarkovPredictor._weights_list(self, layer)
        look = None
        if hidden_TD is not None and self.lookahead.gate[layer] is not None:
            look = self.lookahead.log_probs(layer, hidden_TD)
        m = self.markov
        if m._pending_tokens or m._pending[0]:
            m._flush()
        p = m._tables_c().probs(layer, m.alpha, w, prev_layer, prev_tok, num_tokens, look)
        if p is not None:  # the compiled path (same formula)
            return p
        rows = m._logits_lists(layer, prev_layer, prev_tok, num_tokens, w)
        if hidden_TD is not None and self.lookahead.gate[layer] is not None:
            for r, look in zip(rows, look.tolist()):
                for b, v in enumerate(look):
                    r[b] += w[2] * v
        return [_softmax(r) for r in rows]

    def observe(self, layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK):
        self.markov.observe(layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK)

    def observe_lists(self, layer, ids, prev_layer, prev_tok):
        self.markov.observe_lists(layer, ids, prev_layer, prev_tok)


def make_predictor(name: str, *, num_layers: int, num_experts: int, top_k: int, moe_layers: list[bool] | None = None,
                   counts: TransitionCounts | None = None, gate_weights: list | None = None,
                   norm_weights: list | None = None, norm_eps: float = 1e-6) -> ExpertPredictor:
    """Build a predictor by name (one of PREDICTORS). Where `counts` carries fitted lookahead gates
    (`fit_lookahead_gates`), lookahead and hybrid use them in place of the routers' `gate_weights`.

    Raises:
        ValueError: unknown `name`, lookahead / hybrid without `gate_weights`, or fitted gates whose shape does
            not match the routers'.
    """
    kw = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k, "moe_layers": moe_layers}
    if name == "none":
        return NoPredictor(**kw)
    if name == "frequent":
        return FrequencyPredictor(**kw, counts=counts)
    if name == "markov":
        return MarkovPredictor(**kw, counts=counts)
    if name in ("lookahead", "hybrid"):
        if gate_weights is None:
            raise ValueError(f"prefetch={name!r} needs the routers' gate_weights")
        if counts is not None and counts.lookahead_gates:
            for l, g in counts.lookahead_gates.items():
                if l >= len(gate_weights) or gate_weights[l] is None or tuple(g.shape) != tuple(gate_weights[l].shape):
                    raise ValueError(f"lookahead_gates[{l}].shape={tuple(g.shape)} does not match the model's router "
                                     f"at layer {l} (a transitions file from another model?)")
            gate_weights = [counts.lookahead_gates.get(l, g) if g is not None else None for l, g in enumerate(gate_weights)]
        look = LookaheadPredictor(**kw, gate_weights=gate_weights, norm_weights=norm_weights, norm_eps=norm_eps)
        return look if name == "lookahead" else HybridPredictor(MarkovPredictor(**kw, counts=counts), look,
                                                                counts=counts)
    raise ValueError(f"prefetch={name!r} is not a known predictor (expected one of {PREDICTORS})")


def keep_previous_first(pred: list[int], prev: list[int], budget: int) -> list[int]:
    """One token's prediction under the `sticky` gating policy: its predecessor's experts at this layer first,
    then the predictor's own ranking `pred` (best first) up to `budget` ids in all.

    Why: `sticky` keeps a previous expert whenever it scores within `sticky_margin` of a new one (thrash 0.37
    against exact routing's 0.77 on the shipped model), while the predictors learned their weights on exact
    routing and rank the previous experts lower. Measured by `bench/gating.py` (prequential recall, budget
    k+1): hybrid on sticky routing 0.69 alone, 0.96 with the previous experts first (exact routing: 0.90).
    Unknown entries (< 0) in `prev` are skipped; duplicates are not repeated."""
    out = [e for e in dict.fromkeys(prev) if e >= 0][:budget]
    seen = set(out)
    for e in pred:
        if len(out) >= budget:
            break
        if e >= 0 and e not in seen:
            out.append(e)
            seen.add(e)
    return out


@dataclass(kw_only=True, slots=True)
class RoutingTrace:
    """The routing of one sequence through every layer (recorded by running the model).

    ids: `[T, L, K]` int64 expert ids (-1 at dense layers). hidden: `[T, L, D]` float residual stream entering
    each layer's FFN, or None (then lookahead predictors see no hidden state).
    """

    ids: torch.Tensor
    hidden: torch.Tensor | None = None


def prequential_eval(predictors: dict[str, ExpertPredictor], traces: list[RoutingTrace], *,
                     budget: int | None = None, keep_previous: bool = False) -> dict[str, RoutingStats]:
    """Score each predictor token by token, predicting (t, l) before it is observed, then learning from it.

    Every MoE layer after the first is predicted (the first has no previous layer in the same token; its
    prefetch, if any, comes from the previous token alone). Predictors are updated online in place.

    Args:
        predictors: name -> predictor (all share L, E, K).
        traces: sequences, in the order they are served.
        budget: experts per token predicted (default K + 1).
        keep_previous: the traces were routed by `sticky`: predict as the engine does for it
            (`keep_previous_first`).
    Returns:
        name -> RoutingStats with per-layer recall and precision (`summary()`).
    """
    out = {n: RoutingStats() for n in predictors}
    for tr in traces:
        T, L, _ = tr.ids.shape
        moe = [l for l in range(L) if bool((tr.ids[:, l] >= 0).any())]
        for t in range(T):
            for i, l in enumerate(moe):
                pl = moe[i - 1] if i else None
                prev_layer = tr.ids[t : t + 1, pl] if pl is not None else None
                prev_tok = tr.ids[t - 1 : t, l] if t else None
                hidden = tr.hidden[t : t + 1, pl] if (pl is not None and tr.hidden is not None) else None
                true = tr.ids[t : t + 1, l]
                for name, p in predictors.items():
                    if pl is not None:
                        pred = p.predict(l, prev_layer, prev_tok, hidden, 1, budget)
                        if keep_previous and prev_tok is not None:
                            pred = torch.tensor([keep_previous_first(pred[0].tolist(), prev_tok[0].tolist(),
                                                                     pred.shape[1])], dtype=torch.int64)
                        out[name].add_prediction(l, pred, true, p.num_experts)
                    p.observe(l, true, prev_layer, prev_tok)
    return out


LOOKAHEAD_RIDGE = 10.0  # ridge of `fit_lookahead_gates`; on tiny-moe held-out recall is flat over 1-100


def fit_lookahead_gates(traces: list[RoutingTrace], gate_weights: list, norm_weights: list | None = None,
                        norm_eps: float = 1e-6, *, ridge: float = LOOKAHEAD_RIDGE) -> dict[int, torch.Tensor]:
    """Fit, per MoE layer l after the first, a linear pre-gate G_l `[E, D]` that maps the hidden state the
    lookahead sees (the residual entering the previous MoE layer's FFN) to layer l's router log-probabilities:

        G_l = argmin_G sum_t || x_t G^T - log softmax(gate_l(n_l(h_t^l))) ||^2 + ridge * ||G||^2,
        x_t = n_l(h_t^(l_prev)),  n_l = RMSNorm with layer l's post-attention norm weight,

    solved in closed form (ridge regression). The raw lookahead uses G_l = gate_l, which ignores what layer
    l_prev's FFN and layer l's attention add to the residual; the fit learns that map on calibration text (the
    pre-gate of Pre-gated MoE, Hwang et al. 2024, arXiv 2308.12066, fitted here without training the model).
    Measured on tiny-moe (bench/experts.py): see BENCHMARKS.md, issue 4.

    Args:
        traces: calibration sequences with hidden states (`RoutingTrace.hidden` `[T, L, D]`), training text only.
        gate_weights: per layer `[E, D]` router weights (None for dense layers). norm_weights: per layer `[D]`
            post-attention RMSNorm weights (None: none). ridge: L2 penalty (>= 0).
    Returns:
        {layer: `[E, D]` float32} for every MoE layer with a previous MoE layer ({} without hidden states).
    Raises:
        ValueError: ridge < 0.
    """
    if ridge < 0:
        raise ValueError(f"ridge={ridge} must be >= 0")
    L = len(gate_weights)
    norms = list(norm_weights or [None] * L)

    def rms(h: torch.Tensor, l: int) -> torch.Tensor:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm_eps)
        return h * norms[l].float() if norms[l] is not None else h

    moe = [l for l in range(L) if gate_weights[l] is not None]
    xtx: dict[int, torch.Tensor] = {}
    xty: dict[int, torch.Tensor] = {}
    for tr in traces:
        if tr.hidden is None:
            continue
        for pl, l in zip(moe, moe[1:]):
            x = rms(tr.hidden[:, pl].double(), l)
            y = torch.log_softmax(rms(tr.hidden[:, l].double(), l) @ gate_weights[l].double().T, dim=-1)
            xtx[l] = xtx.get(l, 0) + x.T @ x
            xty[l] = xty.get(l, 0) + x.T @ y
    out = {}
    for l, a in xtx.items():
        eye = torch.eye(a.shape[0], dtype=a.dtype)
        out[l] = torch.linalg.solve(a + ridge * eye, xty[l]).T.float().contiguous()
    return out


def fit_loglinear(traces: list[RoutingTrace], num_layers: int, num_experts: int, top_k: int, *,
                  lookahead: LookaheadPredictor | None = None, alpha: float = 0.5, steps: int = 200) -> dict:
    """Fit the per-layer log-linear weights of `MarkovPredictor` and `HybridPredictor` on calibration traces.

    Features are computed block-prequentially: each sequence is scored with the counts of the sequences before
    it only (starting from zero counts), so a token never informs its own prediction and the fit sees the
    counts as sparse as they are early in serving. Then per layer the weights minimise a pairwise ranking
    loss, mean softplus(score(unused) - score(used)) (full-batch Adam, `steps` steps, from the defaults).

    Args:
        traces: calibration sequences (training text, never the evaluation text); hidden states are needed for
            the hybrid's lookahead term (without them, or without `lookahead`, only "markov" is fitted).
    Returns:
        {"markov": `[L][2]` floats, "hybrid": `[L][3]` floats (when fitted)}; dense layers keep the defaults.
    """
    m = MarkovPredictor(num_layers, num_experts, top_k, alpha=alpha, prior_tokens=None)
    feats: dict[int, list] = {}  # layer -> [(logf [E], g [T, F, E], multi-hot truth [T, E])]
    for tr in traces:
        moe = [l for l in range(num_layers) if bool((tr.ids[:, l] >= 0).any())]
        T = tr.ids.shape[0]
        for i, l in enumerate(moe[1:], 1):
            pl = moe[i - 1]
            prev_tok = torch.cat([torch.full_like(tr.ids[:1, l], -1), tr.ids[:-1, l]])
            logf, g = m.features(l, tr.ids[:, pl], prev_tok, T)
            cols = [g[0], g[1]]
            if lookahead is not None and tr.hidden is not None and lookahead.gate[l] is not None:
                cols.append(lookahead.log_probs(l, tr.hidden[:, pl]))
            feats.setdefault(l, []).append((logf, torch.stack(cols, 1), multi_hot(tr.ids[:, l], num_experts).float()))
        for i, l in enumerate(moe):
            prev_tok = torch.cat([torch.full_like(tr.ids[:1, l], -1), tr.ids[:-1, l]])
            m.observe(l, tr.ids[:, l], tr.ids[:, moe[i - 1]] if i else None, prev_tok)
    out = {"markov": [list(DEFAULT_WEIGHTS["markov"]) for _ in range(num_layers)]}
    hybrid = all(f[1].shape[1] == 3 for v in feats.values() for f in v) and bool(feats)
    if hybrid:
        out["hybrid"] = [list(DEFAULT_WEIGHTS["hybrid"]) for _ in range(num_layers)]
    for l, rows in feats.items():
        logf = torch.cat([r[0].expand(r[1].shape[0], -1) for r in rows])  # [N, E]
        g = torch.cat([r[1] for r in rows])  # [N, F, E]
        y = torch.cat([r[2] for r in rows])  # [N, E]
        for name, nf in (("markov", 2), ("hybrid", 3)):
            if name not in out:
                continue
            w = torch.tensor(DEFAULT_WEIGHTS[name], requires_grad=True)
            opt = torch.optim.Adam([w], lr=0.05)
            for _ in range(steps):
                opt.zero_grad()
                s = logf + torch.einsum("f,nfe->ne", w, g[:, :nf])
                # Pairwise ranking loss (used expert above unused one): prefetch keeps the top k + 1, so the
                # ranking matters, not calibrated probabilities (a likelihood fit damps the sharp lookahead).
                margin = s.unsqueeze(2) - s.unsqueeze(1)  # [N, E, E]: s(used) - s(other)
                pairs = y.unsqueeze(2) * (1 - y).unsqueeze(1)
                loss = (F.softplus(-margin) * pairs).sum() / pairs.sum()
                loss.backward()
                opt.step()
            out[name][l] = [round(float(x), 4) for x in w.detach()]
    return out
