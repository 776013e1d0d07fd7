"""bench/kv_report.py: the RESULT keys of bench/kv_quality.py from hand-made rows: pooled KLD / same-top-1, the
retrieval ratio (0 when fp16 retrieves nothing), a context the model cannot run as 0, one not asked for as nan."""
from __future__ import annotations

import math

from bench.kv_eval import WindowStats
from bench.kv_report import Row, print_tables, result_line


def _row(name, kl, same, retr, eff=3.25, nll=100.0):
    st = {"prose": WindowStats(nll=nll, n=100, kl=kl, same=same), "code": WindowStats(nll=2 * nll, n=100, kl=3 * kl,
                                                                                      same=same)}
    return Row(name, 3, eff, {1024: st}, {1024: retr})


def _keys(line):
    assert line.startswith("RESULT ")
    return {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


def test_result_keys_pool_domains_and_mark_contexts_not_run():
    rows = [_row("fp16-kv", 0.0, 100, [40, 80], eff=16.0), _row("ours3", 0.5, 90, [38, 80]),
            _row("kivi3-m", 1.0, 80, [20, 80], nll=110.0)]
    k = _keys(result_line(rows, [1024], model_max=1024))
    assert k["kld3_1k"] == 0.01  # (0.5 + 1.5) / 200 positions
    assert k["top1_3_1k"] == 90.0 and k["kivi3m_top1_1k"] == 80.0
    assert k["retr3_1k"] == 0.95 and k["kivi3m_retr_1k"] == 0.5 and k["fp16_retr_1k"] == 0.5
    assert k["bits3"] == 3.25 and k["ppl_prose"] == round(math.exp(1.0), 3)
    assert k["kivi3m_prose"] == round(100 * (math.exp(1.1) / math.exp(1.0) - 1), 3)
    # 4k: the model cannot run it -> 0, never the 1k figure; a row not run -> nan
    assert k["kld3_4k"] == 0 and k["retr3_4k"] == 0 and k["fp16_retr_4k"] == 0
    assert math.isnan(k["kld2_1k"]) and math.isnan(k["bits2"])
    # a model that could run 4k but was not asked to: nan
    k = _keys(result_line(rows, [1024], model_max=4096))
    assert math.isnan(k["kld3_4k"]) and math.isnan(k["fp16_retr_4k"])


def test_retrieval_ratio_is_zero_when_fp16_retrieves_nothing(capsys):
    rows = [_row("fp16-kv", 0.0, 100, [0, 80], eff=16.0), _row("ours3", 0.5, 90, [1, 80])]
    k = _keys(result_line(rows, [1024], model_max=1024))
    assert k["retr3_1k"] == 0.0 and k["fp16_retr_1k"] == 0.0
    print_tables(rows, [1024], 1024, "header", 1024, "retrieval note")
    out = capsys.readouterr().out
    assert "4k: not run (model context 1024)" in out and "1k: not run" not in out
    assert "[0.000,0.046]" in out  # Wilson 95% of 0/80
