"""The pre-attention expert predictor: a small two-layer MLP per MoE layer on a hidden state taken before that
layer's attention, trained in the calibration run to output the layer's top-k experts.

Source: "pre-attention" expert prediction, arXiv 2511.10676 (a linear -> activation -> linear network per
layer on the hidden state before attention, trained on the router's true top-k; 93.0-97.6% accuracy there).

Which hidden state (measured on tiny-moe, 16k-118k calibration tokens, held-out prose / code recall at k+1):
the prefetcher (`actors.experts.runtime.ExpertRuntime.on_route`) starts the next MoE layer's prefetch right
after the previous MoE layer pl routes, so it overlaps pl's expert FFN and layer l's attention. At that moment
the hidden states known are pl's input (before pl's attention) and the residual entering pl's FFN (after it);
the paper's choice, l's own input before l's attention, is known only after pl's FFN, which leaves only l's
attention to hide the transfer. So this predictor reads the residual stream entering pl's FFN (the state the
runtime already hands the lookahead predictor): it is before layer l's attention and before pl's FFN. Measured
(offline, on the 1k checkpoint, 8 x 512 held-out tokens per domain, 118k calibration tokens): this input 0.948 /
0.931, pl's input before its attention 0.90 / 0.88, the paper's l input 0.956 / 0.944 (with a third of the lead
time).

Shape legend: T = tokens, E = routed experts, L = layers, D = hidden, H = MLP hidden width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.prefetch.base import ExpertPredictor

PRE_ATTENTION_HIDDEN = 256  # H: width of the MLP's hidden layer
# Online learning rate of the MLP's output layer (`PreAttentionPredictor`, plain SGD on the multi-label
# cross-entropy of each served token). Chosen on training-side development text (Twelfth Night, The Merchant of
# Venice; ast, shutil, email/message, asyncio/base_events; never the held-out text): standalone MLP recall at k+1,
# prose / code, 0 -> 0.941 / 0.933, 0.003 -> 0.945 / 0.938, 0.01 -> 0.942 / 0.936, 0.05 -> 0.919 / 0.915
# (BENCHMARKS.md, issue 21 part 3).
PRE_ATTENTION_ONLINE_LR = 0.003
# Rows of one step that count in full in an online update; a larger step (a prefill) takes the mean gradient
# times this many rows, so a long prompt moves the layer no more than this many served tokens would.
PRE_ATTENTION_ONLINE_ROWS = 32


@dataclass(kw_only=True, slots=True)
class PreAttentionMLP:
    """One MoE layer's predictor: logits = w2 @ gelu(w1 @ rms(h) + b1) + b2, rms(h) = h / RMS(h) (no weight).

    w1: `[H, D]`, b1: `[H]`, w2: `[E, H]`, b2: `[E]`, all float32. parts: the input is `parts` hidden states side
    by side (`[T, parts * D_model]`), each RMS-normalised on its own (`actors.prefetch.pre_attention_prev`: 2).
    Raises (in `__post_init__`): ValueError naming the tensor whose shape disagrees, or D not divisible by parts.
    """

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    eps: float = 1e-6
    parts: int = 1

    def __post_init__(self) -> None:
        H, D = self.w1.shape
        E = self.w2.shape[0]
        if self.parts < 1 or D % self.parts:
            raise ValueError(f"pre-attention parts={self.parts} does not divide the input width D={D}")
        for name, want in (("b1", (H,)), ("w2", (E, H)), ("b2", (E,))):
            got = tuple(getattr(self, name).shape)
            if got != want:
                raise ValueError(f"pre-attention {name}.shape={got}, expected {want} (w1 is {(H, D)})")

    @property
    def dims(self) -> tuple[int, int, int]:
        """(D, H, E)."""
        return self.w1.shape[1], self.w1.shape[0], self.w2.shape[0]

    def logits(self, h_TD: torch.Tensor) -> torch.Tensor:
        """`[T, E]` float32 logits of the experts the layer will route `h_TD` `[T, D]` to."""
        return self.forward_parts(h_TD)[1]

    def forward_parts(self, h_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`[T, H]` float32 hidden activations gelu(w1 @ rms(h) + b1), `[T, E]` float32 logits)."""
        a = F.gelu(F.linear(rms_parts(h_TD.detach().float().cpu(), self.parts, self.eps), self.w1, self.b1))
        return a, F.linear(a, self.w2, self.b2)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The four tensors by name (for saving)."""
        return {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": self.b2}


def rms_parts(x_TD: torch.Tensor, parts: int, eps: float = 1e-6) -> torch.Tensor:
    """`x_TD` `[T, D]` float as `parts` equal slices side by side, each divided by its own RMS (same shape)."""
    x = x_TD.reshape(x_TD.shape[0], parts, -1)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).reshape(x_TD.shape)


def fit_pre_attention_mlp(x_ND: torch.Tensor, y_NE: torch.Tensor, *, hidden: int = PRE_ATTENTION_HIDDEN,
                          epochs: int = 10, lr: float = 3e-3, weight_decay: float = 1e-4, batch: int = 1024,
                          seed: int = 0, parts: int = 1) -> PreAttentionMLP:
    """Train one layer's MLP with a multi-label loss (binary cross-entropy on the multi-hot true top-k).

    Args:
        x_ND: `[N, D]` hidden states (any float dtype; `parts` states side by side). y_NE: `[N, E]` multi-hot
            {0, 1} targets. hidden: H (>= 1). epochs: passes over the data (>= 1), AdamW at `lr`, mini-batches
            of `batch`. parts: input slices normalised apart (`PreAttentionMLP.parts`).
    Raises:
        ValueError: N = 0, mismatched row counts, or hidden / epochs < 1.
    """
    if x_ND.shape[0] == 0 or x_ND.shape[0] != y_NE.shape[0]:
        raise ValueError(f"x rows={x_ND.shape[0]}, y rows={y_NE.shape[0]}: need the same number > 0")
    if hidden < 1 or epochs < 1:
        raise ValueError(f"hidden={hidden} and epochs={epochs} must be >= 1")
    g = torch.Generator().manual_seed(seed)
    D, E = x_ND.shape[1], y_NE.shape[1]
    x = rms_parts(x_ND.float(), parts)
    y = y_NE.float()
    l1, l2 = torch.nn.Linear(D, hidden), torch.nn.Linear(hidden, E)
    with torch.no_grad():  # seeded init (independent of the global RNG)
        for lin in (l1, l2):
            b = 1.0 / lin.in_features ** 0.5
            lin.weight.copy_(torch.rand(lin.weight.shape, generator=g) * 2 * b - b)
            lin.bias.zero_()
    opt = torch.optim.AdamW([*l1.parameters(), *l2.parameters()], lr=lr, weight_decay=weight_decay)
    with torch.enable_grad():
        for _ in range(epochs):
            perm = torch.randperm(x.shape[0], generator=g)
            for i in range(0, x.shape[0], batch):
                b = perm[i : i + batch]
                loss = F.binary_cross_entropy_with_logits(l2(F.gelu(l1(x[b]))), y[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
    d = lambda t: t.detach().float().contiguous()  # noqa: E731
    return PreAttentionMLP(w1=d(l1.weight), b1=d(l1.bias), w2=d(l2.weight), b2=d(l2.bias), parts=parts)


class PreAttentionPredictor(ExpertPredictor):
    """Scores layer l's experts by its fitted `PreAttentionMLP` on the residual entering the previous MoE
    layer's FFN (module docstring). Layers without an MLP (the first MoE layer, dense layers) or calls without a
    hidden state get uniform scores.

    Online learning (`online_lr` > 0): after layer l routes (`observe`), one SGD step on the output layer (w2, b2)
    of l's MLP on the multi-label cross-entropy of the tokens it last scored for l (the rows of the latest
    `log_probs(l, ...)` call, used once; none, or another row count: no step). Per served token: g = (sigmoid(z) -
    y) / E, w2 -= lr * g^T a, b2 -= lr * g (a: the hidden activations, y: the multi-hot true experts); a step of
    T > PRE_ATTENTION_ONLINE_ROWS rows takes the mean gradient times that many rows. The hidden layer stays as
    trained. Why: served text is not the calibration text; the output layer re-weights the features the MLP
    learned towards the experts the served text uses (held-out code, last layer: 0.85 -> 0.87 standalone, BENCHMARKS.md).
    The calibrated tensors are not changed (this predictor learns on its own copies of w2, b2).

    Also a hidden-state source of `HybridPredictor` (`log_probs`, `gate`), in place of the lookahead.

    Args:
        mlps: MoE layer -> PreAttentionMLP (from the calibration file, `TransitionCounts.pre_attention`).
        online_lr: SGD learning rate of the online step (>= 0; 0: the calibrated MLPs, unchanged).
    Raises:
        ValueError: an MLP's layer outside [0, L) or its E not num_experts; online_lr < 0.
    """

    name = "pre_attention"

    def __init__(self, num_layers, num_experts, top_k, moe_layers=None, *, mlps: dict[int, PreAttentionMLP],
                 online_lr: float = PRE_ATTENTION_ONLINE_LR):
        super().__init__(num_layers, num_experts, top_k, moe_layers)
        for l, m in mlps.items():
            if not 0 <= l < num_layers or m.dims[2] != num_experts:
                raise ValueError(f"pre_attention[{l}] predicts {m.dims[2]} experts; expected a layer in "
                                 f"[0, {num_layers}) and num_experts={num_experts}")
        if online_lr < 0:
            raise ValueError(f"online_lr={online_lr} must be >= 0")
        self.online_lr = float(online_lr)
        self._scored: dict[int, tuple] = {}  # layer -> (T, [(mlp, rows or None, a [T', H], z [T', E])]) to learn on
        self.mlps = self._own(mlps)
        self.gate = [self.mlps.get(l) for l in range(num_layers)]  # non-None where a source exists (hybrid)
        self.norm_eps = 1e-6

    def compiled_gate(self, layer: int) -> None:
        """No compiled kernel for the MLP (the hybrid's compiled step then falls back to Python)."""
        return None

    def _own(self, mlps: dict[int, PreAttentionMLP]) -> dict[int, PreAttentionMLP]:
        """The MLPs this predictor scores with: with online learning, copies whose w2, b2 it may change."""
        if not self.online_lr:
            return dict(mlps)
        return {l: PreAttentionMLP(w1=m.w1, b1=m.b1, w2=m.w2.clone(), b2=m.b2.clone(), eps=m.eps, parts=m.parts)
                for l, m in mlps.items()}

    def _groups(self, layer: int, hidden_TD: torch.Tensor) -> list[tuple]:
        """Which MLP scores which rows: [(mlp, row indices `[T']` int64 or None for all rows, input `[T', D']`)]."""
        return [(self.mlps[layer], None, hidden_TD)]

    def log_probs(self, layer: int, hidden_TD: torch.Tensor) -> torch.Tensor:
        """`[T, E]` float32 log softmax of the layer's MLP logits (the layer must have an MLP). With online
        learning, these rows are the ones the next `observe(layer, ...)` learns on."""
        scored, z_TE = [], None
        for m, rows, x in self._groups(layer, hidden_TD):
            a, z = m.forward_parts(x)
            if rows is None:
                z_TE = z
            else:
                z_TE = torch.zeros(hidden_TD.shape[0], self.num_experts) if z_TE is None else z_TE
                z_TE[rows] = z
            scored.append((m, rows, a, z))
        if self.online_lr:
            self._scored[layer] = (hidden_TD.shape[0], scored)
        return torch.log_softmax(z_TE, dim=-1)

    def learns(self, layer: int) -> bool:
        """True where the next `observe(layer, ...)` makes an online step (rows of `layer` scored, not yet learned)."""
        return layer in self._scored

    def observe(self, layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK):
        """The online SGD step on layer `layer`'s output layer (class docstring); ids_TK `[T, K]` int64 (-1: none)."""
        T_scored, scored = self._scored.pop(layer, (None, None))
        if T_scored is None or ids_TK.shape[0] != T_scored:
            return
        ids_all = ids_TK.detach().cpu().long()
        for m, rows, a, z in scored:
            ids = ids_all if rows is None else ids_all[rows]
            T, E = z.shape
            if T == 0:
                continue
            y = torch.zeros(T, E).scatter_(1, ids.clamp(min=0), (ids >= 0).float())  # multi-hot, -1 ignored
            g = (torch.sigmoid(z) - y) * (min(T, PRE_ATTENTION_ONLINE_ROWS) / (T * E))  # [T, E] dLoss/dz
            m.w2.sub_(self.online_lr * (g.T @ a))
            m.b2.sub_(self.online_lr * g.sum(0))

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        if hidden_TD is None or layer not in self.mlps:
            return torch.full((num_tokens, self.num_experts), 1.0 / self.num_experts)
        return self.log_probs(layer, hidden_TD).exp()
