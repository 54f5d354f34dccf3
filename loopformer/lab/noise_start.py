"""The noise start: the random initial state of equilibrium models (EqR), as a loop extension.

In training the loop starts from h_0 = σ · RMS(e) · ε, ε ~ N(0, I) per position (σ = `sigma`), and the read-in e is
injected before the first loop too (h_1 = TF(h_0 + e, 0)): the block learns a map that converges from anywhere near
the input rather than a path from one start. At evaluation the start is the noise's mean, 0. Needs input injection
(without it the read-in would never reach the loop).

    model.extensions: {noise_start: {sigma: 1.0}}

The stability study screened it on the circuit at r = 32 (studies/stability/README.md, "Screens"): a failing looped
seed reached 38.5 % (the recipe alone 15.2 %), a failing TMLT seed stayed at 0 %; it left the core and stays here
because equilibrium-style loops use it.

Shapes: B batch, T length, D width.
"""

from __future__ import annotations

import math

import torch

from loopformer.model.extensions import LoopExtension
from loopformer.model.stability import rms


class NoiseStart(LoopExtension):
    def __init__(self, cfg, sigma: float = 1.0):
        super().__init__(cfg)
        self.sigma = float(sigma)

    @classmethod
    def check(cls, cfg, sigma: float = 1.0) -> None:
        if not cfg.input_injection:
            raise ValueError("extensions.noise_start needs input_injection=true (the read-in reaches the loop only "
                             "by injection)")
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and 0 <= sigma <= 100):
            raise ValueError(f"extensions.noise_start.sigma must lie in [0, 100] (got {sigma!r})")

    def start(self, e: torch.Tensor, h0: torch.Tensor | None, training: bool) -> torch.Tensor:
        """σ · RMS(e) · ε in training, else zeros (or the core's start state).  [B,T,D]."""
        if training and self.sigma > 0:
            return torch.randn_like(e) * (self.sigma * rms(e.detach()))
        return torch.zeros_like(e) if h0 is None else h0
