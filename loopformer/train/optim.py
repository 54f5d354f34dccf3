"""Optimiser, learning-rate schedules and loop counts (curriculum, sampled budgets) — pure functions of the step.

Schedules (multipliers of the peak lr, paper App. C.1.3 and C.3):
    linear     warm-up from 0 to lr over `warmup` steps, then linear decay to min_lr at the last step
    cosine     warm-up, then lr_min + (lr - lr_min)·(1 + cos(π·p))/2, p the post-warm-up progress (nanoGPT's)
    constant   warm-up, then lr
    onecycle   warm-up, then cosine to min_lr (cosine with warm-up set by `warmup_fraction`)
Loop curriculum (`train.loops.start`): the loop count rises by `increment` every `every` steps of its clock — the
step, or with `train.loops.gate` the steps of the log windows whose training accuracy reached the gate (`gate_clock`;
the count stays until the task is learned at it, whatever the step budget or the task's difficulty).
Elastic depth (`train.loops.sample`): the loop count of a step (or of each row) drawn from a budget range by a
generator seeded with (seed, step) (docs/elastic-depth.md; its losses are `loopformer.train.losses`); with a loop
curriculum, drawn once the curriculum has reached the model's loops.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from loopformer.errors import UserError
from loopformer.model.layers import is_timestep_param, param_group
from loopformer.train.config import LoopSampling, OptimConfig


def warmup_steps(cfg: OptimConfig, total: int) -> int:
    if cfg.warmup_fraction > 0:
        return max(1, int(round(cfg.warmup_fraction * total)))
    return min(cfg.warmup_steps, max(total - 1, 0))


def lr_at(cfg: OptimConfig, step: int, total: int) -> float:
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


def loops_at(cfg: LoopSampling, clock: int, final: int) -> int:
    """Training loop count at curriculum clock `clock` (the step, or `gate_clock`): the loop curriculum, or the
    model's loops when it is off."""
    if cfg.start <= 0:
        return final
    return min(final, cfg.start + (clock // cfg.every) * cfg.increment)


def gate_clock(clock: int, accuracy: float, window: int, gate: float) -> int:
    """The curriculum clock after a log window of `window` steps whose training accuracy was `accuracy`
    (`train.loops.gate` = a): clock + window when accuracy >= a, else clock — the count rises only through steps
    trained at a loop count the model has learned."""
    return clock + window if accuracy >= gate else clock


def curriculum_end(cfg: LoopSampling, final: int) -> int | None:
    """The first step whose loop curriculum count (`loops_at`) is `final` (the model's loops); None without a
    curriculum. A run of fewer steps never trains at `final` loops, nor draws past it (`hold`)."""
    if cfg.start <= 0 or cfg.start >= final:
        return None if cfg.start <= 0 else 0
    return math.ceil((final - cfg.start) / cfg.increment) * cfg.every


def sample_loops(cfg: LoopSampling, step: int, final: int, seed: int, rows: int = 1,
                 clock: int | None = None) -> np.ndarray:
    """Loop budgets of step `step` (`train.loops.sample`): [rows] ints in min..max, drawn "uniform" or
    "loguniform" (⌊exp(U(log lo, log(hi + 1)))⌋: each octave equally often) by a generator seeded with
    (seed, step) — the same draw on every process and after a resume. "fixed": `loops_at` for every row. With a loop
    curriculum as well (`start`), the curriculum's count until it reaches `final`, the draws from then on
    (e.g. budgets past r once the r loops are learned, so that the answer is trained to hold past them); before step
    `sample_from`, never a draw. With `hold_ramp` the hold's upper bound grows linearly from r to ⌈f·r⌉ over that
    many steps from the first draw. `clock`: the curriculum's clock (`gate_clock`; None: the step), which also
    times the ramp."""
    at = step if clock is None else clock
    R = loops_at(cfg, at, final)
    if not cfg.samples_budgets or R < final or step < cfg.sample_from:
        return np.full(rows, R, dtype=np.int64)
    lo, hi = cfg.budget_range(final)
    if cfg.hold_ramp:                    # the ramp: r .. r + (⌈f·r⌉ − r) · (steps drawn so far) / hold_ramp
        first = max(cfg.sample_from if clock is None else 0, curriculum_end(cfg, final) or 0)
        hi = lo + (hi - lo) * min(max(at - first, 0), cfg.hold_ramp) // cfg.hold_ramp
    rng = np.random.default_rng([seed, step, 0x100B5])
    if cfg.sample == "uniform" or cfg.hold:
        return rng.integers(lo, hi + 1, size=rows)
    draw = np.floor(np.exp(rng.uniform(math.log(lo), math.log(hi + 1), size=rows))).astype(np.int64)
    return np.clip(draw, lo, hi)


def steps_for(cfg_steps: int, epochs: float, n_train: int | None, batch_size: int) -> int:
    """Optimiser steps: `steps` if set, else `epochs` passes over n_train rows."""
    if cfg_steps:
        return cfg_steps
    if n_train is None:
        raise UserError("this task samples data on the fly: set train.steps instead of train.epochs")
    return max(1, math.ceil(epochs * n_train / batch_size))


def freeze(model: torch.nn.Module, groups: list[str]) -> None:
    """`train.optim.freeze`: the parameters of these groups (`loopformer.model.layers.PARAM_GROUPS`) stop requiring
    gradients, so the optimiser never holds them and they keep the values they start with. A UserError when that
    leaves nothing to train."""
    if not groups:
        return
    named = list(model.named_parameters())
    for name, p in named:
        if param_group(name) in groups:
            p.requires_grad_(False)
    if not any(p.requires_grad for _, p in named):
        have = sorted({param_group(n) for n, _ in named})
        raise UserError(f"train.optim.freeze={groups} leaves no parameter to train (this model's groups: {have})")


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
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
        out += [{"params": groups[(True, True)], "weight_decay": ts_wd, "lr_mult": cfg.timestep_lr_mult,
                 "timestep": True},
                {"params": groups[(True, False)], "weight_decay": 0.0, "lr_mult": cfg.timestep_lr_mult,
                 "timestep": True}]
    params = [p for g in out for p in g["params"]]
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(out, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)
