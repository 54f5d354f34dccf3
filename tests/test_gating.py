"""The forget gate on the carried state (loopformer.model.gating) against the loop written out by hand."""

import math

import pytest
import torch

from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.model.layers import rms_norm


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=16, n_heads=2, loops=4, max_len=16, input_injection=True, causal=False)
    return ModelConfig(**{**base, **kw})


def _gated_by_hand(m, x, loops):
    """h_0 = e; loop t: o = TF(h_t (+ e for t > 0)), f = σ(w ⊙ RMSN(o) + b), h_{t+1} = f ⊙ h_t + o − h_t."""
    e = m.begin(x, loops, None, None, None).e
    h = e
    for t in range(loops):
        inp = h + e if t > 0 else h
        o = m.blocks[0](inp)
        f = torch.sigmoid(m.forget.weight * rms_norm(o, None, m.forget.eps) + m.forget.bias)
        h = f * h + o - h
    return h


def test_the_gated_loop_matches_hand_computation():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(forget_gate=True)).eval()
    with torch.no_grad():                              # a gate that has learned something: other f per channel
        m.forget.weight.normal_(0, 1.0)
        m.forget.bias.normal_(0, 1.0)
    x = torch.randint(0, 11, (3, 7))
    torch.testing.assert_close(m(x, return_all=True).hidden, _gated_by_hand(m, x, 4))
    torch.testing.assert_close(m(x, loops=9).hidden, _gated_by_hand(m, x, 9))


def test_an_open_gate_is_the_plain_loop_and_a_closed_one_overwrites():
    torch.manual_seed(0)
    plain = LoopedTransformer(_cfg())
    torch.manual_seed(0)
    open_ = LoopedTransformer(_cfg(forget_gate=True, forget_gate_bias=20.0))
    shared = {k: v for k, v in open_.state_dict().items() if not k.startswith("forget.")}
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in shared.items())   # the gate draws nothing
    assert set(plain.state_dict()) == set(shared)
    x = torch.randint(0, 11, (2, 6))
    torch.testing.assert_close(open_.eval()(x).hidden, plain.eval()(x).hidden, atol=1e-5, rtol=1e-5)  # σ(20) ≈ 1
    assert open_.forget.forget(torch.randn(3, 16)).min() > 1 - 1e-6
    closed = LoopedTransformer(_cfg(forget_gate=True, forget_gate_bias=-20.0)).eval()
    h_prev, o = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    torch.testing.assert_close(closed.forget(h_prev, o), o - h_prev, atol=1e-6, rtol=0)  # nothing carried over
    assert torch.sigmoid(torch.tensor(4.0)).item() == pytest.approx(0.982, abs=1e-3)     # the default start


def test_the_gate_learns_and_halting_runs_the_same_loop():
    torch.manual_seed(1)
    m = LoopedTransformer(_cfg(forget_gate=True)).train()
    x = torch.randint(0, 11, (4, 6))
    m(x).logits.pow(2).mean().backward()
    assert m.forget.weight.grad.abs().sum() > 0 and m.forget.bias.grad.abs().sum() > 0
    m.eval()
    with torch.no_grad():
        m.forget.weight.normal_(0, 1.0)
        fixed = m(x, loops=6).logits
        halted = m(x, loops=6, halt="kl:0").logits             # a rule that never stops early: all 6 loops
    torch.testing.assert_close(halted, fixed)


@pytest.mark.parametrize("bad, msg", [
    (dict(forget_gate=True, solver="anderson"), "forget_gate gates the unrolled loop"),
    (dict(forget_gate=True, forget_gate_bias=math.inf), "forget_gate_bias must lie in"),
])
def test_bad_gate_settings_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**bad)
