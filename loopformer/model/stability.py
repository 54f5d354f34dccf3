"""Stabilisers of deep loops: switches that make a block applied r = 32-64 times train on every seed and settle.

Each is a `ModelConfig` field, off by default (the model is then exactly the paper's), and each follows a remedy
the field reports for looped / recurrent-depth models:

    start_state     where the loop starts. "input" (default, the paper's): h_0 = e, the read-in. "zeros": h_0 = 0
                    and the read-in is injected before the first loop too (h_1 = TF(0 + e)), which with input
                    injection is the same map as "input" but makes every loop's input h + e. "noise": in training
                    h_0 = σ · RMS(e) · ε, ε ~ N(0, I) per position (σ = `start_noise`), then + e as for "zeros" —
                    the random initial state of equilibrium models (locuslab/EqR), which teaches the block a map
                    that converges from anywhere near the input rather than a path from one start; at evaluation
                    the start is its mean, 0. "zeros" and "noise" need input injection (without it the input would
                    never reach the loop).
    state_noise     in training only, after every loop h_t <- h_t + σ · RMS(h_t) · ε (σ = `state_noise`, ε ~ N(0, I)
                    per position): the state-noise regulariser of EqR, widening the basin the loop must return to.
    loop_scale      the residual branches' scale c in X' = X + c ⊙ Attn(·), X'' = X' + c ⊙ FF(·): "none" (c = 1),
                    "rsqrt" (c = 1/√r), "inv" (c = 1/r) with r = `loops` the trained loop count — the unrolled
                    depth's residual scaling (1/N residual scaling, DeepNorm-style constants for r·k layers) — or
                    "layerscale": a learned per-channel vector per branch, started at `layerscale_init` (CaiT's
                    LayerScale; an identity-biased start: the untrained loop barely moves its state). The constant
                    is fixed at construction: running more loops than r at inference keeps the trained scale.
    sandwich_norm   an RMSNorm (learned gain, started at 1) on each branch's output before the residual add, as well
                    as the pre-norm on its input (Huginn's sandwich): X' = X + c ⊙ RMSN(Attn(RMSN(X))), which bounds
                    every update's size however the weights grow.
    grad_window     in training, the carried state is detached before every k-th loop (k = `grad_window`): the loss
                    read after loop t backpropagates through loops ⌊(t−1)/k⌋·k + 1 .. t only — at most k applications
                    of the block — and into the read-in through every injection. Unlike `grad_loops` (the gradient
                    of the last loops only), every loop's own loss still trains the block; with per-loop targets
                    (`task.loop_targets`) each loop learns its step from the states the model itself reaches. An
                    expanding loop map (spectral radius ρ > 1) multiplies the gradient by up to ρ per loop it
                    crosses, so the window bounds that growth to ρ^k instead of ρ^r (docs/stability.md). The
                    forward pass, and so evaluation, is unchanged.

Under timestep modulation the gate multiplies the scaled branch: X' = X + γ1(t) ⊙ c ⊙ RMSN(Attn(α1(t) ⊙ RMSN(X))).
The stablemax cross-entropy (the loss side of these remedies) is `loopformer.train.losses.stablemax_cross_entropy`.

Shapes: B batch, T length, D width.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

START_STATES = ("input", "zeros", "noise")
LOOP_SCALES = ("none", "rsqrt", "inv", "layerscale")


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS over the width, kept as a trailing dimension: [..., D] -> [..., 1]."""
    return x.pow(2).mean(-1, keepdim=True).add(eps).sqrt()


def branch_constant(scale: str, loops: int) -> float:
    """c of a constant `loop_scale`: 1 ("none", and "layerscale" before its learned vector), 1/√r, 1/r."""
    return {"rsqrt": 1.0 / math.sqrt(loops), "inv": 1.0 / loops}.get(scale, 1.0)


def has_branch_out(cfg) -> bool:
    """Whether the layers of `cfg` get a `BranchOut` (any branch-side stabiliser on)."""
    return cfg.sandwich_norm or cfg.loop_scale != "none"


class BranchOut(nn.Module):
    """What a residual branch's output passes through before it is added: RMSN (sandwich norm) and the scale c
    (a constant, or LayerScale's learned vector).  [..., D] -> [..., D]."""

    def __init__(self, cfg, norm: nn.Module | None = None):
        super().__init__()
        self.norm = norm if cfg.sandwich_norm else None     # the layer's RMSNorm class, made by the layer
        self.const = branch_constant(cfg.loop_scale, cfg.loops)
        self.layerscale_init = cfg.layerscale_init
        self.gain = nn.Parameter(torch.full((cfg.d_model,), cfg.layerscale_init)) \
            if cfg.loop_scale == "layerscale" else None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.norm is not None:
            self.norm.weight.fill_(1.0)
        if self.gain is not None:
            self.gain.fill_(self.layerscale_init)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            a = self.norm(a)
        if self.gain is not None:
            return a * self.gain
        return a * self.const if self.const != 1.0 else a


def start_state(e: torch.Tensor, cfg, training: bool) -> torch.Tensor | None:
    """h_0 of the loop for read-in `e` [B,T,D]: None for "input" (the loop starts from e itself), else the state to
    which e is injected before the first loop: zeros, or in training σ · RMS(e) · ε (at evaluation zeros)."""
    if cfg.start_state == "input":
        return None
    if cfg.start_state == "noise" and training and cfg.start_noise > 0:
        return torch.randn_like(e) * (cfg.start_noise * rms(e.detach()))
    return torch.zeros_like(e)


def perturb(h: torch.Tensor, cfg, training: bool) -> torch.Tensor:
    """h + σ · RMS(h) · ε in training (σ = `state_noise`), h itself otherwise.  [B,T,D] (or [N,D])."""
    if not training or cfg.state_noise <= 0:
        return h
    return h + torch.randn_like(h) * (cfg.state_noise * rms(h.detach()))


def cut(h: torch.Tensor, cfg, t: int, train: bool) -> torch.Tensor:
    """The carried state entering loop t (0-based): detached where a gradient window starts (`grad_window` k:
    t = k, 2k, ...; `train`: in training with gradients recorded), else h itself.  [B,T,D]."""
    k = cfg.grad_window
    return h.detach() if train and k and t and t % k == 0 else h


def check(cfg) -> None:
    """The stabiliser fields of a ModelConfig, checked (ValueError naming the field: a config error)."""
    if cfg.start_state not in START_STATES:
        raise ValueError(f"start_state must be one of {START_STATES} (got {cfg.start_state!r})")
    if cfg.loop_scale not in LOOP_SCALES:
        raise ValueError(f"loop_scale must be one of {LOOP_SCALES} (got {cfg.loop_scale!r})")
    if cfg.start_state != "input" and not cfg.input_injection:
        raise ValueError(f"start_state={cfg.start_state} needs input_injection=true (the read-in "
                         "reaches the loop only by injection)")
    for name in ("start_noise", "state_noise"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and 0 <= v <= 100):
            raise ValueError(f"{name} must lie in [0, 100] (got {v})")
    if not (math.isfinite(cfg.layerscale_init) and 0 < cfg.layerscale_init <= 10):
        raise ValueError(f"layerscale_init must lie in (0, 10] (got {cfg.layerscale_init})")
    if cfg.forget_gate:
        if cfg.solver != "unroll":
            raise ValueError("forget_gate gates the unrolled loop's state (solver=unroll)")
        if not (math.isfinite(cfg.forget_gate_bias) and abs(cfg.forget_gate_bias) <= 20):
            raise ValueError(f"forget_gate_bias must lie in [-20, 20] (got {cfg.forget_gate_bias})")
    if cfg.grad_window is not None and cfg.solver != "unroll":
        raise ValueError("grad_window applies to the unrolled loop (solver=unroll); the fixed-point mode's "
                         "gradient is set by solver_backward")
    if (cfg.sandwich_norm or cfg.loop_scale != "none") and cfg.compat == "authors" and not cfg.timestep:
        raise ValueError("sandwich_norm and loop_scale apply to the standard layer, not the published "
                         "code's looped layer (compat=authors)")
