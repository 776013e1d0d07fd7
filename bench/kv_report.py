"""The tables and the RESULT line of bench/kv_quality.py, from its rows (`Row`).

Context tags of the RESULT keys: `_1k` = 1,024 tokens, `_4k` = 4,096 tokens, exactly (never another context).
A tagged key is 0 when the model cannot run that context (its max_position_embeddings is smaller) and nan when
the context was not in --contexts, the row was not run (--rows) or retrieval was not run (--retrieval).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bench.kv_eval import WindowStats, wilson_interval

DOMAINS = ("prose", "code")
KEY_CONTEXTS = {"1k": 1024, "4k": 4096}
NAN = float("nan")


@dataclass
class Row:
    """One configuration's results. stats: {context: {domain: WindowStats}}; retr: {context: [correct, total]}
    (empty without --retrieval); bits: effective bits per element at the first context."""

    name: str
    bits: int
    eff_bits: float
    stats: dict[int, dict[str, WindowStats]]
    retr: dict[int, list[int]] = field(default_factory=dict)

    def ppl(self, c: int, dom: str) -> float:
        return self.stats[c][dom].ppl() if c in self.stats else NAN

    def pooled(self, c: int, tail: bool = False) -> tuple[float, float]:
        """(mean KLD in nats, same-top-1 %) over both domains' positions at context c (tail: positions past
        the first 1,024 only)."""
        if c not in self.stats:
            return NAN, NAN
        ss = self.stats[c].values()
        n = sum(s.tail_n if tail else s.n for s in ss)
        if not n:
            return NAN, NAN
        kl = sum(s.tail_kl if tail else s.kl for s in ss)
        same = sum(s.tail_same if tail else s.same for s in ss)
        return kl / n, 100.0 * same / n

    def accuracy(self, c: int) -> float:
        k, n = self.retr.get(c, (0, 0))
        return k / n if n else NAN


def print_tables(rows: list[Row], contexts: list[int], model_max: int, header: str, tail_from: int,
                 retrieval_note: str | None) -> None:
    """Per context: bits, perplexity per domain (and its increase over fp16-kv in %), mean KLD and same-top-1
    (pooled over the domains; past `tail_from` apart when the context is longer); then retrieval."""
    base = rows[0]
    print(header)
    for tag, c in KEY_CONTEXTS.items():
        if c > model_max:
            print(f"{tag}: not run (model context {model_max})")
        elif c not in contexts:
            print(f"{tag}: not run (not in --contexts)")
    for c in contexts:
        tail = c > tail_from
        n = {d: base.stats[c][d].n for d in DOMAINS}
        print(f"\ncontext {c}: {n['prose']}/{n['code']} positions prose/code; KLD = mean KL(p_fp16 || p_row) nats, "
              f"top1 = same top-1 %" + (f"; >{tail_from // 1024}k: positions >= {tail_from}" if tail else ""))
        print(f"{'config':<24}{'bits/elem':>10}{'ppl prose':>11}{'dppl%':>8}{'ppl code':>10}{'dppl%':>8}"
              f"{'KLD':>9}{'top1%':>8}" + (f"{'KLD>1k':>9}{'top1>1k':>9}" if tail else ""))
        for r in rows:
            kl, t1 = r.pooled(c)
            line = (f"{r.name:<24}{r.eff_bits:>10.3f}{r.ppl(c, 'prose'):>11.3f}{dppl(r, base, c, 'prose'):>8.2f}"
                    f"{r.ppl(c, 'code'):>10.3f}{dppl(r, base, c, 'code'):>8.2f}{kl:>9.5f}{t1:>8.2f}")
            if tail:
                klt, t1t = r.pooled(c, tail=True)
                line += f"{klt:>9.5f}{t1t:>9.2f}"
            print(line)
    if retrieval_note is None:
        print("\nretrieval: not run (--retrieval)")
        return
    print(f"\n{retrieval_note}")
    print(f"{'config':<24}" + "".join(f"{'acc@' + str(c):>10}{'95% CI':>15}{'x fp16':>8}" for c in contexts))
    for r in rows:
        if not r.retr:
            continue
        cells = []
        for c in contexts:
            k, n = r.retr[c]
            lo, hi = wilson_interval(k, n)
            cells.append(f"{k / n:>10.3f}{f'[{lo:.3f},{hi:.3f}]':>15}{ratio(r, base, c):>8.3f}")
        print(f"{r.name:<24}" + "".join(cells))


def dppl(r: Row, base: Row, c: int, dom: str) -> float:
    return 100.0 * (r.ppl(c, dom) / base.ppl(c, dom) - 1.0)


def ratio(r: Row, base: Row, c: int) -> float:
    """Retrieval accuracy as a fraction of fp16-kv's; 0 when fp16-kv retrieves nothing (no division by 0)."""
    fp = base.accuracy(c)
    return r.accuracy(c) / fp if fp > 0 else (0.0 if fp == 0 else NAN)


def result_line(rows: list[Row], contexts: list[int], model_max: int) -> str:
    """`RESULT ...`: the keys of the module doc of bench/kv_quality.py."""
    by = {r.name: r for r in rows}
    nan_row = Row("", 0, NAN, {})
    base = rows[0]
    c0 = contexts[0]

    def row(name):
        return by.get(name, nan_row)

    def keys(key, r):
        return f"{key}_bits={r.eff_bits:.3f} {key}_prose={dppl(r, base, c0, 'prose'):.3f} " \
               f"{key}_code={dppl(r, base, c0, 'code'):.3f}"

    b3, b2 = row("ours3"), row("ours2")
    out = [f"bits3={b3.eff_bits:.3f} dppl3_prose={dppl(b3, base, c0, 'prose'):.3f} "
           f"dppl3_code={dppl(b3, base, c0, 'code'):.3f} bits2={b2.eff_bits:.3f} "
           f"dppl2_prose={dppl(b2, base, c0, 'prose'):.3f} dppl2_code={dppl(b2, base, c0, 'code'):.3f}",
           keys("uniform3", row("kivi3")), keys("kivi3m", row("kivi3-m")), keys("kivi2m", row("kivi2-m")),
           f"ppl_prose={base.ppl(c0, 'prose'):.3f} ppl_code={base.ppl(c0, 'code'):.3f}"]
    for tag, c in KEY_CONTEXTS.items():
        def val(x: float) -> float:
            return 0.0 if c > model_max else x

        def fmt(key: str, r: Row, what: str) -> str:
            if what == "kld":
                x = r.pooled(c)[0]
            elif what == "top1":
                x = r.pooled(c)[1]
            else:
                x = ratio(r, base, c) if r.retr else NAN
            return f"{key}={val(x):.5f}" if what == "kld" else f"{key}={val(x):.3f}"

        for b in (3, 2, 4):
            r = row(f"ours{b}")
            out.append(f"{fmt(f'kld{b}_{tag}', r, 'kld')} {fmt(f'top1_{b}_{tag}', r, 'top1')} "
                       f"{fmt(f'retr{b}_{tag}', r, 'retr')}")
        for key, name in (("kivi3m", "kivi3-m"), ("kivi2m", "kivi2-m")):
            r = row(name)
            out.append(f"{fmt(f'{key}_kld_{tag}', r, 'kld')} {fmt(f'{key}_top1_{tag}', r, 'top1')} "
                       f"{fmt(f'{key}_retr_{tag}', r, 'retr')}")
        out.append(f"fp16_retr_{tag}={val(base.accuracy(c) if base.retr else NAN):.3f}")
    return "RESULT " + " ".join(out)
