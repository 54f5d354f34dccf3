"""The model family: equivalences, masks, loop options, memory options, caches."""

import math

import pytest
import torch

from loopformer.errors import UserError
from loopformer.model import PRESETS, LoopedTransformer, ModelConfig, preset
from loopformer.model.options import LoopOptions


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=17, max_len=32, d_model=24, n_heads=3, n_layers=1, loops=4)
    base.update(kw)
    return ModelConfig(**base)


def ids(b=3, t=11, v=17, seed=0):
    return torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(seed))


def perturb(model, std=0.3):
    """Random non-zero weights everywhere (so gates/modulations are exercised)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std * (0.1 if p.dim() < 2 else 1.0))
    return model


@pytest.mark.parametrize("bias,causal", [(False, True), (True, False)])
def test_looped_block_equals_weight_tied_stack(bias, causal):
    looped = perturb(LoopedTransformer(tiny(loops=4, n_layers=1, bias=bias, causal=causal))).eval()
    stack = LoopedTransformer(tiny(loops=1, n_layers=4, bias=bias, causal=causal)).eval()
    sd = looped.state_dict()
    new = {}
    for k, _v in stack.state_dict().items():
        src = k
        if k.startswith("blocks."):
            src = "blocks.0." + k.split(".", 2)[2]
        new[k] = sd[src]
    stack.load_state_dict(new)
    x = ids()
    torch.testing.assert_close(looped(x).logits, stack(x).logits, rtol=1e-5, atol=1e-5)


def test_untrained_tmlt_block_is_identity_with_adaln_zero():
    model = LoopedTransformer(tiny(timestep=True, timestep_gate_init=0.0, loops=5)).eval()
    x = ids()
    out = model(x, return_all=True)
    e = model.embed(x)
    for t in range(5):
        torch.testing.assert_close(out.all_hidden[t], e, rtol=0, atol=0)
    # once the modulation is trained (non-zero), it is no longer the identity
    with torch.no_grad():
        model.blocks[0].modulation.bias.fill_(0.5)
    assert (model(x).hidden - e).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [True, False])
def test_tmlt_with_unit_gates_starts_as_the_looped_model(causal):
    tmlt = LoopedTransformer(tiny(timestep=True, timestep_gate_init=1.0, causal=causal, input_injection=True)).eval()
    looped = LoopedTransformer(tiny(causal=causal, input_injection=True)).eval()
    missing = looped.load_state_dict(tmlt.state_dict(), strict=False)
    assert not missing.missing_keys and all("modulation" in k or "timestep" in k for k in missing.unexpected_keys)
    gates, scales = tmlt.modulations(4, torch.device("cpu")).split(2, dim=2)
    assert (gates == 1).all() and (scales == 0).all()
    x = ids()
    torch.testing.assert_close(tmlt(x).logits, looped(x).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="timestep_gate_init"):
        tiny(timestep=True, timestep_gate_init=float("nan"))


def test_tmlt_modulation_depends_on_loop_index_and_extrapolates():
    model = perturb(LoopedTransformer(tiny(timestep=True, loops=4))).eval()
    mods = model.modulations(100, torch.device("cpu"))
    assert mods.shape == (100, 1, 4, 24)
    assert torch.isfinite(mods).all()
    assert (mods[0] - mods[1]).abs().max() > 1e-4
    out = model(ids(), loops=64)      # far beyond the configured 4 loops
    assert out.loops == 64 and torch.isfinite(out.logits).all()


@pytest.mark.parametrize("kw", [{}, {"timestep": True}, {"n_layers": 2, "loops": 1}, {"input_injection": True}])
def test_causal_outputs_ignore_later_tokens(kw):
    model = perturb(LoopedTransformer(tiny(**kw))).eval()
    x = ids()
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 17
    a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=1e-5, atol=1e-6)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4


def test_bidirectional_outputs_see_later_tokens():
    model = perturb(LoopedTransformer(tiny(causal=False))).eval()
    x = ids()
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 17
    assert (model(x).logits[:, 0] - model(y).logits[:, 0]).abs().max() > 1e-4


@pytest.mark.parametrize("causal,pos", [(True, "learned"), (False, "learned"), (True, "rope"), (False, "rope")])
def test_padding_does_not_change_unpadded_outputs(causal, pos):
    model = perturb(LoopedTransformer(tiny(causal=causal, timestep=True, input_injection=True, pos=pos))).eval()
    x = ids(b=1, t=8)
    ref = model(x).logits
    pad = 5
    xp = torch.cat([x, torch.zeros(1, pad, dtype=torch.long)], 1)   # right padding
    mask = torch.cat([torch.ones(1, 8, dtype=torch.bool), torch.zeros(1, pad, dtype=torch.bool)], 1)
    tol = 1e-5 if pos == "learned" else 1e-4    # rotations: a few more roundings in float32
    torch.testing.assert_close(model(xp, attn_mask=mask).logits[:, :8], ref, rtol=tol, atol=tol)
    if causal:  # left padding: positions restart at the first real token
        xl = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], 1)
        ml = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, 8, dtype=torch.bool)], 1)
        torch.testing.assert_close(model(xl, attn_mask=ml).logits[:, pad:], ref, rtol=tol, atol=tol)


def test_loop_override_and_every_loop_outputs():
    model = perturb(LoopedTransformer(tiny(timestep=True, input_injection=True))).eval()
    x = ids()
    full = model(x, loops=6, return_all=True)
    assert full.all_logits.shape == (6, 3, 11, 17) and full.all_hidden.shape == (6, 3, 11, 24)
    torch.testing.assert_close(full.all_logits[-1], full.logits)
    for r in (1, 3, 6):
        torch.testing.assert_close(model(x, loops=r).logits, full.all_logits[r - 1], rtol=1e-4, atol=1e-4)
    with pytest.raises(UserError):
        model(x, loops=0)


def test_halting_stops_early_and_reports_loops():
    model = LoopedTransformer(tiny(timestep=True, timestep_gate_init=0.0, loops=10)).eval()   # identity at init
    out = model(ids(), halt="latent:1e-6", opts=LoopOptions(per_token=False))
    assert out.loops == 2 and (out.exit_loops == 2).all()
    model2 = perturb(LoopedTransformer(tiny(loops=10))).eval()
    assert model2(ids(), halt="latent:1e-12", opts=LoopOptions(per_token=False)).loops == 10


def _loss_and_grads(model, x):
    model.zero_grad()
    loss = model(x).logits.square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_truncated_backprop_same_forward_and_no_gradient_from_early_loops():
    cfg = tiny(loops=5, timestep=True)
    full = perturb(LoopedTransformer(cfg))
    trunc = LoopedTransformer(cfg.replace(grad_loops=1))
    trunc.load_state_dict(full.state_dict())
    x = ids()
    torch.testing.assert_close(full(x).logits, trunc(x).logits)
    _, g_full = _loss_and_grads(full, x)
    _, g_trunc = _loss_and_grads(trunc, x)
    # no input injection: the embedding only enters loop 1, which runs without gradient
    assert "embed.tok.weight" in g_full and "embed.tok.weight" not in g_trunc
    # the block's gradient equals one differentiable loop from the detached state after loop 4
    with torch.no_grad():
        h4 = trunc(x, loops=4).hidden
    ref = LoopedTransformer(cfg)
    ref.load_state_dict(full.state_dict())
    ref.zero_grad()
    mods = ref.modulations(5, x.device)
    h5 = ref.block(h4, mods[4], None, None, 4)
    ref.head(ref.norm_f(h5)).square().mean().backward()
    for name in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight"):
        torch.testing.assert_close(g_trunc[name], dict(ref.named_parameters())[name].grad, rtol=1e-4, atol=1e-7)
    assert (g_trunc["blocks.0.attn.qkv.weight"] - g_full["blocks.0.attn.qkv.weight"]).abs().max() > 1e-6


def test_activation_checkpointing_same_loss_and_gradients():
    cfg = tiny(loops=4, timestep=True, input_injection=True)
    a = perturb(LoopedTransformer(cfg))
    b = LoopedTransformer(cfg.replace(checkpoint=True))
    b.load_state_dict(a.state_dict())
    x = ids()
    la, ga = _loss_and_grads(a, x)
    lb, gb = _loss_and_grads(b, x)
    torch.testing.assert_close(la, lb)
    assert ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kw", [{"loops": 3}, {"loops": 3, "timestep": True, "input_injection": True},
                                {"n_layers": 2, "loops": 1}, {"loops": 2, "n_layers": 2, "compat": "authors"},
                                {"loops": 3, "timestep": True, "pos": "rope"},
                                {"loops": 2, "n_layers": 2, "compat": "authors", "pos": "rope"},
                                {"loops": 3, "pos": "rope", "attn_window": 3}])
def test_cached_generation_equals_full_recompute(kw):
    model = perturb(LoopedTransformer(tiny(**kw))).eval()
    x = ids(b=2, t=12)
    full = model(x).logits
    cache = model.new_cache(2, 32)
    steps = [model(x[:, :5], cache=cache).logits]          # prompt
    for i in range(5, 12):                                  # then one token at a time
        steps.append(model(x[:, i:i + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    assert cache.length == 12 and cache.slots == model.config.loops * model.config.n_layers


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_cached_generation_with_left_padding(pos):
    model = perturb(LoopedTransformer(tiny(loops=3, timestep=True, pos=pos))).eval()
    a, b = ids(b=1, t=9, seed=1), ids(b=1, t=6, seed=2)
    x = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])       # [2, 9], row 2 left-padded
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    ext = torch.randint(0, 17, (2, 4))
    cache = model.new_cache(2, 32)
    got = [model(x, cache=cache, attn_mask=mask).logits[:, -1:]]
    m = mask
    for i in range(4):
        m = torch.cat([m, torch.ones(2, 1, dtype=torch.bool)], 1)
        got.append(model(ext[:, i:i + 1], cache=cache, attn_mask=m).logits)
    got = torch.cat(got, 1)
    for row, seq in ((0, a), (1, b)):
        full = model(torch.cat([seq, ext[row:row + 1]], 1)).logits[0, seq.shape[1] - 1:]
        torch.testing.assert_close(got[row], full, rtol=1e-5, atol=1e-5)


def test_cache_errors():
    model = LoopedTransformer(tiny(loops=3))
    cache = model.new_cache(1, 32)
    with pytest.raises(UserError):
        model(ids(b=1), loops=4, cache=cache)
    with pytest.raises(UserError):
        LoopedTransformer(tiny(causal=False)).new_cache(1)
    with pytest.raises(UserError, match="max_len"):
        model(ids(b=1, t=40))


def test_vector_input_and_heads():
    cfg = ModelConfig(input_dim=5, d_model=16, n_heads=2, loops=3, head="regression", max_len=20)
    model = LoopedTransformer(cfg)
    out = model(torch.randn(4, 10, 5), return_all=True)
    assert out.logits.shape == (4, 10, 1) and out.all_logits.shape == (3, 4, 10, 1)
    seq = LoopedTransformer(tiny(head="sequence", n_out=3, causal=False))
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[0, 6:] = False
    out = seq(ids(), attn_mask=mask, return_all=True)
    assert out.logits.shape == (3, 3) and out.all_logits.shape == (4, 3, 3)
    # mean pooling ignores padded positions
    alone = seq(ids()[:1, :6]).logits
    torch.testing.assert_close(out.logits[:1], alone, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_share_storage():
    model = LoopedTransformer(tiny(tie_embeddings=True))
    assert model.head.proj.weight.data_ptr() == model.embed.tok.weight.data_ptr()


@pytest.mark.parametrize("name", ["debug", "reasoning", "reasoning-tmlt", "icl"])
def test_presets_build_and_train_a_step(name):
    cfg = PRESETS[name]
    model = LoopedTransformer(cfg.replace(loops=2))
    x = torch.randint(0, cfg.vocab_size, (2, 8)) if cfg.vocab_size else torch.randn(2, 8, cfg.input_dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model(x).logits.square().mean()
    loss.backward()
    opt.step()
    changed = sum(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert changed > 0


def test_lm_presets_match_in_parameters():
    looped = LoopedTransformer(PRESETS["lm-looped"]).num_params()
    base = LoopedTransformer(PRESETS["lm-baseline"]).num_params()
    assert abs(looped - base) / base < 0.05   # App. C.3: the two are matched in size


def test_preset_unknown():
    with pytest.raises(UserError, match="unknown preset"):
        preset("nope")


def test_rope_depends_on_relative_positions_only():
    """Rotary positions: shifting every position by the same amount changes nothing, and q·k after rotation equals
    the rotation of q by the difference of the positions (by hand, one pair of dimensions)."""
    from loopformer.model.layers import rope_tables, rotate

    model = perturb(LoopedTransformer(tiny(loops=3, pos="rope", causal=False))).eval()
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
        shifted = model(x, positions=torch.arange(40, 51)[None].expand(3, -1)).logits
        torch.testing.assert_close(shifted, ref, rtol=1e-4, atol=1e-5)
        learned = LoopedTransformer(tiny(loops=3, causal=False)).eval()
        assert (learned(x, positions=torch.arange(5, 16)[None].expand(3, -1)).logits
                - learned(x).logits).abs().max() > 1e-4          # learned positions do change it
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    for a, b in ((3, 1), (10, 8), (5, 5)):
        qa = rotate(q, rope_tables(torch.tensor([[a]]), 8))
        kb = rotate(k, rope_tables(torch.tensor([[b]]), 8))
        qd = rotate(q, rope_tables(torch.tensor([[a - b]]), 8))
        torch.testing.assert_close((qa * kb).sum(), (qd * k).sum(), rtol=1e-5, atol=1e-5)
    theta = 10000 ** (-0 / 8)                                   # pair (0, 4) turns by p·θ_0 = p
    v = torch.zeros(1, 1, 1, 8)
    v[..., 0] = 1.0
    r = rotate(v, rope_tables(torch.tensor([[2]]), 8))
    torch.testing.assert_close(r[0, 0, 0, [0, 4]], torch.tensor([math.cos(2 * theta), math.sin(2 * theta)]))
    assert not model.config.indexed_positions and model(ids(t=60)).logits.shape[1] == 60   # past max_len = 32


@pytest.mark.parametrize("causal", [True, False])
def test_an_attention_window_limits_what_each_position_reads(causal):
    """With attn_window = w, a layer applied R times reads R·(w − 1) positions back (and, bidirectional, ahead):
    changing the token just outside that field leaves a position's output as it was, the one just inside changes it;
    a window covering the row is full attention."""
    w, R, i = 3, 2, 8
    model = perturb(LoopedTransformer(tiny(loops=R, pos="rope", attn_window=w, causal=causal))).eval()
    x = ids(b=1, t=16)
    with torch.no_grad():
        base = model(x).logits[0, i]
        for j, moves in [(i - R * (w - 1) - 1, False), (i - R * (w - 1), True),
                         (i + R * (w - 1) + 1, False), (i + R * (w - 1), not causal)]:
            y = x.clone()
            y[0, j] = (y[0, j] + 1) % 17
            assert (not torch.allclose(model(y).logits[0, i], base, atol=1e-6)) == moves, j
        wide = LoopedTransformer(tiny(loops=R, pos="rope", attn_window=16, causal=causal)).eval()
        wide.load_state_dict(model.state_dict())
        full = LoopedTransformer(tiny(loops=R, pos="rope", causal=causal)).eval()
        full.load_state_dict(model.state_dict())
        torch.testing.assert_close(wide(x).logits, full(x).logits, rtol=1e-5, atol=1e-5)


def test_a_negative_attention_window_is_refused():
    with pytest.raises(ValueError, match="attn_window"):
        tiny(attn_window=-1)
