"""Row-split parallelism (`kernels.cpu.parallel`): every split kernel gives bit-identical results on 1 and 2
compute threads (each row is computed alone, in the same order of operations), errors of any share reach the
caller, and a prompt's logits through the engine do not depend on the thread count."""
from __future__ import annotations

import pytest
import torch

from actors.model.attention import AttentionMetadata, paged_attention_ref
from kernels import tuning
from kernels.cpu import cpu_kernels_available, expert_ffn, linear, parallel, rms_norm

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="the compiled CPU kernels are not built")


@pytest.fixture
def threads():
    """Call with n to set this process's compute threads; back to 1 afterwards (the setting is process-wide)."""
    yield parallel.set_threads
    parallel.set_threads(1)


def _both(threads, fn):
    threads(1)
    a = fn()
    threads(2)
    b = fn()
    return a, b


def test_row_ranges_cover_aligned_disjoint(threads):
    threads(2)
    assert parallel.row_ranges(tuning.PARALLEL_ROWS * 2 - 1) == [(0, tuning.PARALLEL_ROWS * 2 - 1)]  # too few rows
    r = parallel.row_ranges(500)
    assert r == [(0, 256), (256, 500)]
    assert all(lo % parallel.ROW_ALIGN == 0 for lo, _ in r)
    threads(3)
    r = parallel.row_ranges(1000, min_rows=1)
    assert r[0][0] == 0 and r[-1][1] == 1000 and all(a[1] == b[0] for a, b in zip(r, r[1:])) and len(r) == 3
    threads(1)
    assert parallel.row_ranges(10_000) == [(0, 10_000)]
    with pytest.raises(ValueError, match="compute threads"):
        parallel.set_threads(0)


@needs_kernels
@pytest.mark.parametrize("M", [128, 200, 500])
@pytest.mark.parametrize("packed", [False, True])
def test_linear_bit_identical(threads, monkeypatch, M, packed):
    if not packed:
        monkeypatch.setenv("MOERAY_PANEL_CACHE_BYTES", "0")  # the row-major kernel every time
    g = torch.Generator().manual_seed(M)
    w = torch.randn(300, 192, generator=g).to(torch.bfloat16)
    b = torch.randn(300, generator=g)
    x = torch.randn(M, 256, generator=g)[:, 32:224]  # row-strided input (a column slice)
    linear(x, w, b)  # a weight seen twice gets its panel-layout copy (kernels.cpu.packing), if allowed
    a, c = _both(threads, lambda: linear(x, w, b))
    assert torch.equal(a, c)
    torch.testing.assert_close(a, x @ w.float().T + b, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_bit_identical(threads, residual):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(300, 256, generator=g), torch.randn(256, generator=g)
    r = torch.randn(300, 256, generator=g) if residual else None
    a, c = _both(threads, lambda: rms_norm(x, w, 1e-6, residual=r))
    for u, v in zip(a if residual else [a], c if residual else [c]):
        assert torch.equal(u, v)


@needs_kernels
@pytest.mark.parametrize("form", ["weighted", "pairs", "rows"])
def test_expert_ffn_bit_identical(threads, form):
    g = torch.Generator().manual_seed(2)
    E, D, I, T, K = 8, 128, 96, 300, 2
    gu = (torch.randn(E, 2 * I, D, generator=g) * 0.1).to(torch.bfloat16)
    dn = (torch.randn(E, D, I, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(T, D, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[5, 1] = -1  # a pair routed nowhere
    w = torch.rand(T, K, generator=g)
    if form == "weighted":
        call = lambda: expert_ffn(x, gu, dn, ids, w)  # noqa: E731
    elif form == "pairs":
        call = lambda: expert_ffn(x, gu, dn, ids)  # noqa: E731
    else:
        call = lambda: expert_ffn(x, gu, dn, ids[:, 0].contiguous())  # noqa: E731
    call()  # the stacks' panel copies made (kernels.cpu.packing): both runs take the same kernel
    a, c = _both(threads, call)
    assert a is not None and torch.equal(a, c)
    t = 7  # one token's value by hand
    f = lambda e: (torch.nn.functional.silu(gu[e, :I].float() @ x[t]) * (gu[e, I:].float() @ x[t])) @ dn[e].float().T  # noqa: E731
    want = {"weighted": w[t, 0] * f(ids[t, 0]) + w[t, 1] * f(ids[t, 1]), "pairs": f(ids[t, 0]), "rows": f(ids[t, 0])}[form]
    row = a[t * K] if form == "pairs" else a[t]
    torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_a_failing_share_raises(threads):
    threads(2)
    gu, dn = torch.zeros(4, 16, 8, dtype=torch.bfloat16), torch.zeros(4, 8, 8, dtype=torch.bfloat16)
    ids = torch.zeros(400, 1, dtype=torch.int64)
    ids[350, 0] = 4  # >= E, in the second share only
    with pytest.raises(ValueError, match="num_experts=4"):
        expert_ffn(torch.zeros(400, 8), gu, dn, ids)


def test_run_ranges_raises_after_all_ranges(threads):
    threads(2)
    seen = []

    def fn(lo, hi):
        seen.append(lo)
        if lo == 0:
            raise KeyError("first share")

    with pytest.raises(KeyError, match="first share"):
        parallel.run_ranges(fn, [(0, 1), (1, 2)])
    assert sorted(seen) == [0, 1]


@pytest.mark.parametrize("prefix", [0, 96])
def test_prefill_attention_split_over_kv_heads(threads, prefix):
    """A prefill's KV heads split over the threads (whole prompt: causal; a later chunk: the masked form)."""
    g = torch.Generator().manual_seed(3)
    S, N, Hkv, H, Dh, n = 16, 32, 2, 4, 32, 160
    ctx = prefix + n
    kc, vc = torch.randn(N, S, Hkv, Dh, generator=g), torch.randn(N, S, Hkv, Dh, generator=g)
    table = torch.randperm(N, generator=g)[: -(-ctx // S)]
    q = torch.randn(n, H, Dh, generator=g)
    z = torch.zeros(0, dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=z, decode_tokens=z, decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
                             decode_context_lens=z, prefills=[(0, n, ctx, table)])
    a, c = _both(threads, lambda: paged_attention_ref(q, kc, vc, meta, Dh ** -0.5))
    assert torch.equal(a, c)
    k = kc[table].reshape(-1, Hkv, Dh)[:ctx].repeat_interleave(H // Hkv, 1).transpose(0, 1)
    v = vc[table].reshape(-1, Hkv, Dh)[:ctx].repeat_interleave(H // Hkv, 1).transpose(0, 1)
    s = (q.transpose(0, 1) @ k.transpose(1, 2)) * Dh ** -0.5
    s = s.masked_fill(torch.arange(ctx)[None, :] > torch.arange(prefix, ctx)[:, None], float("-inf"))
    torch.testing.assert_close(a, (s.softmax(-1) @ v).transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_engine_prefill_same_on_two_threads(threads):
    """A 300-token prefill of the shipped model through the engine: the same logits, bit for bit, on 1 and 2
    compute threads (every split kernel and the attention split are row- / head-exact)."""
    from tests.actors.engine.test_chunked_prefill import _engine, _long_prompt

    eng = _engine()
    ids = _long_prompt(eng, 300)
    eng.prompt_logits(ids)  # every weight seen once: both runs take the panel kernels (kernels.cpu.packing)
    a, c = _both(threads, lambda: eng.prompt_logits(ids))
    assert a.shape[0] == 300 and torch.equal(a, c)


@needs_kernels
def test_forked_child_runs_on_one_thread(threads):
    """A child forked after the pool started has none of its threads: it must not wait for them (no hang)."""
    import os

    threads(2)
    w = torch.randn(64, 64).to(torch.bfloat16)
    x = torch.randn(300, 64)
    linear(x, w)  # seen once: the calls below both take the panel kernel
    want = linear(x, w)
    pid = os.fork()
    if pid == 0:  # child: the same call, on one thread (a wait for the parent's helpers would hang here)
        ok = parallel.threads() == 1 and torch.equal(linear(x, w), want)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


@needs_kernels
def test_a_call_right_after_the_pool_starts_is_not_lost():
    """A call made before a new helper thread first runs must still reach it (the helper once read its starting
    generation after that call had bumped it, lost the task, and the caller waited forever: a rank's warm-up hung).
    Fresh processes, each starting the C pool and calling it at once (task kind 99 runs nothing, answers -100)."""
    import subprocess
    import sys

    from kernels.cpu import _build

    so = _build.lib()._name
    code = ("import ctypes; lib = ctypes.CDLL(%r); lib.moeray_pool_run.restype = ctypes.c_long\n"
            "for n in (1, 3, 7):\n"
            "    lib.moeray_pool_start(ctypes.c_long(n))\n"
            "    buf = ctypes.create_string_buffer(8 * (n + 1))\n"
            "    assert lib.moeray_pool_run(ctypes.c_long(99), buf, ctypes.c_long(8), ctypes.c_long(n + 1)) == -100\n"
            % so)
    for _ in range(10):
        subprocess.run([sys.executable, "-c", code], check=True, timeout=20)


@needs_kernels
def test_helpers_spin_within_a_step_and_sleep_after_park(threads):
    """Helpers spin up to `STEP_SPIN_S` for the next call (a futex wake-up costs ~40 us on a small VM), and `park`
    (the engine's end of a step) sends them to sleep at once: the process burns no CPU while its caller sleeps."""
    import time

    from kernels.cpu import _build

    threads(2)
    lib = _build.lib()
    x, w = torch.randn(512, 256), torch.randn(256)

    def helper_cpu_over(sleep_s: float, park: bool) -> float:
        rms_norm(x, w, 1e-6)  # a 2-range call: the helper ran a share and now waits for the next one
        if park:
            parallel.park()
        c0, t0 = time.process_time(), time.thread_time()
        time.sleep(sleep_s)
        return (time.process_time() - c0) - (time.thread_time() - t0)  # CPU of the other threads

    try:
        lib.moeray_pool_set_spin(int(10e9))  # spin "forever" unless parked
        spinning = helper_cpu_over(0.1, park=False)
        parked = helper_cpu_over(0.1, park=True)
    finally:
        lib.moeray_pool_set_spin(int(parallel.STEP_SPIN_S * 1e9))
        parallel.park()
    assert spinning > 0.02, spinning  # the helper spun while the caller slept
    assert parked < 0.01, parked      # parked: asleep, no CPU
    torch.testing.assert_close(rms_norm(x, w, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
