"""Per-request KV quantization profile (`SamplingParams.kv_profile`) through `RankEngine`, on the shipped model
with a 3-bit cache (its `prose` and `code` profiles): the field reaches the sequence, mixed-profile batches equal
each request alone, nothing is left in the engine's profile map, `stats()` reports the cache's memory."""
from __future__ import annotations

import pytest

from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.kv.profile_choice import AUTO
from actors.engine.messages import GenerateRequest
from actors.engine.sampling import KV_PROFILE_AUTO, SamplingParams, served_kv_profiles
from cluster.config import DEFAULT_MODEL

PROSE = "ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."
CODE = "def add(a, b):\n    return {'sum': a + b, 'items': [a, b]}  # (x)\n"


def _engine(**kw) -> RankEngine:
    mc = ModelConfig.from_pretrained(DEFAULT_MODEL)
    cfg = EngineConfig(model=DEFAULT_MODEL, max_model_len=128, max_num_seqs=8, kv_cache_bytes=2**21, **kw)
    return RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))


@pytest.fixture(scope="module")
def qeng():
    return _engine(kv_bits=3, kv_profile="prose")


def _req(eng: RankEngine, rid: str, text: str, max_tokens: int = 6, **params) -> GenerateRequest:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return GenerateRequest(request_id=rid, prompt_ids=eng.tokenizer.encode(text).ids, params=sp.to_dict())


def _run(eng: RankEngine, max_steps: int = 200) -> dict[str, list]:
    """Step until idle; {request id: [token ids..., finish_reason]}."""
    got: dict[str, list] = {}
    for _ in range(max_steps):
        if not eng.has_work:
            break
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason:
                got[o.request_id].append(o.finish_reason)
    assert not eng.has_work
    return got


def test_sampling_params_kv_profile_field():
    assert KV_PROFILE_AUTO == AUTO
    sp = SamplingParams(kv_profile="code")
    assert sp.to_dict()["kv_profile"] == "code"
    msg = GenerateRequest(request_id="r", prompt_ids=[1], params=sp.to_dict()).encode()
    assert SamplingParams.from_dict(GenerateRequest.decode(msg).params) == sp
    assert SamplingParams().kv_profile is None
    for bad in ("", "../prose", "a/b", " prose", "x" * 65, 3, ["code"]):
        with pytest.raises(ValueError, match=r"^kv_profile="):
            SamplingParams(kv_profile=bad)


def test_check_kv_profile_against_served_names():
    assert served_kv_profiles(DEFAULT_MODEL, 3, None) == ("code", "prose")
    assert served_kv_profiles(DEFAULT_MODEL, None, None) == ()
    quant = {"kv_bits": 3, "kv_profile": "prose"}
    for ok in (None, "auto", "prose", "code"):
        SamplingParams(kv_profile=ok).check_kv_profile(DEFAULT_MODEL, quant)
    with pytest.raises(ValueError, match=r"kv_profile='nope' is not served; available: code, prose or auto"):
        SamplingParams(kv_profile="nope").check_kv_profile(DEFAULT_MODEL, quant)
    # full-precision KV: a named profile is an error, "auto" means "the server's choice" and passes
    SamplingParams(kv_profile="auto").check_kv_profile(DEFAULT_MODEL, {})
    with pytest.raises(ValueError, match=r"kv_profile='prose' needs a quantized KV cache"):
        SamplingParams(kv_profile="prose").check_kv_profile(DEFAULT_MODEL, {})


def test_request_profile_reaches_its_sequence_and_mixed_batch_equals_alone(qeng):
    eng = qeng
    cases = {  # request id: (prompt, requested profile, the profile the engine must pick)
        "prose-as-code": (PROSE, "code", "code"),
        "default": (PROSE, None, "prose"),  # the engine's kv_profile
        "auto-code": (CODE, "auto", "code"),
        "auto-prose": (PROSE, "auto", "prose"),
    }
    for rid, (text, prof, _) in cases.items():
        eng.add_request(_req(eng, rid, text, kv_profile=prof))
    assert eng._kv_profile_of == {rid: want for rid, (_, _, want) in cases.items()}
    first = {o.request_id: o.token_ids for o in eng.step()}  # all four prefill in this one step
    assert sorted(st.profile for st in eng.cache._seqs.values()) == sorted(w for _, _, w in cases.values())
    mixed = {rid: first[rid] + rest for rid, rest in _run(eng).items()}
    assert not eng._kv_profile_of
    for rid, (text, prof, _) in cases.items():
        eng.add_request(_req(eng, rid, text, kv_profile=prof))
        alone = _run(eng)[rid]
        assert len(alone) == 7 and alone[-1] == "length"
        assert mixed[rid] == alone, rid  # greedy tokens with profile X: the same in a mixed batch and alone
        assert not eng._kv_profile_of


def test_unknown_profile_is_refused_and_leaves_nothing(qeng):
    with pytest.raises(ValueError, match=r"kv_profile='nope' is not loaded"):
        qeng.add_request(_req(qeng, "bad", PROSE, kv_profile="nope"))
    assert not qeng._kv_profile_of and not qeng.has_work


def test_abort_and_scheduler_reject_leave_no_profile_entry(qeng):
    eng = qeng
    eng.scheduler.prefix.clear()  # the shared engine's earlier tests left retained prefix-cache sources
    free0 = eng.cache.allocator.num_free
    eng.add_request(_req(eng, "queued", PROSE, kv_profile="code"))
    eng.abort("queued")  # aborted before its first step
    eng.add_request(_req(eng, "running", CODE, max_tokens=50, kv_profile="auto"))
    early = eng.step() + eng.step()
    assert [(o.request_id, o.finish_reason) for o in early if o.finish_reason] == [("queued", "abort")]
    eng.abort("running")  # aborted mid-decode
    # more tokens than the whole cache holds: the scheduler fails it (never admitted, never bound)
    n = eng.cache.allocator.num_blocks * eng.cfg.block_size + 1
    eng.add_request(GenerateRequest(request_id="huge", prompt_ids=[7] * n, params=SamplingParams(
        temperature=0.0, max_tokens=1, kv_profile="code").to_dict()))
    assert set(eng._kv_profile_of) == {"running", "huge"}  # the abort takes effect at the next step
    got = _run(eng)
    assert got["running"][-1] == "abort" and got["huge"] == ["error"]
    eng.scheduler.prefix.clear()  # retained prefix-cache sources hold their pages until evicted
    assert eng._kv_profile_of == {} and eng.cache.allocator.num_free == free0
    assert eng.stats()["kv_memory"]["kv_sequences"] == 0


def test_stats_report_kv_memory(qeng):
    s = qeng.stats()["kv_memory"]
    assert s["kv_bits"] == 3 and s["kv_blocks_total"] == qeng.stats()["kv_blocks_total"]
    assert 0 < s["kv_bytes_reserved"] <= qeng.cfg.kv_cache_bytes


def test_full_precision_engine_refuses_a_named_profile():
    eng = _engine()
    assert "kv_memory" not in eng.stats()  # the full-precision cache has no memory_stats()
    with pytest.raises(ValueError, match=r"kv_profile='prose' needs a quantized KV cache"):
        eng.add_request(_req(eng, "p", PROSE, kv_profile="prose"))
    eng.add_request(_req(eng, "a", PROSE, max_tokens=2, kv_profile="auto"))  # auto: the server's choice
    assert _run(eng)["a"][-1] == "length" and not eng._kv_profile_of
