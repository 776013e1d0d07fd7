"""The batched sampler of an engine step: one token per sequence from the step's logits, greedy or sampled
(temperature, top-k, top-p) with each request's own seeded uniforms, one bad row never failing the others.

Method (`sample`): greedy rows take the argmax. The sampled rows go together: z = (x - max) / T, the stable
form of softmax(x / T) (z <= 0, so exp(z) never overflows, whatever T >= GREEDY_BELOW_TEMPERATURE), floored at
_Z_FLOOR; top-k keeps the tokens whose z is >= the k-th largest (ties kept); top-p then keeps the smallest
most-probable prefix whose mass reaches top_p (a token is kept while the mass of the more probable ones is
< top_p; tokens tied with the last kept one are kept too). Each row then draws by inverse transform sampling
(Devroye, "Non-Uniform Random Variate Generation", 1986, sec. II.2): one uniform u from the row's own
generator, token = the first index whose prefix sum of exp(z) exceeds u * sum(exp(z)). P(token j) =
exp(z_j) / sum(exp(z)): the distribution `torch.multinomial` samples, but one uniform per token, so a seed's
token stream differs from what moeray's per-row `torch.multinomial` drew before this sampler. Drawing exactly
one uniform per sampled token from the request's own stream makes a seeded request's tokens independent of
its batch.

Why it is built this way (CPU; the measurements are in BENCHMARKS.md, "Batched sampler"): torch.sort,
torch.topk and torch.argmax over a [B, V] batch are an order of magnitude slower than numpy's sort, partition
and argmax; torch.cumsum over V is sequential, the two-level prefix sum (`_first_cum_index`) vectorized; exp()
of inputs below -87.3 (subnormal or zero results) takes a far slower path, hence the floor.
Shape legend: B = rows, S = sampled rows, C = rows with a top-k/top-p cut, M = candidates, V = vocab.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from actors.engine.grammar import GrammarState, apply_grammar_masks
from actors.engine.penalties import SequenceControls, apply_controls
from actors.engine.sampling import SamplingParams

# Temperatures below this sample greedily, as in vLLM (its _SAMPLING_EPS). T = 1e-38 would overflow x / T.
GREEDY_BELOW_TEMPERATURE = 1e-5
BAD_LOGITS = "the model's logits for this request are not finite (nan or inf); no token can be sampled"
# z is floored here before exp: a token more than 87 (in units of T) below the row's best weighs e^-87
# (~1.6e-38 of the best) in place of less, which no float32 prefix sum over a row can resolve anyway.
_Z_FLOOR = -87.0
_TOP_P_CANDIDATES = 256  # top-p looks for its cut among a row's 256 most probable tokens first, then sorts all
_BLOCK = 64  # elements per block of `_first_cum_index`'s two-level prefix sum


def make_generator(seed: int | None) -> random.Random:
    """A request's own uniform stream (Mersenne Twister, `random.Random`), seeded with `seed` (None: from
    os.urandom). The sampler takes one `random()` (a 53-bit double in [0, 1)) from it per sampled token."""
    return random.Random(seed)


def sample(logits_BV: torch.Tensor, params: list[SamplingParams], generators: list[random.Random | None],
           controls: list[SequenceControls | None] | None = None,
           grammars: list[GrammarState | None] | None = None) -> tuple[list[int], dict[int, str]]:
    """Pick one token per row of `logits_BV` [B, V] (float, any device; sampled on CPU in fp32), batched.

    Args:
        params: one per row (temperature, top_k, top_p are read).
        generators: one per row, `make_generator`'s; only sampled rows' are read (greedy rows' may be None).
        controls: one per row or None (no row has any): the rows' logit controls (`actors.engine.penalties`),
            applied to a copy of their logits before everything else; `logits_BV` is never modified.
        grammars: one per row or None (no row has one): the rows' grammar states (`actors.engine.grammar`), whose
            token masks are applied after the controls (disallowed tokens: -inf, drawn with weight exactly 0).
    Returns:
        (tokens: B ints, -1 for a failed row; errors: row -> message, empty when every row succeeded).
        Never raises for one row: a row whose logits are not finite (nan, +inf, all -inf) or whose params are
        unusable fails alone; if the batched computation itself raises, each row is sampled alone by
        `_sample_one` (same method and uniforms), and only the rows that fail there too fail.
    """
    B, V = logits_BV.shape
    if B == 0:
        return [], {}
    x = logits_BV.detach().to("cpu", torch.float32)
    errors: dict[int, str] = {}
    crow = [i for i, c in enumerate(controls or ()) if c is not None]
    grow = [i for i, g in enumerate(grammars or ()) if g is not None]
    if (crow or grow) and x.data_ptr() == logits_BV.data_ptr():  # a copy: the caller's logits stay raw (logprobs)
        x = x.clone()
    if crow:  # only the rows that use controls
        _controls(x.numpy(), crow, [controls[i] for i in crow], errors)
    if grow:  # only the rows with a grammar; a failing one fails alone
        apply_grammar_masks(x.numpy(), grow, [grammars[i] for i in grow], errors)
    masked = set(grow)
    best = np.argmax(x.numpy(), axis=1)  # the first maximum (a nan wins)
    mxn = x.numpy()[np.arange(B), best]  # row max: nan if any nan, inf if any inf, -inf if all are
    mx = torch.from_numpy(mxn)
    tokens: list[int] = best.tolist()
    finite = np.isfinite(mxn).tolist()
    rows, temps, ks, ps, us = [], [], [], [], []
    for i, p in enumerate(params):
        if i in errors:
            continue
        if not finite[i]:
            errors[i] = BAD_LOGITS
            continue
        try:
            t = float(p.temperature)
            if t < GREEDY_BELOW_TEMPERATURE:
                continue
            k, tp = int(p.top_k), float(p.top_p)
            if not (t <= 100.0 and 0.0 < tp <= 1.0):
                raise ValueError(f"temperature={t} or top_p={tp} out of range")
            u = generators[i].random()
        except Exception as e:  # a bug upstream: this request fails, not the step
            errors[i] = f"sampling parameters unusable: {e!r:.200}"
            continue
        rows.append(i), temps.append(t), ks.append(k if 0 < k < V else V), ps.append(tp), us.append(u)
    if rows:
        try:
            hard = [j for j, i in enumerate(rows) if i in masked]
            drawn = _sample_rows(x, mx, rows, temps, np.asarray(ks), np.asarray(ps, np.float32), us, hard)
        except Exception:
            drawn = []
            for i, t, k, tp, u in zip(rows, temps, ks, ps, us):
                try:
                    drawn.append(_sample_one(x[i], t, k, tp, u, i in masked))
                except Exception as e:
                    errors[i] = f"sampling failed: {e!r:.200}"
                    drawn.append(-1)
        for i, tok in zip(rows, drawn):
            tokens[i] = tok
    for i in errors:
        tokens[i] = -1
    return tokens, errors


def _controls(x: np.ndarray, rows: list[int], ctl: list[SequenceControls], errors: dict[int, str]) -> None:
    """`apply_controls` on x [B, V] (in place) for `rows`, batched; if that raises, row by row, and a row that
    fails alone gets its error in `errors`."""
    try:
        return apply_controls(x, rows, ctl)
    except Exception:
        pass
    for i, c in zip(rows, ctl):
        try:
            apply_controls(x, [i], [c])
        except Exception as e:
            errors[i] = f"logit controls failed: {e!r:.200}"


def _sample_rows(x: torch.Tensor, mx: torch.Tensor, rows: list[int], temps: list[float], ks: np.ndarray,
                 ps: np.ndarray, us: list[float], hard: list[int] = ()) -> list[int]:
    """`sample`'s sampled rows, batched: x [B, V] fp32, mx [B] row maxima; per sampled row its index, temperature,
    top_k (V: off), top_p (1: off) and uniform; `hard`: the sampled rows (indices into `rows`) whose -inf logits
    weigh exactly 0 (grammar masks), not the floor's e^-87. Returns one token per sampled row."""
    V = x.shape[1]
    if len(rows) == x.shape[0]:
        z = x - mx.unsqueeze(1)
    else:
        idx = torch.tensor(rows)
        z = x.index_select(0, idx) - mx[idx].unsqueeze(1)
    z.div_(torch.tensor(temps).unsqueeze(1)).clamp_(min=_Z_FLOOR)  # [S, V], row max 0
    w = torch.exp(z)
    zn, wn = z.numpy(), w.numpy()
    if len(hard):
        h = np.asarray(hard, dtype=np.int64)
        wn[h] *= np.isfinite(x.numpy()[np.asarray(rows, dtype=np.int64)[h]])
    cut = np.flatnonzero((ks < V) | (ps < 1.0))
    if cut.size:
        thr = np.full(len(rows), -np.inf, dtype=np.float32)
        whole = cut.size == len(rows)
        thr[cut] = _thresholds(zn if whole else zn[cut], wn if whole else wn[cut], ks[cut], ps[cut])
        np.multiply(wn, zn >= thr[:, None], out=wn)  # masked tokens weigh 0
    return _draw(wn, np.asarray(us, dtype=np.float32))


def _thresholds(z: np.ndarray, w: np.ndarray, ks: np.ndarray, ps: np.ndarray) -> np.ndarray:
    """Per row of z [C, V] (fp32, max 0, floored) and w = exp(z): the smallest z a token may have to survive
    top-k (ks; V: off), then top-p (ps; 1: off), [C]. From the M largest values (numpy's partition, then a sort
    of those); rows whose top-p cut is not among them sort the whole row."""
    C, V = z.shape
    kcut = ks < V
    M = min(V, max(int(ks[kcut].max()) + 1 if kcut.any() else 0, _TOP_P_CANDIDATES if (ps < 1.0).any() else 0))
    thr = np.empty(C, dtype=np.float32)
    todo = np.arange(C)
    if M < V:
        cand = np.partition(z, V - M, axis=1)[:, V - M:]  # the M largest of each row
        cand.sort(axis=1)
        thr, ok = _cut(cand[:, ::-1], z, w, ks, ps)
        todo = np.flatnonzero(~ok)
    if todo.size:
        zs = np.sort(z[todo], axis=1)[:, ::-1]
        thr[todo] = _cut(zs, z[todo], w[todo], ks[todo], ps[todo])[0]
    return thr


def _cut(zs: np.ndarray, z: np.ndarray, w: np.ndarray, ks: np.ndarray, ps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_thresholds` from zs [C, M]: each row's M largest z, descending (M = V: the whole row). Returns the
    thresholds [C] and which rows they are final for (a top-p cut beyond the M candidates is not)."""
    C, M = zs.shape
    V = z.shape[1]
    kcut = ks < V
    thr = np.where(kcut, zs[np.arange(C), np.minimum(ks, M) - 1], -np.inf).astype(np.float32)
    ok = np.ones(C, dtype=bool)
    pr = np.flatnonzero(ps < 1.0)
    if pr.size:
        zp = zs[pr]
        wp = np.exp(zp)
        np.multiply(wp, zp >= thr[pr, None], out=wp)  # after top-k
        total = wp.sum(axis=1)
        if M < V:  # the mass top-k kept: the whole row's without top-k; with ties of the k-th beyond M, recount
            whole = np.flatnonzero(~kcut[pr])
            total[whole] = torch.from_numpy(w[pr[whole]]).sum(dim=1).numpy()
            for j in np.flatnonzero(kcut[pr] & (thr[pr] == zp[:, -1])).tolist():
                r = pr[j]
                total[j] = w[r][z[r] >= thr[r]].sum(dtype=np.float32)
        # the last kept token is the first whose inclusive prefix mass reaches top_p * total
        last = _first_cum_index(wp, ps[pr], right=False, total=total)
        ok[pr] = last < M
        thr[pr] = np.maximum(thr[pr], zp[np.arange(pr.size), np.minimum(last, M - 1)])
    return thr, ok | (M == V)


def _first_cum_index(w: np.ndarray, frac: np.ndarray, right: bool, total: np.ndarray | None = None) -> np.ndarray:
    """Per row of w [R, V] (fp32, >= 0): the first index whose inclusive prefix sum is > frac * total (right)
    or >= it (not right), [R] int64; V where none is. total: [R], default sum(w) (with right, the target is
    then kept below it, so an index always qualifies). Two levels: block sums and their prefix sums find the
    block, then the prefix sums of that block alone: O(V) vectorized work, no sequential scan over V."""
    R, V = w.shape
    nb = -(-V // _BLOCK)
    wb = (w if nb * _BLOCK == V else np.pad(w, ((0, 0), (0, nb * _BLOCK - V)))).reshape(R, nb, _BLOCK)
    cb = np.zeros((R, nb + 1), dtype=np.float32)  # cb[:, i] = mass of the blocks before block i
    np.cumsum(torch.from_numpy(np.ascontiguousarray(wb)).sum(dim=2).numpy(), axis=1, out=cb[:, 1:])
    if total is None:
        t = frac * cb[:, -1]
        if right:
            t = np.minimum(t, np.nextafter(cb[:, -1], np.float32(0)))
    else:
        t = frac * total
    before = np.less_equal if right else np.less  # prefix sums that do not qualify yet (they are sorted)
    b = before(cb[:, 1:], t[:, None]).sum(axis=1)
    none = b == nb
    b = np.minimum(b, nb - 1)
    ar = np.arange(R)
    cw = np.cumsum(wb[ar, b], axis=1)
    cw += cb[ar, b][:, None]
    j = np.minimum(before(cw, t[:, None]).sum(axis=1), _BLOCK - 1)  # the levels round apart: stay in the block
    idx = np.minimum(b * _BLOCK + j, V - 1)
    idx[none] = V
    return idx


def _draw(w: np.ndarray, u: np.ndarray) -> list[int]:
    """Inverse transform sampling per row of w [R, V] (unnormalized probabilities, fp32) with uniforms u [R]:
    the first index whose prefix sum exceeds u * sum(w). A token of weight 0 is never drawn: where rounding
    between `_first_cum_index`'s two levels lands on one, the nearest token of weight > 0 at or below it is
    taken (above, if there is none below)."""
    tok = _first_cum_index(w, u, right=True)
    out = tok.tolist()
    for r in np.flatnonzero(w[np.arange(len(out)), tok] <= 0).tolist():
        nz = np.flatnonzero(w[r] > 0)
        below = nz[nz <= out[r]]
        out[r] = int(below[-1] if below.size else nz[0])
    return out


def _sample_one(x_V: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float, hard: bool = False) -> int:
    """One row of `sample`'s sampled path, alone, with per-row torch ops (topk, softmax, sort): `sample`'s
    fallback when the batched path raises. Same method: z = max((x - max) / T, _Z_FLOOR), top-k, top-p on the
    sorted probabilities, inverse transform of `u` (`_draw`); `hard`: -inf logits weigh exactly 0."""
    V = x_V.numel()
    z = ((x_V.float() - x_V.max()) / temperature).clamp(min=_Z_FLOOR)
    keep = torch.ones(V, dtype=torch.bool)
    if top_k < V:
        keep &= z >= torch.topk(z, top_k).values[-1]
    if top_p < 1.0:
        probs = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=0)
        sp = torch.sort(probs, descending=True).values
        keep &= probs >= sp[sp.cumsum(0) - sp < top_p][-1]
    w = torch.exp(z) * keep
    if hard:
        w = w * torch.isfinite(x_V)
    return _draw(w.unsqueeze(0).numpy(), np.asarray([u], dtype=np.float32))[0]
