"""The grammar libraries on PyPI side by side, on the shipped tokenizer: llguidance (moeray's choice,
`actors.engine.grammar`), xgrammar and outlines-core. Those not installed are skipped; install them apart from the
project's venv (xgrammar pulls torch, transformers, triton, apache-tvm-ffi), e.g.
`pip install --no-deps --target /tmp/gramlib xgrammar apache-tvm-ffi outlines-core` and `--path /tmp/gramlib`.

Per library: license and runtime dependencies (its wheel's metadata), installed size (its files), per schema of
bench/structured.py (whitespace fixed: json.dumps' separators, no free whitespace) the compile time (first matcher,
tokenizer already built) and mask + advance ms per token over a random walk of allowed tokens (uniform, seeded,
`--walks` walks of at most 200 tokens), each library's mask read out as a [V] bool array.

    python bench/grammar_libs.py --quick --path /tmp/gramlib   # last line: RESULT llguidance_ms=.. xgrammar_ms=..
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.structured import SCHEMAS  # noqa: E402
from cluster.config import DEFAULT_MODEL  # noqa: E402

TOK = os.path.join(DEFAULT_MODEL, "tokenizer.json")
V, EOS = 4096, 0


def llguidance_lib():
    import llguidance as llg

    tok = llg.LLTokenizer(open(TOK).read(), n_vocab=V, eos_token=[EOS])
    opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    compile_ = lambda s: llg.LLMatcher.grammar_from_json_schema(s, overrides=opts)  # noqa: E731

    def mask(m):
        return np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:V].astype(bool)
    return compile_, lambda g: llg.LLMatcher(tok, g, log_level=0), mask, lambda m, t: m.consume_token(t), \
        lambda m: m.is_stopped()


def xgrammar_lib():
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=TOK, eos_token="<|endoftext|>"),
                                              vocab_size=V)
    comp = xgr.GrammarCompiler(info)
    bm = xgr.allocate_token_bitmask(1, V)
    compile_ = lambda s: comp.compile_json_schema(json.dumps(s), any_whitespace=False,  # noqa: E731
                                                  separators=(", ", ": "))

    def mask(m):
        m.fill_next_token_bitmask(bm, 0)
        return np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[:V].astype(bool)
    return compile_, xgr.GrammarMatcher, mask, lambda m, t: m.accept_token(t), lambda m: m.is_terminated()


def outlines_core_lib():
    from collections import defaultdict

    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import Tokenizer

    from actors.engine.detokenizer import token_bytes

    by_bytes = defaultdict(list)  # outlines-core wants each token's text: the byte-level tokens' bytes
    for i, b in enumerate(token_bytes(Tokenizer.from_file(TOK))):
        if i != EOS and b:
            by_bytes[b].append(i)
    vocab = Vocabulary(EOS, dict(by_bytes))
    compile_ = lambda s: Index(build_regex_from_schema(json.dumps(s), whitespace_pattern=""), vocab)  # noqa: E731

    def mask(g):
        a = np.zeros(V, bool)
        a[g.get_tokens()] = True
        return a
    return compile_, Guide, mask, lambda g, t: g.advance(t), lambda g: g.is_finished()


LIBS = {"llguidance": (llguidance_lib, "llguidance"), "xgrammar": (xgrammar_lib, "xgrammar"),
        "outlines-core": (outlines_core_lib, "outlines_core")}


def package_facts(dist: str) -> tuple[str, str, float]:
    """(license, runtime dependencies, installed MB) from the installed distribution's metadata."""
    d = md.distribution(dist)
    lic = d.metadata.get("License-Expression") or d.metadata.get("License") or "?"
    deps = sorted({r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in d.requires or ()
                   if "extra ==" not in r})
    size = sum(os.path.getsize(d.locate_file(f)) for f in d.files or () if os.path.isfile(d.locate_file(f)))
    return lic, ", ".join(deps) or "none", size / 2**20


def walk(lib, schema: dict, walks: int) -> tuple[float, float]:
    """(compile ms, mask + advance ms per token)."""
    compile_, matcher, mask, advance, done = lib
    t0 = time.perf_counter()
    g = compile_(schema)
    matcher(g)
    t_compile = time.perf_counter() - t0
    rng, t, n = random.Random(0), 0.0, 0
    for _ in range(walks):
        m = matcher(g)
        for _ in range(200):
            if done(m):
                break
            t0 = time.perf_counter()
            allowed = np.flatnonzero(mask(m))
            t1 = time.perf_counter()
            tok = int(allowed[rng.randrange(len(allowed))])
            t2 = time.perf_counter()
            advance(m, tok)
            t += (t1 - t0) + (time.perf_counter() - t2)
            n += 1
    return t_compile * 1e3, t / max(n, 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 walks per schema (else 20)")
    ap.add_argument("--walks", type=int, default=None)
    ap.add_argument("--path", action="append", default=[], help="a folder holding libraries to compare")
    a = ap.parse_args()
    sys.path[:0] = a.path
    walks = a.walks or (5 if a.quick else 20)
    print(f"{'library':14} {'version':8} {'license':11} {'MB':>5}  runtime dependencies")
    libs, result = {}, []
    for name, (make, mod) in LIBS.items():
        try:
            libs[name] = make()
        except ImportError as e:
            print(f"{name:14} skipped: {e}")
            continue
        lic, deps, mb = package_facts(name)
        print(f"{name:14} {md.version(name):8} {lic:11} {mb:5.1f}  {deps}")
    print(f"\n{'schema':10} " + " ".join(f"{n + ' compile ms':>24} {'ms/token':>9}" for n in libs))
    per_lib = {n: [] for n in libs}
    for s_name, schema in SCHEMAS.items():
        cells = []
        for n, lib in libs.items():
            c, ms = walk(lib, schema, walks)
            per_lib[n].append(ms)
            cells.append(f"{c:24.2f} {ms:9.4f}")
        print(f"{s_name:10} " + " ".join(cells), flush=True)
    for n, v in per_lib.items():
        result.append(f"{n.replace('-', '_')}_ms={sum(v) / len(v):.4f}")
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
