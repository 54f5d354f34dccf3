"""An exponential moving average of the weights (as HRM / TRM and the diffusion models use).

After every optimiser step, for every parameter p of the raw model and its average a:

    a ← decay · a + (1 − decay) · p            (a starts as a copy of the initial weights)

Buffers are copied as they are. The average is a full model (`EMA.module`, same class and config), so evaluation
and checkpoints treat it like the raw weights; the trainer evaluates both and saves it next to them
(`loopformer.model.io`, `ema.safetensors`), so a resumed run continues the same average.
"""

from __future__ import annotations

import copy

import torch

from loopformer.model.looped import unwrap


class EMA:
    """The moving average of a model's weights with `decay` in (0, 1)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the EMA decay must be in (0, 1) (got {decay})")
        self.decay = float(decay)
        self.module = copy.deepcopy(unwrap(model)).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """One step of the average towards the current weights of `model` (its raw module)."""
        raw = unwrap(model)
        for a, p in zip(self.module.parameters(), raw.parameters()):
            a.mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)
        for a, b in zip(self.module.buffers(), raw.buffers()):
            a.copy_(b)


class ShardedEMA:
    """The moving average of a sharded model's weights (`train.system.parallel=fsdp`): each process averages its own
    shard of every parameter (`tensors`, {name: sharded tensor}), with the same arithmetic as `EMA`; checkpoints write
    the shards with the model's (`loopformer.train.sharding`) and rank 0 the gathered average as `ema.safetensors`."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the EMA decay must be in (0, 1) (got {decay})")
        self.decay = float(decay)
        self.tensors = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for n, p in model.named_parameters():
            self.tensors[n].mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)


__all__ = ["EMA", "ShardedEMA"]
