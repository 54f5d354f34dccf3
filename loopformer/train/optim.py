"""Optimiser, learning-rate schedules, per-loop losses and loop curricula — pure functions of the step.

Schedules (multipliers of the peak lr, paper App. C.1.3 and C.3):
    linear     warm-up from 0 to lr over `warmup` steps, then linear decay to min_lr at the last step
    cosine     warm-up, then lr_min + (lr - lr_min)·(1 + cos(π·p))/2, p the post-warm-up progress (nanoGPT's)
    constant   warm-up, then lr
    onecycle   warm-up, then cosine to min_lr (cosine with warm-up set by `warmup_fraction`)
Per-loop loss (Sec. 5 / App. C.1.3: Sudoku and ICL put every loop's read-out in the loss, as Yang et al. 2023):
    last       the read-out after the last loop only
    all        the mean of the losses of the read-out after loops 1..R
    window     the mean over the last `loss_window` loops
Per-loop targets (`task.loop_targets`, tasks with intermediate states): the read-out after loop t is scored against
the state after the task's step j(t) (`loopformer.tasks.common.loop_steps`) instead of the answer, normalised by the
answer's supervised positions like the plain per-loop loss.
Exit gate (a model with `exit_gate`, see `loopformer.model.halting`): `exit_loss` adds, weighted by
`exit_loss_weight`, the halting target loss (BCE on "the read-out after loop t is correct") or the exit distribution
loss (the per-loop losses weighted by the exit distribution, minus β × its entropy). A bidirectional model's gate
decides per row (its logit: the mean over the supervised positions), a causal model's per token. The gate reads
the hidden states detached: its loss trains the gate only, never the trunk (with the exit-distribution loss the
trunk still learns from the per-loop task losses that the gate weights).
Elastic depth (`train.loops_sample`): the loop count of a step (or of each row) drawn from a budget range by a
generator seeded with (seed, step); `consistency_loss` ties the read-out at R to a stop-gradient read-out at a
larger budget, `fixed_point_loss` keeps loops past R from moving the state (docs/elastic-depth.md).
Shapes: R loops, B batch, T length, C classes.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from loopformer.errors import UserError
from loopformer.model.halting import exit_distribution_loss, halting_target_loss, row_mean
from loopformer.model.diagnostics import is_timestep_param
from loopformer.tasks.base import IGNORE
from loopformer.tasks.common import loop_steps
from loopformer.train.config import TrainConfig


def warmup_steps(cfg: TrainConfig, total: int) -> int:
    if cfg.warmup_fraction > 0:
        return max(1, int(round(cfg.warmup_fraction * total)))
    return min(cfg.warmup_steps, max(total - 1, 0))


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """The learning rate for optimiser step `step` (0-based) of `total`."""
    warm = warmup_steps(cfg, total)
    if warm > 0 and step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(total - warm, 1)
    p = min(max((step - warm) / span, 0.0), 1.0)
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * p
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))   # cosine / onecycle


def loops_at(cfg: TrainConfig, step: int, final: int) -> int:
    """Training loop count at `step`: the loop curriculum, or the model's loops when it is off."""
    if cfg.loops_start <= 0:
        return final
    return min(final, cfg.loops_start + (step // cfg.loops_every) * cfg.loops_increment)


def budget_range(cfg: TrainConfig, final: int) -> tuple[int, int]:
    """The loop budgets training draws from (`train.loops_sample`): (loops_min, loops_max or the model's loops)."""
    return cfg.loops_min, cfg.loops_max or final


def sample_loops(cfg: TrainConfig, step: int, final: int, seed: int, rows: int = 1) -> np.ndarray:
    """Loop budgets of step `step` (`train.loops_sample`): [rows] ints in loops_min..loops_max, drawn "uniform" or
    "loguniform" (⌊exp(U(log lo, log(hi + 1)))⌋: each octave equally often) by a generator seeded with
    (seed, step) — the same draw on every process and after a resume. "fixed": `loops_at` for every row."""
    if cfg.loops_sample == "fixed":
        return np.full(rows, loops_at(cfg, step, final), dtype=np.int64)
    lo, hi = budget_range(cfg, final)
    rng = np.random.default_rng([seed, step, 0x100B5])
    if cfg.loops_sample == "uniform":
        return rng.integers(lo, hi + 1, size=rows)
    draw = np.floor(np.exp(rng.uniform(math.log(lo), math.log(hi + 1), size=rows))).astype(np.int64)
    return np.clip(draw, lo, hi)


def consistency_loss(student: torch.Tensor, teacher: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Summed disagreement of read-outs [..., C] with a stop-gradient target at the positions `keep` [...] (bool):
    KL(softmax(teacher) || softmax(student)) per position for logits, the squared error for a regression read-out
    (C = 1)."""
    teacher = teacher.detach()
    if student.shape[-1] == 1:
        d = (student - teacher).square().squeeze(-1)
    else:
        d = F.kl_div(F.log_softmax(student.float(), -1), F.log_softmax(teacher.float(), -1), reduction="none",
                     log_target=True).sum(-1)
    return (d * keep).sum()


def fixed_point_loss(h_next: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Summed relative movement of the state past the budget, ||h_next − sg h||² / ||sg h||² per position
    ([B,T,D] -> a scalar, summed over the B·T positions)."""
    h = h.detach()
    return ((h_next - h).square().sum(-1) / h.square().sum(-1).clamp_min(1e-12)).sum()


def steps_for(cfg_steps: int, epochs: float, n_train: Optional[int], batch_size: int) -> int:
    """Optimiser steps: `steps` if set, else `epochs` passes over n_train rows."""
    if cfg_steps:
        return cfg_steps
    if n_train is None:
        raise UserError("this task samples data on the fly: set train.steps instead of train.epochs")
    return max(1, math.ceil(epochs * n_train / batch_size))


def loss_loops(cfg: TrainConfig, loops: int) -> Optional[int]:
    """How many trailing loops enter the loss (None: only the final read-out, no per-loop outputs needed)."""
    if cfg.loss_loops == "last":
        return None
    if cfg.loss_loops == "all":
        return loops
    return min(cfg.loss_window, loops)


def loop_targets(step_targets: torch.Tensor, loops: int, n_read: int) -> torch.Tensor:
    """The targets of the last `n_read` of `loops` read-outs from a task's intermediate states: [n_read,B,T] from
    step_targets [B,K,T], loop t scored against step j(t) (`loop_steps`)."""
    j = torch.as_tensor(loop_steps(loops, step_targets.shape[1])[loops - n_read:] - 1, device=step_targets.device)
    return step_targets.index_select(1, j).transpose(0, 1)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norm gains, biases) and embeddings' positions do not (GPT-2 practice).

    The timestep parameters (`is_timestep_param`) form their own groups with lr × `timestep_lr_mult` (each group's
    "lr_mult"; the trainer sets `lr = schedule × lr_mult`) and weight decay `timestep_weight_decay`. All groups
    are updated by one fused kernel on CPUs and CUDA GPUs (one pass over the parameters, not one per tensor).
    """
    groups: dict[tuple[bool, bool], list] = {(ts, dec): [] for ts in (False, True) for dec in (True, False)}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decays = p.dim() >= 2 and "pos" not in name.split(".")[-2:]
        groups[(is_timestep_param(name), decays)].append(p)
    ts_wd = cfg.weight_decay if cfg.timestep_weight_decay is None else cfg.timestep_weight_decay
    out = [{"params": groups[(False, True)], "weight_decay": cfg.weight_decay, "lr_mult": 1.0},
           {"params": groups[(False, False)], "weight_decay": 0.0, "lr_mult": 1.0}]
    if groups[(True, True)] or groups[(True, False)]:
        out += [{"params": groups[(True, True)], "weight_decay": ts_wd, "lr_mult": cfg.timestep_lr_mult},
                {"params": groups[(True, False)], "weight_decay": 0.0, "lr_mult": cfg.timestep_lr_mult}]
    params = [p for g in out for p in g["params"]]
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(out, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)


def summed_loss(logits: torch.Tensor, targets: torch.Tensor, weight: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, int]:
    """(sum of per-position losses, number of supervised positions).

    Token logits [..., B,T,C] with integer targets [B,T] (IGNORE skipped): cross-entropy; targets [..., B,T] give
    every read-out its own targets (per-loop targets; the count is then the mean per read-out).
    Regression outputs [..., B,T,1] with real targets [B,T] and `weight` [B,T] (1 = supervised): squared error.
    Leading dims (loops) are summed over; the count is per read-out.
    """
    if targets.dtype.is_floating_point:
        return loss_sum(logits, targets, weight), int((torch.ones_like(targets) if weight is None else weight).sum())
    lead = logits.shape[:-3]
    per_read = targets.dim() == logits.dim() - 1                   # targets [..., B,T]: one per read-out
    count = int((targets != IGNORE).sum().item())
    return loss_sum(logits, targets), count // max(1, math.prod(lead)) if per_read else count


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sum of `summed_loss` alone (no host synchronisation: it compiles into one graph with the forward)."""
    if targets.dtype.is_floating_point:
        pred = logits[..., 0].float()
        w = torch.ones_like(targets) if weight is None else weight.to(targets.dtype)
        return ((pred - targets).pow(2) * w).sum()
    lead = logits.shape[:-3]
    per_read = targets.dim() == logits.dim() - 1                   # targets [..., B,T]: one per read-out
    flat_t = (targets if per_read else targets.expand(*lead, *targets.shape)).reshape(-1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat_t, ignore_index=IGNORE,
                           reduction="sum")


def per_loop_losses(all_logits: torch.Tensor, targets: torch.Tensor, weight: Optional[torch.Tensor] = None,
                    per_token: bool = False) -> torch.Tensor:
    """The read-out's loss after every loop: per position [R,B,T] (`per_token`; 0 outside the loss), or per row
    [R,B] (mean over the row's supervised positions).  all_logits [R,B,T,C], targets [B,T]."""
    R = all_logits.shape[0]
    if targets.dtype.is_floating_point:
        loss = (all_logits[..., 0].float() - targets).pow(2)                              # [R,B,T]
        mask = torch.ones_like(targets, dtype=torch.bool) if weight is None else weight > 0
        loss = loss * mask
    else:
        mask = targets != IGNORE
        loss = F.cross_entropy(all_logits.flatten(0, 2).float(), targets.expand(R, *targets.shape).reshape(-1),
                               ignore_index=IGNORE, reduction="none").view(R, *targets.shape)
    return loss if per_token else row_mean(loss, mask)


def per_loop_correct(all_logits: torch.Tensor, targets: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Whether the read-out after every loop is right: per position [R,B,T] (`per_token`), or per row [R,B] (every
    supervised position right).  all_logits [R,B,T,C], targets [B,T] class ids."""
    right = all_logits.argmax(-1) == targets                                               # [R,B,T]
    return right if per_token else (right | (targets == IGNORE)).all(-1)


def exit_loss(cfg: TrainConfig, all_logits: torch.Tensor, all_stop: torch.Tensor, targets: torch.Tensor,
              weight: Optional[torch.Tensor] = None, per_token: bool = False) -> torch.Tensor:
    """The exit gate's loss (`cfg.exit_loss`), unweighted: "target" or "distribution" (module docstring).

    all_logits [R,B,T,C], all_stop [R,B,T] (the gate's logits after every loop), targets [B,T]."""
    supervised = (targets != IGNORE) if not targets.dtype.is_floating_point else \
        (torch.ones_like(targets, dtype=torch.bool) if weight is None else weight > 0)      # [B,T]
    stop = all_stop if per_token else row_mean(all_stop, supervised)                       # [R,B,T] | [R,B]
    mask = supervised if per_token else supervised.any(-1)                                 # [B,T] | [B]
    if cfg.exit_loss == "target":
        if targets.dtype.is_floating_point:
            raise UserError("train.exit_loss=target needs class targets (use distribution for regression)")
        correct = per_loop_correct(all_logits.detach(), targets, per_token)
        return halting_target_loss(stop, correct, mask)
    losses = per_loop_losses(all_logits, targets, weight, per_token)
    return exit_distribution_loss(losses, stop, cfg.exit_entropy_weight, mask)
