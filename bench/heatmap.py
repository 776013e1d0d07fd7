"""Per-layer expert-load heat map (PNG): which experts of each MoE layer the router picks, on real text.

    python bench/heatmap.py --quick                          # a private cluster on the shipped model
    python bench/heatmap.py --url http://host:8000           # a running server's /metrics instead
    python bench/heatmap.py --out /tmp/load.png --ranks 2

Without --url it brings up an EP cluster (`moeray.api.LLM`), serves held-out prose and code windows
(models/<model>/heldout/{prose,code}.txt, else built-in lines) with greedy decoding, and reads the cluster's
cumulative expert load (`cluster.metrics.aggregate_stats`: (token, expert) assignments, top-k per token and
MoE layer). With --url it reads `moeray_expert_tokens_total{layer,expert}` from the server's /metrics.

Each cell is an expert's share of its layer's assignments times E (1.0 = the fair share; the colour scale
is centred there). The table lists, per MoE layer: assignments, balancedness (mean/max load, 1 = balanced),
the hottest expert and its share x E.
Last line: RESULT png_bytes=<n> layers=<L MoE layers drawn> experts=<E>
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.config import DEFAULT_MODEL  # noqa: E402

FALLBACK_PROMPTS = ["To be, or not to be, that is the question:", "def parse(line):\n    key, _, value = line",
                    "Full fathom five thy father lies;", "import json\n\nclass Encoder(json.JSONEncoder):"]


def heldout_prompts(model: str, n: int, chars: int) -> list[str]:
    """n prompts of about `chars` characters, alternating prose and code windows spread over the held-out text."""
    texts = []
    for dom in ("prose", "code"):
        p = os.path.join(model, "heldout", f"{dom}.txt")
        if os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                texts.append(f.read())
    if not texts:
        return (FALLBACK_PROMPTS * n)[:n]
    out = []
    for i in range(n):
        t = texts[i % len(texts)]
        start = (i // len(texts)) * max(1, (len(t) - chars) // max(1, n // len(texts)))
        out.append(t[start:start + chars])
    return out


def load_from_cluster(args) -> list[list[float]]:
    """expert_load [L][E] after serving the held-out prompts on a fresh cluster."""
    from actors.engine.sampling import SamplingParams
    from moeray.api import LLM

    prompts = heldout_prompts(args.model, args.prompts, args.prompt_chars)
    llm = LLM(model=args.model, ranks=args.ranks, num_threads_per_rank=1)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
        bad = [o.error for o in outs if o.finish_reason == "error"]
        if bad:
            raise RuntimeError(f"{len(bad)} prompts failed: {bad[0]}")
        return llm.stats()["expert_load"]
    finally:
        llm.shutdown()


def load_from_metrics(url: str, timeout: float = 10.0) -> list[list[float]]:
    """expert_load [L][E] from a server's `moeray_expert_tokens_total{layer,expert}` (dense layers: zero rows).

    Raises:
        ValueError: the metrics carry no expert token counts (no request served yet, or not a moeray server).
    """
    from prometheus_client.parser import text_string_to_metric_families

    from moeray.cli_top import fetch

    cells = {}
    for fam in text_string_to_metric_families(fetch(url, timeout)):
        for s in fam.samples:
            if s.name == "moeray_expert_tokens_total":
                cells[(int(s.labels["layer"]), int(s.labels["expert"]))] = s.value
    if not cells:
        raise ValueError(f"{url}: no moeray_expert_tokens_total samples (serve a request first)")
    L = 1 + max(l for l, _ in cells)
    E = 1 + max(e for _, e in cells)
    return [[cells.get((l, e), 0.0) for e in range(E)] for l in range(L)]


def draw_heatmap(load: list[list[float]], path: str, title: str = "") -> tuple[int, list[int]]:
    """Write the heat map of the MoE layers of `load` [L][E] (rows with no assignments are dense layers and
    are left out) to PNG `path`. Returns (bytes written, the layers drawn).

    Raises:
        ValueError: no layer has any assignment.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    layers = [l for l, row in enumerate(load) if sum(row) > 0]
    if not layers:
        raise ValueError("expert_load has no assignments in any layer")
    E = len(load[0])
    share = [[load[l][e] / sum(load[l]) * E for e in range(E)] for l in layers]  # 1.0 = fair share
    vmax = max(2.0, max(max(r) for r in share))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * E + 2.5), max(2.0, 0.5 * len(layers) + 1.5)), dpi=120)
    im = ax.imshow(share, cmap="RdBu_r", norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax), aspect="auto")
    ax.set_xticks(range(E), [str(e) for e in range(E)] if E <= 64 else None)
    ax.set_yticks(range(len(layers)), [f"layer {l} (bal {sum(load[l]) / E / max(load[l]):.2f})" for l in layers])
    ax.set_xlabel("expert")
    if E <= 16:
        for i, row in enumerate(share):
            for e, v in enumerate(row):
                dark = v < 0.35 or v > 1.0 + 0.65 * (vmax - 1.0)  # white text on the saturated ends
                ax.text(e, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if dark else "black")
    fig.colorbar(im, ax=ax, label="load share x E (1 = fair)")
    ax.set_title(title or "expert load per layer", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return os.path.getsize(path), layers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="read a running server's /metrics instead of starting a cluster")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4 prompts x 16 tokens (about a minute on 2 CPU cores)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "expert_load.png"))
    args = ap.parse_args()
    try:  # fail before the cluster run, not after it
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench/heatmap.py needs matplotlib: make bench-deps (or pip install -e '.[bench]')", file=sys.stderr)
        return 2
    if args.quick:
        args.prompts, args.max_tokens, args.prompt_chars = 4, 16, 300

    if args.url:
        load, src = load_from_metrics(args.url), args.url
    else:
        load = load_from_cluster(args)
        src = f"{os.path.basename(args.model.rstrip('/'))}, {args.ranks} ranks, {args.prompts} prompts x {args.max_tokens} tokens"
    nbytes, layers = draw_heatmap(load, args.out, f"expert load: {src}")
    E = len(load[0])

    print(f"\nexpert load ({src}) -> {args.out}")
    print("| layer | assignments | balancedness (mean/max) | hottest expert | its share x E |")
    print("|---|---|---|---|---|")
    for l in layers:
        row = load[l]
        hot = max(range(E), key=lambda e: row[e])
        print(f"| {l} | {sum(row):.0f} | {sum(row) / E / row[hot]:.3f} | {hot} | {row[hot] / sum(row) * E:.2f} |")
    print(f"RESULT png_bytes={nbytes} layers={len(layers)} experts={E}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
