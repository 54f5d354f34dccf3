"""Timestep-encoding options of the TMLT: the learned per-loop embedding and the scaled sinusoid, against direct
computations; the paper's parametrisation (the default) unchanged."""

from __future__ import annotations

import pytest
import torch

from loopformer.model import LoopedTransformer
from loopformer.model.config import ModelConfig
from loopformer.model.layers import timestep_features


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=9, max_len=8, d_model=16, n_heads=2, loops=4, timestep=True,
                       timestep_gate_init=1.0, **kw)


def test_default_is_the_paper_sinusoid():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg())
    assert m.timestep.table is None and set(k for k in m.state_dict() if k.startswith("timestep")) == {
        "timestep.mlp.0.weight", "timestep.mlp.0.bias", "timestep.mlp.2.weight", "timestep.mlp.2.bias"}
    t = torch.arange(6)
    with torch.no_grad():
        ref = m.timestep.mlp(timestep_features(t, 256, 10000.0))
        assert torch.equal(m.timestep(t), ref)


def test_scaled_sinusoid_reads_scaled_index():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(timestep_scale=8.0))
    t = torch.arange(5)
    with torch.no_grad():
        assert torch.allclose(m.timestep(t), m.timestep.mlp(timestep_features(8.0 * t.float(), 256)), atol=1e-6)


def test_learned_embedding_per_loop_clamps_past_trained_loops():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(timestep_embed="learned", timestep_freq_dim=8))
    assert m.timestep.table.weight.shape == (4, 8)
    assert 0.5 < float(m.timestep.table.weight.std()) < 2.0          # initialised at the sinusoid's scale
    with torch.no_grad():
        te = m.timestep(torch.arange(7))
        assert torch.allclose(te[4], te[3], atol=1e-6) and torch.allclose(te[6], te[3], atol=1e-6)  # past r: last
        assert not torch.equal(te[0], te[1])
        x = torch.randint(0, 9, (2, 5))
        out = m(x, loops=8, return_all=True)                             # runs past the trained loops
        assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("field,value", [("timestep_embed", "table"), ("timestep_scale", 0.0),
                                         ("timestep_scale", float("nan"))])
def test_bad_timestep_options(field, value):
    with pytest.raises(ValueError, match=field):
        _cfg(**{field: value})


def test_same_seed_tmlt_shares_the_looped_models_weights():
    """Paired initialisation: a TMLT model and a looped model of one seed differ only by the timestep parameters,
    so with the gates at 1 the untrained TMLT computes exactly what the untrained looped model computes."""
    base = dict(vocab_size=9, max_len=8, d_model=16, n_heads=2, loops=4, input_injection=True)
    torch.manual_seed(3)
    looped = LoopedTransformer(ModelConfig(**base))
    torch.manual_seed(3)
    tmlt = LoopedTransformer(ModelConfig(**base, timestep=True, timestep_gate_init=1.0))
    lsd, tsd = looped.state_dict(), tmlt.state_dict()
    assert set(lsd) < set(tsd)
    assert all(torch.equal(lsd[k], tsd[k]) for k in lsd)
    x = torch.randint(0, 9, (3, 6))
    with torch.no_grad():
        assert torch.allclose(looped(x).logits, tmlt(x).logits, atol=1e-6)


def test_looped_initialisation_is_unchanged():
    """The looped model's initial weights are the plain sequence: modules built, then every parameter drawn in
    order from the global RNG (GPT-2 init) — pinned by redrawing them by hand."""
    cfg = ModelConfig(vocab_size=9, max_len=8, d_model=16, n_heads=2, loops=4, init_std=0.1)
    torch.manual_seed(5)
    model = LoopedTransformer(cfg)
    torch.manual_seed(5)
    ref = LoopedTransformer.__new__(LoopedTransformer)
    torch.nn.Module.__init__(ref)
    from loopformer.model.heads import Embed, Head
    from loopformer.model.layers import Layer, RMSNorm

    Embed(cfg), Layer(cfg), RMSNorm(16), Head(cfg)          # what building the modules draws
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            expect = torch.zeros_like(p)
        elif p.dim() >= 2:
            s = 0.1 / 2 ** 0.5 if name.endswith("proj.weight") and "blocks" in name else 0.1
            expect = torch.empty_like(p).normal_(0.0, s)
        else:
            expect = torch.ones_like(p)
        assert torch.equal(p.detach(), expect), name


def test_converted_checkpoints_record_the_papers_parametrisation():
    from loopformer.model.convert import config_from_args

    args = {"n_loop": 4, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 9}
    cfg = config_from_args(args, "tmlt")
    assert cfg.timestep and cfg.timestep_gate_init == 0.0 and cfg.compat == "authors"
    assert ModelConfig(vocab_size=9).timestep_gate_init == 1.0           # the library's default recipe
