"""Run configuration: one typed, nested dataclass per experiment (model, task, optimisation, evaluation, logging).

The shipped YAML files in `configs/` fill these; dotted overrides (`train.optim.lr=3e-4 model.loops=16`) go on top.
Defaults follow the paper's reasoning-task recipe (App. C.1.3): AdamW β = (0.9, 0.999), weight decay 0.01,
lr 1e-4 decayed linearly to 0 after 5 warm-up steps, batch 64. The language-modelling recipe (App. C.3: β2 0.95,
wd 1e-4, 2000 warm-up steps, cosine from 2e-4 to 6e-5) is `schedule: cosine` with its values in the YAML.

The train section keeps a run's length and batches at its top and the rest in small sections: `train.optim`
(`OptimConfig`), `train.loops` (`LoopSampling`), `train.losses` (`LossConfig`), `train.select` (`SelectConfig`),
`train.system` (`SystemConfig`); each checks its own fields, the checks across sections are `RunConfig`'s. The flat
keys of the earlier release (`train.lr`, `train.loops_hold`, `train.compile`, ... : `RENAMED`) still load until the
next release — in a YAML file, an override, a stage's `set`, a sweep's grid, a run folder's stored config — each
named once on stderr with its new key (`upgrade`).

The model section is a `ModelConfig`; the fields the task fixes (vocabulary / input width, sequence length,
causality, read-out) are filled from the task before the YAML is applied, so a config only names what it chooses.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loopformer.configio import load_config, one_line, user_layers
from loopformer.device import DEVICES
from loopformer.errors import UserError
from loopformer.eval.config import EvalConfig
from loopformer.model.config import BEFORE_SPLIT, ModelConfig
from loopformer.model.config import REMOVED as MODEL_REMOVED
from loopformer.model.config import migrate as migrate_model
from loopformer.model.layers import PARAM_GROUPS
from loopformer.model.memory import loop_cap
from loopformer.sources import TaskConfig, model_fields
from loopformer.train.compiling import COMPILE_SCOPES

LOSS_LOOPS = ("last", "all", "window")
EXIT_LOSSES = ("target", "distribution")
LOOP_SAMPLES = ("fixed", "uniform", "loguniform")
SAMPLE_PER = ("batch", "row")
SCHEDULES = ("linear", "cosine", "constant", "onecycle")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
COMPILE = ("auto", "true", "false")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass
class OptimConfig:
    """The optimiser (AdamW) and its learning-rate schedule (`loopformer.train.optim`)."""
    lr: float = 1e-4
    min_lr: float = 0.0               # the schedule's floor
    schedule: str = "linear"          # linear | cosine | constant | onecycle (warm-up to lr, cosine to min_lr)
    warmup_steps: int = 5
    warmup_fraction: float = 0.0      # if > 0, warm-up = this fraction of the steps (overrides warmup_steps)
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0            # max global gradient norm; 0 disables clipping
    timestep_lr_mult: float = 0.1     # lr multiplier of the timestep embedder and the modulations (TMLT); 1: the
                                      # paper's single learning rate. See docs/tmlt-study.md
    timestep_weight_decay: float | None = None  # their weight decay (None: weight_decay)
    freeze: list[str] = field(default_factory=list)  # parameter groups that keep the values they start with (not
                                      # trained): any of embedding, block, timestep, modulation, past, head. E.g.
                                      # [embedding, block, timestep, modulation, head] trains only the loops past r's
                                      # own modulation (model.timestep_past: own) from train.init_from's weights

    def __post_init__(self) -> None:
        _need(self.lr > 0 and 0 <= self.min_lr <= self.lr,
              "need train.optim.lr > 0 and 0 <= train.optim.min_lr <= train.optim.lr")
        _need(self.schedule in SCHEDULES, f"train.optim.schedule must be one of {SCHEDULES} (got {self.schedule!r})")
        _need(self.warmup_steps >= 0 and 0 <= self.warmup_fraction < 1,
              "bad warm-up: train.optim.warmup_steps >= 0 and train.optim.warmup_fraction in [0, 1)")
        _need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
              "train.optim.betas must be two values in [0,1)")
        _need(self.grad_clip >= 0 and self.weight_decay >= 0,
              "train.optim.grad_clip and train.optim.weight_decay must be >= 0")
        _need(0 <= self.eps < 1, f"train.optim.eps must be in [0, 1) (got {self.eps})")   # NaN fails every comparison
        _need(self.timestep_lr_mult > 0, f"train.optim.timestep_lr_mult must be > 0 (got {self.timestep_lr_mult})")
        _need(self.timestep_weight_decay is None or self.timestep_weight_decay >= 0,
              "train.optim.timestep_weight_decay must be >= 0 (or null)")
        _need(all(g in PARAM_GROUPS for g in self.freeze) and len(set(self.freeze)) == len(self.freeze),
              f"train.optim.freeze lists parameter groups, each once, of {PARAM_GROUPS} (got {self.freeze})")


@dataclass
class LoopSampling:
    """The loop count R of each training step: the loop curriculum, elastic depth's drawn budgets
    (docs/elastic-depth.md), the hold past r and a loop rule's jitter (`loopformer.train.optim`)."""
    start: int = 0                    # loop curriculum: start with this many loops (0: off) ...
    every: int = 1000                 # ... and add `increment` loops every `every` steps, up to model.loops
    increment: int = 1
    start_at_steps: bool = False      # the curriculum starts at the task's K intermediate steps (task.loop_targets):
                                      # one step per loop and nothing to hold, whatever K; `start` is then unused
    gate: float = 0.0                 # a in (0, 1]: the curriculum's clock runs only through log windows whose
                                      # training accuracy is >= a (the count stays until the task is learned at
                                      # it, then rises; a fall below a stops it, and the hold's ramp); 0: the step
    gate_modulation: bool = False     # with gate (TMLT): the timestep embedder and the modulations stay frozen until
                                      # the gate first opens: the block learns as the looped block, then the loop
                                      # index joins
    # elastic depth (docs/elastic-depth.md): train one model for a range of loop budgets
    sample: str = "fixed"             # the loop count R of a step: "fixed" (model.loops, or the curriculum) | drawn
                                      # "uniform" over min..max | "loguniform" (each octave alike);
                                      # a pure function of (seed, step): exact resume; with a loop curriculum,
                                      # drawn once the curriculum has reached model.loops
    min: int = 1
    max: int = 0                      # 0: model.loops
    hold: float = 0.0                 # f > 1: once the loop curriculum has reached r = model.loops (from the first
                                      # step without one), each step draws its loop count uniformly from r..⌈f·r⌉
                                      # and the answer is trained to hold past r (docs/stability.md); the same as
                                      # sample=uniform min=r max=⌈f·r⌉, but following r; 0: off
    hold_ramp: int = 0                # with hold: the draws' upper bound grows linearly from r to ⌈f·r⌉ over this many
                                      # steps from the first draw (no cliff where the draws begin); 0: at once
    sample_from: int = 0              # the first step whose loop count is drawn (sample, hold); the steps before it
                                      # run model.loops (or the curriculum): learn at r, then draw
    sample_per: str = "batch"         # "batch": one R per step | "row": one per row (each row stops after its own
                                      # loops; the step runs the batch's largest; needs train.losses.loops=last)
    jitter: int = 0                   # with model.loop_rule: every row runs T(n) + U{0..jitter} loops in training
                                      # (the answer must hold past T(n)); a pure function of (seed, step)

    def __post_init__(self) -> None:
        _need(self.start >= 0 and self.every >= 1 and self.increment >= 1,
              "loop curriculum: train.loops.start >= 0, train.loops.every >= 1, train.loops.increment >= 1")
        _need(self.sample in LOOP_SAMPLES, f"train.loops.sample must be one of {LOOP_SAMPLES} (got {self.sample!r})")
        _need(self.sample_per in SAMPLE_PER,
              f"train.loops.sample_per must be one of {SAMPLE_PER} (got {self.sample_per!r})")
        _need(self.min >= 1 and self.max >= 0, "train.loops.min must be >= 1 and train.loops.max >= 0")
        _need(self.sample_from >= 0, f"train.loops.sample_from must be >= 0 (got {self.sample_from})")
        _need(self.hold == 0 or 1 < self.hold <= 64,
              f"train.loops.hold must be 0 (off) or in (1, 64] (got {self.hold})")
        _need(self.hold == 0 or self.sample == "fixed",
              "train.loops.hold draws the loop counts r..f·r itself: leave train.loops.sample at fixed")
        _need(0 <= self.jitter <= 1024, f"train.loops.jitter must be in 0..1024 (got {self.jitter})")
        _need(math.isfinite(self.gate) and 0 <= self.gate <= 1,
              f"train.loops.gate must be 0 (off) or in (0, 1] (got {self.gate})")
        _need(self.gate == 0 or self.start > 0 or self.start_at_steps,
              "train.loops.gate gates a loop curriculum: set train.loops.start or train.loops.start_at_steps")
        _need(not self.gate_modulation or self.gate > 0,
              "train.loops.gate_modulation frees the modulations at the gate's opening: set train.loops.gate")
        _need(self.hold_ramp >= 0, f"train.loops.hold_ramp must be >= 0 (got {self.hold_ramp})")
        _need(self.hold_ramp == 0 or self.hold > 0,
              "train.loops.hold_ramp ramps the hold's draws: set train.loops.hold")

    @property
    def samples_budgets(self) -> bool:
        """Whether a step's loop count is drawn from a budget range (`sample` other than "fixed", or `hold`)."""
        return self.sample != "fixed" or self.hold > 0

    def budget_range(self, final: int) -> tuple[int, int]:
        """The loop budgets training draws from: (min, max or `final`, the model's loops); with `hold` f:
        (r, ⌈f·r⌉), r = `final`."""
        if self.hold:
            return final, math.ceil(self.hold * final)
        return self.min, self.max or final


@dataclass
class LossConfig:
    """Every training loss beside the task's: which read-outs enter it, the fixed-point loss, the exit gate's loss
    (`loopformer.train.losses`)."""
    loops: str = "last"               # last | all (every loop's read-out, Sudoku and ICL) | window (the last `window`)
    window: int = 1
    kind: str = "cross_entropy"       # the classification loss: "cross_entropy" | "stablemax" (a softmax whose
                                      # exponential grows linearly: no softmax collapse; loopformer.train.losses)
    fixed_point: float = 0.0          # weight of the fixed-point loss: fixed_point_loops more loops past R should not
                                      # move the state, ||h(R+m) − sg h(R)||² / ||sg h(R)||² per position; 0: off
    fixed_point_loops: int = 1
    exit_loss: str = "target"         # how a model's exit gate (model.exit_gate) learns: "target" (BCE on "the
                                      # read-out after loop t is already correct", as TRM) | "distribution" (the
                                      # per-loop losses weighted by the exit distribution, as Ouro); see
                                      # loopformer.train.losses
    exit_loss_weight: float = 1.0     # weight of the exit loss next to the task loss
    exit_entropy_weight: float = 0.01 # "distribution": β, the weight of the exit distribution's entropy bonus

    def __post_init__(self) -> None:
        _need(self.loops in LOSS_LOOPS, f"train.losses.loops must be one of {LOSS_LOOPS} (got {self.loops!r})")
        _need(self.window >= 1, "train.losses.window must be >= 1")
        _need(self.kind in ("cross_entropy", "stablemax"),
              f"train.losses.kind must be 'cross_entropy' or 'stablemax' (got {self.kind!r})")
        _need(math.isfinite(self.fixed_point) and self.fixed_point >= 0,
              f"train.losses.fixed_point must be a finite number >= 0 (got {self.fixed_point})")
        _need(1 <= self.fixed_point_loops <= 1024,
              f"train.losses.fixed_point_loops must be in 1..1024 (got {self.fixed_point_loops})")
        _need(self.exit_loss in EXIT_LOSSES,
              f"train.losses.exit_loss must be one of {EXIT_LOSSES} (got {self.exit_loss!r})")
        _need(self.exit_loss_weight >= 0 and self.exit_entropy_weight >= 0,
              "train.losses.exit_loss_weight and train.losses.exit_entropy_weight must be >= 0")


@dataclass
class SelectConfig:
    """Which weights a run keeps and which steps it takes: the best on a validation split, a moving average, gradient
    spikes skipped (`loopformer.train.selection`, `loopformer.train.ema`, `loopformer.train.spikes`)."""
    keep_best: bool = False           # keep the weights that score best on the validation split (task.n_val) at the
                                      # periodic evaluations (train.eval_every) and the end, and finish with them
                                      # (loopformer.train.selection; results.json "keep_best")
    keep_best_depth: str = "r"        # what keep_best scores: "r", the metric at r | "trained", the worst of the
                                      # metric at r..R, R the deepest loop count the run draws (train.loops.hold,
                                      # train.loops.sample): weights that hold the answer over the loops they train
    ema_decay: float = 0.0            # > 0: keep an exponential moving average of the weights with this decay
                                      # (e.g. 0.999), evaluated and checkpointed next to the raw weights
    skip_spikes: float = 0.0          # > 1: skip an optimiser step whose gradient norm (before clipping) exceeds this
                                      # many times its running geometric mean (loopformer.train.spikes); 0: off
    spike_window: int = 100           # steps the running mean of log gradient norms spans
    rollback: float = 0.0             # > 0: once a log window's training accuracy has reached rollback_learned, a
                                      # window below this puts back the last good window's weights and optimiser
                                      # state with the learning rate halved, at most 3 times; the fall after a
                                      # rise of the loop curriculum's count right after a good window is not a
                                      # collapse (a candidate of the transfer study: loopformer.train.rollback;
                                      # "rollback" records); 0: off
    rollback_learned: float = 0.95    # the window accuracy that counts as learned (its weights: the snapshot)

    def __post_init__(self) -> None:
        _need(0 <= self.rollback <= 1 and 0 < self.rollback_learned <= 1 and
              (self.rollback == 0 or self.rollback <= self.rollback_learned),
              f"train.select.rollback must be 0 (off) or in (0, rollback_learned] and rollback_learned in (0, 1] "
              f"(got {self.rollback}, {self.rollback_learned})")
        _need(self.keep_best_depth in ("r", "trained"),
              f"train.select.keep_best_depth must be r or trained (got {self.keep_best_depth!r})")
        _need(0.0 <= self.ema_decay < 1.0, f"train.select.ema_decay must be in [0, 1) (got {self.ema_decay})")
        _need(self.skip_spikes == 0 or (math.isfinite(self.skip_spikes) and self.skip_spikes > 1),
              f"train.select.skip_spikes must be 0 (off) or a factor > 1 (got {self.skip_spikes})")
        _need(self.spike_window >= 2, f"train.select.spike_window must be >= 2 (got {self.spike_window})")


@dataclass
class SystemConfig:
    """How the step runs, not what it learns: precision, compilation, the layout over several processes."""
    precision: str = "auto"           # auto (bf16 on CUDA, fp32 elsewhere) | fp32 | bf16 (slower on CPUs) | fp16
    compile: str = "auto"             # torch.compile the training step (forward, loss, backward) at the final loop
                                      # count: auto (on for runs of >= 1,000 such steps on a CUDA GPU or on a CPU
                                      # with a C++ compiler; off if compiling fails) | true | false
    compile_scope: str = "auto"       # what compiles: "step" (forward and loss unrolled over every loop: one graph
                                      # per loop count, cold compilation growing with r) | "block" (each layer of
                                      # the shared block once, looped eagerly: compilation independent of r, every
                                      # loop count compiled) | auto (block above 16 loops or with a loop curriculum
                                      # or drawn budgets, else step); loopformer.train.compiling
    compile_mode: str = "default"     # torch.compile's mode: default | reduce-overhead (CUDA graphs of the step,
                                      # for small models on a GPU) | max-autotune
    parallel: str = "ddp"             # several processes (torchrun): "ddp" (each holds the whole model, gradients
                                      # all-reduced) | "fsdp" (parameters, gradients and optimiser state sharded over
                                      # the processes, distributed checkpoints; loopformer.train.sharding)

    def __post_init__(self) -> None:
        _need(self.precision in PRECISIONS,
              f"train.system.precision must be one of {PRECISIONS} (got {self.precision!r})")
        self.compile = str(self.compile).lower()          # a YAML boolean arrives as "True" / "False"
        _need(self.compile in COMPILE, f"train.system.compile must be one of {COMPILE} (got {self.compile!r})")
        _need(self.compile_scope in COMPILE_SCOPES,
              f"train.system.compile_scope must be one of {COMPILE_SCOPES} (got {self.compile_scope!r})")
        _need(self.compile_mode in COMPILE_MODES,
              f"train.system.compile_mode must be one of {COMPILE_MODES} (got {self.compile_mode!r})")
        _need(self.parallel in ("ddp", "fsdp"),
              f"train.system.parallel must be 'ddp' or 'fsdp' (got {self.parallel!r})")


@dataclass
class TrainConfig:
    """How a run trains: its length and batches at the top, the rest in sections (`train.optim`, `train.loops`,
    `train.losses`, `train.select`, `train.system`)."""
    steps: int = 0                    # optimiser steps; 0: from `epochs`
    epochs: float = 0.0               # passes over the training split (token tasks), used when steps = 0
    batch_size: int = 64              # global batch: summed over processes and accumulation micro-steps
    grad_accum: int = 1
    eval_every: int = 0               # steps between evaluations (and checkpoints); 0: only at the end
    log_every: int = 10
    init_from: str = ""               # a run (or checkpoint) folder whose weights start this run: fine-tuning, e.g.
                                      # a hold trained after the task (docs/stability.md); the optimiser, schedule
                                      # and steps start afresh, the model's shapes must match; "" = random init
    optim: OptimConfig = field(default_factory=OptimConfig)
    loops: LoopSampling = field(default_factory=LoopSampling)
    losses: LossConfig = field(default_factory=LossConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    system: SystemConfig = field(default_factory=SystemConfig)

    def __post_init__(self) -> None:
        _need(self.steps >= 0 and self.epochs >= 0, "train.steps and train.epochs must be >= 0")
        _need(self.steps > 0 or self.epochs > 0, "set train.steps or train.epochs")
        _need(self.batch_size >= 1 and self.grad_accum >= 1, "train.batch_size and train.grad_accum must be >= 1")
        _need(self.batch_size % self.grad_accum == 0,
              f"train.batch_size={self.batch_size} is not divisible by train.grad_accum={self.grad_accum}")
        _need(self.eval_every >= 0 and self.log_every >= 1, "train.eval_every >= 0 and train.log_every >= 1")


# The flat train keys of the earlier release, each under its section now: they still load (a YAML file, a dotted
# override, a stage's `set`, a sweep's grid, a run folder's stored config), with one notice per key, until the
# next release.
RENAMED = {"lr": "optim.lr", "min_lr": "optim.min_lr", "schedule": "optim.schedule",
           "warmup_steps": "optim.warmup_steps", "warmup_fraction": "optim.warmup_fraction",
           "weight_decay": "optim.weight_decay", "betas": "optim.betas", "eps": "optim.eps",
           "grad_clip": "optim.grad_clip", "timestep_lr_mult": "optim.timestep_lr_mult",
           "timestep_weight_decay": "optim.timestep_weight_decay", "freeze": "optim.freeze",
           "loops_start": "loops.start", "loops_every": "loops.every", "loops_increment": "loops.increment",
           "curriculum_targets": "loops.curriculum_targets", "loops_sample": "loops.sample", "loops_min": "loops.min",
           "loops_max": "loops.max", "loops_hold": "loops.hold", "loops_sample_from": "loops.sample_from",
           "loops_sample_per": "loops.sample_per", "loop_jitter": "loops.jitter",
           "loss_loops": "losses.loops", "loss_window": "losses.window", "loss": "losses.kind",
           "consistency": "losses.consistency", "consistency_budget": "losses.consistency_budget",
           "fixed_point": "losses.fixed_point", "fixed_point_loops": "losses.fixed_point_loops",
           "jacobian": "losses.jacobian", "exit_loss": "losses.exit_loss",
           "exit_loss_weight": "losses.exit_loss_weight", "exit_entropy_weight": "losses.exit_entropy_weight",
           "keep_best": "select.keep_best", "keep_best_depth": "select.keep_best_depth",
           "ema_decay": "select.ema_decay", "skip_spikes": "select.skip_spikes", "spike_window": "select.spike_window",
           "precision": "system.precision", "compile": "system.compile", "compile_scope": "system.compile_scope",
           "compile_mode": "system.compile_mode", "parallel": "system.parallel"}
_NOTICED: set[str] = set()            # the renamed keys this process has named on stderr (each once)


def renamed_key(key: str) -> str | None:
    """This release's dotted key for one of the earlier release (`train.lr` -> `train.optim.lr`); None for a key
    that was not renamed."""
    parts = key.strip().split(".")
    if len(parts) >= 2 and parts[0] == "train" and parts[1] in RENAMED:
        return ".".join(["train", RENAMED[parts[1]], *parts[2:]])
    return None


def _notice(old: str, new: str, notice: bool) -> None:
    if notice and old not in _NOTICED:
        _NOTICED.add(old)
        print(f"config: {old} is now {new} (the old key works until the next release)", file=sys.stderr)


def _renamed_set(where: str, sets: Any, notice: bool) -> Any:
    """A stage's `set` ({dotted key: value}) with the renamed keys under their new names."""
    if not isinstance(sets, dict):
        return sets
    out: dict = {}
    for key, value in sets.items():
        new = renamed_key(key) if isinstance(key, str) else None
        if new is not None:
            if new in sets:
                raise UserError(f"config error: {where} gives both {key} and {new}: keep {new}")
            _notice(key, new, notice)
        out[new or key] = value
    return out


# the training switches that left the core with their defaults (docs/architecture.md, "What left the core"): old
# configs hold them at the default, dropped on reading; set otherwise they are refused in one line
TRAIN_REMOVED = {"losses.jacobian": 0.0, "losses.consistency": 0.0, "losses.consistency_budget": "double",
                 "loops.curriculum_targets": "spread"}


def _drop_removed(train: dict) -> dict:
    """A train section (its keys already in sections) without the fields that left the core (`TRAIN_REMOVED`)."""
    out = dict(train)
    for key, default in TRAIN_REMOVED.items():
        section, name = key.split(".")
        sec = out.get(section)
        if isinstance(sec, dict) and name in sec:
            if sec[name] != default:
                raise UserError(f"config error: train.{key} has left loopformer (its study found it did not help); "
                                f"runs that used it run from the tag {BEFORE_SPLIT}")
            out[section] = {k: v for k, v in sec.items() if k != name}
    return out


def _model_override(key: str, value: str) -> str | None:
    """A `model.X=V` override in this release's form: a field that left the core at its default dropped (None),
    `model.sandwich_norm=true` / `model.start_state=noise` / `model.start_noise=σ` as their lab extensions, another
    removed field set refused in one line; any other override as given."""
    name = key.split(".", 1)[1]
    if name not in MODEL_REMOVED and not (name == "start_state" and value.strip() == "noise"):
        return f"{key}={value}"
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    if name == "start_state":
        return "model.extensions.noise_start={}"
    if name == "start_noise":
        return f"model.extensions.noise_start.sigma={value}"
    try:
        data = migrate_model({name: parsed})
    except ValueError as exc:
        raise UserError(f"config error: {exc}") from None
    return "model.extensions.sandwich_norm={}" if data.get("extensions") else None


def _nested(key: str, value: str) -> dict:
    """{section: {name: the override's value}} of a dotted `section.name=value` override."""
    section, name = key.split(".", 1)
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return {section: {name: parsed}}


def _upgrade_overrides(raw: list, notice: bool) -> list:
    """`upgrade` of a list of `key=value` overrides: renamed keys under their new names (in place, so the later of
    an old and a new key still wins); the fields that left the core migrated, dropped or refused."""
    out = []
    for item in raw:
        key, eq, value = item.partition("=") if isinstance(item, str) else (item, "", "")
        if eq and key.strip().startswith("model."):
            item = _model_override(key.strip(), value)   # fields that left the core: migrated or refused
            if item is None:
                continue
        new = renamed_key(key) if eq else None
        if new is not None:
            _notice(key.strip(), new, notice)
            item = f"{new}={value}"
        name = (new or key).strip()
        if eq and name.removeprefix("train.") in TRAIN_REMOVED:   # a field that left the core
            _drop_removed(_nested(name.removeprefix("train."), value))
            continue
        out.append(item)
    return out


def upgrade(raw: Any, notice: bool = True) -> Any:
    """A raw config layer with the keys of the earlier release (`RENAMED`) under their new names, before the typed
    load (`loopformer.configio.load_config` calls it on every layer): a dict (a YAML file, a stored config, a base)
    has its flat train keys moved into their sections and its stages' `set` keys renamed; a list of `key=value`
    overrides has its keys renamed, in place, so the later of an old and a new key still wins. `notice`: one line on
    stderr per old key (once per process); a run folder's stored config is read without it."""
    if isinstance(raw, list):
        return _upgrade_overrides(raw, notice)
    if not isinstance(raw, dict):
        return raw
    if isinstance(raw.get("model"), dict):
        try:
            raw = {**raw, "model": migrate_model(raw["model"])}   # fields that left the core (model/config.py)
        except ValueError as exc:
            raise UserError(f"config error: {exc}") from None
    train = raw.get("train")
    if isinstance(train, dict) and any(k in RENAMED for k in train):
        train = dict(train)
        for old in [k for k in train if k in RENAMED]:
            section, name = RENAMED[old].split(".")
            sec = train.get(section)
            if sec is not None and not isinstance(sec, dict):
                raise UserError(f"config error: train.{section} holds key: value pairs (got {sec!r})")
            if name in (sec or {}):
                raise UserError(f"config error: train.{old} and train.{section}.{name} are both given: keep "
                                f"train.{section}.{name}")
            train[section] = {**(sec or {}), name: train.pop(old)}
            _notice(f"train.{old}", f"train.{section}.{name}", notice)
        raw = {**raw, "train": train}
    if isinstance(raw.get("train"), dict):
        raw = {**raw, "train": _drop_removed(raw["train"])}
    stages = raw.get("stages")
    if isinstance(stages, list) and any(isinstance(st, dict) and isinstance(st.get("set"), dict)
                                        and any(renamed_key(k) for k in st["set"] if isinstance(k, str))
                                        for st in stages):
        raw = {**raw, "stages": [{**st, "set": _renamed_set(f"stages[{k}].set", st["set"], notice)}
                                 if isinstance(st, dict) and "set" in st else st
                                 for k, st in enumerate(stages, 1)]}
    return raw


@dataclass
class LogConfig:
    progress: bool = True             # tqdm bar
    dynamics: bool = True             # log training dynamics (per-loop gates, update sizes, read-outs; per-group
                                      # gradient norms; settle loops) as "dynamics" records
    dynamics_every: int = 0           # steps between dynamics records (0: every log_every steps)
    tensorboard: bool = True          # when the tensorboard package is installed
    wandb: bool = False               # when the wandb package is installed
    wandb_project: str = "loopformer"


@dataclass
class StageConfig:
    """One stage of a staged run (`RunConfig.stages`): the run's config with `set` on top; every stage after the
    first starts from the previous one's weights (`train.init_from`)."""
    name: str = ""                    # a label: the stage's folder is stages/<k>-<name> (k from 1)
    set: dict[str, Any] = field(default_factory=dict)  # dotted keys and values over the run's config, e.g.
                                      # {train.optim.lr: 5.0e-4, train.loops.hold: 4}


@dataclass
class RunConfig:
    name: str = "run"
    out_dir: str = "runs/run"         # the run folder (config, metrics, checkpoint, results)
    seed: int = 0                     # model initialisation and dropout
    device: str = "auto"              # auto | cpu | cuda | mps
    threads: int = 0                  # CPU threads for torch (0: torch's default)
    memory_check: bool = True         # refuse a run whose estimated memory (parameters, optimiser, activations,
                                      # read-outs: loopformer.model.memory) exceeds what the device has available
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=1))
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=1000))
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    stages: list[StageConfig] = field(default_factory=list)  # a staged run (loopformer.train.stages): each
                                      # stage trains from the previous one's weights; stages before the last in
                                      # out_dir/stages/, the last in out_dir itself (empty: one run)
    upgrade = staticmethod(upgrade)   # the keys of the earlier release, renamed in every raw layer (configio)

    def __post_init__(self) -> None:
        _need(0 <= self.seed < 2 ** 63, f"seed must be in [0, 2^63) (got {self.seed})")
        _need(self.device in DEVICES, f"device must be one of {DEVICES} (got {self.device!r})")
        _need(self.threads >= 0, "threads must be >= 0")
        _need(self.log.dynamics_every >= 0, f"log.dynamics_every must be >= 0 (got {self.log.dynamics_every})")
        _need(bool(self.out_dir), "out_dir must be set")
        _check_stages(self.stages)
        tr, m = self.train, self.model
        cap, ev = loop_cap(m.total_loops), self.eval     # the most loops the model may be evaluated with
        _need(ev.loops <= cap and ev.max_loops <= cap, f"eval: need loops and max_loops <= {cap} (got "
                                                       f"{ev.loops}, {ev.max_loops})")
        _need(all(b <= cap for b in ev.budgets), f"eval.budgets must lie in 1..{cap} (got {ev.budgets})")
        loss, loops, sel = tr.losses, tr.loops, tr.select
        gate_loss = m.exit_gate and loss.exit_loss_weight > 0       # the exit gate's loss enters the step
        if m.supervision_steps > 1 and gate_loss:
            _need(loss.exit_loss == "target", "with model.supervision_steps > 1 the exit gate learns across steps: "
                                              "train.losses.exit_loss must be 'target'")
        _need(not loops.start_at_steps or self.task.loop_targets,
              "train.loops.start_at_steps starts the curriculum at the task's intermediate steps: it needs "
              "task.loop_targets")
        if self.task.loop_targets:
            _need(loss.loops != "last", "task.loop_targets supervises every loop in the loss: set "
                                        "train.losses.loops to all or window")
            _need(m.supervision_steps == 1, "task.loop_targets needs model.supervision_steps = 1")
        if loops.samples_budgets:
            hi = loops.budget_range(m.loops)[1]
            _need(loops.min <= hi, f"train.loops.min={loops.min} exceeds the largest budget {hi} "
                                   f"(train.loops.max, else model.loops)")
            _need(hi <= 1024, f"train.loops.max={hi} exceeds 1,024 loops")
            if loops.sample_per == "row":
                _need(m.supervision_steps == 1, "train.loops.sample_per=row needs model.supervision_steps = 1 "
                                                "(with supervision steps the budget is drawn per batch)")
                _need(loss.loops == "last", "train.loops.sample_per=row scores each row after its own loops: "
                                            "it needs train.losses.loops=last")
                _need(loss.fixed_point == 0, "train.losses.fixed_point continues every row past one budget: it "
                                             "needs train.loops.sample_per=batch")
                _need(not gate_loss,
                      "train.loops.sample_per=row cannot train an exit gate (use train.loops.sample_per=batch)")
        if m.loop_rule != "fixed":
            _need(not loops.samples_budgets and loops.start == 0 and not loops.start_at_steps,
                  f"model.loop_rule={m.loop_rule} sets every row's loops from its size: it excludes train.loops.sample "
                  "and the loop curriculum (random loops on top of the rule: train.loops.jitter)")
            _need(m.supervision_steps == 1,
                  "model.loop_rule runs each row its own loops: it needs supervision_steps = 1")
            _need(loss.fixed_point == 0 and not gate_loss,
                  "model.loop_rule scores each row after its own loops: train.losses.fixed_point and an exit gate's "
                  "loss are not available with it")
        else:
            _need(loops.jitter == 0, "train.loops.jitter adds loops to a loop rule's: set model.loop_rule")
        if sel.keep_best_depth == "trained":
            _need(loops.samples_budgets and loops.budget_range(m.loops)[1] > m.loops and m.loop_rule == "fixed",
                  "train.select.keep_best_depth=trained scores the loop counts past r that the run draws: set "
                  "train.loops.hold or train.loops.sample with train.loops.max > model.loops (no model.loop_rule)")
        if sel.keep_best:
            _need(tr.eval_every > 0,
                  "train.select.keep_best selects among the periodic evaluations: set train.eval_every")
            _need(tr.system.parallel != "fsdp",
                  "train.select.keep_best keeps a full copy of the weights: not with train.system.parallel=fsdp")
        if sel.rollback:
            _need(tr.system.parallel != "fsdp",
                  "train.select.rollback keeps a full copy of the weights: not with train.system.parallel=fsdp")
        if loss.fixed_point > 0 and m.supervision_steps != 1:
            raise ValueError("train.losses.fixed_point needs model.supervision_steps = 1")
        if loss.loops == "window":
            _need(loss.window <= m.loops, f"train.losses.window={loss.window} exceeds model.loops={m.loops}")


STAGE_FIXED = ("stages", "out_dir")     # what a stage may not set: the runner places its folder


def _check_stages(stages: list[StageConfig]) -> None:
    names = [s.name for s in stages]
    for k, st in enumerate(stages, 1):
        _need(re.fullmatch(r"[A-Za-z0-9_.-]*", st.name) is not None and st.name not in (".", ".."),
              f"stages[{k}].name must be letters, digits, '_', '.' or '-' (got {st.name!r})")
        for key in st.set:
            _need(isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", key) is not None,
                  f"stages[{k}].set: {key!r} is not a dotted config key (e.g. train.optim.lr)")
            _need(key.split(".")[0] not in STAGE_FIXED,
                  f"stages[{k}].set: {key} is set by the staged run itself (each stage's folder)")
            _need(not (k > 1 and key == "train.init_from"),
                  f"stages[{k}].set: train.init_from is the previous stage's folder (only the first stage may set it)")
    named = [n for n in names if n]
    _need(len(set(named)) == len(named), f"stages: names must differ (got {names})")


def _raw_layers(path: str | os.PathLike | None, overrides: Iterable[str]) -> dict:
    """The YAML file and overrides merged without a schema (to find the task before the full load), the keys of the
    earlier release renamed (`upgrade`; each named once, whichever load meets it first)."""
    layers = user_layers(path, overrides, upgrade=upgrade, notice=False)
    try:
        merged = OmegaConf.merge(*layers) if layers else OmegaConf.create({})
        return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]
    except (OmegaConfBaseException, ValueError, TypeError) as exc:   # e.g. a list merged onto a section
        raise UserError(f"config error: {one_line(exc)}") from None


def load_run_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = (),
                    base: dict | None = None, stored: bool = False) -> RunConfig:
    """Load a run config: defaults < `base` < what the task fixes < YAML at `path` < dotted `overrides`.
    A config that sets `train.epochs` and not `train.steps` trains for those epochs (steps = 0 below the YAML).

    The task section is read first, the task is built (see `loopformer.sources.model_fields`), and the model
    fields it fixes are merged in below the YAML, so the YAML may still override e.g. `model.max_len`. The keys of
    the earlier release (`RENAMED`) load under their new names, each named once on stderr; `stored`: the file is a
    run folder's own config (an older run's), read without those notices.
    """
    overrides = list(overrides)
    raw = _raw_layers(path, overrides)
    for layer in (base or {}, raw):
        if layer.get("task") is not None and not isinstance(layer["task"], dict):
            raise UserError("config error: task must hold key: value pairs (task.name, task.options, ...), "
                            "not a list or a value")
    task_raw = dict((base or {}).get("task", {}) or {})
    task_raw.update(raw.get("task", {}) or {})
    task_cfg = load_config(TaskConfig, base={"task": task_raw}["task"]) if task_raw else TaskConfig()
    fixed: dict = {"model": model_fields(task_cfg)}
    train_raw = raw.get("train")
    if isinstance(train_raw, dict) and train_raw.get("epochs") and "steps" not in train_raw:
        fixed["train"] = {"steps": 0}   # epochs given without steps: the default step count must not win
    merged_base = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(base or {}), OmegaConf.create(fixed)))
    return load_config(RunConfig, path, overrides, base=merged_base, stored=stored)  # type: ignore[arg-type]
