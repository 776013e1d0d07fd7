"""lm-eval-harness, unmodified, against `moeray serve`: per-document loglikelihoods and greedy generations equal
lm-eval's own `hf` model on the same checkpoint.

Runs the `lm_eval` CLI three times on the two local tasks of bench/lm_eval_tasks (`moeray_next_line_mc`: pick the
true next line of held-out text among 4, `moeray_next_line_gen`: continue it greedily to the newline):
  1. `--model hf --model_args pretrained=models/tiny-moe,dtype=float32` (the reference);
  2. `--model local-completions --model_args model=tiny-moe,base_url=http://127.0.0.1:PORT/v1/completions,
     tokenizer=models/tiny-moe,tokenized_requests=True` against `moeray serve` (full-precision KV, fp32, --ranks
     ranks), with automatic prefix caching on, then 3. with `--no-prefix-caching`.
Each with `--log_samples`; per doc it compares every choice's loglikelihood (max abs diff over all of them), the
is_greedy flags and the generated text. With caching on, the generate_until request of a doc reads the blocks the
4 loglikelihood requests of the same context left (those score every prompt position, so never read the cache,
as in vLLM): `prefix_hits` is moeray_prefix_cache_hits_total (tokens) after the run.

    python bench/lm_eval_parity.py --quick   # 8 docs of each task; the full run: 48 each
Last line: RESULT max_abs_diff_cache_on=.. max_abs_diff_cache_off=.. gen_equal=.. docs=..
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "models/tiny-moe"
TASKS = ["moeray_next_line_mc", "moeray_next_line_gen"]  # mc first: its requests leave the contexts in the cache
ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def lm_eval(model: str, model_args: str, out: str, limit: int | None, batch_size: int) -> float:
    """One `python -m lm_eval` run (from the repo root: the task YAMLs name their data relative to it); returns
    its wall seconds. Raises CalledProcessError with lm-eval's output on failure."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS),
           "--include_path", "bench/lm_eval_tasks", "--batch_size", str(batch_size), "--log_samples",
           "--output_path", out, *(["--limit", str(limit)] if limit else []), *(["--device", "cpu"] if model == "hf" else [])]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if r.returncode:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-8000:])
        raise subprocess.CalledProcessError(r.returncode, cmd)
    return time.perf_counter() - t0


def samples(out: str, task: str) -> dict[int, dict]:
    """doc_id -> lm-eval's logged sample of `task` under output folder `out`."""
    path = sorted(glob.glob(os.path.join(out, "*", f"samples_{task}_*.jsonl")))[-1]
    with open(path) as f:
        return {d["doc_id"]: d for d in map(json.loads, f)}


def _wait_port_free(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
        time.sleep(1)


class Serve:
    """`moeray serve` in its own process group, HTTP only, until `stop`."""

    def __init__(self, port: int, ranks: int, prefix_caching: bool, log: str):
        _wait_port_free(port)  # a previous server's replica may still hold it for a few seconds after its exit
        cmd = [sys.executable, "-m", "moeray.cli", "serve", "--model", MODEL, "--ranks", str(ranks), "--http-port",
               str(port), "--grpc-port", "0", *([] if prefix_caching else ["--no-prefix-caching"])]
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moeray serve exited with {self.proc.returncode}; see {log}")
            try:
                urllib.request.urlopen(f"{self.base}/v1/models", timeout=2).read()
                return
            except OSError:
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"moeray serve did not answer on {self.base} within 600 s; see {log}")

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"{self.base}/metrics", timeout=10).read().decode()
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def stop(self) -> None:
        for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        self.log.close()


def compare(ref: str, got: str) -> dict:
    """Per-doc comparison of run `got` with the reference run `ref` (output folders)."""
    mc_r, mc_g = samples(ref, TASKS[0]), samples(got, TASKS[0])
    gen_r, gen_g = samples(ref, TASKS[1]), samples(got, TASKS[1])
    assert mc_r.keys() == mc_g.keys() and gen_r.keys() == gen_g.keys(), "different docs"
    diffs, greedy_eq = [], True
    for k in mc_r:
        for (a, ga), (b, gb) in zip(mc_r[k]["filtered_resps"], mc_g[k]["filtered_resps"]):
            diffs.append(abs(float(a) - float(b)))
            greedy_eq &= ga == gb
    gen_eq = sum(gen_r[k]["filtered_resps"][0] == gen_g[k]["filtered_resps"][0] for k in gen_r)
    return {"mc_docs": len(mc_r), "lls": len(diffs), "max_abs_diff": max(diffs), "greedy_equal": greedy_eq,
            "gen_docs": len(gen_r), "gen_equal": gen_eq,
            "acc": sum(d["acc"] for d in mc_g.values()) / len(mc_g),
            "exact_match": sum(d["exact_match"] for d in gen_g.values()) / len(gen_g)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 docs of each task (else all 48)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--batch-size", type=int, default=8, help="lm-eval --batch_size (prompts per HTTP request)")
    a = ap.parse_args()
    limit = 8 if a.quick else None
    out = tempfile.mkdtemp(prefix="lm_eval_parity_")
    walls = {"hf": lm_eval("hf", f"pretrained={MODEL},dtype=float32", f"{out}/hf", limit, a.batch_size)}
    rows, hits = {}, {}
    for cache in (True, False):
        name = "cache_on" if cache else "cache_off"
        srv = Serve(a.port, a.ranks, cache, f"{out}/serve_{name}.log")
        try:
            args = (f"model=tiny-moe,base_url={srv.base}/v1/completions,tokenizer={MODEL},tokenized_requests=True")
            walls[name] = lm_eval("local-completions", args, f"{out}/{name}", limit, a.batch_size)
            hits[name] = srv.metric("moeray_prefix_cache_hits_total")
        finally:
            srv.stop()
        rows[name] = compare(f"{out}/hf", f"{out}/{name}")
    ref = compare(f"{out}/hf", f"{out}/hf")
    print(f"lm-eval {' + '.join(TASKS)}; moeray serve --ranks {a.ranks}, fp32, full-precision KV; "
          f"lm-eval --batch_size {a.batch_size}; samples in {out}")
    print(f"{'run':<28} {'mc docs':>7} {'lls':>4} {'max |dll|':>10} {'greedy=':>7} {'gen docs':>8} {'gen equal':>9} "
          f"{'acc':>6} {'exact':>6} {'prefix hits':>11} {'wall s':>7}")
    for name, label in (("hf", "hf (reference)"), ("cache_on", "moeray, prefix caching on"),
                        ("cache_off", "moeray, --no-prefix-caching")):
        r = ref if name == "hf" else rows[name]
        print(f"{label:<28} {r['mc_docs']:>7} {r['lls']:>4} {r['max_abs_diff']:>10.2e} {str(r['greedy_equal']):>7} "
              f"{r['gen_docs']:>8} {r['gen_equal']:>9} {r['acc']:>6.3f} {r['exact_match']:>6.3f} "
              f"{hits.get(name, float('nan')):>11.0f} {walls[name]:>7.1f}")
    gen_equal = all(r["gen_equal"] == r["gen_docs"] and r["greedy_equal"] for r in rows.values())
    print(f"RESULT max_abs_diff_cache_on={rows['cache_on']['max_abs_diff']:.3g} "
          f"max_abs_diff_cache_off={rows['cache_off']['max_abs_diff']:.3g} gen_equal={gen_equal} "
          f"docs={rows['cache_on']['mc_docs'] + rows['cache_on']['gen_docs']}")


if __name__ == "__main__":
    main()
