"""Building blocks of the looped block: RMSNorm, attention (with a per-loop key/value cache), MLP, and the
timestep embedding/modulation of the Timestep-Modulated Looped Transformer (paper Sec. 4.2).

Shapes: B batch, T query length, S key length (cache + new), D model width, H heads, Dh head width, R loops.

TMLT (Eq. 12-15):  PE(t) sinusoidal -> TE(t) = W3·SiLU(W4·PE(t) + b4) + b3
                   [γ1, γ2, s1, s2] = W5·SiLU(TE(t)) + b5,  α_i = 1 + s_i
                   X' = X + γ1 ⊙ Attn(α1 ⊙ RMSN(X)),  TF(X, t) = X' + γ2 ⊙ FF(α2 ⊙ RMSN(X'))
W5 starts at zero and b5 at [γ0, γ0, 0, 0] with γ0 = `timestep_gate_init`: with the default γ0 = 1 the untrained
TMLT block is the untrained looped block; γ0 = 0 is the paper's adaLN-Zero (the untrained block is the identity).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from loopformer.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: Optional[float]) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RMSNorm(nn.Module):
    """x / RMS(x), with an optional learnable gain (the authors' block norms have none)."""

    def __init__(self, dim: int, gain: bool = True, eps: Optional[float] = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def make_norm(cfg: ModelConfig, gain: Optional[bool] = None) -> nn.Module:
    if cfg.norm == "none":
        return nn.Identity()
    return RMSNorm(cfg.d_model, cfg.norm_gain if gain is None else gain, cfg.norm_eps)


_ACT = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn, cfg.d_model, bias=cfg.bias)
        self.act = _ACT[cfg.activation]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B,T,D] -> [B,T,D]
        return self.drop(self.proj(self.act(self.fc(x))))


class KVCache:
    """Key/value cache for generation: one slot per (loop, layer), because the hidden state that produces the keys
    differs at every loop. Preallocated to `max_len` positions; `length` is the number of positions filled.

        k, v: [R·k, B, H, max_len, Dh]
    """

    def __init__(self, slots: int, batch: int, heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.k = torch.zeros(slots, batch, heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len
        self.length = 0
        self.loops = 0  # set by the model on the first call; later calls must use the same loop count
        self.mods = None  # the loop modulations [R,k,4,D]: fixed weights for a cache's lifetime, computed once

    @property
    def slots(self) -> int:
        return self.k.shape[0]

    def update(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B,H,T,Dh] after the filled part; return all keys/values so far [B,H,length+T,Dh]."""
        t = k.shape[2]
        end = self.length + t
        self.k[slot, :, :, self.length:end] = k
        self.v[slot, :, :, self.length:end] = v
        return self.k[slot, :, :, :end], self.v[slot, :, :, :end]


class Attention(nn.Module):
    """Multi-head self-attention through `scaled_dot_product_attention`; q, k, v come from one projection.

    `v_input` (authors' compatibility only) takes values from a different tensor than queries and keys.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.dh = cfg.n_heads, cfg.hd
        inner = self.h * self.dh
        self.qkv = nn.Linear(cfg.d_model, 3 * inner, bias=cfg.bias)
        self.proj = nn.Linear(inner, cfg.d_model, bias=cfg.bias)
        self.scale = cfg.attn_scale
        self.p_drop = cfg.dropout
        self.drop = nn.Dropout(cfg.dropout)
        self.causal = cfg.causal

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, slot: int = 0,
                v_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, _ = x.shape
        inner = self.h * self.dh
        if v_input is None:
            qkv = self.qkv(x)                                                   # [B,T,3·H·Dh]
        else:
            w, b = self.qkv.weight, self.qkv.bias
            qk = F.linear(x, w[: 2 * inner], None if b is None else b[: 2 * inner])
            v = F.linear(v_input, w[2 * inner:], None if b is None else b[2 * inner:])
            qkv = torch.cat([qk, v], dim=-1)
        q, k, v = (z.view(B, T, self.h, self.dh).transpose(1, 2) for z in qkv.split(inner, dim=-1))  # [B,H,T,Dh]
        if cache is not None:
            k, v = cache.update(slot, k, v)                                     # [B,H,S,Dh]
        dropout = self.p_drop if self.training else 0.0
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=self.causal and T > 1,
                                               scale=self.scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale)
        y = y.transpose(1, 2).reshape(B, T, inner)                              # [B,T,H·Dh]
        return self.drop(self.proj(y))


class Layer(nn.Module):
    """One pre-norm transformer layer; with `mod` (per-loop α, γ) it is the TMLT layer of Eq. 14-15."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.authors_lt = cfg.compat == "authors" and not cfg.timestep
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg) if not self.authors_lt else nn.Identity()
        self.mlp = MLP(cfg)
        # TMLT: SiLU(TE(t)) -> [γ1, γ2, s1, s2] (the authors' chunk order: gate_attn, gate_mlp, scale_attn, scale_mlp)
        with torch.random.fork_rng(devices=[]):   # draws nothing (see LoopedTransformer.reset_parameters)
            self.modulation = nn.Linear(cfg.d_model, 4 * cfg.d_model) if cfg.timestep else None

    def forward(self, x: torch.Tensor, mod: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, slot: int = 0) -> torch.Tensor:
        # x: [B,T,D]; mod: [4, D] for this loop (or None)
        if mod is None:
            if self.authors_lt:  # their LT: v from the un-normalised x, and no pre-norm before the MLP
                x = x + self.attn(self.norm1(x), mask, cache, slot, v_input=x)
                return x + self.mlp(x)
            x = x + self.attn(self.norm1(x), mask, cache, slot)
            return x + self.mlp(self.norm2(x))
        gate_attn, gate_mlp, scale_attn, scale_mlp = mod
        x = x + gate_attn * self.attn(self.norm1(x) * (1 + scale_attn), mask, cache, slot)
        return x + gate_mlp * self.mlp(self.norm2(x) * (1 + scale_mlp))


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """PE(t): [cos(t·f_i), sin(t·f_i)] with f_i = max_period^(-i/(dim/2)), i < dim/2.  t: [R] -> [R, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """TE(t) = W3·SiLU(W4·PE(t) + b4) + b3 (Eq. 12).

    PE(t) is the sinusoid of `timestep_features` at `timestep_scale · t` (loop indices never seen in training still
    embed), or with `timestep_embed="learned"` a trained vector per loop t < `loops` (later loops reuse the last).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.freq_dim, self.max_period, self.scale = cfg.timestep_freq_dim, cfg.timestep_max_period, cfg.timestep_scale
        self.table = nn.Embedding(cfg.loops, cfg.timestep_freq_dim) if cfg.timestep_embed == "learned" else None
        self.mlp = nn.Sequential(nn.Linear(cfg.timestep_freq_dim, cfg.d_model), nn.SiLU(),
                                 nn.Linear(cfg.d_model, cfg.d_model))

    def forward(self, t: torch.Tensor) -> torch.Tensor:  # [R] -> [R, D]
        if self.table is not None:
            pe = self.table(t.clamp(max=self.table.num_embeddings - 1))
        else:
            pe = timestep_features(t * self.scale if self.scale != 1.0 else t, self.freq_dim, self.max_period)
        return self.mlp(pe.to(self.mlp[0].weight.dtype))
