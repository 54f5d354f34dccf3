"""Load an exact construction into the library's own model (`loopformer.model.LoopedTransformer`) in float64.

The mapping (paper Eq. 3: L2 ∘ TF^r ∘ L1):
    L1                 -> embed.read_in            (Linear input_dim → D)
    attention heads    -> blocks.0.attn.qkv / proj (head_dim = 1; q|k|v rows, head-major), bias 0
    FF (W1, b1, W2, b2)-> blocks.0.mlp.fc / proj   (activation "relu")
    L2                 -> head.proj                (regression head, n_out = output width)
with norm "none", no final norm, no positions, non-causal attention, no input injection, one layer per block.

Hardmax attention (Lemma A.6) is approximated by softmax with a large `attn_scale`; in float64 a scale of 1e4 on
score gaps ≥ 1 gives weights exp(−1e4) = 0 exactly, and exact ties (the idle zero state) give the uniform average
that the exact evaluator also uses.  Softmax constructions (Eq. 96) use attn_scale = λ.
Per-loop scaling η(t) (Theorem 4.2) is not a model field; `run_assembled` installs a forward hook on the MLP
that multiplies its output by η(t) in loop t (the TMLT gate γ2(t) plays this role in a trained model).

float64 suffices where every intermediate value stays well inside 2^53 relative precision: Lemmas A.5, A.6,
A.7, A.9/4.1 for up to ~40 bits, Theorem 4.2, and the composed Theorem A.1 network for δ^-1 = 2, N = 2, d = 1.
Beyond that the contextual ID state keeps growing like δ^-d per loop after Step 2 and the impulse cancellations
σ(a) − σ(b) lose the bits the construction needs (the bit complexity 2δ^-(N+1)d of Theorem 3.6).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import numpy as np
import torch

from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.theory.exact import LoopedNet

HARDMAX_SCALE = 1e4


def _t(rows, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor([[float(v) for v in r] for r in rows], dtype=dtype)


def model_config(net: LoopedNet, hardmax_scale: float = HARDMAX_SCALE):
    H = max(1, net.n_heads)
    blk = net.block
    scale = hardmax_scale if blk.attention == "hardmax" else float(blk.temperature)
    return ModelConfig(input_dim=net.l1.shape[1], d_model=net.width, n_heads=H, head_dim=1, ffn_dim=net.ff_width,
                       n_layers=1, loops=max(1, net.loops), activation="relu", norm="none", bias=True, causal=False,
                       pos="none", final_norm=False, attn_scale=scale, head="regression", n_out=net.l2.shape[0],
                       timestep=False, input_injection=False, dropout=0.0)


@torch.no_grad()
def assemble(net: LoopedNet, hardmax_scale: float = HARDMAX_SCALE):
    """A float64 `LoopedTransformer` holding the construction's weights (see the module docstring)."""
    cfg = model_config(net, hardmax_scale)
    model = LoopedTransformer(cfg).to(torch.float64).eval()
    sd = model.state_dict()
    D, H = net.width, max(1, net.n_heads)
    sd["embed.read_in.weight"].copy_(_t(net.l1.weight))
    sd["embed.read_in.bias"].copy_(torch.tensor([float(v) for v in net.l1.bias], dtype=torch.float64))
    qkv = torch.zeros(3 * H, D, dtype=torch.float64)
    proj = torch.zeros(D, H, dtype=torch.float64)
    for h, head in enumerate(net.block.heads):
        qkv[h] = torch.tensor([float(v) for v in head.wq])
        qkv[H + h] = torch.tensor([float(v) for v in head.wk])
        qkv[2 * H + h] = torch.tensor([float(v) for v in head.wv])
        proj[:, h] = torch.tensor([float(v) for v in head.wo])
    sd["blocks.0.attn.qkv.weight"].copy_(qkv)
    sd["blocks.0.attn.qkv.bias"].zero_()
    sd["blocks.0.attn.proj.weight"].copy_(proj)
    sd["blocks.0.attn.proj.bias"].zero_()
    ff = net.block.ff
    sd["blocks.0.mlp.fc.weight"].copy_(_t(ff.w1))
    sd["blocks.0.mlp.fc.bias"].copy_(torch.tensor([float(v) for v in ff.b1], dtype=torch.float64))
    sd["blocks.0.mlp.proj.weight"].copy_(_t(ff.w2))
    sd["blocks.0.mlp.proj.bias"].copy_(torch.tensor([float(v) for v in ff.b2], dtype=torch.float64))
    sd["head.proj.weight"].copy_(_t(net.l2.weight))
    sd["head.proj.bias"].copy_(torch.tensor([float(v) for v in net.l2.bias], dtype=torch.float64))
    model.load_state_dict(sd, strict=True)
    return model


@contextmanager
def per_loop_scaling(model, eta: Sequence | None):
    """FF(x) → η(t) ⊙ FF(x) in loop t (Sec. 4.1) via a forward hook on the (single) layer's MLP."""
    if eta is None:
        yield
        return
    table = torch.tensor([[float(v) for v in e] for e in eta], dtype=torch.float64)   # [R, D]
    state = {"t": 0}

    def hook(_mod, _inp, out):
        s = table[state["t"]].to(out.dtype)
        state["t"] += 1
        return out * s

    handle = model.blocks[0].mlp.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def run_assembled(model, net: LoopedNet, X: Sequence[Sequence[Sequence]]) -> np.ndarray:
    """Run the assembled model on a batch of sequences X [B][N][d_in]; returns [B, N, d_out] float64."""
    x = torch.tensor(np.asarray(X, dtype=np.float64))
    if net.loops == 0:
        raise ValueError("a zero-loop construction has no block to run")
    with per_loop_scaling(model, net.eta):
        out = model(x, loops=net.loops)
    return out.logits.numpy()
