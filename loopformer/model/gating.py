"""A forget gate on the carried state: a loop that can overwrite what it carries instead of adding to it.

The paper's loop is residual: loop t maps h_t to h_{t+1} = h_t (+ e) + Attn(·) + FF(·), so whatever the state holds
stays unless the branches cancel it exactly. A task whose state must be *replaced* every loop — the word problem's
running product g_1···g_t, which loop t turns into g_1···g_{t+1} — needs the branches to subtract the old value
and add the new one, loop after loop (docs/length-generalisation.md: the block learns the group's table, 99.2 % of
the products, and still loses the chained product as the words grow). With `model.forget_gate` the loop becomes

    h_{t+1} = f ⊙ h_t + (TF(h_t (+ e)) − h_t),    f = σ(w ⊙ RMSN(TF(h_t (+ e))) + b)      (per position and channel)

— the plain loop's update with the carried h_t scaled by a learned forget gate f in (0, 1), as in an LSTM's cell or
a GRU's reset: f → 1 is the paper's loop, f → 0 drops the carried state and keeps only what this loop computed
(input injection included). w starts at 0 and b at `forget_gate_bias` (4: f = σ(4) ≈ 0.982, close to the plain
loop), so the untrained gated model is nearly the plain one, and the gate draws no random numbers (models with and
without it share every other initial weight). The gate reads the block's output, is shared across loops like the
block, and is not modulated by the loop index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ForgetGate(nn.Module):
    """f = σ(w ⊙ RMSN(h_out) + b), then h_out − (1 − f) ⊙ h_prev (see the module docstring).  [..., D] each."""

    def __init__(self, d_model: int, init_bias: float = 4.0, eps: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_model))
        self.bias = nn.Parameter(torch.full((d_model,), float(init_bias)))
        self.init_bias, self.eps = float(init_bias), eps

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.zero_()
        self.bias.fill_(self.init_bias)

    def forget(self, h_out: torch.Tensor) -> torch.Tensor:
        """f: how much of the carried state each channel keeps, in (0, 1).  [..., D]."""
        return torch.sigmoid(self.weight * F.rms_norm(h_out, (h_out.shape[-1],), None, self.eps) + self.bias)

    def forward(self, h_prev: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
        """The new state from the carried one h_prev (before input injection) and the block's output h_out."""
        return h_out - (1 - self.forget(h_out)) * h_prev


def update(gate: ForgetGate | None, h_prev: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """The state after a loop: `gate`(h_prev, h_out), or h_out itself without a gate (the paper's loop)."""
    return h_out if gate is None else gate(h_prev, h_out)


__all__ = ["ForgetGate", "update"]
