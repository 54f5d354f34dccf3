"""Free per-loop scales: Theorem 4.2's model, the η(t) arm of the dials study, as a loop extension.

Theorem 4.2 memorises labels y_0..y_{K-1} exactly with L2 ∘ (id + η(t) ⊙ FF)^{K-1} ∘ L1: one weight-tied map FF
whose update is scaled at every loop by a vector η(t) of its own. Here the weight-tied map is the block's update,
F(h) = TF(h + e, t) − h (with input injection it includes the read-in e), and every loop t scales it by a free,
learned vector η(t):

    h_{t+1} = h_t + η(t) ⊙ (TF(h_t + e, t) − h_t)        η(t) ∈ R^D, t = 0..r-1          (per position)

η(t) starts at `init` (1: the untrained model is the looped model of the same seed, loop for loop). The
parameters grow with r (r·D of them, one vector per trained loop; loops past r, and the later supervision
steps, reuse η(r-1)); timestep encoding is the paper's parameter-cheap version of the same freedom (Sec. 4.2).
The vectors are not weight-decayed (vectors, as norm gains).

    model.extensions: {loop_scales: {}}           # or {loop_scales: {init: 0.5}}

The third arm of the dials study (studies/dials/), beside the looped model and the TMLT.

Shapes: B batch, T length, D width, R loops.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loopformer.model.extensions import LoopExtension


class LoopScales(LoopExtension):
    def __init__(self, cfg, init: float = 1.0):
        super().__init__(cfg)
        self.start_value = float(init)
        self.eta = nn.ParameterList(nn.Parameter(torch.full((cfg.d_model,), float(init)))   # R × [D]
                                    for _ in range(cfg.loops))

    @classmethod
    def check(cls, cfg, init: float = 1.0) -> None:
        if isinstance(init, bool) or not (isinstance(init, (int, float)) and math.isfinite(init) and
                                          -100 <= init <= 100):
            raise ValueError(f"extensions.loop_scales.init must be a number in [-100, 100] (got {init!r})")

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p in self.eta:
                p.fill_(self.start_value)

    def scales(self, t: int | torch.Tensor) -> torch.Tensor:
        """η(t): [D] for an int t, [B,1,D] for a loop per row (t [B]); past the trained loops, η(r-1)."""
        last = len(self.eta) - 1
        if isinstance(t, int):
            return self.eta[min(t, last)]
        table = torch.stack(list(self.eta))                                          # [R,D]
        return table[t.clamp(max=last)].unsqueeze(-2)                                 # [B,1,D]

    def after_loop(self, h: torch.Tensor, out: torch.Tensor, t) -> torch.Tensor:
        """h + η(t) ⊙ (out − h).  [B,T,D]."""
        return h + self.scales(t) * (out - h)
