"""A loopformer language model in plain PyTorch for transformers' remote code (`trust_remote_code=True`).

An exported folder (`loopformer hf export`) carries this file and `configuration_loopformer.py`, so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

loads the model where loopformer is not installed. It is loopformer's forward for a causal language model written
out on its own — the read-in (token embedding, learned or rotary positions), the shared block of k pre-norm layers
run R times with input injection and the timestep modulation of TMLT (Xu & Sato, ICML 2025, Eq. 12-15), the final
RMSNorm and the head — with the same parameter names as `loopformer.model.LoopedTransformer` under `model.`, so
one weights file serves both classes; tests/test_hf.py checks its logits against loopformer's.

Where loopformer is installed, `import loopformer.hf` registers `loopformer.hf.model.LoopformerForCausalLM`, which
runs loopformer's own model and adds what this file leaves out: halting rules (adaptive depth), the fixed-point
mode, the lab's loop extensions, position factors. `unsupported(config)` names what a config needs of those.

The key/value cache holds one slot per (loop, layer) — every loop sees another hidden state, so it writes keys and
values of its own: slot t·k + i of a `DynamicCache` is layer i at loop t.

Shapes: B batch, T new tokens, S keys (cached + new), D width, H heads, Dh head width, R loops, k layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_loopformer import LoopformerConfig

# the name of the output's cache field: `cache` (transformers >= 5.2x), `past_key_values` before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


def unsupported(config) -> str | None:
    """What of `config` this file does not run (None: it runs all of it)."""
    problem = config.causal_lm_problem()
    if problem:
        return problem
    for name, plain in (("extensions", {}), ("pos_factors", None), ("halt", None)):
        if (getattr(config, name, None) or plain) != plain:
            return f"{name}={getattr(config, name)!r} (loopformer's own class runs it: `import loopformer.hf`)"
    return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, gain: bool, eps: float | None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x / RMS(x) times the gain; with `scale` (TMLT's α = 1 + s, [D]) times gain ⊙ α."""
        weight = self.weight if scale is None else (scale if self.weight is None else self.weight * scale)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


class Identity(nn.Module):
    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return x if scale is None else x * scale


def rope_tables(positions: torch.Tensor, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the angles p·base^(−2i/dim) at integer positions [B|1,T]: [B|1,1,T,dim/2] each."""
    inv = base ** (-2.0 * torch.arange(dim // 2, device=positions.device, dtype=torch.float32) / dim)
    ang = positions.to(torch.float32)[..., None] * inv
    return ang.cos()[:, None], ang.sin()[:, None]


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [B,H,T,Dh] with each pair (x_i, x_{i+Dh/2}) rotated by its angle (the half-split layout)."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h, self.dh = cfg.n_heads, cfg.head_dim or cfg.d_model // cfg.n_heads
        inner = self.h * self.dh
        self.qkv = nn.Linear(cfg.d_model, 3 * inner, bias=cfg.bias)
        self.proj = nn.Linear(inner, cfg.d_model, bias=cfg.bias)
        self.scale, self.p_drop = cfg.attn_scale, cfg.dropout
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, qkv: torch.Tensor, mask, cache, slot: int, rope) -> torch.Tensor:
        B, T, _ = qkv.shape                                                      # qkv: [B,T,3·H·Dh]
        inner = self.h * self.dh
        q, k, v = (z.view(B, T, self.h, self.dh).transpose(1, 2) for z in qkv.split(inner, dim=-1))  # [B,H,T,Dh]
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        if cache is not None:
            k, v = cache.update(k, v, slot)                                      # [B,H,S,Dh]
        dropout = self.p_drop if self.training else 0.0
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=T > 1, scale=self.scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, inner)))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        ffn = cfg.ffn_dim or 4 * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, ffn, bias=cfg.bias)
        self.proj = nn.Linear(ffn, cfg.d_model, bias=cfg.bias)
        self.act = ACTIVATIONS[cfg.activation]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Layer(nn.Module):
    """A pre-norm layer; with a modulation [γ1, γ2, s1, s2] the TMLT layer:
    X' = X + γ1 ⊙ Attn(α1 ⊙ RMSN(X)),  X'' = X' + γ2 ⊙ FF(α2 ⊙ RMSN(X')),  α = 1 + s.
    compat="authors" without timestep encoding: values from the un-normalised X and no norm before the MLP."""

    def __init__(self, cfg):
        super().__init__()
        norm = (lambda: RMSNorm(cfg.d_model, cfg.norm_gain, cfg.norm_eps)) if cfg.norm == "rms" else Identity
        self.authors = cfg.compat == "authors" and not cfg.timestep
        self.norm1, self.attn, self.mlp = norm(), Attention(cfg), MLP(cfg)
        self.norm2 = Identity() if self.authors else norm()
        self.modulation = nn.Linear(cfg.d_model, 4 * cfg.d_model) if cfg.timestep else None
        self.past_modulation = nn.Parameter(torch.zeros(4, cfg.d_model)) \
            if cfg.timestep and cfg.timestep_past == "own" else None

    def forward(self, x: torch.Tensor, mod: torch.Tensor | None, mask, cache, slot: int, rope) -> torch.Tensor:
        if self.authors:
            w, b = self.attn.qkv.weight, self.attn.qkv.bias
            inner = 2 * w.shape[0] // 3
            qk = F.linear(self.norm1(x), w[:inner], None if b is None else b[:inner])
            v = F.linear(x, w[inner:], None if b is None else b[inner:])
            x = x + self.attn(torch.cat([qk, v], dim=-1), mask, cache, slot, rope)
            return x + self.mlp(x)
        if mod is None:
            x = x + self.attn(self.attn.qkv(self.norm1(x)), mask, cache, slot, rope)
            return x + self.mlp(self.norm2(x))
        gate_attn, gate_mlp, s1, s2 = mod                                        # [D] each
        x = torch.addcmul(x, gate_attn, self.attn(self.attn.qkv(self.norm1(x, 1 + s1)), mask, cache, slot, rope))
        return torch.addcmul(x, gate_mlp, self.mlp(self.norm2(x, 1 + s2)))


class TimestepEmbedder(nn.Module):
    """TE(t) = W3·SiLU(W4·PE(t) + b4) + b3 of the sinusoid PE at timestep_scale · t (or a learned vector per loop);
    a budget-aware model (timestep_time="normalized") adds MLP_Δ(PE(Δt)) of the step size."""

    def __init__(self, cfg):
        super().__init__()
        self.freq_dim, self.max_period, self.scale = cfg.timestep_freq_dim, cfg.timestep_max_period, \
            cfg.timestep_scale
        self.table = nn.Embedding(cfg.loops, cfg.timestep_freq_dim) if cfg.timestep_embed == "learned" else None
        mlp = lambda: nn.Sequential(nn.Linear(cfg.timestep_freq_dim, cfg.d_model), nn.SiLU(),   # noqa: E731
                                    nn.Linear(cfg.d_model, cfg.d_model))
        self.mlp = mlp()
        self.step_mlp = mlp() if cfg.timestep_time == "normalized" else None

    def pe(self, t: torch.Tensor) -> torch.Tensor:
        t = t * self.scale if self.scale != 1.0 else t
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(self.max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
                          / half)
        args = t.float()[..., None] * freqs
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.mlp[0].weight.dtype)

    def forward(self, t: torch.Tensor, step: torch.Tensor | None = None) -> torch.Tensor:
        if self.table is not None:
            return self.mlp(self.table(t.clamp(max=self.table.num_embeddings - 1)).to(self.mlp[0].weight.dtype))
        te = self.mlp(self.pe(t))
        return te if self.step_mlp is None or step is None else te + self.step_mlp(self.pe(step))


class Embed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        return self.drop(h if self.pos is None else h + self.pos(positions))


class Head(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.n_out or cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


class LoopedLM(nn.Module):
    """y = L2(TF^R(L1(x))): loopformer's `LoopedTransformer` for a causal language model (same parameter names)."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed = Embed(cfg)
        self.blocks = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.timestep = TimestepEmbedder(cfg) if cfg.timestep else None
        self.norm_f = RMSNorm(cfg.d_model, True, cfg.norm_eps) if cfg.final_norm else nn.Identity()
        self.head = Head(cfg)
        self.past_injection = nn.Parameter(torch.ones(cfg.d_model)) \
            if cfg.timestep and cfg.timestep_past == "own" and cfg.input_injection else None
        if cfg.tie_embeddings:
            self.head.proj.weight = self.embed.tok.weight

    def past(self, t: torch.Tensor) -> torch.Tensor:
        """Whether loop t lies past the trained r (never with step_timestep="restart")."""
        return (t >= self.config.loops) & (self.config.step_timestep != "restart")

    def modulations(self, R: int, device) -> torch.Tensor | None:
        """[γ1, γ2, s1, s2] of every loop and layer: [R,k,4,D] (None without timestep encoding)."""
        cfg = self.config
        if self.timestep is None:
            return None
        t = torch.arange(R, device=device)
        if cfg.timestep_time == "normalized":                  # τ = r·t / R and Δt = r / R
            tf = t.float()
            if cfg.timestep_past in ("clamp", "hold"):
                tf = torch.minimum(tf, torch.tensor(float(R - int(cfg.timestep_past == "clamp")), device=device))
            r = float(cfg.loops)
            te = F.silu(self.timestep(r * tf / R, torch.full_like(tf, r / R)))
        else:
            if cfg.step_timestep == "restart":
                t = t % cfg.loops
            top = {"clamp": cfg.loops - 1, "hold": cfg.loops, "own": cfg.loops - 1}.get(cfg.timestep_past)
            te = F.silu(self.timestep(t if top is None else t.clamp(max=top)))
        mods = torch.stack([blk.modulation(te).unflatten(-1, (4, -1)) for blk in self.blocks], dim=1)
        if cfg.timestep_past == "own":
            own = torch.stack([blk.past_modulation for blk in self.blocks])      # [k,4,D]
            mods = torch.where(self.past(torch.arange(R, device=device))[:, None, None, None], own, mods)
        return mods

    def injection(self, e: torch.Tensor, t: int) -> torch.Tensor:
        if self.past_injection is not None and bool(self.past(torch.tensor(t))):
            return e * self.past_injection
        return e

    def mask(self, attention_mask: torch.Tensor | None, T: int, past: int, device) -> torch.Tensor | None:
        """[B|1,1,T,S] boolean (True = may attend), or None for the fused causal path."""
        w = self.config.attn_window
        if attention_mask is None and past == 0 and not w:
            return None
        S = past + T
        q = torch.arange(past, S, device=device)[:, None]
        k = torch.arange(S, device=device)[None, :]
        allowed = k <= q
        if w:
            allowed = allowed & ((q - k) < w)
        allowed = allowed[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        return allowed | (k == q)[None, None]

    def forward(self, x: torch.Tensor, loops: int, attention_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        cfg = self.config
        B, T = x.shape
        past = cache.get_seq_length() if cache is not None else 0
        if cfg.pos == "learned" and past + T > cfg.max_len:
            raise ValueError(f"sequence length {past + T} exceeds the model's max_len {cfg.max_len}")
        if attention_mask is not None and attention_mask.shape[-1] != past + T:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, expected {past + T}")
        if positions is None:
            positions = ((attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:past + T]
                         if attention_mask is not None else torch.arange(past, past + T, device=x.device)[None])
        mask = self.mask(attention_mask, T, past, x.device)
        rope = rope_tables(positions, self.blocks[0].attn.dh, cfg.rope_base) if cfg.pos == "rope" else None
        e = self.embed(x, positions)                                            # L1: [B,T,D]
        mods = self.modulations(loops, x.device)                                # [R,k,4,D] | None
        zeros = cfg.start_state == "zeros"
        h = torch.zeros_like(e) if zeros else e
        k = len(self.blocks)
        grad_from = loops - cfg.grad_loops if (torch.is_grad_enabled() and cfg.grad_loops is not None) else 0
        for t in range(loops):                      # h <- TF(h + e, t)
            with torch.set_grad_enabled(torch.is_grad_enabled() and t >= grad_from):
                if (t > 0 or zeros) and cfg.input_injection:
                    h = h + self.injection(e, t)
                for i, blk in enumerate(self.blocks):
                    h = blk(h, None if mods is None else mods[t, i], mask, cache, t * k + i, rope)
                if self.training and cfg.state_noise > 0:
                    rms = h.detach().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
                    h = h + torch.randn_like(h) * (cfg.state_noise * rms)
        return self.head(self.norm_f(h))                                        # L2: [B,T,V]


class LoopformerPreTrainedModel(PreTrainedModel):
    config_class = LoopformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Layer"]
    _keys_to_ignore_on_load_unexpected = [r"exit_gate\."]      # the exit gate of halting: not run here

    def _init_weights(self, module):
        """Nothing: the loaded weights are the model (a fresh model starts from torch's own initialisation)."""


class LoopformerForCausalLM(LoopformerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"model.head.proj.weight": "model.embed.tok.weight"}

    def __init__(self, config: LoopformerConfig):
        super().__init__(config)
        problem = unsupported(config)
        if problem:
            raise ValueError(f"this modelling file does not run {problem}")
        self.model = LoopedLM(config)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False        # forward makes its own cache: a slot per (loop, layer), not per layer

    def get_input_embeddings(self):
        return self.model.embed.tok

    def set_input_embeddings(self, value):
        self.model.embed.tok = value

    def get_output_embeddings(self):
        return self.model.head.proj

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache=None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None, loops: int | None = None,
                past_key_values=None, **kwargs):
        if input_ids is None:
            raise ValueError("a loopformer model reads token ids (input_ids), not inputs_embeds")
        cache = cache if cache is not None else past_key_values
        R = int(loops or self.config.inference_loops or self.config.loops)
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        slots = R * self.config.n_layers
        if use_cache and cache is None:
            cache = DynamicCache()
        if cache is not None and len(cache.layers) not in (0, slots):
            raise ValueError(f"this cache holds {len(cache.layers)} (loop, layer) slots; {R} loops need {slots}")
        logits = self.model(input_ids, R, attention_mask, position_ids, cache if use_cache else None)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
        return out if return_dict is not False else out.to_tuple()


__all__ = ["LoopformerForCausalLM", "LoopformerPreTrainedModel", "unsupported"]
