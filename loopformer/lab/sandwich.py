"""The sandwich norm: an RMSNorm on each residual branch's output as well as the pre-norm on its input (Huginn's
block), as a loop extension:

    X' = X + (γ1(t) ⊙) RMSN(Attn(RMSN(X)))        X'' = X' + (γ2(t) ⊙) RMSN(FF(RMSN(X')))

which bounds every update's size however the weights grow. The output norms have learned gains started at 1.

    model.extensions: {sandwich_norm: {}}

The stability study screened it on the circuit at r = 32 (studies/stability/README.md, "Screens"): 0 % on a failing
looped seed (the recipe alone 15.2 %) and on a failing TMLT seed; it left the core and stays here because
recurrent-depth models use it.
"""

from __future__ import annotations

from torch import nn

from loopformer.model.extensions import LoopExtension
from loopformer.model.layers import RMSNorm


class OutputNorm(nn.Module):
    """RMSN on a branch's output (its gain at `norm.weight`: the state-dict key such models have always had)."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, True, cfg.norm_eps)

    def forward(self, a):
        return self.norm(a)


class SandwichNorm(LoopExtension):
    @classmethod
    def check(cls, cfg) -> None:
        if cfg.compat == "authors" and not cfg.timestep:
            raise ValueError("extensions.sandwich_norm applies to the standard layer, not the published code's "
                             "looped layer (compat=authors)")

    @classmethod
    def branch_out(cls, cfg) -> nn.Module:
        return OutputNorm(cfg)
