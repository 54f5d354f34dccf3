"""The start state and state noise (loopformer.model.stability) and the stablemax loss against hand computations."""

import math

import pytest
import torch

from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.model.stability import rms


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=16, n_heads=2, loops=4, max_len=16, input_injection=True, causal=False)
    return ModelConfig(**{**base, **kw})


def test_defaults_are_the_plain_model():
    """No extension: no branch-output modules, and the layer is the plain residual layer."""
    m = LoopedTransformer(_cfg()).eval()
    blk = m.blocks[0]
    assert blk.post_attn is None and blk.post_mlp is None and len(m.extensions) == 0
    x = torch.randn(2, 5, 16)
    want = x + blk.attn(blk.norm1(x))
    torch.testing.assert_close(blk(x), want + blk.mlp(blk.norm2(want)))


@pytest.mark.parametrize("bad, msg", [
    (dict(start_state="random"), "start_state must be one of"),
    (dict(start_state="zeros", input_injection=False), "needs input_injection=true"),
    (dict(state_noise=-0.1), "state_noise must lie in"),
    (dict(state_noise=math.nan), "state_noise must lie in"),
])
def test_bad_stabiliser_values_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**bad)


def test_bad_stabiliser_override_is_one_line(tmp_path):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "loopformer.cli", "train", "configs/cpu/pointer.yaml",
                        "model.start_state=half", f"out_dir={tmp_path / 'r'}"], capture_output=True, text=True)
    assert p.returncode == 2
    assert "start_state must be one of" in p.stderr and "Traceback" not in p.stderr
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


def test_state_noise_against_hand_computation():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(state_noise=0.1, loops=3))
    x = torch.randint(0, 11, (2, 6))
    m.train()
    torch.manual_seed(7)
    got = m(x).hidden
    torch.manual_seed(7)
    e = m.embed(x)
    noise = [torch.randn_like(e) * 0.1 for _ in range(3)]   # drawn in the loop's order
    torch.testing.assert_close(got, _by_hand_loops(m, x, 3, noise=noise))
    # evaluation: no noise, exactly the plain model with the same weights
    m.eval()
    plain = LoopedTransformer(_cfg(loops=3)).eval()
    plain.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x).hidden, plain(x).hidden)
    torch.testing.assert_close(m(x).hidden, _by_hand_loops(m, x, 3))


def test_zeros_start_is_the_input_start_with_injection():
    torch.manual_seed(0)
    z = LoopedTransformer(_cfg(start_state="zeros")).train()
    torch.manual_seed(0)
    p = LoopedTransformer(_cfg()).train()
    x = torch.randint(0, 11, (2, 6))
    torch.testing.assert_close(z(x).hidden, p(x).hidden)


def test_stabilised_model_trains_and_resumes_through_the_trainer(tmp_path):
    """A tiny run with the zeros start, state noise and the stablemax loss: finite loss, checkpoint round trip."""
    from loopformer.model.io import load
    from loopformer.train.config import load_run_config
    from loopformer.train.trainer import train
    ov = ["task.name=pointer_chase", "task.options={symbols: 6, hops: 2}", "task.n_train=64", "task.n_test=16",
          "model.d_model=16", "model.n_heads=2", "model.loops=3", "model.input_injection=true",
          "model.start_state=zeros", "model.state_noise=0.05", "train.losses.kind=stablemax",
          "train.steps=4",
          "train.batch_size=8", "train.system.compile=false", "log.tensorboard=false", "log.progress=false",
          f"out_dir={tmp_path / 'r'}"]
    res = train(load_run_config(None, ov))
    assert 0 <= res["test"]["accuracy"] <= 1
    m = load(tmp_path / "r")
    assert m.config.start_state == "zeros" and m.config.state_noise == 0.05
