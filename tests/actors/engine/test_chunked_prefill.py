"""Chunked prefill (vLLM's --enable-chunked-prefill / --max-num-batched-tokens): a long prompt split across steps
under the token budget while other streams decode gives the same logits and greedy tokens as one whole prefill;
the scheduler keeps every step within the budget and every decode scheduled; preemption and abort mid-prefill.

Tolerances. Full precision: < 1e-4 (fp32; measured ~4e-6: GEMMs over different row counts round differently).
Quantized KV (3/4 bits): the same rounding moves a K/V value by ~1e-6 before it is quantized, and a value within
that distance of a code boundary takes the neighbouring code (measured: 1 V code of 288 x 2 x 64 at 4 bits on a
300-token prompt, 2.8e-4 on the logits; with per-channel key widths a key code of a 2-bit channel moves further:
2.9e-3 at 3 bits on the PyTorch path; with identical K/V the pages are bit-identical,
tests/actors/kv/test_kv_chunked_prefill.py). So chunked-quantized is compared to unchunked-quantized at < 1e-2,
three orders below what quantization itself changes (quantized vs full-precision logits differ by ~9 on the shipped
model), and greedy tokens must be equal. One sampled position per request may differ more: a code moved that way
reaches the gates, and a token whose 2nd and 3rd expert logits are within ~1e-4 (measured: 9e-5 in this test's decode
steps on the 4k checkpoint, 4-bit KV) can take the other expert (logits of that position 1.0 apart, the next ones back
to ~1e-4).
Gating: `exact`, `sticky` and `velocity` depend only on each sequence's own tokens (the per-sequence slot survives
across chunks), so they are pinned equal; `balanced` (a bias updated from each step's expert load) and `capacity`
(per-step expert capacity) depend on which tokens share a step by design, so chunking may change their output.
"""
from __future__ import annotations

import os

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.engine.messages import GenerateRequest
from actors.engine.sampling import SamplingParams
from actors.engine.scheduler import Scheduler, Sequence
from actors.kv.allocator import BlockAllocator
from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from cluster.config import DEFAULT_MODEL

BUDGET = 37  # not a multiple of the block size: chunks end mid-block
# knobs that make `sticky` and `velocity` act on many tokens (so a lost per-sequence state would show)
GATING_OPTIONS = {"sticky_margin": 0.5, "velocity_fast": 0.3, "velocity_slow": 0.1}


def _engine(model: str = DEFAULT_MODEL, **kw) -> RankEngine:
    mc = ModelConfig.from_pretrained(model)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_model_len", 512)
    kw.setdefault("kv_cache_bytes", 2**23)
    return RankEngine(EngineConfig(model=model, **kw), ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))


def _long_prompt(eng: RankEngine, n: int) -> list[int]:
    return eng.tokenizer.encode(open(os.path.join(DEFAULT_MODEL, "heldout", "prose.txt")).read()).ids[:n]


def _greedy(n: int, **kw) -> dict:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw).to_dict()


def _serve(eng: RankEngine, long_ids: list[int], gating: str | None = None) -> tuple[dict, dict, list]:
    """Three short streams decode; at the third step the long prompt arrives. Returns ({request: [tokens]},
    {request: logits [n, V] of each sampled position}, [(decodes, tokens) per step])."""
    plans, logits = [], {}
    plan, lg = eng.plan, eng.model.logits

    def record_plan(*a, **k):
        plans.append(plan(*a, **k))
        return plans[-1]

    def record_logits(h):
        out = lg(h)
        for s, row in zip(plans[-1].sampled, out):
            logits.setdefault(s.request_id, []).append(row.float())
        return out

    eng.plan, eng.model.logits = record_plan, record_logits
    extra = {"gating": gating} if gating else {}
    for i in range(3):
        eng.add_request(GenerateRequest(request_id=f"s{i}", prompt_ids=[(31 * i + j) % 3000 + 7 for j in range(6 + i)],
                                        params=_greedy(24, **extra)))
    toks: dict[str, list[int]] = {}
    for step in range(500):
        if step == 2:
            eng.add_request(GenerateRequest(request_id="long", prompt_ids=long_ids, params=_greedy(8, **extra)))
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.token_ids)
            assert o.finish_reason in (None, "length"), o.error
        if step > 2 and not eng.has_work:
            break
    shape = [(p.meta.decode_tokens.numel(), p.num_tokens) for p in plans]
    return toks, {r: torch.stack(v) for r, v in logits.items()}, shape


@pytest.mark.parametrize("kv_bits,gating", [(None, None), (3, None), (4, None), (None, "sticky"), (None, "velocity")])
def test_chunked_prefill_equals_unchunked(kv_bits, gating):
    kw = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_profile": "prose"}
    kw["gating_options"] = GATING_OPTIONS
    whole = _engine(enable_chunked_prefill=False, max_batched_tokens=4096, **kw)
    long_ids = _long_prompt(whole, 300)
    t0, l0, s0 = _serve(whole, long_ids, gating)
    chunked = _engine(max_batched_tokens=BUDGET, **kw)
    t1, l1, s1 = _serve(chunked, long_ids, gating)
    assert max(n for _, n in s0) >= 300  # the reference prefilled the prompt in one step
    assert all(n <= BUDGET for _, n in s1)
    # the prompt took ceil(300 / (BUDGET - 3 decodes)) steps, each with every short stream's decode
    prefill_steps = [(d, n) for d, n in s1 if n > d]
    assert len(prefill_steps) >= -(-300 // (BUDGET - 3)) and all(d == 3 for d, _ in prefill_steps[1:-1])
    assert t1 == t0 and sorted(t0) == ["long", "s0", "s1", "s2"] and len(t0["long"]) == 8
    tol = 1e-4 if kv_bits is None else 1e-2
    for rid in t0:
        assert l0[rid].shape == l1[rid].shape
        off = ((l0[rid] - l1[rid]).abs().amax(-1) >= tol).sum().item()
        # quantized: one sampled position per request may differ more (module docstring: a routing near-tie)
        assert off == 0 or (kv_bits is not None and off <= 1), (rid, off, (l0[rid] - l1[rid]).abs().amax(-1))
    chunked.scheduler.prefix.clear()  # retained prefix-cache sources hold their pages until evicted
    assert not chunked._slot_of and chunked.cache.allocator.num_free == chunked.cache.allocator.num_blocks


def _emulate(batch) -> None:
    """What `RankEngine.run` does to the scheduler's sequences after the forward."""
    for s in batch.prefills + batch.decodes:
        s.num_cached += s.num_scheduled
        if s.num_cached == s.length:
            s.output_ids.append(1)


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=list(range(1, n + 1)), params=SamplingParams(), detok=None)


def test_long_prompt_is_split_under_the_budget_while_decodes_run():
    sch = Scheduler(BlockAllocator(200), 16, max_num_seqs=10, max_batched_tokens=64)
    dec = [_seq(f"d{i}", 5) for i in range(8)]
    for s in dec:
        sch.add(s)
    _emulate(sch.schedule())  # 8 prompts of 5 tokens in one step
    assert all(s.num_cached == 5 and len(s.output_ids) == 1 for s in dec)
    long, second = _seq("long", 1000), _seq("second", 100)
    sch.add(long)
    sch.add(second)
    chunks = []
    for _ in range(40):
        b = sch.schedule()
        assert sum(s.num_scheduled for s in b.prefills + b.decodes) <= 64
        assert b.decodes == dec  # every running stream decodes every step
        assert all(s.num_scheduled == 1 for s in b.decodes)
        if long in b.prefills:
            assert b.prefills[0] is long  # the partial prefill goes before new admissions
            chunks.append((long.num_cached, long.num_scheduled))
        had = len(long.output_ids)
        _emulate(b)
        if long.output_ids and not had:
            break
    # 1000 tokens in chunks of 64 - 8 = 56: contiguous, the last one shorter; the token comes after the last chunk
    assert chunks == [(56 * i, 56) for i in range(17)] + [(952, 48)]
    assert second.num_cached == 8 and second in sch.running  # admitted with the last chunk's leftover budget
    b = sch.schedule()
    assert b.decodes == dec + [long] and b.prefills == [second] and second.num_scheduled == 55


def test_mixed_step_budget_beside_decodes():
    """max_mixed_tokens caps a step that has decodes; an idle rank's prefill takes the whole max_batched_tokens;
    the mixed cap never drops below max_num_seqs (a full decode batch fits)."""
    sch = Scheduler(BlockAllocator(400), 16, max_num_seqs=10, max_batched_tokens=512, max_mixed_tokens=128)
    long = _seq("long", 1100)
    sch.add(long)
    b = sch.schedule()
    assert b.prefills == [long] and long.num_scheduled == 512  # idle: the whole budget
    _emulate(b)
    b = sch.schedule()
    assert long.num_scheduled == 512 and not b.decodes  # still no decode: a prefilling sequence is not one
    _emulate(b)
    dec = [_seq(f"d{i}", 5) for i in range(4)]
    for d in dec:
        sch.add(d)
    b = sch.schedule()  # the long one's last 76 tokens, then 4 x 5 admitted: no decode yet, so 512 allowed
    assert long.num_scheduled == 76 and sum(s.num_scheduled for s in b.prefills) == 96
    _emulate(b)
    late = _seq("late", 600)
    sch.add(late)
    b = sch.schedule()
    assert len(b.decodes) == 5 and b.prefills == [late] and late.num_scheduled == 128 - 5  # beside decodes: 128
    assert Scheduler(BlockAllocator(4), 16, max_num_seqs=16, max_batched_tokens=64,
                     max_mixed_tokens=8).max_mixed_tokens == 16
    assert Scheduler(BlockAllocator(4), 16, max_num_seqs=4, max_batched_tokens=64,
                     max_mixed_tokens=None).max_mixed_tokens == 64


def test_without_chunking_a_prompt_is_one_prefill():
    sch = Scheduler(BlockAllocator(200), 16, max_num_seqs=10, max_batched_tokens=64, enable_chunked_prefill=False)
    dec = [_seq(f"d{i}", 5) for i in range(8)]
    for s in dec:
        sch.add(s)
    _emulate(sch.schedule())
    long, short = _seq("long", 1000), _seq("short", 3)
    sch.add(long)
    sch.add(short)
    b = sch.schedule()
    assert b.prefills == [long] and long.num_scheduled == 1000 and b.decodes == dec  # alone over the budget


def test_preemption_mid_prefill_scheduler():
    """Decodes that need blocks preempt the newest sequence even mid-prefill: its blocks are freed, it goes back
    to the front of the queue and is recomputed from position 0 once it fits again."""
    alloc = BlockAllocator(12)
    sch = Scheduler(alloc, 16, max_num_seqs=4, max_batched_tokens=40)
    dec = [_seq(f"d{i}", 15) for i in range(2)]
    for s in dec:
        sch.add(s)
    _emulate(sch.schedule())  # 1 block each; now 16 tokens each
    long = _seq("long", 150)  # 10 blocks: all that is left
    sch.add(long)
    b = sch.schedule()
    assert b.prefills == [long] and long.num_scheduled == 38 and alloc.num_free == 0
    _emulate(b)  # the decodes reach 17 tokens: each needs a second block
    b = sch.schedule()
    assert b.decodes == dec and b.prefills == [] and sch.waiting[0] is long
    assert long.num_cached == 0 and long.block_table == [] and long.num_preemptions == 1 and alloc.num_free == 8
    _emulate(b)
    sch.finish(dec[1])
    b = sch.schedule()
    assert b.decodes == [dec[0]] and b.prefills == [long] and (long.num_cached, long.num_scheduled) == (0, 39)
    assert len(long.block_table) == 10


def test_preemption_mid_prefill_gives_the_same_tokens(tiny_model_dir):
    path = tiny_model_dir("qwen2_moe", num_layers=3)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(4)] for i in range(3)] + [[(5 * j) % 290 + 2 for j in range(60)]]
    params = _greedy(30)

    def run(eng):
        preempted = []
        orig = eng.scheduler._preempt

        def preempt(victim):
            preempted.append((victim.request_id, victim.num_cached, victim.length))
            orig(victim)

        eng.scheduler._preempt = preempt
        out = {str(i): [] for i in range(len(prompts))}
        for i, p in enumerate(prompts[:3]):
            eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=p, params=params))
        for step in range(2000):
            if step == 3:
                eng.add_request(GenerateRequest(request_id="3", prompt_ids=prompts[3], params=params))
            for o in eng.step():
                out[o.request_id] += o.token_ids
            if step > 3 and not eng.has_work:
                return out, preempted
        raise AssertionError("engine did not finish")

    ref, none = run(_engine(path, enable_chunked_prefill=False, max_batched_tokens=4096, max_model_len=112))
    assert not none
    # 7 blocks of 16: the 60-token prompt (4 blocks) is admitted beside three short streams (1-3 blocks each), which
    # outgrow the pool while it prefills 8 tokens a step
    small = _engine(path, max_batched_tokens=12, max_model_len=112, block_size=16,
                    kv_cache_bytes=7 * 16 * 2 * 3 * 2 * 16 * 4)
    assert small.cache.allocator.num_blocks == 7
    got, preempted = run(small)
    assert got == ref
    assert any(r == "3" and 0 < c < n for r, c, n in preempted), preempted  # preempted part-way through its prefill
    a = small.cache.allocator
    assert a.num_free == a.num_blocks and not small._slot_of


@pytest.mark.parametrize("kv_bits", [None, 3])
def test_abort_mid_prefill_frees_everything(kv_bits):
    kw = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_profile": "prose"}
    eng = _engine(max_batched_tokens=64, **kw)
    a = eng.cache.allocator
    free0 = a.num_free
    pages0 = eng.cache.pool.num_free if kv_bits else None
    eng.add_request(GenerateRequest(request_id="long", prompt_ids=_long_prompt(eng, 300), params=_greedy(4)))
    outs = eng.step() + eng.step()
    seq = eng.scheduler.running[0]
    assert not outs and seq.num_cached == 128 < seq.length  # two chunks in, no token yet
    eng.abort("long")
    outs = eng.step()
    assert [(o.request_id, o.finish_reason, o.token_ids) for o in outs] == [("long", "abort", [])]
    eng.scheduler.prefix.clear()  # the aborted prefix's cached blocks (retained source) until evicted
    assert a.num_free == free0 and not eng.scheduler.running and not eng._slot_of and not eng._kv_profile_of
    if kv_bits:
        assert not eng.cache._seqs and eng.cache.pool.num_free == pages0
    eng.add_request(GenerateRequest(request_id="next", prompt_ids=[5, 6, 7], params=_greedy(3)))
    got = []
    while eng.has_work:
        got += [t for o in eng.step() for t in o.token_ids]
    eng.scheduler.prefix.clear()
    assert len(got) == 3 and a.num_free == free0


def test_budget_below_max_num_seqs_is_refused():
    with pytest.raises(ValueError, match=r"max_batched_tokens=8 must be >= max_num_seqs=16"):
        EngineConfig(model=DEFAULT_MODEL, max_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match=r"max_batched_tokens=8 must be >= max_num_seqs=16"):
        Scheduler(BlockAllocator(4), 16, max_num_seqs=16, max_batched_tokens=8)


def test_mixed_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="max_mixed_tokens=0 must be >= 1"):
        EngineConfig(model=DEFAULT_MODEL, max_mixed_tokens=0)


def test_decodes_query_the_pool_only_when_they_need_a_block():
    """A decode that stays inside its last block needs no pool query: the quantized cache's `num_free` computes a
    page budget, and asking it once per running sequence per step was per-sequence Python on the hot path."""

    class Counting(BlockAllocator):
        queries = 0

        @property
        def num_free(self) -> int:
            Counting.queries += 1
            return super().num_free

    sch = Scheduler(Counting(200), 16, max_num_seqs=10, max_batched_tokens=64)
    dec = [_seq(f"d{i}", 5) for i in range(8)]
    for s in dec:
        sch.add(s)
    _emulate(sch.schedule())  # admitted: each admission asks for its blocks
    for step in range(3):  # lengths 6 .. 8: inside the first 16-token block
        Counting.queries = 0
        b = sch.schedule()
        assert b.decodes == dec and Counting.queries == 0, step
        _emulate(b)
    for s in dec:  # the 17th token starts a second block: each decode asks once and gets it
        s.output_ids.extend([1] * (17 - s.length))
        s.num_cached = s.length - 1
    Counting.queries = 0
    b = sch.schedule()
    assert b.decodes == dec and Counting.queries == len(dec) and all(len(s.block_table) == 2 for s in dec)
