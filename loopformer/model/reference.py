"""A plain re-statement of the published looped-GPT forwards (a nanoGPT fork), written directly from their
definition, on their own parameter layout. Used to check the checkpoint converter and as the speed baseline.

Per loop, timestep-modulated (`tmlt`):
    TE = MLP(PE(t)) recomputed for every loop and batch element;  [g_a, g_m, s_a, s_m] = W·SiLU(TE) + b
    x += g_a ⊙ attn(norm1(x)·(1 + s_a));   x += g_m ⊙ mlp(norm2(x)·(1 + s_m))
Per loop, plain looped (`lt`), with its quirk:
    x += attn(q = norm1(x), k = norm1(x), v = x);   x += mlp(x)
then ln_f (RMSNorm with gain) and the tied lm_head.  norm1 / norm2 are RMSNorms without gain.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _attn(sd: dict, pre: str, xq: torch.Tensor, xv: torch.Tensor, n_head: int, dropout: float = 0.0,
          training: bool = False) -> torch.Tensor:
    B, T, C = xq.shape

    def lin(name, x):
        return F.linear(x, sd[f"{pre}{name}.weight"], sd.get(f"{pre}{name}.bias"))

    q, k, v = lin("q", xq), lin("k", xq), lin("v", xv)
    q, k, v = (z.view(B, T, n_head, C // n_head).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout if training else 0.0)
    return lin("c_proj", y.transpose(1, 2).contiguous().view(B, T, C))


def _mlp(sd: dict, pre: str, x: torch.Tensor) -> torch.Tensor:
    h = F.gelu(F.linear(x, sd[f"{pre}c_fc.weight"], sd.get(f"{pre}c_fc.bias")))
    return F.linear(h, sd[f"{pre}c_proj.weight"], sd.get(f"{pre}c_proj.bias"))


def _timestep_features(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32) / half).to(t.device)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def authors_forward(sd: dict, idx: torch.Tensor, model_type: str, n_loop: int, n_head: int) -> torch.Tensor:
    """Logits [B,T,V] at every position for the state dict `sd` in the authors' key layout."""
    b, t = idx.shape
    eps = None
    x = F.embedding(idx, sd["transformer.wte.weight"]) + F.embedding(
        torch.arange(t, device=idx.device), sd["transformer.wpe.weight"])
    C = x.shape[-1]
    for i in range(n_loop):
        if model_type == "tmlt":
            pe = _timestep_features(torch.full((b,), i, dtype=torch.long, device=idx.device))
            te = F.linear(pe, sd["timestep_embedder.mlp.0.weight"], sd["timestep_embedder.mlp.0.bias"])
            te = F.linear(F.silu(te), sd["timestep_embedder.mlp.2.weight"], sd["timestep_embedder.mlp.2.bias"])
            mod = F.linear(F.silu(te), sd["adaLN_modulation.1.weight"], sd["adaLN_modulation.1.bias"])
            g_a, g_m, s_a, s_m = (m.unsqueeze(1) for m in mod.chunk(4, dim=-1))
            h = F.rms_norm(x, (C,), None, eps) * (1 + s_a)
            x = x + g_a * _attn(sd, "transformer.attn.", h, h, n_head)
            h = F.rms_norm(x, (C,), None, eps) * (1 + s_m)
            x = x + g_m * _mlp(sd, "transformer.mlp.", h)
        elif model_type == "lt":
            h = F.rms_norm(x, (C,), None, eps)
            x = x + _attn(sd, "transformer.attn.", h, x, n_head)
            x = x + _mlp(sd, "transformer.mlp.", x)
        else:
            raise ValueError(f"unknown model_type {model_type!r}")
    x = F.rms_norm(x, (C,), sd["transformer.ln_f.weight"], eps)
    return F.linear(x, sd["lm_head.weight"])


def random_authors_state_dict(model_type: str, vocab_size: int, block_size: int, n_embd: int,
                              seed: int = 0, bias: bool = False) -> dict[str, torch.Tensor]:
    """A randomly initialised state dict in the authors' key layout (for tests and benchmarks).

    Modulation weights are random (not zero) so that a test exercises every term."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    C = n_embd
    sd = {"transformer.wte.weight": rnd(vocab_size, C), "transformer.wpe.weight": rnd(block_size, C)}
    for n in ("q", "k", "v", "c_proj"):
        sd[f"transformer.attn.{n}.weight"] = rnd(C, C)
    sd["transformer.mlp.c_fc.weight"] = rnd(4 * C, C)
    sd["transformer.mlp.c_proj.weight"] = rnd(C, 4 * C)
    if bias:
        for n in ("q", "k", "v", "c_proj"):
            sd[f"transformer.attn.{n}.bias"] = rnd(C)
        sd["transformer.mlp.c_fc.bias"] = rnd(4 * C)
        sd["transformer.mlp.c_proj.bias"] = rnd(C)
    sd["transformer.ln_f.weight"] = 1 + rnd(C, std=0.1)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    if model_type == "tmlt":
        sd["timestep_embedder.mlp.0.weight"] = rnd(C, 256)
        sd["timestep_embedder.mlp.0.bias"] = rnd(C)
        sd["timestep_embedder.mlp.2.weight"] = rnd(C, C)
        sd["timestep_embedder.mlp.2.bias"] = rnd(C)
        sd["adaLN_modulation.1.weight"] = rnd(4 * C, C, std=0.2)
        sd["adaLN_modulation.1.bias"] = rnd(4 * C, std=0.2)
    return sd
