"""Deep supervision with a carried state (the recursive-reasoning recipe of HRM / TRM, on the looped trunk).

One sample is run for N supervision steps of r loops each. Step s starts from step s−1's final hidden state,
detached, so backpropagation (and memory) covers one step; every step's read-out gets its own loss:

    h_0 = e = L1(x)
    step s = 1..N:   h_s = TF^r(h_{s-1}.detach() (+ e), loops s·r .. s·r + r − 1)      loss_s = ℓ(L2(h_s), y)

With input injection the read-in e is added before every loop, so at inference (no gradients, nothing to detach)
N steps of r loops are exactly one forward pass of N·r loops; a TMLT model reads the loop index counting on
across steps (`ModelConfig.step_timestep = "continue"`) or restarting at every step ("restart": the same r
modulations each step, the model's `loop_indices` takes t mod r). So evaluation after any number of steps is the
loop-wise curve of the model taken at multiples of r. `supervision_steps` below runs the N steps of inference;
training loops over the same steps itself (`Trainer._micro_step`: each step's forward and loss, then its backward),
with the same carried, detached state and loop offsets (`step_offset`).

Halting across steps (TRM's halting head): a model with an exit gate (`ModelConfig.exit_gate`,
`loopformer.model.halting.ExitGate`) trained with N > 1 steps learns, after every step, the halting target "the
step's answer is already right" (BCE of the row's mean stop logit; the trainer adds it with
`train.losses.exit_loss_weight`). At inference a row stops after the first step whose stop probability reaches the
threshold (`step_exits`), and never later than N.

Shapes: B batch, T length, D width, R loops per step, N steps, C classes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from loopformer.model.looped import LoopOutput, unwrap
from loopformer.model.options import LoopOptions


def step_offset(step_timestep: str, step: int, loops: int) -> int:
    """The loop index the timestep encoding gives the first loop of supervision step `step` (0-based) of `loops`
    loops: counting on across steps ("continue") or restarting at 0 ("restart")."""
    return step * loops if step_timestep == "continue" else 0


def supervision_steps(net: torch.nn.Module, x: torch.Tensor, steps: int, loops: int | None = None, *,
                      return_all: bool = False, detach: bool = True, read_at: torch.Tensor | None = None,
                      read_loops: int | None = None) -> Iterator[LoopOutput]:
    """The N = `steps` supervision steps of `loops` loops each (default: the model's r) on inputs x [B,T]: yields
    each step's output (logits [B,T,C], hidden [B,T,D]; with `return_all` every loop's read-out) in turn.

    `net` may be a DDP / compiled wrapper. Step s > 0 starts from the hidden state of step s−1, detached unless
    `detach` is False; a caller that backpropagates each step's loss before asking for the next keeps one step's
    activations in memory. The timestep encoding continues counting (loop offset s·R) or restarts (offset 0)
    per the model's `step_timestep`. `read_at`, `read_loops`: the read-out's positions and loops (see
    `LoopedTransformer.forward`). Training runs the same steps itself, each with its loss and backward
    (`loopformer.train.trainer.Trainer._micro_step`, with `step_offset`).
    """
    cfg = unwrap(net).config
    R = int(loops or cfg.loops)
    h: torch.Tensor | None = None
    for s in range(int(steps)):
        offset = step_offset(cfg.step_timestep, s, R)
        out = net(x, loops=R, return_all=return_all,
                  opts=LoopOptions(state=h, loop_offset=offset, read_at=read_at, read_loops=read_loops))
        yield out
        h = out.hidden.detach() if detach else out.hidden


def step_exits(stop_logits: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """The step each row stops after: the first s with σ(stop_logits[s]) >= threshold, else the last step.

    stop_logits [N,B] (a row's logit after each step) -> [B] int64 step indices 0..N-1."""
    hold = torch.sigmoid(stop_logits.float()) >= threshold                             # [N,B]
    hold[-1] = True
    return hold.float().argmax(0)                                                       # the first True


__all__ = ["supervision_steps", "step_offset", "step_exits"]
