"""Compute per answer, from the config alone: how many layer applications and how many floating-point operations one
forward pass of `LoopedTransformer(cfg)` spends on one sequence, so runs of different depth, loops or width can be
compared at their cost.

Layer applications (`layer_applications`):   k · R
    k = n_layers, R = the block's applications per answer: loops × supervision_steps (the standard model: L · 1).

FLOPs per answer (`forward_flops`), one sequence of T tokens, a multiply-add counted as 2 FLOPs (the convention of
`torch.utils.flop_counter`), D = d_model, I = n_heads · head_dim, F = the MLP width, C = the read-out's outputs,
P = timestep_freq_dim:

    attention projections      k · R · 2·T·(3·D·I + I·D)       q, k, v from one projection, then the output's
    attention scores / values  k · R · 4·T²·I                   q·kᵀ over all T keys and the weights times v
                                                                (2·T²·I each; a causal mask is not discounted:
                                                                the matmul attention computes the full T × T)
    MLP                        k · R · 4·T·D·F                  D → F → D
    read-in                    2·T·d_in·D                       a linear read-in of real vectors (token ids and
                                                                learned positions are table lookups: 0)
    read-out                   2·T·D·C                          per-token logits (lm, regression); 2·D·C for a
                                                                pooled sequence head; + 2·T·D for an exit gate
    timestep                   R · (2·(P·D + D²)·e + k · 8·D²)  TMLT only: TE(t) = W3·SiLU(W4·PE(t)) for each loop
                                                                (e = 2 with the step embedder of
                                                                timestep_time="normalized", else 1) and each
                                                                layer's W5: D → 4·D

Not counted: element-wise work (norms, softmax, activations, residual adds, the TMLT gains and gates, input
injection, biases, dropout), O(T·D) per layer against the O(T·D²) above. The timestep terms are per forward call,
shared by the rows of a batch: counted once, as for a batch of one sequence (amortised over B rows they are B
times smaller). This is the plain forward at the trained depth (every position read out, no halting, no key/value
cache); a training step's backward costs about twice as much again.
"""

from __future__ import annotations

from loopformer.model.config import ModelConfig

TERMS = ("attention projections", "attention scores/values", "MLP", "read-in", "read-out", "timestep")


def layer_applications(cfg: ModelConfig) -> int:
    """Loops × layers per answer: n_layers · R (the standard model: its L layers once)."""
    return cfg.n_layers * cfg.total_loops


def flop_terms(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, int]:
    """FLOPs of one forward pass over one sequence of `seq_len` tokens (default max_len), per term of the module
    docstring (keys: TERMS)."""
    T = int(seq_len or cfg.max_len)
    D, I, Fw, k, R, C = cfg.d_model, cfg.n_heads * cfg.hd, cfg.ffn, cfg.n_layers, cfg.total_loops, cfg.out_dim
    embedders = 2 if cfg.timestep_time == "normalized" else 1
    return {
        "attention projections": k * R * 2 * T * (3 * D * I + I * D),
        "attention scores/values": k * R * 4 * T * T * I,
        "MLP": k * R * 4 * T * D * Fw,
        "read-in": 2 * T * cfg.input_dim * D,
        "read-out": 2 * (1 if cfg.head == "sequence" else T) * D * C + (2 * T * D if cfg.exit_gate else 0),
        "timestep": R * (2 * (cfg.timestep_freq_dim * D + D * D) * embedders + k * 8 * D * D) if cfg.timestep else 0,
    }


def forward_flops(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """FLOPs per answer: the sum of `flop_terms` (see the module docstring)."""
    return sum(flop_terms(cfg, seq_len).values())


def format_flops(n: float) -> str:
    """A FLOP count with an SI prefix: 1.23 MFLOPs, 4.5 GFLOPs."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}FLOPs"
    return f"{n:.3g} FLOPs"


__all__ = ["TERMS", "layer_applications", "flop_terms", "forward_flops", "format_flops"]
