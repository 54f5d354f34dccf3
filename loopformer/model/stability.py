"""The start state and state noise of the loop: the two core switches of deep loops that a shipped recipe uses.

    start_state     where the loop starts. "input" (default, the paper's): h_0 = e, the read-in. "zeros": h_0 = 0
                    and the read-in is injected before the first loop too (h_1 = TF(0 + e)), which with input
                    injection is the same map as "input" but makes every loop's input h + e; needs input injection.
                    An extension can give another start (`LoopExtension.start`; the lab's noise start).
    state_noise     in training only, after every loop h_t <- h_t + σ · RMS(h_t) · ε (σ = `state_noise`, ε ~ N(0, I)
                    per position): the state-noise regulariser of EqR, widening the basin the loop must return to
                    (the circuit's recipe, configs/cpu/schedule.yaml).

Other stabilisers run through the loop's extension point (`loopformer.model.extensions`, `loopformer.lab`); the
stability study's page says which left the core and why (docs/architecture.md has the table).

Shapes: B batch, T length, D width.
"""

from __future__ import annotations

import math

import torch

START_STATES = ("input", "zeros")


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS over the width, kept as a trailing dimension: [..., D] -> [..., 1]."""
    return x.pow(2).mean(-1, keepdim=True).add(eps).sqrt()


def start_state(e: torch.Tensor, cfg) -> torch.Tensor | None:
    """h_0 of the loop for read-in `e` [B,T,D]: None for "input" (the loop starts from e itself), else the state to
    which e is injected before the first loop: zeros."""
    return None if cfg.start_state == "input" else torch.zeros_like(e)


def perturb(h: torch.Tensor, cfg, training: bool) -> torch.Tensor:
    """h + σ · RMS(h) · ε in training (σ = `state_noise`), h itself otherwise.  [B,T,D] (or [N,D])."""
    if not training or cfg.state_noise <= 0:
        return h
    return h + torch.randn_like(h) * (cfg.state_noise * rms(h.detach()))


def check(cfg) -> None:
    """The start-state and state-noise fields of a ModelConfig, checked (ValueError naming the field)."""
    if cfg.start_state not in START_STATES:
        raise ValueError(f"start_state must be one of {START_STATES} (got {cfg.start_state!r})")
    if cfg.start_state != "input" and not cfg.input_injection:
        raise ValueError(f"start_state={cfg.start_state} needs input_injection=true (the read-in "
                         "reaches the loop only by injection)")
    if not (math.isfinite(cfg.state_noise) and 0 <= cfg.state_noise <= 100):
        raise ValueError(f"state_noise must lie in [0, 100] (got {cfg.state_noise})")
