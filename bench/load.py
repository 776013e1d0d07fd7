"""Load test of the front doors on loopback: many concurrent streaming clients over HTTP (SSE) and gRPC,
random early disconnects and cancels, deliberately bad requests; then every KV block must be free again.

What it does, bounded in count and time:
  1. starts its own server: `python -m moeray.cli serve` as a subprocess on free 127.0.0.1 ports, HTTP
     (Ray Serve, `/v1/completions` + `/v1/chat/completions`) and gRPC (`moeray.v1.Moeray`) over one EP
     cluster of the shipped model (2 ranks by default), on a private local Ray (RAY_ADDRESS=local);
     waits for `GET /health` 200 and gRPC `Health` SERVING;
  2. reads the cluster's free KV blocks (gRPC `GetClusterStats`, summed over ranks): the initial count;
  3. runs `--clients` (64) stream clients for `--duration-s` seconds. Each loops: pick HTTP (completions or
     chat) or gRPC, a random held-out text slice as prompt (16-800 characters), max_tokens in [4, 48], a
     temperature; stream it to the end. A fraction (`--disconnect-frac`) ends early at a random chunk:
     HTTP closes the connection, gRPC cancels the call, or (gRPC, half of them) sends the `Cancel` RPC and
     reads on until the server's ABORT finish. Alongside, `--bad-clients` (4) clients send deliberately bad
     requests (negative or too large max_tokens, top_p 2, empty prompt, unknown model, missing prompt, a
     body that is not JSON) that must get HTTP 400 / INVALID_ARGUMENT;
  4. after the last stream ends, one greedy request per protocol must still be served; then waits for the
     cluster to go idle and reads free KV blocks again: `leaked_blocks` = initial - final;
  5. stops the server (SIGINT: `serve.shutdown()` and Ray exit; SIGKILL of its process group as fallback).

Counting (well-formed requests; the bad ones only count as `rejected` or `failed`):
  ok       stream ended with exactly one finish (stop | length) and, for HTTP, `data: [DONE]` (gRPC: usage
           completion_tokens equals the token ids received); or a deliberate early end: the client closed
           it (`disconnected`), or sent Cancel and got one ABORT (or normal) finish (`cancelled`);
  failed   anything else: HTTP status != 200, gRPC status != OK, an error event, no / two finishes, an
           unexpected abort, a usage mismatch; also 503 / RESOURCE_EXHAUSTED (`overloaded`, listed apart in
           the table): the queue limit (`--max-queue` 256) is above the client count, so overload is a bug;
  hung     no finish within `--request-timeout-s` (the client then gives up and closes the stream);
  rejected a bad request answered with HTTP 400 / gRPC INVALID_ARGUMENT (anything else: failed).
TTFT = request sent -> first chunk with text (HTTP) / token ids (gRPC), client side. ITL = gap between
consecutive such chunks; gRPC sends one token per message, an SSE event may carry more than one token
when text is held back (partial characters, possible stop strings), so HTTP gaps can span two tokens.

    python bench/load.py            # 64 + 4 clients for 60 s, 2 ranks
    python bench/load.py --quick    # 64 + 4 clients for 25 s (whole run under 3 minutes)

Last line: RESULT ok=<n> failed=<n> hung=<n> rejected=<n> leaked_blocks=<n> p99_itl_ms=<x>
(`leaked_blocks=-1` / `p99_itl_ms=-1`: not measured, e.g. the server did not start; exit status 1 then,
and whenever failed, hung or leaked_blocks is not 0). A hard timeout (`--timeout-s`) stops the server and
prints the RESULT line with the streams still open counted as hung.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DEFAULT_MODEL = os.path.join(ROOT, "models", "tiny-moe")  # = cluster.config.DEFAULT_MODEL, without torch

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no C-core INFO lines (GOAWAY at server stop) in the table

import aiohttp  # noqa: E402
import grpc  # noqa: E402

from actors.rank.rendezvous import free_port  # noqa: E402
from router_service.proto.moeray.v1 import moeray_pb2 as pb  # noqa: E402
from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc  # noqa: E402

PROTOCOLS = ("http", "grpc")
FALLBACK_TEXT = ("The quick brown fox jumps over the lazy dog. " * 8
                 + "def main():\n    return sum(range(10))\n" * 4)


# ---------------------------------------------------------------------------------------------- tallies
@dataclass
class Tally:
    """Counts and latency samples (ms) of one protocol."""

    requests: int = 0  # well-formed requests started
    ok: int = 0  # of which: completed + disconnected + cancelled
    completed: int = 0
    disconnected: int = 0
    cancelled: int = 0
    failed: int = 0
    hung: int = 0
    overloaded: int = 0  # also counted in failed
    bad: int = 0  # bad requests sent
    rejected: int = 0
    bad_wrong: int = 0  # bad requests answered otherwise (also counted in failed)
    tokens: int = 0  # chunks with text / token ids received
    ttft_ms: list = field(default_factory=list)
    itl_ms: list = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)


@dataclass
class State:
    """Everything the run measured so far (read by the watchdog too)."""

    tally: dict = field(default_factory=lambda: {p: Tally() for p in PROTOCOLS})
    open_streams: int = 0  # well-formed streams in flight now
    peak_streams: int = 0
    stream_samples: list = field(default_factory=list)
    kv_total: int = -1
    kv_free_initial: int = -1
    kv_free_final: int = -1
    kv_used_peak: int = 0
    running_peak: int = 0
    load_s: float = 0.0
    note: str = ""

    def totals(self) -> dict:
        t = self.tally.values()
        return {k: sum(getattr(x, k) for x in t) for k in ("ok", "failed", "hung", "rejected", "overloaded",
                                                           "disconnected", "cancelled", "completed", "requests",
                                                           "bad", "bad_wrong", "tokens")}


def pct(xs: list, q: float) -> float:
    """The q-th percentile (linear interpolation) of xs; -1 if empty."""
    if not xs:
        return -1.0
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def result_line(st: State, hung_extra: int = 0) -> str:
    """The RESULT line (see the module docstring); `hung_extra`: open streams to count as hung (hard timeout)."""
    tot = st.totals()
    itl = [x for t in st.tally.values() for x in t.itl_ms]
    leaked = st.kv_free_initial - st.kv_free_final if st.kv_free_initial >= 0 and st.kv_free_final >= 0 else -1
    p99 = pct(itl, 99)
    return (f"RESULT ok={tot['ok']} failed={tot['failed']} hung={tot['hung'] + hung_extra} "
            f"rejected={tot['rejected']} leaked_blocks={leaked} p99_itl_ms={p99:.2f}")


# ---------------------------------------------------------------------------------------------- server
class ServerProcess:
    """`moeray serve` in a subprocess (its own session, so a fallback kill reaches Ray's head processes)."""

    def __init__(self, model: str, ranks: int, max_queue: int):
        self.http_port, self.grpc_port = free_port(), free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        self.cmd = [sys.executable, "-m", "moeray.cli", "serve", "--model", model, "--ranks", str(ranks),
                    "--host", "127.0.0.1", "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                    "--max-queue", str(max_queue)]
        fd, self.log_path = tempfile.mkstemp(prefix="moeray_load_server_", suffix=".log")
        self.log = os.fdopen(fd, "w")
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        env = dict(os.environ, RAY_ADDRESS="local", PYTHONUNBUFFERED="1")  # a private Ray, never a shared one
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log_tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /health is 200 and gRPC Health is SERVING. Raises RuntimeError (server exited) or
        TimeoutError (not ready within timeout_s)."""
        deadline = time.monotonic() + timeout_s
        http_ok = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if not http_ok:
                    with urllib.request.urlopen(self.http_url + "/health", timeout=5) as r:
                        http_ok = r.status == 200
                if http_ok:
                    with grpc.insecure_channel(self.grpc_addr) as ch:
                        h = pb_grpc.MoerayStub(ch).Health(pb.HealthRequest(), timeout=5)
                    if h.status == pb.HealthResponse.STATUS_SERVING:
                        return
            except Exception:  # noqa: BLE001 - not up yet (connection refused, 404 before the app is deployed)
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 45.0) -> str:
        """SIGINT (clean: Serve and Ray shut down), then SIGKILL to its process group. Returns how it ended."""
        p = self.proc
        if p is None or p.poll() is not None:
            return "not running"
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=timeout_s)
            how = f"clean exit {p.returncode} after SIGINT in {time.monotonic() - t0:.1f} s"
        except subprocess.TimeoutExpired:
            self.kill()
            how = f"killed after {timeout_s:.0f} s without exit"
        self.log.close()
        return how

    def kill(self) -> None:
        p = self.proc
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the group this script created (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class Spec:
    """One well-formed request."""

    proto: str
    chat: bool
    text: str
    max_tokens: int
    temperature: float
    end_after: int | None  # chunks to read before ending early (0: right after sending); None: read to the end
    use_cancel_rpc: bool  # gRPC early end by the Cancel RPC instead of cancelling the call


def load_texts(model: str) -> list[str]:
    """The model folder's held-out texts (`heldout/prose.txt`, `heldout/code.txt`), else a built-in text."""
    texts = []
    for name in ("prose.txt", "code.txt"):
        path = os.path.join(model, "heldout", name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    return texts or [FALLBACK_TEXT]


def make_spec(rng: random.Random, texts: list[str], a) -> Spec:
    """A random well-formed request: protocol by `a.http_frac`, early end by `a.disconnect_frac`."""
    doc = rng.choice(texts)
    n = rng.randint(16, 800)
    start = rng.randrange(0, max(1, len(doc) - n))
    text = doc[start:start + n].strip() or "Hello"
    proto = "http" if rng.random() < a.http_frac else "grpc"
    max_tokens = rng.randint(4, 48)
    end_after = rng.randint(0, max_tokens - 1) if rng.random() < a.disconnect_frac else None
    return Spec(proto=proto, chat=proto == "http" and rng.random() < 0.3, text=text, max_tokens=max_tokens,
                temperature=rng.choice([0.0, 0.7, 1.0]), end_after=end_after,
                use_cancel_rpc=proto == "grpc" and rng.random() < 0.5)


class Timer:
    """TTFT and inter-chunk gaps of one stream (ms)."""

    def __init__(self, tally: Tally):
        self.tally, self.t0, self.last = tally, time.perf_counter(), None

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.tally.ttft_ms.append((now - self.t0) * 1e3)
        else:
            self.tally.itl_ms.append((now - self.last) * 1e3)
        self.last = now
        self.tally.tokens += 1


async def http_stream(session: aiohttp.ClientSession, base: str, s: Spec, tally: Tally) -> tuple[str, str]:
    """Returns (outcome, detail); outcome in completed | disconnected | failed | overloaded."""
    body = {"max_tokens": s.max_tokens, "temperature": s.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if s.chat:
        url, body["messages"] = base + "/v1/chat/completions", [{"role": "user", "content": s.text}]
    else:
        url, body["prompt"] = base + "/v1/completions", s.text
    timer = Timer(tally)
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            detail = f"HTTP {resp.status}: {(await resp.text())[:120]}"
            return ("overloaded" if resp.status == 503 else "failed"), detail
        if s.end_after == 0:
            resp.close()
            return "disconnected", ""
        chunks, finishes, reasons, done, usage = 0, 0, [], False, None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                return "failed", f"error event: {ev['error'].get('message', '')[:120]}"
            usage = ev.get("usage") or usage
            for ch in ev.get("choices", []):
                text = ch.get("delta", {}).get("content") if s.chat else ch.get("text")
                if text:
                    chunks += 1
                    timer.chunk()
                if ch.get("finish_reason"):
                    finishes += 1
                    reasons.append(ch["finish_reason"])
            if s.end_after is not None and chunks >= s.end_after and not finishes:
                resp.close()
                return "disconnected", ""
        if not done:
            return "failed", "stream ended without data: [DONE]"
        if finishes != 1 or reasons[0] not in ("stop", "length"):
            return "failed", f"finish reasons {reasons}"
        if usage is None or usage.get("completion_tokens", 0) < chunks:  # every text chunk holds >= 1 token
            return "failed", f"usage {usage} after {chunks} text chunks"
        return "completed", ""


_FINISH_OK = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


async def grpc_stream(stub, s: Spec, tally: Tally, rid: str) -> tuple[str, str]:
    """Returns (outcome, detail); outcome in completed | disconnected | cancelled | failed | overloaded."""
    req = pb.GenerateRequest(request_id=rid, text=s.text,
                             sampling=pb.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature))
    timer = Timer(tally)
    call = stub.Generate(req)
    chunks, ntok, finishes, reasons, usage, cancel_sent = 0, 0, 0, [], None, False
    try:
        if s.end_after == 0 and not s.use_cancel_rpc:
            await asyncio.sleep(0)
            call.cancel()
            return "disconnected", ""
        async for r in call:
            if r.token_ids:
                chunks += 1
                ntok += len(r.token_ids)
                timer.chunk()
            if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finishes += 1
                reasons.append(r.finish_reason)
                usage = r.usage
            if s.end_after is not None and chunks >= s.end_after and not finishes and not cancel_sent:
                if not s.use_cancel_rpc:
                    call.cancel()
                    return "disconnected", ""
                cancel_sent = True
                await stub.Cancel(pb.CancelRequest(request_id=rid), timeout=10)  # then read on to the ABORT
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "overloaded", e.details() or ""
        return "failed", f"{e.code().name}: {(e.details() or '')[:120]}"
    finally:
        if not call.done():  # given up (hung) or an exception: let the server see the end
            call.cancel()
    if finishes != 1:
        return "failed", f"{finishes} finishes"
    if cancel_sent:  # the Cancel may race the last token: a normal finish is fine too
        ok = reasons[0] in _FINISH_OK + (pb.FINISH_REASON_ABORT,)
        return ("cancelled", "") if ok else ("failed", f"finish {reasons[0]} after Cancel")
    if reasons[0] not in _FINISH_OK:
        return "failed", f"finish reason {pb.FinishReason.Name(reasons[0])}"
    if usage.completion_tokens != ntok:
        return "failed", f"usage completion_tokens={usage.completion_tokens}, received {ntok}"
    return "completed", ""


# ---------------------------------------------------------------------------------------------- bad requests
BAD_HTTP = [
    ("max_tokens=-3", {"prompt": "Hello", "max_tokens": -3}),
    ("top_p=2", {"prompt": "Hello", "max_tokens": 8, "top_p": 2}),
    ("empty prompt", {"prompt": "", "max_tokens": 8}),
    ("unknown model", {"model": "no-such-model", "prompt": "Hello", "max_tokens": 8}),
    ("max_tokens over the context", {"prompt": "Hello", "max_tokens": 5000}),
    ("chat without messages", {"messages": [], "max_tokens": 8}),
    ("not JSON", None),
]
BAD_GRPC = [
    ("max_tokens=-3", dict(text="Hello", sampling=pb.SamplingParams(max_tokens=-3))),
    ("top_p=2", dict(text="Hello", sampling=pb.SamplingParams(max_tokens=8, top_p=2.0))),
    ("empty prompt", dict(text="", sampling=pb.SamplingParams(max_tokens=8))),
    ("unknown model", dict(model="no-such-model", text="Hello", sampling=pb.SamplingParams(max_tokens=8))),
    ("max_tokens over the context", dict(text="Hello", sampling=pb.SamplingParams(max_tokens=5000))),
    ("no prompt", dict(sampling=pb.SamplingParams(max_tokens=8))),
]


async def bad_http(session, base: str, rng: random.Random) -> tuple[bool, str]:
    """Send one random bad request; (got 400, what came back otherwise)."""
    name, body = rng.choice(BAD_HTTP)
    path = "/v1/chat/completions" if body is not None and "messages" in body else "/v1/completions"
    if body is None:
        kw = {"data": b'{"prompt": "Hello", "max_tokens": ', "headers": {"content-type": "application/json"}}
    else:
        kw = {"json": {**body, "stream": rng.random() < 0.5}}
    async with session.post(base + path, **kw) as resp:
        text = await resp.text()
        if resp.status == 400:
            return True, ""
        return False, f"{name}: HTTP {resp.status} {text[:80]}"


async def bad_grpc(stub, rng: random.Random) -> tuple[bool, str]:
    """Send one random bad `Generate`; (got INVALID_ARGUMENT, what came back otherwise)."""
    name, kw = rng.choice(BAD_GRPC)
    call = stub.Generate(pb.GenerateRequest(**kw))
    try:
        async for _ in call:
            call.cancel()
            return False, f"{name}: streamed instead of INVALID_ARGUMENT"
        return False, f"{name}: OK status"
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return True, ""
        return False, f"{name}: {e.code().name}"


# ---------------------------------------------------------------------------------------------- clients
class Load:
    """The client side: stream clients, bad-request clients, a stats sampler."""

    def __init__(self, a, st: State, http_url: str, grpc_addr: str):
        self.a, self.st, self.http_url, self.grpc_addr = a, st, http_url, grpc_addr
        self.texts = load_texts(a.model)
        self.rid = 0

    async def one(self, s: Spec) -> None:
        """Run one well-formed request within the per-request deadline and count its outcome."""
        st, t = self.st, self.st.tally[s.proto]
        t.requests += 1
        st.open_streams += 1
        st.peak_streams = max(st.peak_streams, st.open_streams)
        self.rid += 1
        try:
            if s.proto == "http":
                coro = http_stream(self.session, self.http_url, s, t)
            else:
                coro = grpc_stream(self.stubs[self.rid % len(self.stubs)], s, t, f"load-{self.rid}")
            outcome, detail = await asyncio.wait_for(coro, self.a.request_timeout_s)
        except asyncio.TimeoutError:
            outcome, detail = "hung", f"no finish within {self.a.request_timeout_s:.0f} s"
        except (aiohttp.ClientError, grpc.aio.AioRpcError, json.JSONDecodeError, OSError) as e:
            outcome, detail = "failed", f"{type(e).__name__}: {str(e)[:120]}"
        finally:
            st.open_streams -= 1
        if outcome in ("completed", "disconnected", "cancelled"):
            t.ok += 1
            setattr(t, outcome, getattr(t, outcome) + 1)
        elif outcome == "hung":
            t.hung += 1
        else:
            t.failed += 1
            if outcome == "overloaded":
                t.overloaded += 1
        if detail:
            t.errors[f"{outcome}: {detail}"] += 1

    async def stream_client(self, i: int) -> None:
        rng = random.Random(self.a.seed * 1000 + i)
        while time.monotonic() < self.stop_at:
            await self.one(make_spec(rng, self.texts, self.a))

    async def bad_client(self, i: int) -> None:
        rng = random.Random(self.a.seed * 1000 + 500 + i)
        while time.monotonic() < self.stop_at:
            proto = "http" if rng.random() < self.a.http_frac else "grpc"
            t = self.st.tally[proto]
            t.bad += 1
            try:
                if proto == "http":
                    coro = bad_http(self.session, self.http_url, rng)
                else:
                    coro = bad_grpc(self.stubs[rng.randrange(len(self.stubs))], rng)
                good, detail = await asyncio.wait_for(coro, self.a.request_timeout_s)
            except (asyncio.TimeoutError, aiohttp.ClientError, grpc.aio.AioRpcError, OSError) as e:
                good, detail = False, f"{type(e).__name__}: {str(e)[:120]}"
            if good:
                t.rejected += 1
            else:
                t.failed += 1
                t.bad_wrong += 1
                t.errors[f"bad request: {detail}"] += 1
            await asyncio.sleep(rng.uniform(0.1, 0.6))

    async def stats(self) -> pb.ClusterStats:
        return await self.stubs[0].GetClusterStats(pb.GetClusterStatsRequest(), timeout=30)

    async def sampler(self) -> None:
        n = 0
        while True:
            if time.monotonic() < self.stop_at:  # the mean is over the load window, not the drain after it
                self.st.stream_samples.append(self.st.open_streams)
            if n % 4 == 0:  # cluster stats once a second: peak KV use and running sequences
                try:
                    s = await self.stats()
                    self.st.kv_used_peak = max(self.st.kv_used_peak, s.kv_blocks_total - s.kv_blocks_free)
                    self.st.running_peak = max(self.st.running_peak, s.running)
                except grpc.aio.AioRpcError:
                    pass
            n += 1
            await asyncio.sleep(0.25)

    async def wait_idle(self, timeout_s: float) -> pb.ClusterStats:
        """Until nothing runs or waits and free KV blocks are back at the initial count (or timeout_s)."""
        deadline = time.monotonic() + timeout_s
        s = await self.stats()
        while time.monotonic() < deadline:
            s = await self.stats()
            if (s.in_flight == 0 and s.running == 0 and s.waiting == 0
                    and s.kv_blocks_free >= self.st.kv_free_initial):
                break
            await asyncio.sleep(0.25)
        return s

    async def run(self) -> None:
        """Initial KV count, the load, the after-load requests, then the final KV count once idle."""
        a, st = self.a, self.st
        self.channels = [grpc.aio.insecure_channel(self.grpc_addr) for _ in range(4)]
        self.stubs = [pb_grpc.MoerayStub(c) for c in self.channels]
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as self.session:
            s0 = await self.wait_idle(30)
            st.kv_total, st.kv_free_initial = s0.kv_blocks_total, s0.kv_blocks_free
            t0 = time.monotonic()
            self.stop_at = t0 + a.duration_s
            sampler = asyncio.create_task(self.sampler())
            await asyncio.gather(*[self.stream_client(i) for i in range(a.clients)],
                                 *[self.bad_client(i) for i in range(a.bad_clients)])
            st.load_s = time.monotonic() - t0
            sampler.cancel()
            # the server is still sane: one greedy request per protocol is served after the storm
            for proto in PROTOCOLS:
                await self.one(Spec(proto=proto, chat=False, text="To be, or not to be", max_tokens=8,
                                    temperature=0.0, end_after=None, use_cancel_rpc=False))
            s1 = await self.wait_idle(a.idle_timeout_s)
            st.kv_free_final = s1.kv_blocks_free
            if s1.in_flight or s1.running or s1.waiting:
                st.note = f"not idle at the end: in_flight={s1.in_flight} running={s1.running} waiting={s1.waiting}"
        for c in self.channels:
            await c.close()


# ---------------------------------------------------------------------------------------------- report
def report(st: State, a, server: ServerProcess | None, startup_s: float, stop_how: str) -> None:
    """Print the run summary and the per-protocol table (counts; TTFT and ITL percentiles in ms)."""
    print(f"\nload test: {a.clients} stream clients + {a.bad_clients} bad-request clients for {a.duration_s:.0f} s "
          f"(the last streams ended at {st.load_s:.1f} s), {a.ranks} rank(s), model {os.path.relpath(a.model, ROOT)}, loopback")
    print(f"server: `moeray serve` up in {startup_s:.1f} s; stopped: {stop_how}; log {server.log_path if server else '-'}")
    mean_streams = sum(st.stream_samples) / len(st.stream_samples) if st.stream_samples else 0.0
    print(f"well-formed streams in flight: peak {st.peak_streams}, mean {mean_streams:.1f} over the "
          f"{a.duration_s:.0f} s window; cluster peak: "
          f"{st.running_peak} running sequences, {st.kv_used_peak} of {st.kv_total} KV blocks in use")
    hdr = (f"{'protocol':8} {'requests':>8} {'ok':>6} {'complete':>8} {'discon':>6} {'cancel':>6} {'failed':>6} "
           f"{'hung':>4} {'overload':>8} {'bad':>5} {'rejected':>8} {'chunks':>7}  "
           f"{'TTFT p50/p90/p99 ms':>22}  {'ITL p50/p90/p99 ms':>20}")
    print(hdr)
    rows = list(st.tally.items())
    total = Tally()
    for _, t in rows:
        for k in ("requests", "ok", "completed", "disconnected", "cancelled", "failed", "hung", "overloaded",
                  "bad", "rejected", "tokens"):
            setattr(total, k, getattr(total, k) + getattr(t, k))
        total.ttft_ms += t.ttft_ms
        total.itl_ms += t.itl_ms
    for name, t in rows + [("all", total)]:
        ttft = "/".join(f"{pct(t.ttft_ms, q):.0f}" for q in (50, 90, 99))
        itl = "/".join(f"{pct(t.itl_ms, q):.0f}" for q in (50, 90, 99))
        print(f"{name:8} {t.requests:8d} {t.ok:6d} {t.completed:8d} {t.disconnected:6d} {t.cancelled:6d} "
              f"{t.failed:6d} {t.hung:4d} {t.overloaded:8d} {t.bad:5d} {t.rejected:8d} {t.tokens:7d}  "
              f"{ttft:>22}  {itl:>20}")
    if st.load_s > 0:
        print(f"throughput over those {st.load_s:.1f} s: {total.tokens / st.load_s:.1f} chunks/s, {total.requests / st.load_s:.2f} well-formed "
              f"requests/s, {(total.bad) / st.load_s:.2f} bad requests/s")
    leaked = st.kv_free_initial - st.kv_free_final if st.kv_free_initial >= 0 and st.kv_free_final >= 0 else -1
    print(f"KV blocks free: {st.kv_free_initial} of {st.kv_total} before, {st.kv_free_final} after idle "
          f"-> leaked {leaked}" + (f"; {st.note}" if st.note else ""))
    errs = Counter()
    for name, t in rows:
        for k, v in t.errors.items():
            errs[f"{name} {k}"] += v
    for k, v in errs.most_common(8):
        print(f"  {v:5d} x {k}")


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run the load test; exit status 0 only if nothing failed, hung or leaked (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="25 s of load (whole run under 3 minutes)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--ranks", type=int, default=2, help="EP ranks of the server")
    ap.add_argument("--clients", type=int, default=64, help="concurrent well-formed streaming clients")
    ap.add_argument("--bad-clients", type=int, default=4, help="clients sending deliberately bad requests")
    ap.add_argument("--duration-s", type=float, default=None, help="load duration (default 60, quick 25)")
    ap.add_argument("--http-frac", type=float, default=0.5, help="share of requests over HTTP (rest gRPC)")
    ap.add_argument("--disconnect-frac", type=float, default=0.15, help="share of streams ended early")
    ap.add_argument("--max-queue", type=int, default=256, help="server queue limit (keep above the client count)")
    ap.add_argument("--request-timeout-s", type=float, default=90.0, help="a stream without finish by then is hung")
    ap.add_argument("--idle-timeout-s", type=float, default=30.0, help="wait for the cluster to go idle at the end")
    ap.add_argument("--startup-timeout-s", type=float, default=120.0)
    ap.add_argument("--timeout-s", type=float, default=None, help="hard limit of the whole run (default 420, quick 175)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    a.model = os.path.abspath(a.model)
    if a.duration_s is None:
        a.duration_s = 25.0 if a.quick else 60.0
    if a.timeout_s is None:
        a.timeout_s = 175.0 if a.quick else 420.0
    for name in ("clients", "ranks"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)} must be >= 1")
    if a.max_queue <= a.clients + a.bad_clients:
        ap.error(f"--max-queue={a.max_queue} must exceed --clients + --bad-clients = {a.clients + a.bad_clients}")

    st = State()
    server = ServerProcess(a.model, a.ranks, a.max_queue)

    def hard_timeout() -> None:  # runs on a timer thread: report what we have, stop everything
        print(f"\nhard timeout after {a.timeout_s:.0f} s: stopping the server; open streams count as hung",
              file=sys.stderr, flush=True)
        server.kill()
        print(result_line(st, hung_extra=st.open_streams), flush=True)
        os._exit(3)

    watchdog = threading.Timer(a.timeout_s, hard_timeout)
    watchdog.daemon = True
    watchdog.start()
    startup_s, stop_how, error = -1.0, "-", None
    t0 = time.monotonic()
    try:
        server.start()
        server.wait_ready(a.startup_timeout_s)
        startup_s = time.monotonic() - t0
        asyncio.run(Load(a, st, server.http_url, server.grpc_addr).run())
    except Exception as e:  # noqa: BLE001 - still stop the server and print every RESULT key
        error = f"{type(e).__name__}: {e}"
    finally:
        stop_how = server.stop()
    watchdog.cancel()
    report(st, a, server, startup_s, stop_how)
    if error:
        print(f"error: {error}", file=sys.stderr)
    line = result_line(st)
    print(line, flush=True)
    tot = st.totals()
    bad = error or tot["failed"] or tot["hung"] or not tot["ok"] or "leaked_blocks=0 " not in line
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
