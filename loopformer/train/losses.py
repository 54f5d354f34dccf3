"""Training losses: the task loss at the supervised positions and loops, the exit gate's losses, elastic depth's.

Supervised positions (`supervised`): a class target other than IGNORE, or a regression weight above 0 (every
position when a regression batch has no weight). The trainer's read-out looks only there (`read_positions`,
`at_read`: the read-outs and targets as one row of n positions, `LoopOptions.read_at`).
Per-loop loss (Sec. 5 / App. C.1.3: Sudoku and ICL put every loop's read-out in the loss, as Yang et al. 2023;
`train.losses.loops`, `loss_loops`):
    last       the read-out after the last loop only
    all        the mean of the losses of the read-out after loops 1..R
    window     the mean over the last `train.losses.window` loops
Per-loop targets (`task.loop_targets`, tasks with intermediate states): the read-out after loop t is scored against
the state after the task's step j(t) (`loopformer.tasks.common.loop_steps`, `loop_targets`) instead of the answer,
normalised by the answer's supervised positions like the plain per-loop loss.
Exit gate (a model with `exit_gate`, `loopformer.model.halting.ExitGate`): `exit_loss` adds, weighted by
`train.losses.exit_loss_weight`, one of two losses (`train.losses.exit_loss`):

    target        (halting target, as TRM's halting head)  BCE(g_t, c_t), c_t = 1 when the read-out after loop t is
                  already correct: the gate learns P(correct | h_t), so the threshold θ is a target accuracy
    distribution  (exit distribution, as Ouro)  λ_t = σ(g_t), p_t = λ_t ∏_{s<t} (1 − λ_s) for t < R and
                  p_R = ∏_{s<R} (1 − λ_s) (the remainder exits at the last loop); loss = Σ_t p_t L_t − β H(p),
                  L_t the read-out's loss after loop t and H(p) = −Σ_t p_t log p_t

A bidirectional model's gate decides per row (its logit: the mean over the supervised positions), a causal model's
per token. The gate reads the hidden states detached: its loss trains the gate only, never the trunk (with the
exit-distribution loss the trunk still learns from the per-loop task losses that the gate weights).
Elastic depth and holding past r (`elastic_losses`): `fixed_point_loss` keeps loops past R from moving the state
(`train.losses.fixed_point`; docs/elastic-depth.md, the circuit's settle recipe).
One supervision step's loss, what the trainer backpropagates, is `step_loss`: the task loss scaled to the global
batch's mean, the fixed-point loss and the exit gate's loss, summed in one place; its micro-batch is a `MicroBatch`.
Shapes: R loops, B batch, T length, C classes, n read positions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from loopformer.errors import UserError
from loopformer.model.halting import row_mean
from loopformer.model.looped import LoopOutput
from loopformer.model.options import LoopOptions
from loopformer.tasks.base import IGNORE
from loopformer.tasks.common import loop_steps
from loopformer.train.config import LossConfig, TrainConfig


# ------------------------------------------------------------------------------------------------- positions
def supervised(targets: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Which positions the loss supervises, bool [..., B,T]: class targets other than IGNORE; for regression
    targets (reals) a `weight` above 0, or every position when `weight` is None."""
    if not targets.dtype.is_floating_point:
        return targets != IGNORE
    return torch.ones_like(targets, dtype=torch.bool) if weight is None else weight > 0


def supervised_count(targets: torch.Tensor, weight: torch.Tensor | None = None) -> int:
    """The number of supervised positions (one host sync): `supervised` summed; for regression the weights' sum."""
    if targets.dtype.is_floating_point and weight is not None:
        return int(weight.sum())
    return int(supervised(targets).sum())


def read_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[n] int64: the flattened B·T positions a batch's loss looks at — a target (or, with per-loop targets, any
    loop's target), or a weight above 0 for regression — or None when that is every position."""
    seen = supervised(batch["targets"], batch.get("weight"))
    if "step_targets" in batch and not batch["targets"].dtype.is_floating_point:
        seen = seen | supervised(batch["step_targets"]).any(1)                        # [B,K,T] -> [B,T]
    return None if bool(seen.all()) else seen.flatten().nonzero().squeeze(1)


def at_read(at: torch.Tensor | None, logits: torch.Tensor, targets: torch.Tensor,
            weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Read-outs taken at the positions `at` ([..., n, C], `read_positions`) with targets [..., B,T] (and weight
    [B,T]) as one row of n positions: ([..., 1, n, C], [..., 1, n], [1, n]), the layout `summed_loss` reads.
    Unchanged when `at` is None."""
    if at is None:
        return logits, targets, weight
    pick = (lambda z: z.flatten(-2).index_select(-1, at).unsqueeze(-2))                 # [..., B,T] -> [..., 1,n]
    return logits.unsqueeze(-3), pick(targets), None if weight is None else pick(weight)


# ------------------------------------------------------------------------------------------------- the task loss
def loss_loops(cfg: LossConfig, loops: int) -> int | None:
    """How many trailing loops enter the loss (None: only the final read-out, no per-loop outputs needed)."""
    if cfg.loops == "last":
        return None
    if cfg.loops == "all":
        return loops
    return min(cfg.window, loops)


def loop_targets(step_targets: torch.Tensor, loops: int, n_read: int, per_row: bool = False) -> torch.Tensor:
    """The targets of the last `n_read` of `loops` read-outs from a task's intermediate states: [n_read,B,T] from
    step_targets [B,K,T], loop t scored against step j(t) (`loop_steps`) of a run of `loops` loops (a curriculum's
    shorter steps spread the K steps over their loops). `per_row` (a loop rule: each row runs its own T(n) loops,
    at least its own steps): loop t is step min(t, K) whatever the batch's largest loop count — the steps are never
    spread over fewer loops, since a batch of short rows (a length curriculum) runs fewer loops than the K steps of
    the longest row, and each row's step_targets hold its final state after its own steps."""
    K = step_targets.shape[1]
    full = loop_steps(max(loops, K if per_row else 0), K)[:loops]
    j = torch.as_tensor(full[loops - n_read:] - 1, device=step_targets.device)
    return step_targets.index_select(1, j).transpose(0, 1)


def summed_loss(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, int]:
    """(sum of per-position losses, number of supervised positions).

    Token logits [..., B,T,C] with integer targets [B,T] (IGNORE skipped): cross-entropy; targets [..., B,T] give
    every read-out its own targets (per-loop targets; the count is then the mean per read-out).
    Regression outputs [..., B,T,1] with real targets [B,T] and `weight` [B,T] (1 = supervised): squared error.
    Leading dims (loops) are summed over; the count is per read-out.
    """
    if targets.dtype.is_floating_point:
        return loss_sum(logits, targets, weight), supervised_count(targets, weight)
    lead = logits.shape[:-3]
    per_read = targets.dim() == logits.dim() - 1                   # targets [..., B,T]: one per read-out
    count = supervised_count(targets)
    return loss_sum(logits, targets), count // max(1, math.prod(lead)) if per_read else count


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None = None,
             kind: str = "cross_entropy") -> torch.Tensor:
    """The sum of `summed_loss` alone (no host synchronisation: it compiles into one graph with the forward).
    kind: the classification loss, "cross_entropy" or "stablemax" (`stablemax_cross_entropy`)."""
    if targets.dtype.is_floating_point:
        pred = logits[..., 0].float()
        w = torch.ones_like(targets) if weight is None else weight.to(targets.dtype)
        return ((pred - targets).pow(2) * w).sum()
    lead = logits.shape[:-3]
    per_read = targets.dim() == logits.dim() - 1                   # targets [..., B,T]: one per read-out
    flat_t = (targets if per_read else targets.expand(*lead, *targets.shape)).reshape(-1)
    if kind == "stablemax":
        return stablemax_cross_entropy(logits.reshape(-1, logits.shape[-1]), flat_t)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat_t, ignore_index=IGNORE,
                           reduction="sum")


def stablemax_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE
                            ) -> torch.Tensor:
    """Σ_n −log p_n(y_n) under stablemax (Prieto et al., "Grokking at the edge of numerical stability"; the loss of
    TRM and of equilibrium reasoners): p_i = s(x_i) / Σ_j s(x_j) with s(x) = x + 1 for x ≥ 0 and 1 / (1 − x) for
    x < 0 — a softmax whose exponential is replaced by a function that grows linearly, so a confident logit cannot
    push the loss into float round-off (softmax collapse). Positions with target `ignore_index` are skipped.
    logits [N,C], targets [N] -> a scalar (the sum)."""
    x = logits.float()
    s = torch.where(x >= 0, x + 1, 1 / (1 - torch.clamp(x, max=0)))                          # [N,C] > 0
    keep = targets != ignore_index
    t = torch.where(keep, targets, 0)
    log_p = torch.log(s.gather(-1, t[:, None]).squeeze(-1)) - torch.log(s.sum(-1))           # [N]
    return -(log_p * keep).sum()


def per_loop_losses(all_logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None = None,
                    per_token: bool = False) -> torch.Tensor:
    """The read-out's loss after every loop: per position [R,B,T] (`per_token`; 0 outside the loss), or per row
    [R,B] (mean over the row's supervised positions).  all_logits [R,B,T,C], targets [B,T]."""
    R = all_logits.shape[0]
    mask = supervised(targets, weight)                                                    # [B,T]
    if targets.dtype.is_floating_point:
        loss = (all_logits[..., 0].float() - targets).pow(2)                              # [R,B,T]
        loss = loss * mask
    else:
        loss = F.cross_entropy(all_logits.flatten(0, 2).float(), targets.expand(R, *targets.shape).reshape(-1),
                               ignore_index=IGNORE, reduction="none").view(R, *targets.shape)
    return loss if per_token else row_mean(loss, mask)


def per_loop_correct(all_logits: torch.Tensor, targets: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Whether the read-out after every loop is right: per position [R,B,T] (`per_token`), or per row [R,B] (every
    supervised position right).  all_logits [R,B,T,C], targets [B,T] class ids."""
    right = all_logits.argmax(-1) == targets                                               # [R,B,T]
    return right if per_token else (right | ~supervised(targets)).all(-1)


# ------------------------------------------------------------------------------------------------- the exit gate
def _masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of x [R, *] over every element, or over the elements of [*] where `mask` holds (broadcast over R)."""
    if mask is None:
        return x.mean()
    w = mask.to(x.dtype).expand_as(x)
    return (x * w).sum() / w.sum().clamp(min=1)


def halting_target_loss(stop_logits: torch.Tensor, correct: torch.Tensor,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Halting target (TRM's halting head):  mean_t,n BCE(σ(g_t,n), c_t,n),  c = 1 where the read-out after loop t
    is already correct.  stop_logits [R, *], correct [R, *] bool, mask [*] (which entries count; None: all)."""
    bce = F.binary_cross_entropy_with_logits(stop_logits.float(), correct.float(), reduction="none")
    return _masked_mean(bce, mask)


def exit_distribution(stop_logits: torch.Tensor) -> torch.Tensor:
    """p_t = λ_t ∏_{s<t}(1 − λ_s) for t < R, p_R = ∏_{s<R}(1 − λ_s), λ = σ(g): the probability of exiting after
    loop t, summing to 1 over t.  [R, *] -> [R, *] (computed in log space)."""
    g = stop_logits.float()
    log_stop, log_go = F.logsigmoid(g), F.logsigmoid(-g)                       # log λ, log(1 − λ)
    survive = torch.cumsum(log_go, 0) - log_go                                  # Σ_{s<t} log(1 − λ_s)
    log_p = survive + log_stop
    log_p = torch.cat([log_p[:-1], survive[-1:]], 0)                            # the remainder exits at R
    return log_p.exp()


def exit_distribution_loss(per_loop_losses: torch.Tensor, stop_logits: torch.Tensor,
                           entropy_weight: float = 0.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exit distribution (Ouro):  mean_n [ Σ_t p_t,n L_t,n − β H(p_·,n) ],  H(p) = −Σ_t p_t log p_t.

    per_loop_losses [R, *] (L_t: the read-out's loss after loop t), stop_logits [R, *], β = `entropy_weight`,
    mask [*] (which entries count; None: all)."""
    p = exit_distribution(stop_logits)                                          # [R, *]
    expected = (p * per_loop_losses.float()).sum(0)                             # [*]
    ent = -(p * torch.log(p.clamp(min=1e-30))).sum(0)
    return _masked_mean((expected - entropy_weight * ent)[None], mask)


def exit_loss(cfg: LossConfig, all_logits: torch.Tensor, all_stop: torch.Tensor, targets: torch.Tensor,
              weight: torch.Tensor | None = None, per_token: bool = False) -> torch.Tensor:
    """The exit gate's loss (`cfg.exit_loss`), unweighted: "target" or "distribution" (module docstring).

    all_logits [R,B,T,C], all_stop [R,B,T] (the gate's logits after every loop), targets [B,T]."""
    mask_bt = supervised(targets, weight)                                                  # [B,T]
    stop = all_stop if per_token else row_mean(all_stop, mask_bt)                          # [R,B,T] | [R,B]
    mask = mask_bt if per_token else mask_bt.any(-1)                                       # [B,T] | [B]
    if cfg.exit_loss == "target":
        if targets.dtype.is_floating_point:
            raise UserError("train.losses.exit_loss=target needs class targets (use distribution for regression)")
        correct = per_loop_correct(all_logits.detach(), targets, per_token)
        return halting_target_loss(stop, correct, mask)
    losses = per_loop_losses(all_logits, targets, weight, per_token)
    return exit_distribution_loss(losses, stop, cfg.exit_entropy_weight, mask)


# ------------------------------------------------------------------------------------------------- elastic depth
def fixed_point_loss(h_next: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Summed relative movement of the state past the budget, ||h_next − sg h||² / ||sg h||² per position
    ([B,T,D] -> a scalar, summed over the B·T positions)."""
    h = h.detach()
    return ((h_next - h).square().sum(-1) / h.square().sum(-1).clamp_min(1e-12)).sum()


def elastic_losses(model: torch.nn.Module, tc: TrainConfig, x: torch.Tensor, out: LoopOutput,
                   R: int) -> torch.Tensor | float:
    """The fixed-point loss of one micro-batch (inputs x) whose step ran R loops (`train.losses.fixed_point`; 0 when
    off): the state after fixed_point_loops more loops against the state at R, a mean over positions. The extra
    forward runs on `model`, the raw model (DDP reduces its gradients with the main forward's)."""
    lc = tc.losses
    if lc.fixed_point <= 0:
        return 0.0
    nxt = model(x, loops=lc.fixed_point_loops, opts=LoopOptions(state=out.hidden, loop_offset=R, budget=R)).hidden
    n_pos = out.hidden.shape[0] * out.hidden.shape[1] * tc.grad_accum
    return lc.fixed_point * fixed_point_loss(nxt, out.hidden) / n_pos


# ------------------------------------------------------------------------------------------------- one step's loss
@dataclass
class MicroBatch:
    """One micro-batch of a training step as its forward and loss read it (`Trainer.forward_loss`)."""
    inputs: torch.Tensor                    # [b,T] token ids ([b,T,F] vectors)
    targets: torch.Tensor                   # [b,T] | [n_read,b,T] per-loop targets
    weight: torch.Tensor | None             # [b,T] regression weights, else None
    at: torch.Tensor | None                 # [n] the read positions among the flattened b·T (None: every one)
    rows: torch.Tensor | None               # [b] a loop count per row, else None
    loops: int                              # R: the loops of a supervision step (rows of their own: the largest)
    return_all: bool                        # every loop's read-out (per-loop losses, the exit gate)
    read_loops: int | None                  # ... of the last read_loops loops only (None: all of them)
    n_read: int | None                      # read-outs in the task loss (None: the final one)
    read_only: bool                         # nothing but the loss reads the output: the last loop at `at` only


@dataclass
class StepScale:
    """What turns one supervision step's sums into its share of the global batch's mean loss."""
    task: float                             # processes / (supervised positions × read-outs × supervision steps)
    gate: float                             # the exit gate's divisor: micro-batches × supervision steps
    per_loop_gate: bool                     # the exit gate reads every loop (else the step's last)


def gate_loss(gate: torch.nn.Module, lc: LossConfig, out: LoopOutput, targets: torch.Tensor,
              weight: torch.Tensor | None, per_loop: bool, causal: bool) -> torch.Tensor:
    """The exit gate's loss (`exit_loss`) on one supervision step's output: after every loop (`per_loop`) or after
    the step. The gate reads, never steers: the hidden states are detached."""
    stops_, reads = ((gate(out.all_hidden.detach()), out.all_logits) if per_loop            # [R,B,T(,C)]
                     else (gate(out.hidden.detach())[None], out.logits[None]))             # the step's [1,...]
    return exit_loss(lc, reads, stops_, targets, weight, causal)


def step_loss(task_sum: torch.Tensor, out: LoopOutput, mb: MicroBatch, answers: torch.Tensor, model: torch.nn.Module,
              tc: TrainConfig, scale: StepScale,
              autocast: Callable[[], Any] = contextlib.nullcontext) -> torch.Tensor:
    """The loss one supervision step backpropagates: the task loss `task_sum` (`loss_sum` at the read positions)
    scaled to the global batch's mean, plus the fixed-point loss (`elastic_losses`, under `autocast` like the
    forward) and, for a model whose exit gate trains, the gate's loss (`gate_loss`, in full precision) against the
    answers [b,T]. `model`: the raw model."""
    with autocast():
        loss = task_sum * scale.task + elastic_losses(model, tc, mb.inputs, out, mb.loops)
    gate = getattr(model, "exit_gate", None)
    if gate is not None and tc.losses.exit_loss_weight > 0:   # a mean over this micro-batch (DDP: over processes)
        loss = loss + tc.losses.exit_loss_weight / scale.gate * gate_loss(
            gate, tc.losses, out, answers, mb.weight, scale.per_loop_gate, model.config.causal)
    return loss


__all__ = ["supervised", "supervised_count", "read_positions", "at_read", "loss_loops", "loop_targets",
           "summed_loss", "loss_sum", "per_loop_losses", "per_loop_correct", "halting_target_loss",
           "exit_distribution", "exit_distribution_loss", "exit_loss", "fixed_point_loss", "elastic_losses",
           "MicroBatch", "StepScale", "gate_loss", "step_loss"]
