"""Run configuration: one typed, nested dataclass per experiment (model, task, optimisation, evaluation, logging).

The shipped YAML files in `configs/` fill these; dotted overrides (`train.lr=3e-4 model.loops=16`) go on top.
Defaults follow the paper's reasoning-task recipe (App. C.1.3): AdamW β = (0.9, 0.999), weight decay 0.01,
lr 1e-4 decayed linearly to 0 after 5 warm-up steps, batch 64. The language-modelling recipe (App. C.3: β2 0.95,
wd 1e-4, 2000 warm-up steps, cosine from 2e-4 to 6e-5) is `schedule: cosine` with its values in the YAML.

The model section is a `ModelConfig`; the fields the task fixes (vocabulary / input width, sequence length,
causality, read-out) are filled from the task before the YAML is applied, so a config only names what it chooses.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loopformer.configio import load_config, one_line, user_layers
from loopformer.device import DEVICES
from loopformer.errors import UserError
from loopformer.eval.config import EvalConfig
from loopformer.model.config import ModelConfig
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
class TrainConfig:
    steps: int = 0                    # optimiser steps; 0: from `epochs`
    epochs: float = 0.0               # passes over the training split (token tasks), used when steps = 0
    batch_size: int = 64              # global batch: summed over processes and accumulation micro-steps
    grad_accum: int = 1
    lr: float = 1e-4
    min_lr: float = 0.0               # the schedule's floor
    schedule: str = "linear"          # linear | cosine | constant | onecycle (warm-up to lr, cosine to min_lr)
    warmup_steps: int = 5
    warmup_fraction: float = 0.0      # if > 0, warm-up = this fraction of the steps (overrides warmup_steps)
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0            # max global gradient norm; 0 disables clipping
    loss_loops: str = "last"          # last | all (every loop's read-out, Sudoku and ICL) | window (last loss_window)
    loss_window: int = 1
    loops_start: int = 0              # loop curriculum: start with this many loops (0: off) ...
    loops_every: int = 1000           # ... and add loops_increment every loops_every steps, up to model.loops
    loops_increment: int = 1
    curriculum_targets: str = "spread"  # per-loop targets of a curriculum's shorter steps (R < model.loops):
                                      # "spread" the task's K steps over the R loops | "prefix" the first R loops of
                                      # the full run's schedule (loop t keeps its target; the last read is not the
                                      # answer until R = model.loops)
    # elastic depth (docs/elastic-depth.md): train one model for a range of loop budgets
    loops_sample: str = "fixed"       # the loop count R of a step: "fixed" (model.loops, or the curriculum) | drawn
                                      # "uniform" over loops_min..loops_max | "loguniform" (each octave alike);
                                      # a pure function of (seed, step): exact resume; with a loop curriculum,
                                      # drawn once the curriculum has reached model.loops
    loops_min: int = 1
    loops_max: int = 0                # 0: model.loops
    loops_hold: float = 0.0           # f > 1: once the loop curriculum has reached r = model.loops (from the first
                                      # step without one), each step draws its loop count uniformly from r..⌈f·r⌉
                                      # and the answer is trained to hold past r (docs/stability.md); the same as
                                      # loops_sample=uniform loops_min=r loops_max=⌈f·r⌉, but following r; 0: off
    loops_sample_from: int = 0        # the first step whose loop count is drawn (loops_sample, loops_hold); the steps
                                      # before it run model.loops (or the curriculum): learn at r, then draw
    loops_sample_per: str = "batch"   # "batch": one R per step | "row": one per row (each row stops after its own
                                      # loops; the step runs the batch's largest; needs loss_loops=last)
    loop_jitter: int = 0              # with model.loop_rule: every row runs T(n) + U{0..loop_jitter} loops in training
                                      # (the answer must hold past T(n)); a pure function of (seed, step)
    consistency: float = 0.0          # weight of the agreement of the read-out at R with a stop-gradient read-out at
                                      # a larger budget (KL; squared error for regression); 0: off
    consistency_budget: str = "double"  # the target's budget: "double" min(2R, loops_max) | "max" loops_max (the
                                      # full route, as LoopFormer's shortcut consistency)
    fixed_point: float = 0.0          # weight of the fixed-point loss: fixed_point_loops more loops past R should not
                                      # move the state, ||h(R+m) − sg h(R)||² / ||sg h(R)||² per position; 0: off
    fixed_point_loops: int = 1
    jacobian: float = 0.0             # weight of the Jacobian penalty: the loop map's mean squared singular value at
                                      # the final state, ||εᵀJ||² / ||ε||² for ε ~ N(0, I) (one more loop); 0: off
    loss: str = "cross_entropy"       # the classification loss: "cross_entropy" | "stablemax" (a softmax whose
                                      # exponential grows linearly: no softmax collapse; loopformer.train.losses)
    eval_every: int = 0               # steps between evaluations (and checkpoints); 0: only at the end
    log_every: int = 10
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
    timestep_lr_mult: float = 0.1     # lr multiplier of the timestep embedder and the modulations (TMLT); 1: the
                                      # paper's single learning rate. See docs/tmlt-study.md
    timestep_weight_decay: float | None = None  # their weight decay (None: weight_decay)
    freeze: list[str] = field(default_factory=list)  # parameter groups that keep the values they start with (not
                                      # trained): any of embedding, block, timestep, modulation, past, head. E.g.
                                      # [embedding, block, timestep, modulation, head] trains only the loops past r's
                                      # own modulation (model.timestep_past: own) from train.init_from's weights
    exit_loss: str = "target"         # how a model's exit gate (model.exit_gate) learns: "target" (BCE on "the
                                      # read-out after loop t is already correct", as TRM) | "distribution" (the
                                      # per-loop losses weighted by the exit distribution, as Ouro); see
                                      # loopformer.train.losses
    exit_loss_weight: float = 1.0     # weight of the exit loss next to the task loss
    exit_entropy_weight: float = 0.01 # "distribution": β, the weight of the exit distribution's entropy bonus
    ema_decay: float = 0.0            # > 0: keep an exponential moving average of the weights with this decay
                                      # (e.g. 0.999), evaluated and checkpointed next to the raw weights
    keep_best: bool = False           # keep the weights that score best on the validation split (task.n_val) at the
                                      # periodic evaluations (eval_every) and the end, and finish with them
                                      # (loopformer.train.selection; results.json "keep_best")
    init_from: str = ""               # a run (or checkpoint) folder whose weights start this run: fine-tuning, e.g.
                                      # a hold trained after the task (docs/stability.md); the optimiser, schedule
                                      # and steps start afresh, the model's shapes must match; "" = random init
    keep_best_depth: str = "r"        # what keep_best scores: "r", the metric at r | "trained", the worst of the
                                      # metric at r..R, R the deepest loop count the run draws (loops_hold,
                                      # loops_sample): weights that hold the answer over the loops they train
    skip_spikes: float = 0.0          # > 1: skip an optimiser step whose gradient norm (before clipping) exceeds this
                                      # many times its running geometric mean (loopformer.train.spikes); 0: off
    spike_window: int = 100           # steps the running mean of log gradient norms spans
    parallel: str = "ddp"             # several processes (torchrun): "ddp" (each holds the whole model, gradients
                                      # all-reduced) | "fsdp" (parameters, gradients and optimiser state sharded over
                                      # the processes, distributed checkpoints; loopformer.train.sharding)

    def __post_init__(self) -> None:
        _need(self.steps >= 0 and self.epochs >= 0, "train.steps and train.epochs must be >= 0")
        _need(self.steps > 0 or self.epochs > 0, "set train.steps or train.epochs")
        _need(self.batch_size >= 1 and self.grad_accum >= 1, "train.batch_size and train.grad_accum must be >= 1")
        _need(self.batch_size % self.grad_accum == 0,
              f"train.batch_size={self.batch_size} is not divisible by train.grad_accum={self.grad_accum}")
        _need(self.lr > 0 and 0 <= self.min_lr <= self.lr, "need train.lr > 0 and 0 <= train.min_lr <= train.lr")
        _need(self.schedule in SCHEDULES, f"train.schedule must be one of {SCHEDULES} (got {self.schedule!r})")
        _need(self.warmup_steps >= 0 and 0 <= self.warmup_fraction < 1, "bad warm-up (steps >= 0, fraction < 1)")
        _need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "train.betas must be two values in [0,1)")
        _need(self.grad_clip >= 0 and self.weight_decay >= 0, "train.grad_clip and train.weight_decay must be >= 0")
        _need(self.loss_loops in LOSS_LOOPS, f"train.loss_loops must be one of {LOSS_LOOPS} (got {self.loss_loops!r})")
        _need(self.loss_window >= 1, "train.loss_window must be >= 1")
        _need(self.curriculum_targets in ("spread", "prefix"),
              f"train.curriculum_targets must be 'spread' or 'prefix' (got {self.curriculum_targets!r})")
        _need(self.loops_start >= 0 and self.loops_every >= 1 and self.loops_increment >= 1,
              "loop curriculum: loops_start >= 0, loops_every >= 1, loops_increment >= 1")
        _need(self.eval_every >= 0 and self.log_every >= 1, "train.eval_every >= 0 and train.log_every >= 1")
        _need(self.precision in PRECISIONS, f"train.precision must be one of {PRECISIONS} (got {self.precision!r})")
        self.compile = str(self.compile).lower()          # a YAML boolean arrives as "True" / "False"
        _need(self.compile in COMPILE, f"train.compile must be one of {COMPILE} (got {self.compile!r})")
        _need(self.compile_scope in COMPILE_SCOPES,
              f"train.compile_scope must be one of {COMPILE_SCOPES} (got {self.compile_scope!r})")
        _need(self.compile_mode in COMPILE_MODES,
              f"train.compile_mode must be one of {COMPILE_MODES} (got {self.compile_mode!r})")
        _need(self.timestep_lr_mult > 0, f"train.timestep_lr_mult must be > 0 (got {self.timestep_lr_mult})")
        _need(all(g in PARAM_GROUPS for g in self.freeze) and len(set(self.freeze)) == len(self.freeze),
              f"train.freeze lists parameter groups, each once, of {PARAM_GROUPS} (got {self.freeze})")
        _need(self.timestep_weight_decay is None or self.timestep_weight_decay >= 0,
              "train.timestep_weight_decay must be >= 0 (or null)")
        _need(self.exit_loss in EXIT_LOSSES, f"train.exit_loss must be one of {EXIT_LOSSES} (got {self.exit_loss!r})")
        _need(self.loops_sample in LOOP_SAMPLES,
              f"train.loops_sample must be one of {LOOP_SAMPLES} (got {self.loops_sample!r})")
        _need(self.loops_sample_per in SAMPLE_PER,
              f"train.loops_sample_per must be one of {SAMPLE_PER} (got {self.loops_sample_per!r})")
        _need(self.loops_min >= 1 and self.loops_max >= 0, "train.loops_min must be >= 1 and train.loops_max >= 0")
        _need(self.loops_sample_from >= 0, f"train.loops_sample_from must be >= 0 (got {self.loops_sample_from})")
        _need(self.loops_hold == 0 or 1 < self.loops_hold <= 64,
              f"train.loops_hold must be 0 (off) or in (1, 64] (got {self.loops_hold})")
        _need(self.loops_hold == 0 or self.loops_sample == "fixed",
              "train.loops_hold draws the loop counts r..f·r itself: leave train.loops_sample at fixed")
        _need(0 <= self.loop_jitter <= 1024, f"train.loop_jitter must be in 0..1024 (got {self.loop_jitter})")
        _need(self.consistency >= 0 and self.fixed_point >= 0, "train.consistency and train.fixed_point must be >= 0")
        _need(math.isfinite(self.jacobian) and self.jacobian >= 0,
              f"train.jacobian must be a finite number >= 0 (got {self.jacobian})")
        _need(self.consistency_budget in ("double", "max"),
              f"train.consistency_budget must be 'double' or 'max' (got {self.consistency_budget!r})")
        _need(1 <= self.fixed_point_loops <= 1024,
              f"train.fixed_point_loops must be in 1..1024 (got {self.fixed_point_loops})")
        _need(0 <= self.eps < 1, f"train.eps must be in [0, 1) (got {self.eps})")   # NaN fails every comparison
        _need(self.loss in ("cross_entropy", "stablemax"),
              f"train.loss must be 'cross_entropy' or 'stablemax' (got {self.loss!r})")
        _need(0.0 <= self.ema_decay < 1.0, f"train.ema_decay must be in [0, 1) (got {self.ema_decay})")
        _need(self.skip_spikes == 0 or (math.isfinite(self.skip_spikes) and self.skip_spikes > 1),
              f"train.skip_spikes must be 0 (off) or a factor > 1 (got {self.skip_spikes})")
        _need(self.spike_window >= 2, f"train.spike_window must be >= 2 (got {self.spike_window})")
        _need(self.parallel in ("ddp", "fsdp"), f"train.parallel must be 'ddp' or 'fsdp' (got {self.parallel!r})")
        _need(self.exit_loss_weight >= 0 and self.exit_entropy_weight >= 0,
              "train.exit_loss_weight and train.exit_entropy_weight must be >= 0")

    @property
    def samples_budgets(self) -> bool:
        """Whether a step's loop count is drawn from a budget range (`loops_sample` other than "fixed", or
        `loops_hold`)."""
        return self.loops_sample != "fixed" or self.loops_hold > 0

    def budget_range(self, final: int) -> tuple[int, int]:
        """The loop budgets training draws from: (loops_min, loops_max or `final`, the model's loops); with
        `loops_hold` f: (r, ⌈f·r⌉), r = `final`."""
        if self.loops_hold:
            return final, math.ceil(self.loops_hold * final)
        return self.loops_min, self.loops_max or final


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
                                      # {train.lr: 5.0e-4, train.loops_hold: 4}


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
        if m.supervision_steps > 1 and m.exit_gate and tr.exit_loss_weight > 0:
            _need(tr.exit_loss == "target", "with model.supervision_steps > 1 the exit gate learns across steps: "
                                            "train.exit_loss must be 'target'")
        if self.task.loop_targets:
            _need(tr.loss_loops != "last", "task.loop_targets supervises every loop in the loss: set "
                                           "train.loss_loops to all or window")
            _need(m.supervision_steps == 1, "task.loop_targets needs model.supervision_steps = 1")
        if tr.samples_budgets:
            hi = tr.budget_range(m.loops)[1]
            _need(tr.loops_min <= hi, f"train.loops_min={tr.loops_min} exceeds the largest budget {hi} "
                                      f"(train.loops_max, else model.loops)")
            _need(hi <= 1024, f"train.loops_max={hi} exceeds 1,024 loops")
            if tr.loops_sample_per == "row":
                _need(m.supervision_steps == 1, "train.loops_sample_per=row needs model.supervision_steps = 1 "
                                                "(with supervision steps the budget is drawn per batch)")
                _need(tr.loss_loops == "last", "train.loops_sample_per=row scores each row after its own loops: "
                                               "it needs train.loss_loops=last")
                _need(tr.fixed_point == 0, "train.fixed_point continues every row past one budget: it needs "
                                           "train.loops_sample_per=batch")
                _need(not (m.exit_gate and tr.exit_loss_weight > 0),
                      "train.loops_sample_per=row cannot train an exit gate (use loops_sample_per=batch)")
        if m.loop_rule != "fixed":
            _need(not tr.samples_budgets and tr.loops_start == 0,
                  f"model.loop_rule={m.loop_rule} sets every row's loops from its size: it excludes train.loops_sample "
                  "and the loop curriculum (random loops on top of the rule: train.loop_jitter)")
            _need(m.supervision_steps == 1 and m.solver == "unroll",
                  "model.loop_rule runs each row its own loops: it needs supervision_steps = 1 and solver=unroll")
            _need(tr.fixed_point == 0 and tr.consistency == 0 and not (m.exit_gate and tr.exit_loss_weight > 0),
                  "model.loop_rule scores each row after its own loops: train.fixed_point, train.consistency and "
                  "an exit gate's loss are not available with it")
        else:
            _need(tr.loop_jitter == 0, "train.loop_jitter adds loops to a loop rule's: set model.loop_rule")
        _need(tr.keep_best_depth in ("r", "trained"),
              f"train.keep_best_depth must be r or trained (got {tr.keep_best_depth!r})")
        if tr.keep_best_depth == "trained":
            _need(tr.samples_budgets and tr.budget_range(m.loops)[1] > m.loops and m.loop_rule == "fixed",
                  "train.keep_best_depth=trained scores the loop counts past r that the run draws: set "
                  "train.loops_hold or train.loops_sample with loops_max > model.loops (no model.loop_rule)")
        if tr.keep_best:
            _need(tr.eval_every > 0, "train.keep_best selects among the periodic evaluations: set train.eval_every")
            _need(tr.parallel != "fsdp",
                  "train.keep_best keeps a full copy of the weights: not with train.parallel=fsdp")
        if (tr.consistency > 0 or tr.fixed_point > 0) and m.supervision_steps != 1:
            raise ValueError("train.consistency and train.fixed_point need model.supervision_steps = 1")
        if tr.loss_loops == "window":
            _need(tr.loss_window <= m.loops, f"train.loss_window={tr.loss_window} exceeds model.loops={m.loops}")


STAGE_FIXED = ("stages", "out_dir")     # what a stage may not set: the runner places its folder


def _check_stages(stages: list[StageConfig]) -> None:
    names = [s.name for s in stages]
    for k, st in enumerate(stages, 1):
        _need(re.fullmatch(r"[A-Za-z0-9_.-]*", st.name) is not None and st.name not in (".", ".."),
              f"stages[{k}].name must be letters, digits, '_', '.' or '-' (got {st.name!r})")
        for key in st.set:
            _need(isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", key) is not None,
                  f"stages[{k}].set: {key!r} is not a dotted config key (e.g. train.lr)")
            _need(key.split(".")[0] not in STAGE_FIXED,
                  f"stages[{k}].set: {key} is set by the staged run itself (each stage's folder)")
            _need(not (k > 1 and key == "train.init_from"),
                  f"stages[{k}].set: train.init_from is the previous stage's folder (only the first stage may set it)")
    named = [n for n in names if n]
    _need(len(set(named)) == len(named), f"stages: names must differ (got {names})")


def _raw_layers(path: str | os.PathLike | None, overrides: Iterable[str]) -> dict:
    """The YAML file and overrides merged without a schema (to find the task before the full load)."""
    layers = user_layers(path, overrides)
    try:
        merged = OmegaConf.merge(*layers) if layers else OmegaConf.create({})
        return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]
    except (OmegaConfBaseException, ValueError, TypeError) as exc:   # e.g. a list merged onto a section
        raise UserError(f"config error: {one_line(exc)}") from None


def load_run_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = (),
                    base: dict | None = None) -> RunConfig:
    """Load a run config: defaults < `base` < what the task fixes < YAML at `path` < dotted `overrides`.
    A config that sets `train.epochs` and not `train.steps` trains for those epochs (steps = 0 below the YAML).

    The task section is read first, the task is built (see `loopformer.sources.model_fields`), and the model
    fields it fixes are merged in below the YAML, so the YAML may still override e.g. `model.max_len`.
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
    return load_config(RunConfig, path, overrides, base=merged_base)  # type: ignore[arg-type]
