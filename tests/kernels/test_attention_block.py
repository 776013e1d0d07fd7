"""The one-call attention block of a decode step (kernels/csrc/attention_block.c) equals the layer op by op, bit for
bit: on random shapes against the wrappers it composes, and in the engine on the shipped model against the same
steps with the block turned off."""
from __future__ import annotations

import pytest
import torch

from actors.model.layers import Rotary
from kernels.cpu import _build, decode_attention, linear, rms_norm
from kernels.cpu.attention_block import attention_block
from kernels.cpu.packing import panels
from tests.conftest import SHIPPED

pytestmark = pytest.mark.skipif(_build.lib() is None, reason="compiled CPU kernels unavailable")


def _case(T, *, bias=True, delta=True, seed=0, H=4, Hkv=2, Dh=16, D=48, S=4, NB=12):
    g = torch.Generator().manual_seed(seed)
    N = (H + 2 * Hkv) * Dh
    c = dict(h=torch.randn(T, D, generator=g), delta=torch.randn(T, D, generator=g) if delta else None,
             in_norm_w=torch.randn(D, generator=g),
             w_qkv=(torch.randn(N, D, generator=g) * 0.2).bfloat16(),
             b_qkv=torch.randn(N, generator=g) * 0.1 if bias else None,
             w_o=(torch.randn(D, H * Dh, generator=g) * 0.2).bfloat16(),
             b_o=torch.randn(D, generator=g) * 0.1 if bias else None, norm_w=torch.randn(D, generator=g))
    rot = Rotary(Dh, 10000.0, 64, torch.float32)
    kc, vc = torch.randn(NB, S, Hkv, Dh, generator=g), torch.randn(NB, S, Hkv, Dh, generator=g)
    ctx = torch.tensor([5, 9, 1, 12, 7][:T], dtype=torch.int64)  # context with the new token
    tables = torch.stack([torch.randperm(NB, generator=g)[:3] for _ in range(T)]).to(torch.int64)
    pos = ctx - 1
    slots = tables[torch.arange(T), pos // S] * S + pos % S
    return c, rot, kc, vc, dict(pos=pos, slots=slots, tok=torch.arange(T), tables=tables, ctx=ctx, H=H)


def _op_by_op(c, rot, kc, vc, m, scale):
    """`MoEModel.forward`'s residual add and input norm, `attention` and `rms_norm(..., residual=h)` through the same
    wrappers, on the PagedKVCache's path."""
    T, H = c["h"].shape[0], m["H"]
    Hkv, Dh = kc.shape[2], kc.shape[3]
    if c["delta"] is None:
        h, x = c["h"], rms_norm(c["h"], c["in_norm_w"], 1e-6)
    else:
        h, x = rms_norm(c["delta"], c["in_norm_w"], 1e-6, residual=c["h"])
    q, k, v = linear(x, c["w_qkv"], c["b_qkv"]).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
    q = rot.apply(q.view(T, H, Dh), m["pos"])
    kc.view(-1, Hkv, Dh)[m["slots"]] = rot.apply(k.view(T, Hkv, Dh), m["pos"])
    vc.view(-1, Hkv, Dh)[m["slots"]] = v.view(T, Hkv, Dh)
    o = torch.empty_like(q)
    assert decode_attention(q, kc, vc, m["tok"], m["tables"], m["ctx"], scale, o)
    return rms_norm(linear(o.reshape(T, H * Dh), c["w_o"], c["b_o"]), c["norm_w"], 1e-6, residual=h)


def _fused(c, rot, kc, vc, m, scale):
    return attention_block(c["h"], c["delta"], c["in_norm_w"], c["w_qkv"], c["b_qkv"], c["w_o"], c["b_o"],
                           c["norm_w"], 1e-6, rot.cos,
                           rot.sin_signed, m["pos"], kc, vc, m["slots"], m["tok"], m["tables"], m["ctx"], m["H"],
                           scale)


@pytest.mark.parametrize("T,bias,delta,packed", [(1, True, True, False), (3, False, True, False), (5, True, False, True),
                                                 (1, True, True, True), (2, True, False, False)])
def test_attention_block_equals_op_by_op(T, bias, delta, packed):
    c, rot, kc, vc, m = _case(T, bias=bias, delta=delta, seed=T)
    if packed:  # a weight seen twice gets its panel copy: both paths must then take the panel kernel
        for w in (c["w_qkv"], c["w_o"]):
            panels(w), panels(w)
            assert panels(w) is not None
    kc2, vc2 = kc.clone(), vc.clone()
    # unpacked: each path sees its own copy once (a second sight would pack it: `kernels.cpu.packing`)
    cf = c if packed else dict(c, w_qkv=c["w_qkv"].clone(), w_o=c["w_o"].clone())
    h_ref, x_ref = _op_by_op(c, rot, kc, vc, m, 0.25)
    h, x = _fused(cf, rot, kc2, vc2, m, 0.25)
    assert torch.equal(h, h_ref) and torch.equal(x, x_ref)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the new rows written in place, the rest untouched


def test_attention_block_rejects_out_of_range_and_declines_what_it_cannot_run():
    c, rot, kc, vc, m = _case(2)
    before = kc.clone()
    with pytest.raises(IndexError, match="RoPE tables"):
        _fused(c, rot, kc, vc, dict(m, pos=torch.tensor([3, 64])), 0.25)
    with pytest.raises(IndexError, match="outside the cache"):
        _fused(c, rot, kc, vc, dict(m, slots=torch.tensor([0, kc.shape[0] * kc.shape[1]])), 0.25)
    assert torch.equal(kc, before)  # nothing written on either error
    assert _fused(dict(c, w_qkv=c["w_qkv"].float()), rot, kc, vc, m, 0.25) is None  # fp32 weights: op by op
    assert _fused(c, rot, kc, vc, dict(m, tok=torch.arange(1)), 0.25) is None  # a token that is not a decode row


@pytest.mark.parametrize("kv_bits", [None, 3])
def test_engine_steps_equal_with_and_without_the_block(monkeypatch, kv_bits):
    """Shipped model (bf16 weights, q/k/v biases), 4 sequences of different lengths over several KV blocks, prefill
    and decode steps, full-precision and 3-bit KV: every step's final hidden states are identical with the block
    (whole, or its halves around the quantized cache's and the prefills' own attention) and op by op."""
    from kernels.cpu import attention_block as block_mod
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams
    from actors.model import model as model_mod
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement

    fused_calls = []
    block = model_mod.MoEModel.attention_block

    def run(enabled: bool) -> list[torch.Tensor]:
        mc = ModelConfig.from_pretrained(SHIPPED)
        eng = RankEngine(EngineConfig(model=SHIPPED, num_threads=1, max_num_seqs=8, kv_bits=kv_bits),
                         ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
        outs = []
        forward = eng.model.forward

        def record(*a, **kw):
            outs.append(forward(*a, **kw).clone())
            return outs[-1]

        def maybe_block(self, *a):
            r = block(self, *a) if enabled else None
            fused_calls.append(r is not None)
            return r

        monkeypatch.setattr(eng.model, "forward", record)
        monkeypatch.setattr(model_mod.MoEModel, "attention_block", maybe_block)
        p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True).to_dict()
        for i, n in enumerate((3, 17, 30, 9)):
            eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=[(11 * i + 5 * j) % 4000 + 7 for j in range(n)],
                                            params=p))
        for _ in range(24):
            eng.step()
        return outs

    halves = []
    attention_in = block_mod.attention_in
    monkeypatch.setattr(block_mod, "attention_in", lambda *a: halves.append(1) or attention_in(*a))
    import actors.model.layers as layers_mod
    monkeypatch.setattr(layers_mod, "attention_in", block_mod.attention_in)
    fused = run(True)
    assert any(fused_calls) and halves  # the prefills (and every quantized step) took the halves
    plain = run(False)
    assert len(fused) == len(plain) == 24
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T,scaled,packed", [(1, False, False), (4, True, False), (3, False, True)])
def test_shared_expert_equals_torch_ops(T, scaled, packed):
    """The shared expert and its gate in one call (kernels/csrc/expert_ffn.c) equal the PyTorch ops they replace
    up to fp32 rounding, on a strided slice of a fused projection, with and without a policy's scale and panels."""
    import torch.nn.functional as F

    from kernels.cpu import shared_expert

    g = torch.Generator().manual_seed(T)
    E, I, D = 5, 24, 40
    y = torch.randn(T, E + 2 * I + 1 + 3, generator=g)[:, : E + 2 * I + 1]  # row stride > width
    w_down = (torch.randn(D, I, generator=g) * 0.3).bfloat16()
    if packed:
        panels(w_down), panels(w_down)
    scale = torch.rand(T, generator=g) if scaled else None
    sg, su = y[:, E:-1].chunk(2, dim=-1)
    gate = torch.sigmoid(y[:, -1:]) * (scale[:, None] if scaled else 1.0)
    want = gate * (F.silu(sg) * su) @ w_down.float().T
    got = shared_expert(y, E, w_down, scale)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    assert shared_expert(y.double(), E, w_down, scale) is None  # other dtypes: the caller's PyTorch ops


def test_attention_halves_equal_op_by_op_and_check_positions():
    """The first half gives the residual add, q rotated and k / v unrotated as the op-by-op path computes them; the
    second half the output linear, residual add and norm; a position beyond the tables raises before any write."""
    from kernels.cpu.attention_block import attention_halves_apply, attention_in, attention_out

    c, rot, kc, vc, m = _case(3, seed=7)
    T, H, Hkv, Dh = 3, m["H"], kc.shape[2], kc.shape[3]
    args = (c["in_norm_w"], c["w_qkv"], c["b_qkv"], c["w_o"], c["b_o"], c["norm_w"], rot.cos, rot.sin_signed, m["pos"])
    assert attention_halves_apply(c["h"], c["delta"], *args, H, Hkv)
    assert not attention_halves_apply(c["h"], c["delta"], c["in_norm_w"], c["w_qkv"].float(), *args[2:], H, Hkv)
    h_ref, x_ref = rms_norm(c["delta"], c["in_norm_w"], 1e-6, residual=c["h"])
    q_ref, k_ref, v_ref = linear(x_ref, c["w_qkv"], c["b_qkv"]).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
    # each path sees its own copy of a weight once (a second sight would pack it: `kernels.cpu.packing`)
    h, q, k, v = attention_in(c["h"], c["delta"], c["in_norm_w"], c["w_qkv"].clone(), c["b_qkv"], 1e-6, rot.cos,
                              rot.sin_signed, m["pos"], H, Hkv)
    assert torch.equal(h, h_ref) and torch.equal(q, rot.apply(q_ref.view(T, H, Dh), m["pos"]))
    assert torch.equal(k, k_ref.reshape(T, Hkv, Dh)) and torch.equal(v, v_ref.reshape(T, Hkv, Dh))
    o = torch.randn(T, H * Dh)
    want = rms_norm(linear(o, c["w_o"], c["b_o"]), c["norm_w"], 1e-6, residual=h)
    got = attention_out(h, o, c["w_o"].clone(), c["b_o"], c["norm_w"], 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(IndexError, match="RoPE tables"):
        attention_in(c["h"], c["delta"], *args[:3], 1e-6, rot.cos, rot.sin_signed, torch.tensor([0, 1, 64]), H, Hkv)
