"""Compute per answer (`loopformer.model.flops`): the closed form against a count by hand for a tiny config and
against the FLOPs `torch.utils.flop_counter` measures on a forward pass of small models."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.model.flops import TERMS, flop_terms, format_flops, forward_flops, layer_applications
from loopformer.model.recursion import supervision_steps

MEASURED_TOLERANCE = 0.01   # the closed form against the counted matmuls of one forward pass: within 1 %


def test_hand_count_of_a_tiny_config():
    """D = 8, two heads of 4 (I = 8), MLP 32, vocabulary 10, T = 4 tokens, one layer looped r = 3 times."""
    cfg = ModelConfig(vocab_size=10, max_len=4, d_model=8, n_heads=2, n_layers=1, loops=3)
    terms = flop_terms(cfg)
    assert set(terms) == set(TERMS)
    assert terms["attention projections"] == 3 * 2 * 4 * (3 * 8 * 8 + 8 * 8) == 6144   # r · 2·T·(3·D·I + I·D)
    assert terms["attention scores/values"] == 3 * 4 * 4 * 4 * 8 == 1536               # r · 4·T²·I
    assert terms["MLP"] == 3 * 4 * 4 * 8 * 32 == 12288                                 # r · 4·T·D·F
    assert terms["read-in"] == 0                                                        # token ids: a lookup
    assert terms["read-out"] == 2 * 4 * 8 * 10 == 640                                   # 2·T·D·C
    assert terms["timestep"] == 0
    assert forward_flops(cfg) == 20608
    assert forward_flops(cfg, seq_len=2) < forward_flops(cfg)
    # TMLT with 4 sinusoid features: per loop TE(t) 2·(P·D + D²) = 192 and the layer's W5 2·D·4D = 512
    tmlt = cfg.replace(timestep=True, timestep_freq_dim=4)
    assert flop_terms(tmlt)["timestep"] == 3 * (2 * (4 * 8 + 8 * 8) + 8 * 8 * 8) == 2112
    assert forward_flops(tmlt) == 20608 + 2112


@pytest.mark.parametrize("cfg,expect", [
    (ModelConfig(vocab_size=10, max_len=8, n_layers=4, loops=1), 4),                       # standard: L · 1
    (ModelConfig(vocab_size=10, max_len=8, n_layers=1, loops=8), 8),                       # looped: k · r
    (ModelConfig(vocab_size=10, max_len=8, n_layers=2, loops=4, supervision_steps=3), 24),  # k · r · N
])
def test_layer_applications(cfg, expect):
    assert layer_applications(cfg) == expect


SMALL = dict(vocab_size=11, max_len=7, d_model=16, n_heads=2)


@pytest.mark.parametrize("kw", [
    dict(SMALL, loops=3),                                                                   # looped
    dict(SMALL, n_layers=3, loops=1, bias=True),                                            # standard, biases
    dict(SMALL, n_layers=2, loops=3, timestep=True, exit_gate=True),                        # TMLT, exit gate
    dict(SMALL, loops=3, timestep=True, timestep_embed="learned", compat="authors"),
    dict(input_dim=5, max_len=9, d_model=16, n_heads=4, loops=2, head="regression", causal=False,
         timestep=True, timestep_time="normalized"),                                        # vectors, TE + step TE
    dict(SMALL, loops=2, head="sequence", n_out=3, head_dim=6, ffn_dim=24, input_injection=True,
         supervision_steps=2),                                                              # pooled, N steps
], ids=["looped", "standard", "tmlt-exit-gate", "authors-learned-te", "icl-normalized", "sequence-steps"])
def test_against_measured_flops(kw):
    """One sequence through the model (its supervision steps in turn), the matmuls counted by FlopCounterMode. The
    attention runs as matmuls (the math backend): the fused CPU kernel is not in the counter's table."""
    cfg = ModelConfig(**kw)
    model = LoopedTransformer(cfg).eval()
    T = cfg.max_len
    x = torch.randint(0, cfg.vocab_size, (1, T)) if cfg.vocab_size else torch.randn(1, T, cfg.input_dim)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        for _ in supervision_steps(model, x, cfg.supervision_steps):
            pass
    measured = counter.get_total_flops()
    assert measured > 0
    assert forward_flops(cfg, T) == pytest.approx(measured, rel=MEASURED_TOLERANCE)


def test_format_flops():
    assert format_flops(20608) == "20.6 kFLOPs"
    assert format_flops(13_200_000) == "13.2 MFLOPs"
    assert format_flops(4.2e9) == "4.2 GFLOPs"
    assert format_flops(512) == "512 FLOPs"
