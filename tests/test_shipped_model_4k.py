"""The shipped checkpoint reads 4,096 tokens (issue 21): transformers loads it (its `rope_parameters` are the default
rope type) and moeray's logits match transformers' past the 1,024 positions the previous checkpoint read."""
from __future__ import annotations

import json
import os

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from tests.conftest import SHIPPED as MODEL
from tests.tiny_models import load_hf


def test_shipped_model_matches_transformers_past_position_1024():
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    assert cfg["max_position_embeddings"] == 4096 and cfg["rope_parameters"]["rope_type"] == "default"
    mc = ModelConfig.from_pretrained(MODEL)
    eng = RankEngine(EngineConfig(model=MODEL, max_model_len=4096, kv_cache_bytes=64 << 20),
                     ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
    ids = eng.tokenizer.encode(open(os.path.join(MODEL, "heldout", "code.txt")).read()).ids[:1400]
    ours = eng.prompt_logits(ids)
    ref = load_hf(MODEL)(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (1400, mc.vocab_size)
    assert (ours - ref).abs().max().item() < 2e-3
    assert torch.equal(ours[1024:].argmax(-1), ref[1024:].argmax(-1))
