"""Automatic prefix caching (actors/kv/prefix_cache.py, actors/kv/quantized_prefix.py): a hit skips the cached
prefill and changes no greedy token (full precision and quantized), sharing and eviction never touch a block in
use, aborts free only their own blocks, and every block returns to the pool."""
from __future__ import annotations

import os

import pytest

from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.engine.messages import GenerateRequest
from actors.engine.sampling import SamplingParams
from actors.kv.prefix_cache import PrefixCachingAllocator, chain_hashes
from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from cluster.config import DEFAULT_MODEL

S = 16


def _engine(**kw) -> RankEngine:
    mc = ModelConfig.from_pretrained(DEFAULT_MODEL)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("kv_cache_bytes", 2**24)
    kw.setdefault("max_batched_tokens", 256)
    return RankEngine(EngineConfig(model=DEFAULT_MODEL, **kw),
                      ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))


_IDS: list[int] = []


def _text(n: int, at: int = 0) -> list[int]:
    if not _IDS:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(DEFAULT_MODEL, "tokenizer.json"))
        _IDS.extend(tok.encode(open(os.path.join(DEFAULT_MODEL, "heldout", "prose.txt")).read()).ids)
    return _IDS[at:at + n]


def _req(rid: str, ids: list[int], n: int = 8, **kw) -> GenerateRequest:
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw).to_dict()
    return GenerateRequest(request_id=rid, prompt_ids=ids, params=p)


def _run(eng: RankEngine, reqs=(), steps_between: int = 0) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(r)
        out[r.request_id] = []
        for _ in range(steps_between):
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
    while eng.has_work:
        for o in eng.step():
            assert o.finish_reason in (None, "length", "abort"), o.error
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def _alone(prompt: list[int], n: int = 8, **kw) -> list[int]:
    return _run(_engine(enable_prefix_caching=False, **kw), [_req("x", prompt, n)])["x"]


# --------------------------------------------------------------------------- allocator units
def test_chain_hash_names_the_whole_prefix():
    a = chain_hashes(list(range(48)), [16, 32, 48])
    b = chain_hashes([99] + list(range(1, 48)), [16, 32, 48])
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]  # a different first block changes every later hash
    assert chain_hashes(list(range(48)), [16, 32, 48], parents=a[:1]) == a
    assert chain_hashes(list(range(16)), [16], salt=b"3bit") != a[:1]


def test_eviction_takes_only_unheld_cached_blocks_lru():
    al = PrefixCachingAllocator(4)
    blocks = [al.allocate() for _ in range(4)]
    for i, b in enumerate(blocks):
        al.register(b, bytes([i]))
    al.acquire(blocks[0])  # a second holder of block 0
    al.free_all(blocks)  # 1, 2, 3 become evictable; the tail (3) least recent
    assert al.num_free == 3 and al.refcount(blocks[0]) == 1
    got = [al.allocate() for _ in range(3)]
    assert got == [blocks[3], blocks[2], blocks[1]]  # tail first; the held block 0 never handed out
    assert al.lookup(bytes([0])) == blocks[0] and al.lookup(bytes([3])) is None
    with pytest.raises(MemoryError):
        al.allocate()
    al.free_all(got + [blocks[0]])
    assert al.num_free == 4


# --------------------------------------------------------------------------- engine
@pytest.mark.parametrize("kv_bits", [None, 3])
def test_hit_gives_the_tokens_of_a_run_without_cache(kv_bits):
    kw = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_profile": "prose"}
    prefix = _text(300)
    second = prefix + _text(40, at=1000)
    eng = _engine(**kw)
    free0 = eng.cache.allocator.num_free
    first = _run(eng, [_req("a", prefix)])["a"]
    stats0 = eng.scheduler.prefix.stats()
    got = _run(eng, [_req("b", second)])["b"]
    hits = eng.scheduler.prefix.stats()["prefix_cache_hits"] - stats0["prefix_cache_hits"]
    assert hits == 288  # the 18 full blocks of the shared 300 tokens (quantized: Ns = 0 sealed blocks)
    assert first == _alone(prefix, **kw) and got == _alone(second, **kw)
    eng.scheduler.prefix.clear()
    assert eng.cache.allocator.num_free == free0


def test_prompt_logprobs_requests_never_hit():
    eng = _engine()
    prefix = _text(100)
    _run(eng, [_req("a", prefix)])
    h0 = eng.scheduler.prefix.hits
    got = _run(eng, [_req("b", prefix + [5, 6], prompt_logprobs=0)])
    assert eng.scheduler.prefix.hits == h0 and len(got["b"]) == 8


def test_whole_prompt_cached_still_computes_its_last_token():
    eng = _engine()
    prompt = _text(64)  # 4 full blocks
    _run(eng, [_req("a", prompt)])
    h0 = eng.scheduler.prefix.hits
    assert _run(eng, [_req("b", prompt)])["b"] == _alone(prompt)
    assert eng.scheduler.prefix.hits - h0 == 48  # 3 blocks: the 4th holds the last prompt token


def test_batch_of_a_long_new_prefill_and_a_hit_gives_each_its_own_output():
    eng = _engine()
    shared = _text(200)
    _run(eng, [_req("warm", shared, 1)])
    long_new, cont = _text(1000, at=2000), shared + _text(30, at=500)
    got = _run(eng, [_req("long", long_new, 8), _req("cont", cont, 8)])
    assert eng.scheduler.prefix.hits >= 192
    assert got["long"] == _alone(long_new) and got["cont"] == _alone(cont)


def test_eviction_under_pressure_keeps_blocks_in_use_and_outputs():
    # 40 blocks: one 300-token sequence (19 blocks) runs while others' cached blocks must be evicted
    kw = dict(kv_cache_bytes=40 * ModelConfig_bytes_per_block(), max_model_len=320, max_num_seqs=2)
    eng = _engine(**kw)
    al = eng.cache.allocator
    prompts = [_text(300, at=400 * i) for i in range(4)]
    held_seen = []
    step = eng.step

    def checked_step():
        out = step()
        held = {b for s in eng.scheduler.running for b in s.block_table}
        assert all(al.refcount(b) > 0 for b in held)  # nothing a running sequence holds is free or evictable
        assert not held & set(al._free) and not held & set(al._lru)
        held_seen.append(len(held))
        return out

    eng.step = checked_step
    got = _run(eng, [_req(str(i), p, 6) for i, p in enumerate(prompts)])
    again = _run(eng, [_req("again", prompts[3] + [7], 6)])  # the last one's blocks are still cached
    assert eng.scheduler.prefix.hits >= 288
    for i, p in enumerate(prompts):
        assert got[str(i)] == _alone(p, 6, **kw)
    assert again["again"] == _alone(prompts[3] + [7], 6, **kw)
    assert al.num_free == al.num_blocks


def ModelConfig_bytes_per_block() -> int:
    mc = ModelConfig.from_pretrained(DEFAULT_MODEL)
    return 2 * mc.num_layers * S * mc.num_kv_heads * mc.head_dim * 4


def test_abort_of_a_sharing_request_frees_only_its_own_blocks():
    eng = _engine()
    al = eng.cache.allocator
    shared = _text(160)  # 10 full blocks
    eng.add_request(_req("a", shared + [1, 2, 3], 40))
    eng.step()  # a's prompt computed and committed at the next schedule
    eng.step()
    eng.add_request(_req("b", shared + _text(50, at=3000), 40))
    eng.step()
    a, b = (next(s for s in eng.scheduler.running if s.request_id == r) for r in ("a", "b"))
    common = [x for x in a.block_table if x in b.block_table]
    assert len(common) == 10 and b.num_cached >= 160
    own_b = [x for x in b.block_table if x not in common]
    free_before = al.num_free
    eng.abort("b")
    eng.step()
    assert all(al.refcount(x) == 1 for x in common)  # a still holds them
    assert al.num_free == free_before + len(own_b)
    rest = _run(eng)
    assert rest["a"] and al.num_free == al.num_blocks
