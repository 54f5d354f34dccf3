"""Stabilisers of deep loops (loopformer.model.stability) against hand computations."""

import math

import pytest
import torch

from loopformer.model import LoopedTransformer, LoopOptions, ModelConfig
from loopformer.model.layers import rms_norm
from loopformer.model.stability import branch_constant, rms


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=16, n_heads=2, loops=4, max_len=16, input_injection=True, causal=False)
    return ModelConfig(**{**base, **kw})


def _layer_by_hand(blk, x, c=1.0, sandwich=False, gate=None):
    """X' = X + γ1·c·N(Attn(RMSN(X))), X'' = X' + γ2·c·N(FF(RMSN(X'))) with N the sandwich norm (or identity)."""
    post_a = (lambda z: rms_norm(z, blk.post_attn.norm.weight, blk.post_attn.norm.eps)) if sandwich else (lambda z: z)
    post_f = (lambda z: rms_norm(z, blk.post_mlp.norm.weight, blk.post_mlp.norm.eps)) if sandwich else (lambda z: z)
    g1, g2 = (1.0, 1.0) if gate is None else gate
    a = blk.attn(blk.norm1(x))
    x1 = x + g1 * c * post_a(a)
    return x1 + g2 * c * post_f(blk.mlp(blk.norm2(x1)))


@pytest.mark.parametrize("scale", ["rsqrt", "inv"])
def test_constant_branch_scale_matches_hand_computation(scale):
    m = LoopedTransformer(_cfg(loop_scale=scale, loops=9)).eval()
    c = {"rsqrt": 1 / 3, "inv": 1 / 9}[scale]
    assert branch_constant(scale, 9) == pytest.approx(c)
    x = torch.randn(3, 7, 16)
    blk = m.blocks[0]
    torch.testing.assert_close(blk(x), _layer_by_hand(blk, x, c=c))


def test_sandwich_norm_matches_hand_computation_and_bounds_updates():
    m = LoopedTransformer(_cfg(sandwich_norm=True)).eval()
    blk = m.blocks[0]
    with torch.no_grad():   # gains away from 1, so the test sees them applied
        blk.post_attn.norm.weight.uniform_(0.5, 1.5)
        blk.post_mlp.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 16) * 50
    torch.testing.assert_close(blk(x), _layer_by_hand(blk, x, sandwich=True))
    # the attention update after the sandwich norm has RMS = the gains' RMS, whatever the input's scale
    with torch.no_grad():
        a = blk.post_attn(blk.attn(blk.norm1(x)))
    w = blk.post_attn.norm.weight.detach()
    assert float(rms(a).max()) <= float(w.abs().max()) + 1e-4


def test_layerscale_starts_small_learns_and_keeps_the_other_weights():
    base = LoopedTransformer(_cfg())
    torch.manual_seed(0)
    plain = LoopedTransformer(_cfg())
    torch.manual_seed(0)
    ls = LoopedTransformer(_cfg(loop_scale="layerscale", layerscale_init=0.05))
    blk = ls.blocks[0]
    assert torch.equal(blk.post_attn.gain, torch.full((16,), 0.05))
    assert blk.post_attn.gain.requires_grad and blk.post_attn.norm is None
    # drawing no random numbers: every common weight equals the plain model's of the same seed
    sp, sl = plain.state_dict(), ls.state_dict()
    assert all(torch.equal(sp[k], sl[k]) for k in sp)
    assert set(sl) - set(sp) == {"blocks.0.post_attn.gain", "blocks.0.post_mlp.gain"}
    assert set(base.state_dict()) == set(sp)      # off by default: the checkpoint layout of earlier versions
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        blk.post_attn.gain.uniform_(0.0, 0.2)
        blk.post_mlp.gain.uniform_(0.0, 0.2)
    a = blk.attn(blk.norm1(x))
    x1 = x + blk.post_attn.gain * a
    want = x1 + blk.post_mlp.gain * blk.mlp(blk.norm2(x1))
    torch.testing.assert_close(blk(x), want)


def test_stabilisers_compose_with_timestep_gates():
    m = LoopedTransformer(_cfg(timestep=True, loop_scale="rsqrt", sandwich_norm=True, timestep_gate_init=0.5)).eval()
    blk = m.blocks[0]
    mods = m.modulations(4, torch.device("cpu"))           # [R,k,4,D]: gates 0.5, scales α = 1 at init
    x = torch.randn(2, 5, 16)
    got = blk(x, mods[2, 0])
    torch.testing.assert_close(got, _layer_by_hand(blk, x, c=0.5, sandwich=True, gate=(0.5, 0.5)))


def test_defaults_are_the_plain_model():
    """All stabilisers off: no extra weights, the same outputs as before (the plain residual layer)."""
    m = LoopedTransformer(_cfg()).eval()
    blk = m.blocks[0]
    assert blk.post_attn is None and blk.post_mlp is None
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(blk(x), _layer_by_hand(blk, x))


@pytest.mark.parametrize("bad, msg", [
    (dict(start_state="random"), "start_state must be one of"),
    (dict(loop_scale="half"), "loop_scale must be one of"),
    (dict(start_state="noise", input_injection=False), "needs input_injection=true"),
    (dict(state_noise=-0.1), "state_noise must lie in"),
    (dict(start_noise=math.nan), "start_noise must lie in"),
    (dict(layerscale_init=0.0), "layerscale_init must lie in"),
    (dict(sandwich_norm=True, compat="authors"), "compat=authors"),
    (dict(grad_window=0), "grad_window must be >= 1"),
    (dict(grad_window=2, solver="anderson"), "grad_window applies to the unrolled loop"),
])
def test_bad_stabiliser_values_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**bad)


def test_bad_stabiliser_override_is_one_line(tmp_path):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "loopformer.cli", "train", "configs/cpu/pointer.yaml",
                        "model.loop_scale=half", f"out_dir={tmp_path / 'r'}"], capture_output=True, text=True)
    assert p.returncode == 2
    assert "loop_scale must be one of" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r").exists()


def test_stablemax_cross_entropy_against_hand_computation():
    from loopformer.tasks import IGNORE
    from loopformer.train.losses import loss_sum, stablemax_cross_entropy
    logits = torch.tensor([[2.0, -1.0, 0.0], [-3.0, 0.5, -0.5], [1.0, 1.0, 1.0]])
    targets = torch.tensor([0, 2, IGNORE])
    s = lambda v: v + 1 if v >= 0 else 1 / (1 - v)                         # noqa: E731
    want = -math.log(s(2.0) / (s(2.0) + s(-1.0) + s(0.0))) - math.log(s(-0.5) / (s(-3.0) + s(0.5) + s(-0.5)))
    assert float(stablemax_cross_entropy(logits, targets)) == pytest.approx(want, rel=1e-6)
    # through the training loss's layout: [R,B,T,C] read-outs, [B,T] targets; gradients finite at huge logits
    big = (torch.randn(2, 3, 4, 5) * 1e4).requires_grad_()
    y = torch.randint(0, 5, (3, 4))
    loss = loss_sum(big, y, kind="stablemax")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(big.grad).all()
    manual = stablemax_cross_entropy(big.detach().reshape(-1, 5), y.expand(2, 3, 4).reshape(-1))
    torch.testing.assert_close(loss.detach(), manual)


def _by_hand_loops(m, x, loops, h0=None, noise=None):
    """The loop written out: h_0 (default e, else h0 + e injected), h_t = TF(h_{t-1} (+ e)) (+ noise[t])."""
    e = m.embed(x)
    h = e if h0 is None else h0 + e
    for t in range(loops):
        if t > 0:
            h = h + e
        h = m.blocks[0](h)
        if noise is not None:
            h = h + noise[t] * rms(h)
    return h


def test_noise_start_and_state_noise_against_hand_computation():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(start_state="noise", start_noise=0.5, state_noise=0.1, loops=3))
    x = torch.randint(0, 11, (2, 6))
    m.train()
    torch.manual_seed(7)
    got = m(x).hidden
    torch.manual_seed(7)
    e = m.embed(x)
    h0 = torch.randn_like(e) * (0.5 * rms(e))
    noise = [torch.randn_like(e) * 0.1 for _ in range(3)]   # drawn in the loop's order after the start
    torch.testing.assert_close(got, _by_hand_loops(m, x, 3, h0=h0, noise=noise))
    # evaluation: no noise, the start at its mean (0): exactly the plain model with the same weights
    m.eval()
    torch.manual_seed(0)
    plain = LoopedTransformer(_cfg(loops=3)).eval()
    plain.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x).hidden, plain(x).hidden)
    torch.testing.assert_close(m(x).hidden, _by_hand_loops(m, x, 3))


def _per_loop_grads(m, x, window_at=()):
    """d(Σ_t loss_t)/d(block weights) with loss_t = mean of loop t's read-out squared, the loop written out by hand
    and the carried state detached before the loops in `window_at` (0-based)."""
    m.zero_grad()
    e = m.embed(x)
    h, loss = e, 0.0
    for t in range(4):
        if t in window_at:
            h = h.detach()
        if t > 0:
            h = h + e
        h = m.blocks[0](h)
        loss = loss + m.head(m.norm_f(h)).pow(2).mean()
    loss.backward()
    return [p.grad.clone() for p in m.blocks.parameters()]


def test_grad_window_against_hand_computation():
    """grad_window = k: the same forward, and the gradient of every loop's loss cut where a window starts (loops
    k, 2k, ...), as the loop written out with those detaches; k >= r is the full gradient; evaluation unchanged."""
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(grad_window=2)).train()
    plain = LoopedTransformer(_cfg()).train()
    plain.load_state_dict(m.state_dict())
    x = torch.randint(0, 11, (2, 6))

    def model_grads(net):
        net.zero_grad()
        out = net(x, return_all=True)
        out.all_logits.pow(2).mean(dim=(1, 2, 3)).sum().backward()
        return [p.grad.clone() for p in net.blocks.parameters()]

    torch.testing.assert_close(m(x).hidden, plain(x).hidden)                     # the forward is unchanged
    windowed, full = model_grads(m), model_grads(plain)
    for got, want in zip(windowed, _per_loop_grads(m, x, window_at=(2,))):
        torch.testing.assert_close(got, want)
    for got, want in zip(full, _per_loop_grads(plain, x)):
        torch.testing.assert_close(got, want)
    assert any(not torch.allclose(a, b) for a, b in zip(windowed, full))         # the window does cut something
    wide = LoopedTransformer(_cfg(grad_window=4)).train()
    wide.load_state_dict(m.state_dict())
    for got, want in zip(model_grads(wide), full):
        torch.testing.assert_close(got, want)
    # in evaluation mode (e.g. the Jacobian of the drift diagnostics) the loop's gradient is whole
    m.eval()
    h = m.embed(x).detach().requires_grad_()
    m(x, opts=LoopOptions(state=h)).hidden.sum().backward()
    plain.eval()
    h2 = h.detach().clone().requires_grad_()
    plain(x, opts=LoopOptions(state=h2)).hidden.sum().backward()
    torch.testing.assert_close(h.grad, h2.grad)


def test_zeros_start_is_the_input_start_with_injection():
    torch.manual_seed(0)
    z = LoopedTransformer(_cfg(start_state="zeros")).train()
    torch.manual_seed(0)
    p = LoopedTransformer(_cfg()).train()
    x = torch.randint(0, 11, (2, 6))
    torch.testing.assert_close(z(x).hidden, p(x).hidden)


def test_stabilised_model_trains_and_resumes_through_the_trainer(tmp_path):
    """A tiny run with every stabiliser and the stablemax loss: finite loss, checkpoint round trip."""
    from loopformer.model.io import load
    from loopformer.train.config import load_run_config
    from loopformer.train.trainer import train
    ov = ["task.name=pointer_chase", "task.options={symbols: 6, hops: 2}", "task.n_train=64", "task.n_test=16",
          "model.d_model=16", "model.n_heads=2", "model.loops=3", "model.input_injection=true",
          "model.start_state=noise", "model.state_noise=0.05", "model.loop_scale=layerscale",
          "model.sandwich_norm=true", "model.grad_window=2", "train.loss=stablemax", "train.jacobian=0.1",
          "train.steps=4",
          "train.batch_size=8", "train.compile=false", "log.tensorboard=false", "log.progress=false",
          f"out_dir={tmp_path / 'r'}"]
    res = train(load_run_config(None, ov))
    assert 0 <= res["test"]["accuracy"] <= 1
    m = load(tmp_path / "r")
    assert m.config.loop_scale == "layerscale" and m.config.sandwich_norm
    assert not torch.equal(m.blocks[0].post_attn.gain, torch.full((16,), 0.1))   # trained


def test_jacobian_penalty_against_the_exact_jacobian():
    """jacobian_loss is ||εᵀJ||²/||ε||² with J the exact Jacobian of one more loop at the final state (checked with
    torch.autograd.functional.jacobian and the same probe), its mean over probes ||J||_F²/(T·D), and it trains the
    weights (a gradient reaches the block)."""
    from loopformer.train.losses import jacobian_loss

    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(loops=3)).train()
    x = torch.randint(0, 11, (1, 5))
    h = m(x).hidden.detach()                                                      # [1,5,16]
    step = lambda s: m(x, loops=1, opts=LoopOptions(state=s.view(1, 5, 16), loop_offset=3, budget=3)).hidden
    J = torch.autograd.functional.jacobian(lambda s: step(s).flatten(), h.flatten())   # [80,80]
    torch.manual_seed(5)
    got = jacobian_loss(m, x, h, 3)
    torch.manual_seed(5)
    eps = torch.randn(80)
    torch.testing.assert_close(got, (eps @ J).square().sum() / eps.square().sum())
    fro = J.square().sum() / 80                                                   # the mean squared singular value
    est = torch.stack([jacobian_loss(m, x, h, 3).detach() for _ in range(400)]).mean()
    assert abs(float(est) / float(fro) - 1) < 0.15
    m.zero_grad()
    jacobian_loss(m, x, h, 3).backward()
    assert m.blocks[0].mlp.fc.weight.grad.abs().sum() > 0                        # the penalty trains the block
