"""Building blocks of the looped block: RMSNorm, attention (reading and writing a per-loop key/value cache,
`loopformer.model.cache`), MLP, and the
timestep embedding/modulation of the Timestep-Modulated Looped Transformer (paper Sec. 4.2).

Shapes: B batch, T query length, S key length (cache + new), D model width, H heads, Dh head width, R loops.

TMLT (Eq. 12-15):  PE(t) sinusoidal -> TE(t) = W3·SiLU(W4·PE(t) + b4) + b3
                   [γ1, γ2, s1, s2] = W5·SiLU(TE(t)) + b5,  α_i = 1 + s_i
                   X' = X + γ1 ⊙ Attn(α1 ⊙ RMSN(X)),  TF(X, t) = X' + γ2 ⊙ FF(α2 ⊙ RMSN(X'))
W5 starts at zero and b5 at [γ0, γ0, 0, 0] with γ0 = `timestep_gate_init`: with the default γ0 = 1 the untrained
TMLT block is the untrained looped block; γ0 = 0 is the paper's adaLN-Zero (the untrained block is the identity).
Each layer owns its modulation W5, b5: `Layer.loop_modulation(SiLU(TE))` gives its [γ1, γ2, s1, s2] for all loops.

The published code's plain looped layer differs (values from the un-normalised x, no norm before the MLP):
`AuthorsLoopedLayer`, chosen by `make_layer` for `compat="authors"` without timestep encoding.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from loopformer.model.cache import KVCache
from loopformer.model.config import ModelConfig
from loopformer.model.extensions import branch_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RMSNorm(nn.Module):
    """x / RMS(x), with an optional learnable gain (the authors' block norms have none)."""

    def __init__(self, dim: int, gain: bool = True, eps: float | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Modulation(NamedTuple):
    """One layer's modulation at one loop, ready to apply: the gates γ1, γ2 and, for the two norms, α = 1 + s
    folded into the RMSNorm's gain ([D]: one pass over x, `folded`) or α itself (a scale per row [B,1,D], or a
    norm without a foldable gain), which then multiplies the normalised x (`Layer.prepare`)."""
    gate_attn: torch.Tensor
    gate_mlp: torch.Tensor
    alpha_attn: torch.Tensor
    alpha_mlp: torch.Tensor
    folded: bool

    def norm(self, norm: nn.Module, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """α ⊙ norm(x), TMLT's α ⊙ RMSN(x) (`alpha`: this modulation's alpha_attn or alpha_mlp)."""
        return rms_norm(x, alpha, norm.eps) if self.folded else norm(x) * alpha


def _folded_gain(norm: nn.Module, s: torch.Tensor) -> torch.Tensor:
    return 1 + s if norm.weight is None else norm.weight * (1 + s)


def make_norm(cfg: ModelConfig, gain: bool | None = None) -> nn.Module:
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


def rope_tables(positions: torch.Tensor, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position encoding (RoPE; Su et al. 2021) for integer `positions` [B|1,T]: cos and sin of the angles
    p·θ_i, θ_i = base^(−2i/dim) for i < dim/2, as [B|1,1,T,dim/2] each (broadcast over heads). q·k after `rotate`
    depends on the positions only through their difference, so nothing is tied to the lengths seen in training."""
    inv = base ** (-2.0 * torch.arange(dim // 2, device=positions.device, dtype=torch.float32) / dim)   # [dim/2]
    ang = positions.to(torch.float32)[..., None] * inv                                                  # [B|1,T,dim/2]
    return ang.cos()[:, None], ang.sin()[:, None]


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [B,H,T,Dh] with each pair (x_i, x_{i+Dh/2}) rotated by its angle (the half-split layout of GPT-NeoX and
    Llama); rope: `rope_tables` at x's positions."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


Rope = tuple[torch.Tensor, torch.Tensor]   # (cos, sin) [B|1,1,T,Dh/2] of `rope_tables`, or None: no rotation

MATH_ATTENTION_MAX_T = 48   # compiled bidirectional attention over at most this many tokens: matmul-softmax-matmul


class Attention(nn.Module):
    """Multi-head self-attention; q, k, v come from one projection. Through `scaled_dot_product_attention`, except
    under `torch.compile` on a CPU for bidirectional attention without a mask over at most `MATH_ATTENTION_MAX_T`
    tokens (the CPU studies' 18-40-token rows), which runs as softmax(q·kᵀ·scale)·v: the same math, which the
    compiler fuses into a faster step there than the fused kernel's (benchmarks/bench_attention.py; eager, the
    kernel is as fast or faster; GPUs keep the kernel: not measured there)."""

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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, slot: int = 0, rope: Rope | None = None) -> torch.Tensor:
        return self.attend(self.qkv(x), mask, cache, slot, rope)               # qkv: [B,T,3·H·Dh]

    def attend(self, qkv: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None,
               slot: int, rope: Rope | None = None) -> torch.Tensor:
        """Attention of the projected q | k | v [B,T,3·H·Dh] (q and k rotated by `rope` when given; a cache keeps
        the rotated keys), then the output projection: [B,T,D]."""
        B, T, _ = qkv.shape
        inner = self.h * self.dh
        q, k, v = (z.view(B, T, self.h, self.dh).transpose(1, 2) for z in qkv.split(inner, dim=-1))  # [B,H,T,Dh]
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        if cache is not None:
            k, v = cache.update(slot, k, v)                                     # [B,H,S,Dh]
        dropout = self.p_drop if self.training else 0.0
        if mask is None and cache is None and not self.causal and self._math(q, T, dropout):
            y = self.math_attention(q, k, v)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=self.causal and T > 1,
                                               scale=self.scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale)
        y = y.transpose(1, 2).reshape(B, T, inner)                              # [B,T,H·Dh]
        return self.drop(self.proj(y))

    @staticmethod
    def _math(x: torch.Tensor, T: int, dropout: float) -> bool:
        """Whether unmasked attention over T keys runs as `math_attention`: compiled, on a CPU (where it was
        measured), short rows, no dropout."""
        return (T <= MATH_ATTENTION_MAX_T and dropout == 0 and x.device.type == "cpu"
                and torch.compiler.is_compiling())

    def math_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q·kᵀ·scale)·v: [B,H,Tq,Dh], [B,H,T,Dh] x2 -> [B,H,Tq,Dh] (scale: 1/sqrt(Dh) unless set)."""
        scale = self.scale if self.scale is not None else self.dh ** -0.5
        return torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v          # [B,H,Tq,T] @ [B,H,T,Dh]

    def attend_at(self, xn: torch.Tensor, at: torch.Tensor, mask: torch.Tensor | None,
                  rope: Rope | None = None) -> torch.Tensor:
        """The attention output at the flattened positions `at` [N] of the B·T positions only: queries projected
        there, keys and values from every position of the query's row, then the output projection: [N,D]
        (what `forward` gives at those positions). xn: [B,T,D] the normalised input; mask: [B|1,1,T,S] bool."""
        B, T, _ = xn.shape
        N, inner = at.shape[0], self.h * self.dh
        w, b = self.qkv.weight, self.qkv.bias
        q = F.linear(xn.flatten(0, 1).index_select(0, at), w[:inner], None if b is None else b[:inner])  # [N,H·Dh]
        kv = F.linear(xn, w[inner:], None if b is None else b[inner:])                  # [B,T,2·H·Dh]
        row, pos = at // T, at % T                                                       # [N] each
        k, v = (z.view(B, T, self.h, self.dh).transpose(1, 2) for z in kv.split(inner, dim=-1))   # [B,H,T,Dh]
        q = q.view(N, self.h, 1, self.dh)                                                # [N,H,1,Dh]
        if rope is not None:                      # keys at their positions, each query at its own
            k = rotate(k, rope)
            sel = (row if rope[0].shape[0] > 1 else torch.zeros_like(row), pos)
            q = rotate(q, (rope[0][:, 0][sel][:, None, None], rope[1][:, 0][sel][:, None, None]))
        k, v = k.index_select(0, row), v.index_select(0, row)                            # [N,H,T,Dh]
        if mask is not None:                                                             # the query's mask row
            allowed = mask[row if mask.shape[0] > 1 else torch.zeros_like(row), :, pos]  # [N,1,T]
            allowed = allowed.unsqueeze(1)                                               # [N,1,1,T]
        elif self.causal:
            allowed = (torch.arange(T, device=xn.device)[None] <= pos[:, None])[:, None, None]
        else:
            allowed = None
        dropout = self.p_drop if self.training else 0.0
        if allowed is None and self._math(q, T, dropout):
            y = self.math_attention(q, k, v)                                             # [N,H,1,Dh]
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=self.scale)
        return self.drop(self.proj(y.reshape(N, inner)))                                # [N,D]


class Layer(nn.Module):
    """One pre-norm transformer layer; with its modulation (per-loop α, γ) it is the TMLT layer of Eq. 14-15."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        # what each branch's output passes before the add, where an extension gives it (e.g. the sandwich norm)
        self.post_attn = branch_out(cfg)
        self.post_mlp = branch_out(cfg)
        # TMLT: SiLU(TE(t)) -> [γ1, γ2, s1, s2] (the authors' chunk order: gate_attn, gate_mlp, scale_attn, scale_mlp)
        with torch.random.fork_rng(devices=[]):   # draws nothing (see LoopedTransformer.reset_parameters)
            self.modulation = nn.Linear(cfg.d_model, 4 * cfg.d_model) if cfg.timestep else None
        # timestep_past="own": the loops past r read this [γ1, γ2, s1, s2] instead of W5·SiLU(TE(t)) + b5
        self.past_modulation = nn.Parameter(torch.empty(4, cfg.d_model)) \
            if cfg.timestep and cfg.timestep_past == "own" else None

    @torch.no_grad()
    def reset_modulation(self, gate_init: float) -> None:
        """W5 = 0 and b5 = [γ0, γ0, 0, 0]: every loop starts with gates γ0 and scales α = 1 (adaLN-Zero for γ0 = 0);
        the loops past r's own modulation likewise."""
        if self.modulation is not None:
            d = self.modulation.in_features
            self.modulation.weight.zero_()
            self.modulation.bias.zero_()
            self.modulation.bias[:2 * d].fill_(gate_init)                                  # γ1, γ2
        if self.past_modulation is not None:
            self.past_modulation.zero_()
            self.past_modulation[:2].fill_(gate_init)

    def loop_modulation(self, te: torch.Tensor) -> torch.Tensor | None:
        """[γ1, γ2, s1, s2] of every loop from SiLU(TE(t)) [R,D]: [R,4,D] ([R,B,D] -> [R,B,4,D] for times of their
        own per row; None without timestep encoding)."""
        if self.modulation is None:
            return None
        return self.modulation(te).unflatten(-1, (4, -1))

    def prepare(self, mod: torch.Tensor) -> Modulation:
        """This layer's [γ1, γ2, s1, s2] at one loop ([4,D], or [4,B,1,D] per row) ready to apply: α = 1 + s folded
        into the RMSNorms' gains where α is one vector [D]. Generation prepares every loop's once per cache."""
        gate_attn, gate_mlp, s1, s2 = mod
        if s1.dim() == 1 and isinstance(self.norm1, RMSNorm) and isinstance(self.norm2, RMSNorm):
            return Modulation(gate_attn, gate_mlp, _folded_gain(self.norm1, s1), _folded_gain(self.norm2, s2), True)
        return Modulation(gate_attn, gate_mlp, 1 + s1, 1 + s2, False)

    def forward(self, x: torch.Tensor, mod: torch.Tensor | Modulation | None = None,
                mask: torch.Tensor | None = None, cache: KVCache | None = None, slot: int = 0,
                rope: Rope | None = None) -> torch.Tensor:
        # x: [B,T,D]; mod: [4,D] (or [4,B,1,D], per row), this layer's modulation at this loop, or it `prepare`d
        m = None if mod is None else (mod if isinstance(mod, Modulation) else self.prepare(mod))
        return self._residuals(x, self.attn(self._norm1(x, m), mask, cache, slot, rope), m)

    def forward_at(self, x: torch.Tensor, at: torch.Tensor, mod: torch.Tensor | Modulation | None = None,
                   mask: torch.Tensor | None = None, rope: Rope | None = None) -> torch.Tensor:
        """The layer's output at the flattened positions `at` [N] only — `forward(x)` there, [N,D] — for a last
        layer whose other positions nothing reads: the attention's queries, the output projection, the MLP and the
        residual run on N rows; keys and values still come from every position. mod: one modulation for all rows."""
        m = None if mod is None else (mod if isinstance(mod, Modulation) else self.prepare(mod))
        a = self.attn.attend_at(self._norm1(x, m), at, mask, rope)                           # [N,D]
        return self._residuals(x.flatten(0, 1).index_select(0, at), a, m)

    def _norm1(self, x: torch.Tensor, m: Modulation | None) -> torch.Tensor:
        """The attention's input: RMSN(x), or α1 ⊙ RMSN(x) under a modulation."""
        return self.norm1(x) if m is None else m.norm(self.norm1, x, m.alpha_attn)

    def _residuals(self, x: torch.Tensor, a: torch.Tensor, m: Modulation | None) -> torch.Tensor:
        """X' = X + (γ1 ⊙) a with a the attention output, then X' + (γ2 ⊙) FF((α2 ⊙) RMSN(X')); with a stabiliser
        each branch output passes its extension's module (`post_attn`, `post_mlp`) before the add."""
        if self.post_attn is not None:
            return self._residuals_stabilised(x, a, m)
        if m is None:
            x = x + a
            return x + self.mlp(self.norm2(x))
        x = torch.addcmul(x, m.gate_attn, a)
        return torch.addcmul(x, m.gate_mlp, self.mlp(m.norm(self.norm2, x, m.alpha_mlp)))

    def _residuals_stabilised(self, x: torch.Tensor, a: torch.Tensor, m: Modulation | None) -> torch.Tensor:
        """`_residuals` with X' = X + (γ1 ⊙) P(a) and X'' = X' + (γ2 ⊙) P(FF(·)), P the branch's output module."""
        a = self.post_attn(a)
        x = x + a if m is None else torch.addcmul(x, m.gate_attn, a)
        f = self.post_mlp(self.mlp(self.norm2(x) if m is None else m.norm(self.norm2, x, m.alpha_mlp)))
        return x + f if m is None else torch.addcmul(x, m.gate_mlp, f)


class AuthorsLoopedLayer(Layer):
    """The published code's plain looped layer (`compat="authors"`, no timestep encoding): attention values come
    from the un-normalised x, and there is no norm before the MLP. Same parameters and state-dict keys as `Layer`
    (its `norm2` is an identity)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm2 = nn.Identity()

    def forward(self, x: torch.Tensor, mod: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, slot: int = 0, rope: Rope | None = None) -> torch.Tensor:
        x = x + self.attn.attend(self._qkv(self.norm1(x), x), mask, cache, slot, rope)
        return x + self.mlp(x)

    def forward_at(self, x: torch.Tensor, at: torch.Tensor, mod: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None, rope: Rope | None = None) -> torch.Tensor:
        """`forward` at the flattened positions `at` only: [N,D] (computed everywhere, then selected)."""
        return self.forward(x, mod, mask, rope=rope).flatten(0, 1).index_select(0, at)

    def _qkv(self, xn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q, k from the normalised `xn`, v from the raw `x`: [B,T,3·H·Dh]."""
        w, b = self.attn.qkv.weight, self.attn.qkv.bias
        inner = 2 * w.shape[0] // 3
        qk = F.linear(xn, w[:inner], None if b is None else b[:inner])
        v = F.linear(x, w[inner:], None if b is None else b[inner:])
        return torch.cat([qk, v], dim=-1)


def make_layer(cfg: ModelConfig) -> Layer:
    """The layer of the configured block: the authors' looped layer for `compat="authors"` without timestep
    encoding, the standard (TMLT when `timestep`) layer otherwise."""
    return AuthorsLoopedLayer(cfg) if cfg.compat == "authors" and not cfg.timestep else Layer(cfg)


# ------------------------------------------------------------------ parameter groups
PARAM_GROUPS = ("embedding", "block", "timestep", "modulation", "past", "head")   # what each parameter belongs to


def param_group(name: str) -> str:
    """The group of a parameter of `LoopedTransformer` by its name (see PARAM_GROUPS)."""
    parts = name.split(".")
    if parts[-1] in ("past_modulation", "past_injection"):
        return "past"          # the loops past r's own modulation and injection (timestep_past="own")
    if parts[0] == "timestep":
        return "timestep"
    if "modulation" in parts:
        return "modulation"
    if parts[0] == "blocks":
        return "block"
    if parts[0] == "embed":
        return "embedding"
    return "head"   # head.proj, norm_f


def is_timestep_param(name: str) -> bool:
    """The TMLT parameters: the timestep embedder TE(t), each layer's modulation W5, b5 (and its own modulation of
    the loops past r)."""
    return param_group(name) in ("timestep", "modulation", "past")


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """PE(t): [cos(t·f_i), sin(t·f_i)] with f_i = max_period^(-i/(dim/2)), i < dim/2.  t: [...] -> [..., dim]
    (t may be fractional: the normalised time of a budget-aware model)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[..., None] * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """TE(t) = W3·SiLU(W4·PE(t) + b4) + b3 (Eq. 12).

    PE(t) is the sinusoid of `timestep_features` at `timestep_scale · t` (loop indices never seen in training still
    embed), or with `timestep_embed="learned"` a trained vector per loop t < `loops` (later loops reuse the last).
    A budget-aware model (`timestep_time="normalized"`) reads fractional times and adds a second embedder of the
    step size: TE(t, Δ) = MLP(PE(t)) + MLP_Δ(PE(Δ)), MLP_Δ's output layer starting at zero (so it starts as, and
    converts exactly from, the paper's TE).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.freq_dim, self.max_period, self.scale = cfg.timestep_freq_dim, cfg.timestep_max_period, cfg.timestep_scale
        self.table = nn.Embedding(cfg.loops, cfg.timestep_freq_dim) if cfg.timestep_embed == "learned" else None
        self.mlp = self._mlp(cfg)
        self.step_mlp = self._mlp(cfg) if cfg.timestep_time == "normalized" else None   # MLP_Δ

    @staticmethod
    def _mlp(cfg: ModelConfig) -> nn.Sequential:
        return nn.Sequential(nn.Linear(cfg.timestep_freq_dim, cfg.d_model), nn.SiLU(),
                             nn.Linear(cfg.d_model, cfg.d_model))

    def _pe(self, t: torch.Tensor) -> torch.Tensor:
        pe = timestep_features(t * self.scale if self.scale != 1.0 else t, self.freq_dim, self.max_period)
        return pe.to(self.mlp[0].weight.dtype)

    def forward(self, t: torch.Tensor, step: torch.Tensor | None = None) -> torch.Tensor:  # [...] -> [..., D]
        if self.table is not None:
            return self.mlp(self.table(t.clamp(max=self.table.num_embeddings - 1)).to(self.mlp[0].weight.dtype))
        te = self.mlp(self._pe(t))
        if self.step_mlp is not None and step is not None:
            te = te + self.step_mlp(self._pe(step))
        return te
