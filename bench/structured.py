"""Structured output in-process: validity and stop rate of sampled outputs per JSON schema, the grammar's cost per
token, and the decode slowdown against unconstrained decoding in the same run.

One rank (`RankEngine`, world size 1, 1 torch thread like a rank actor), the shipped checkpoint, full-precision KV.
Per schema: `--outputs` requests at temperature 1 (seeds 0..), max_tokens 256, the grammar compiled as the
HTTP edge compiles it (`actors.engine.grammar.json_schema_grammar`, whitespace fixed), `--streams` (16) in flight
(`--quick`: 50 outputs per schema, else 200).
  - valid: the output parses and validates against its schema (`jsonschema`); stop: finish_reason "stop" (a
    truncated output counts against both).
  - mask ms/token: the outputs' tokens replayed through fresh matchers in batches of `--streams`, as the sampler
    runs them: `apply_grammar_masks` over the batch (one batched llguidance call, unpack, -inf) plus each row's
    `GrammarState.advance`, divided by the tokens.
  - slowdown: engine wall time per output token with the grammar / without it: the same prompts, seeds and
    concurrency unconstrained, each request's max_tokens set to the constrained output's length (EOS ignored),
    so both runs decode the same number of tokens in the same batch shapes.

    python bench/structured.py --quick   # 50 outputs per schema; last line: RESULT valid_rate=.. stop_rate=..
                                         #   mask_ms_per_token=.. slowdown=..
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.config import DEFAULT_MODEL  # noqa: E402

_S = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
_I = lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}  # noqa: E731


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = {
    "person": _obj({"name": _S(20), "age": _I(0, 120), "role": {"enum": ["admin", "user", "guest"]},
                    "active": {"type": "boolean"}}),
    "order": _obj({"id": {"type": "string", "pattern": "^[a-z0-9]{1,8}$"},
                   "items": {"type": "array", "minItems": 1, "maxItems": 3,
                             "items": _obj({"sku": _I(1, 9999), "gift": {"type": "boolean"}})}}),
    "tool_call": {"anyOf": [_obj({"name": {"const": "get_weather"}, "arguments": _obj({"city": _S(16), "days": _I(1, 7)})}),
                            _obj({"name": {"const": "ping"}, "arguments": _obj({})})]},
    "nested": _obj({"user": _obj({"first": _S(12), "last": _S(12)}), "tags": {"type": "array", "maxItems": 4,
                                                                            "items": {"enum": ["a", "b", "c"]}},
                    "score": _I(-50, 50)}),
}


def make_engine(streams: int):
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement

    mc = ModelConfig.from_pretrained(DEFAULT_MODEL)
    cfg = EngineConfig(model=DEFAULT_MODEL, max_num_seqs=streams, max_model_len=512, kv_cache_bytes=64 * 2**20)
    return RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))


def run(eng, prompt: list[int], params: list) -> tuple[float, dict]:
    """Submit every request at once and step until done: (wall s, {index: (token ids, text, finish_reason)})."""
    from actors.engine.messages import GenerateRequest

    t0 = time.perf_counter()
    for i, p in enumerate(params):
        eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=prompt, params=p.to_dict()))
    out = {i: [[], "", None] for i in range(len(params))}
    while eng.has_work:
        for o in eng.step():
            r = out[int(o.request_id)]
            r[0] += o.token_ids
            r[1] += o.text
            r[2] = o.finish_reason or r[2]
    return time.perf_counter() - t0, out


def mask_cost(grammar: str, outputs: list[list[int]], batch: int, vocab: int, eos: tuple) -> float:
    """Seconds of mask + advance over `outputs` (token ids) replayed in batches of `batch` rows."""
    import numpy as np

    from actors.engine.grammar import GrammarState, apply_grammar_masks, load_tokenizer

    tok = load_tokenizer(f"{DEFAULT_MODEL}/tokenizer.json", vocab, eos)
    x = np.zeros((batch, vocab), dtype=np.float32)
    total = 0.0
    for b in range(0, len(outputs), batch):
        group = outputs[b:b + batch]
        states = [GrammarState(tok, grammar) for _ in group]
        for k in range(max(len(g) for g in group)):
            live = [j for j, g in enumerate(group) if k < len(g)]
            errors: dict = {}
            t0 = time.perf_counter()
            apply_grammar_masks(x, live, [states[j] for j in live], errors)
            for j in live:
                states[j].advance(group[j][k])
            total += time.perf_counter() - t0
            assert not errors, errors
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="50 outputs per schema (else 200)")
    ap.add_argument("--outputs", type=int, default=None)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args()
    a.outputs = a.outputs or (50 if a.quick else 200)
    torch.set_num_threads(1)
    import jsonschema

    from actors.engine.grammar import json_schema_grammar
    from actors.engine.sampling import SamplingParams

    eng = make_engine(a.streams)
    prompt = eng.tokenizer.encode("Reply in JSON: ").ids
    V, eos = eng.model_cfg.vocab_size, tuple(sorted(eng.eos))
    run(eng, prompt, [SamplingParams(temperature=1.0, max_tokens=8, seed=0)])  # warm-up
    rows, tot = [], {"n": 0, "valid": 0, "stop": 0, "tokens": 0, "mask_s": 0.0, "t_con": 0.0, "t_free": 0.0}
    print(f"{'schema':10} {'outputs':>7} {'valid':>6} {'stop':>6} {'tokens':>7} {'mask ms/tok':>11} "
          f"{'ms/tok with':>11} {'ms/tok without':>14} {'slowdown':>8}")
    for name, schema in SCHEMAS.items():
        g = json_schema_grammar(schema)
        con = [SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=i, grammar=g) for i in range(a.outputs)]
        t_con, out = run(eng, prompt, con)
        valid = 0
        for ids, text, _ in out.values():
            try:
                jsonschema.validate(json.loads(text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        stop = sum(r[2] == "stop" for r in out.values())
        lens = [max(1, len(out[i][0])) for i in range(a.outputs)]
        free = [SamplingParams(temperature=1.0, max_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate(lens)]
        t_free, _ = run(eng, prompt, free)
        ntok = sum(lens)
        m = mask_cost(g, [out[i][0] for i in range(a.outputs)], a.streams, V, eos)
        print(f"{name:10} {a.outputs:7d} {valid / a.outputs:6.2f} {stop / a.outputs:6.2f} {ntok / a.outputs:7.1f} "
              f"{m / ntok * 1e3:11.4f} {t_con / ntok * 1e3:11.3f} {t_free / ntok * 1e3:14.3f} {t_con / t_free:8.2f}",
              flush=True)
        for k, v in (("n", a.outputs), ("valid", valid), ("stop", stop), ("tokens", ntok), ("mask_s", m),
                     ("t_con", t_con), ("t_free", t_free)):
            tot[k] += v
    print(f"RESULT valid_rate={tot['valid'] / tot['n']:.3f} stop_rate={tot['stop'] / tot['n']:.3f} "
          f"mask_ms_per_token={tot['mask_s'] / tot['tokens'] * 1e3:.4f} slowdown={tot['t_con'] / tot['t_free']:.2f}")


if __name__ == "__main__":
    main()
