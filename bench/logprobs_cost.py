"""Cost of `actors.engine.logprobs.step_logprobs` per engine step (64 sampled rows, vocab 8192, top-5), by how
many rows ask: 0 must cost ~nothing (a pass over the params). Run: PYTHONPATH=. python bench/logprobs_cost.py"""
import time, torch, random
from types import SimpleNamespace as NS
from actors.engine.logprobs import step_logprobs
V = 8192; N = 64
logits = torch.randn(N, V)
toks = [random.randrange(V) for _ in range(N)]
cases = {ask: [NS(params=NS(logprobs=5 if i < ask else None, max_tokens=16)) for i in range(N)] for ask in (0, 1, 8, 64)}
res = {a: [] for a in cases}
for rep in range(5):
    for a, seqs in cases.items():
        t = time.perf_counter()
        for _ in range(20): step_logprobs(logits, seqs, toks, [])
        res[a].append((time.perf_counter() - t) / 20 * 1e6)
for a, r in res.items(): print(f"N={N} V={V} asking={a}: median {sorted(r)[2]:.0f} us/step")
