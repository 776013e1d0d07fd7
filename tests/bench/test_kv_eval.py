"""bench/kv_eval.py, what bench/kv_quality.py measures with: KLD and same-top-1 against hand-computed values, the
Wilson interval against its closed form, and greedy retrieval decoding through the fp, quantized and KIVI caches
on a tiny model (transformers' greedy tokens; decode == teacher-forced prefill; the scorer's exact match)."""
from __future__ import annotations

import math

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.kv.calibration import collect_calibration_kv, fit_model_profile
from actors.kv.quantized import QuantizedPagedKVCache
from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from bench.kv_eval import (KiviCache, WindowStats, add_window, answer_digits_done, greedy_decode,
                           kl_and_same_top1, score_records, wilson_interval, window_logits)
from scripts.retrieval_records import build_eval_records, is_correct


def test_kl_and_same_top1_match_hand_computed_values():
    p = torch.tensor([[0.5, 0.5, 1e-30], [0.7, 0.2, 0.1], [0.6, 0.3, 0.1]]).log()
    q = torch.tensor([[0.25, 0.75, 1e-30], [0.2, 0.7, 0.1], [0.5, 0.25, 0.25]]).log() + 3.0  # logits: any shift
    kl, same = kl_and_same_top1(p, q)
    hand = [0.5 * math.log(2) + 0.5 * math.log(2 / 3),  # 0.143841
            0.7 * math.log(3.5) + 0.2 * math.log(2 / 7),  # 0.626381
            0.6 * math.log(1.2) + 0.3 * math.log(1.2) + 0.1 * math.log(0.4)]  # 0.072473
    assert kl.tolist() == pytest.approx(hand, abs=1e-6)
    assert same.tolist() == [False, False, True]
    assert kl_and_same_top1(p, p)[0].abs().max() < 1e-7  # KL(p || p) = 0
    st = WindowStats()
    add_window(st, q, torch.tensor([1, 0, 2]), p, tail_from=1)
    assert st.n == 3 and st.kl == pytest.approx(sum(hand), abs=1e-5) and st.same == 1
    assert (st.tail_n, st.tail_same) == (2, 1) and st.tail_kl == pytest.approx(hand[1] + hand[2], abs=1e-5)
    nll = -(math.log(0.75) + math.log(0.2) + math.log(0.25))
    assert st.nll == pytest.approx(nll, abs=1e-5) and st.ppl() == pytest.approx(math.exp(nll / 3), rel=1e-6)
    with pytest.raises(ValueError, match="differ"):
        kl_and_same_top1(p, q[:2])


def test_wilson_interval_matches_the_closed_form():
    z2 = 1.959964 ** 2
    assert wilson_interval(0, 10) == pytest.approx((0.0, z2 / (10 + z2)), abs=1e-9)  # (0, 0.27754)
    assert wilson_interval(10, 10) == pytest.approx((10 / (10 + z2), 1.0), abs=1e-9)
    assert wilson_interval(5, 10) == pytest.approx((0.236590, 0.763410), abs=1e-5)  # published: 0.2366-0.7634
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="k=11"):
        wilson_interval(11, 10)


CONTEXT = 220  # prompt of 220 tokens: decoding feeds positions 220-224, sealing the block and KIVI group ending at 223


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model("qwen2_moe", str(tmp_path_factory.mktemp("kveval")), num_layers=2)
    mc = ModelConfig.from_pretrained(path)
    eng = RankEngine(EngineConfig(model=path, max_model_len=256, max_num_seqs=1),
                     ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
    text = ("To be, or not to be, that is the question. def add(a, b):\n    return a + b\n"
            "The quick brown fox jumps over the lazy dog. for i in range(10):\n    print(i)\n") * 12
    records = build_eval_records(eng.tokenizer, text, [CONTEXT], [0.1, 0.9], 2, seed=1)
    k, v = collect_calibration_kv(eng, eng.tokenizer.encode(text).ids[:512], window=128)
    prof = fit_model_profile(k, v, name="prose", bits=2)
    return path, mc, eng, records, prof


def _caches(mc, prof):
    quant = QuantizedPagedKVCache(num_layers=mc.num_layers, num_blocks=17, block_size=16,
                                  num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, profiles={"prose": prof},
                                  default_profile="prose", max_sequences=1, sink_tokens=1,
                                  rope_theta=mc.rope_theta, max_positions=256)
    return {"quant": quant, "kivi": KiviCache(2, 32, 8, max_tokens=256)}


def test_greedy_decode_through_the_fp_cache_equals_transformers(tiny):
    import transformers as tf

    path, _, eng, records, _ = tiny
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for r in records[:2]:
        ours = greedy_decode(eng.model, eng.cache, list(r.prompt_ids), 6)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([r.prompt_ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, CONTEXT:].tolist()
        assert ours == ref


@pytest.mark.parametrize("kind", ["quant", "kivi"])
def test_decode_through_a_quantized_cache_equals_its_teacher_forced_prefill(tiny, kind):
    """Token by token decoding reads the quantized KV as the prefill of the whole sequence does (the bench's
    perplexity and KLD rows and its retrieval rows see one cache)."""
    _, mc, eng, records, prof = tiny
    for r in records[:2]:
        cache = _caches(mc, prof)[kind]
        steps: list = []
        out = greedy_decode(eng.model, cache, list(r.prompt_ids), 6, logits_out=steps)
        assert len(out) == 6
        seq = list(r.prompt_ids) + out
        logits = window_logits(eng.model, _caches(mc, prof)[kind], seq)  # [L - 1, V]
        torch.testing.assert_close(torch.stack(steps), logits[CONTEXT - 1:], atol=2e-4, rtol=1e-4)
        assert logits[CONTEXT - 1:].argmax(-1).tolist() == out
    fp = window_logits(eng.model, eng.cache, list(records[0].prompt_ids))
    q = window_logits(eng.model, _caches(mc, prof)[kind], list(records[0].prompt_ids))
    assert 0 < (fp - q).abs().max()  # the quantized cache is really in the path


def test_score_records_counts_exact_matches(tiny):
    """The scorer's verdicts are `is_correct` of the greedy completion: a record whose answer is the completion's
    own leading characters counts, the original (random model) does not."""
    import dataclasses

    _, mc, eng, records, prof = tiny
    tok = eng.tokenizer
    cache = _caches(mc, prof)["quant"]
    r = records[0]
    comp = tok.decode(greedy_decode(eng.model, cache, list(r.prompt_ids), 6, eng.eos, answer_digits_done(tok)))
    s = comp.lstrip()
    k = next(i for i in range(1, len(s) + 1) if not s[i:i + 1].isdigit())
    hit = dataclasses.replace(r, answer=s[:k])
    assert is_correct(comp, hit.answer) and not is_correct(comp, r.answer)
    assert score_records(eng.model, cache, tok, [hit, r], 6, eng.eos) == [True, False]
    assert cache.allocator.num_used == 0  # every record's blocks freed


def test_kivi_cache_rejects_a_decode_that_does_not_continue_its_sequence(tiny):
    _, mc, eng, records, _ = tiny
    cache = KiviCache(2, 32, 8, max_tokens=256)
    window_logits(eng.model, cache, list(records[0].prompt_ids[:40]))
    with pytest.raises(ValueError, match="position 50"):
        from actors.model.attention import AttentionMetadata
        meta = AttentionMetadata(slot_mapping=torch.tensor([50]), decode_tokens=torch.tensor([0]),
                                 decode_block_tables=torch.tensor([[0, 1, 2, 3]]), decode_context_lens=torch.tensor([51]))
        eng.model.forward(torch.tensor([5]), torch.tensor([50]), cache, meta)

