"""One rank serving several KV widths from one page pool (`kv_bits` plus `kv_extra_bits`): a request picks a
width by naming "<profile>-<b>bit"; in a mixed 2/3/4-bit batch each request gets the same greedy tokens as in
an engine serving only its width, and every block and page comes back."""
from __future__ import annotations

import pytest

from actors.engine.config import EngineConfig
from actors.engine.sampling import SamplingParams, served_kv_profiles
from cluster.config import DEFAULT_MODEL
from tests.actors.engine.test_engine_kv_profile import CODE, PROSE, _engine, _req, _run


def test_served_names_and_config_checks():
    assert served_kv_profiles(DEFAULT_MODEL, 3, None, (2, 4)) == (
        "code", "code-2bit", "code-4bit", "prose", "prose-2bit", "prose-4bit")
    opts = {"kv_bits": 3, "kv_extra_bits": [2]}
    SamplingParams(kv_profile="prose-2bit").check_kv_profile(DEFAULT_MODEL, opts)
    with pytest.raises(ValueError, match="prose-4bit"):
        SamplingParams(kv_profile="prose-4bit").check_kv_profile(DEFAULT_MODEL, opts)
    with pytest.raises(ValueError, match="kv_extra_bits"):
        EngineConfig(model=DEFAULT_MODEL, kv_extra_bits=(2,))  # no default width
    with pytest.raises(ValueError, match="kv_extra_bits"):
        EngineConfig(model=DEFAULT_MODEL, kv_bits=3, kv_extra_bits=(5,))


def test_mixed_widths_in_one_batch_equal_single_width_engines():
    mixed = _engine(kv_bits=3, kv_extra_bits=(2, 4))
    assert mixed.cache.widths == [2, 3, 4]
    free0 = mixed.cache.allocator.num_free
    jobs = {"p3": (PROSE, "prose"), "p2": (PROSE, "prose-2bit"), "c4": (CODE, "code-4bit"), "c2": (CODE, "code-2bit")}
    for rid, (text, prof) in jobs.items():
        mixed.add_request(_req(mixed, rid, text, max_tokens=24, kv_profile=prof))
    got = _run(mixed)
    mixed.scheduler.prefix.clear()  # retained prefix-cache sources hold their pages until evicted
    assert mixed.cache.allocator.num_free == free0 and not mixed._kv_profile_of
    for bits, rids in ((3, ["p3"]), (2, ["p2", "c2"]), (4, ["c4"])):
        single = _engine(kv_bits=bits)
        for rid in rids:
            text, prof = jobs[rid]
            single.add_request(_req(single, rid, text, max_tokens=24, kv_profile=prof.split("-")[0]))
        alone = _run(single)
        for rid in rids:
            assert got[rid] == alone[rid], (rid, bits)
