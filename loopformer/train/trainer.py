"""The training loop: one function, `train(cfg)`, for every task, model variant and launch (1 process or torchrun).

Recipe (paper App. C.1.3 / C.2 / C.3, set by the run config): AdamW, warm-up then linear or cosine decay, gradient
clipping and accumulation, the loss on the last loop, on every loop or on a window of the last loops, optional
loop / in-context curricula, periodic evaluation with a checkpoint each time, and a final loop-wise evaluation.

    train(cfg)                      Trainer(cfg) builds data, model, optimiser (and restores a checkpoint),
                                    open_log (run files, metrics log, bar), wrap (DDP, compile), then
      for step in start..total:       step(s)       one optimiser step over the global batch of step s
                                      log_train     the window's loss / accuracy / lr (every log_every steps)
                                      log_dynamics  per-loop gates, update sizes, read-outs (every dynamics_every)
                                      evaluate + checkpoint                        (every eval_every steps)
      evaluate(final) + checkpoint + results.json

Exact resumption: the global batch of step s is a pure function of (data seed, s) (see `loopformer.sources`),
the learning rate a pure function of s, and the checkpoint holds the weights, the optimiser state, every
process's RNG state, s and the open log window — so `--resume` after a crash continues exactly where the last
checkpoint left off, and the metrics log is cut back to that step. The run folder is `loopformer.train.run`.
Shapes: B batch, T length, R loops, C classes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from loopformer import configio
from loopformer.configio import to_dict
from loopformer.device import can_compile
from loopformer.errors import UserError
from loopformer.eval.lengths import plan_lengths
from loopformer.eval.run import check_eval_config, evaluate_all
from loopformer.model.diagnostics import grad_norms, loop_dynamics, modulation_stats, state_grad_norms, summarize_settle
from loopformer.model.io import check_init_from, load_training_state, load_weights, save_checkpoint
from loopformer.model.lengths import LoopRule, check_covers, jitter
from loopformer.model.looped import LoopedTransformer, LoopOutput, unwrap
from loopformer.model.memory import check_fits, estimate
from loopformer.model.options import LoopOptions
from loopformer.model.recursion import step_offset
from loopformer.sources import DataSource, make_data
from loopformer.tasks import IGNORE
from loopformer.train import run
from loopformer.train.compiling import compile_block, compile_scope, eager, uncompile_block
from loopformer.train.config import RunConfig
from loopformer.train.distributed import Dist, all_sum, barrier, broadcast_object, gather_objects, setup, teardown
from loopformer.train.ema import EMA, ShardedEMA
from loopformer.train.losses import (
    MicroBatch,
    StepScale,
    at_read,
    loop_targets,
    loss_loops,
    loss_sum,
    read_positions,
    step_loss,
    supervised,
    supervised_count,
)
from loopformer.train.optim import (
    curriculum_end,
    freeze,
    gate_clock,
    loops_at,
    lr_at,
    make_optimizer,
    sample_loops,
    steps_for,
)
from loopformer.train.rollback import RollbackGuard
from loopformer.train.run import MetricsLog
from loopformer.train.selection import BestKeeper, held_score
from loopformer.train.sharding import (
    SHARDED,
    full,
    full_state,
    gather_tensors,
    gradient_sync,
    load_sharded,
    local,
    reshard,
    save_sharded,
    shard_model,
)
from loopformer.train.spikes import SpikeGuard


# ------------------------------------------------------------------------------------------------- helpers
def precision_for(cfg: RunConfig, device: torch.device) -> str:
    """The training precision on `device`: train.system.precision, with "auto" resolved (bf16 on a CUDA GPU that has it,
    else fp32)."""
    prec = cfg.train.system.precision
    if prec == "auto":
        prec = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return prec


def autocast_for(cfg: RunConfig, device: torch.device) -> tuple[Callable[[], Any], bool]:
    """(context factory, needs a gradient scaler) for the configured precision on `device`."""
    prec = precision_for(cfg, device)
    if prec == "fp32":
        return contextlib.nullcontext, False
    dtype = torch.bfloat16 if prec == "bf16" else torch.float16
    if prec == "fp16" and device.type != "cuda":
        raise UserError("train.system.precision=fp16 needs a CUDA device (use bf16 or fp32)")
    return (lambda: torch.autocast(device.type, dtype=dtype)), prec == "fp16"


def nonfinite_parameter(model: torch.nn.Module, d: Dist | None = None) -> str | None:
    """The name of the first parameter holding a NaN or an infinity, or None (one host sync). A sharded model's
    shards are checked on every process and the flags summed over processes (`d`; every process must call it)."""
    params = [(n, local(p)) for n, p in unwrap(model).named_parameters()]
    if not params:
        return None
    flags = torch.stack([torch.isfinite(p.detach()).all() for _, p in params])
    if d is not None and d.active and d.sharded:
        flags = torch.tensor(all_sum(d, (~flags).double().tolist())) == 0
    if bool(flags.all()):
        return None
    return params[int((~flags).nonzero()[0, 0])][0]


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


COMPILE_MIN_STEPS = 1000   # train.system.compile=auto: steps at the final loop count that repay a compilation (20-60 s)


def step_scope(cfg: RunConfig) -> str:
    """What a compiled step compiles ("step" or "block", `loopformer.train.compiling.compile_scope`)."""
    lp, R = cfg.train.loops, cfg.model.loops
    curriculum = 0 < lp.start < R
    varying = lp.samples_budgets or curriculum or cfg.model.loop_rule != "fixed"
    return compile_scope(cfg.train.system.compile_scope, R, varying=varying)


def compiles(cfg: RunConfig, device: torch.device, total: int) -> bool:
    """Whether the training step runs compiled (`train.system.compile`): "true" / "false" as said; "auto" when at least
    COMPILE_MIN_STEPS steps run compiled — every step when the block is compiled (`step_scope`), else the steps at
    the final loop count (after any loop curriculum; none with drawn budgets) — on a CUDA device with Triton or on a
    CPU with a C++ compiler (what torch.compile's code generation needs)."""
    mode = cfg.train.system.compile
    if mode != "auto":
        return mode == "true"
    lp, R = cfg.train.loops, cfg.model.loops
    if step_scope(cfg) == "block":           # one graph for every loop count
        return total >= COMPILE_MIN_STEPS and can_compile(device)
    if lp.samples_budgets or cfg.model.loop_rule != "fixed":   # loop counts drawn or per size: few steps at any one
        return False
    # the first step of the loop curriculum (`loops_at`) at R loops: after ceil((R − start) / increment) rises
    first = 0 if lp.start <= 0 else -(-max(0, R - lp.start) // lp.increment) * lp.every
    return total - first >= COMPILE_MIN_STEPS and can_compile(device)


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """This process's peak memory so far, in MiB: the host's resident set ("host", where the OS reports it) and the
    CUDA allocator's peak ("cuda") on a GPU."""
    out: dict[str, float] = {}
    try:
        import resource  # POSIX only
        kib = 2**10 if sys.platform == "darwin" else 1      # ru_maxrss: bytes on macOS, KiB elsewhere
        out["host"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / kib / 2**10
    except ImportError:
        pass
    if device.type == "cuda":
        out["cuda"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def dynamics_record(model: torch.nn.Module, batch: dict[str, torch.Tensor], loops: int, step: int,
                    grads: dict[str, float]) -> dict:
    """A "dynamics" metrics record: per-loop modulation magnitudes, update sizes, read-out loss / accuracy and
    settle loops on `batch` (in eval mode: no dropout, no RNG drawn, so training is unchanged), the gradient
    norm of every parameter group at this step, and per loop the norm of the final loss's gradient with respect to
    the state after that loop ("state_grad": which loops carry the gradient)."""
    raw = unwrap(model)
    # bound the per-loop read-outs [R,b,T,C] to ~1.5e8 elements: fewer rows, and for causal models fewer positions
    x, y, w = batch["inputs"], batch["targets"], batch.get("weight")
    per_row = loops * x.shape[1] * raw.config.out_dim
    rows = max(1, min(x.shape[0], int(1.5e8 // per_row)))
    cut = x.shape[1] if not raw.config.causal else max(1, min(x.shape[1], int(1.5e8 // (loops * raw.config.out_dim))))
    x, y = x[:rows, :cut], y[:rows, :cut]
    w = None if w is None else w[:rows, :cut]
    rec: dict[str, Any] = {"split": "dynamics", "step": step, "loops": loops}
    rec.update({f"grad_norm_{g}": v for g, v in grads.items()})
    mods = modulation_stats(raw, loops)
    if mods:
        rec.update(mods)
    dyn = loop_dynamics(raw, x, y, loops=loops, weight=w, ignore_index=IGNORE)
    settle = summarize_settle(dyn.pop("settle"), loops)
    rec.update({f"loop_{k}" if k != "update" else k: v for k, v in dyn.items()})
    rec.update({k: v for k, v in settle.items() if k != "settle_hist"})
    rec["state_grad"] = state_grad_norms(raw, x, y, loops=loops, weight=w, ignore_index=IGNORE)
    return rec


# ------------------------------------------------------------------------------------------------- training
def train(cfg: RunConfig, *, resume: bool = False, on_step: Callable[[int], None] | None = None,
          progress: bool | None = None, overwrite: bool = False) -> dict:
    """Train per `cfg`; returns the final results dict (also written to `out_dir/results.json` by rank 0).

    resume: continue from `out_dir/checkpoint` (the same run folder). on_step(step) is called after each
    optimiser step (tests use it to interrupt a run). overwrite: start afresh in a folder holding an earlier run or
    other files (see `loopformer.train.run.prepare`). Rank 0 holds the run folder's lock throughout. Under torchrun
    every process calls this.
    """
    if cfg.stages:                               # refused before the run folder or a process group is touched
        raise UserError("a staged config (stages:) runs each stage in turn: loopformer.train.stages.train_run")
    d = setup(cfg.device, sharded=cfg.train.system.parallel == "fsdp")
    lock = run.RunLock(cfg.out_dir) if d.main else None
    t: Trainer | None = None
    try:
        if lock is not None:
            lock.acquire()
        t = Trainer(cfg, d, resume, overwrite)
        if t.finished:                           # a finished run: nothing to do, nothing rewritten
            barrier(d)
            return run.read_results(t.run_dir)
        t.open_log(progress)
        t.wrap()
        tc = cfg.train
        if t.start == 0:
            t.score_start()                      # a fine-tuning run's starting weights compete for keep_best
        for step in range(t.start, t.total):
            t.step(step)
            done = step + 1
            if done % tc.log_every == 0 or done == t.total:
                t.log_train(done)
            if t.dyn_every and done % t.dyn_every == 0:
                t.log_dynamics(done)
            if tc.eval_every and done % tc.eval_every == 0 and done < t.total:
                t.last_eval = t.evaluate(done, final=False)
                t.checkpoint(done)
                t.window_t0 = time.perf_counter()
            if on_step is not None:
                on_step(done)
        t.bar.close()
        t.select(t.total)                        # train.select.keep_best: finish with the best weights seen
        final = t.evaluate(t.total, final=True)
        t.checkpoint(t.total)
        return t.finish(final)
    finally:
        if lock is not None:
            lock.release()
        t = None        # the model (and, sharded, its hold on the process groups) goes before the groups do
        teardown()


def check_memory(cfg: RunConfig, device: torch.device, world: int = 1) -> None:
    """Refuse, in one line, a step whose estimated memory (one micro-batch at the deepest loop count the run
    trains, on each of `world` processes) exceeds what `device` has available."""
    tc = cfg.train
    half = autocast_for(cfg, device)[0] is not contextlib.nullcontext
    hi = max(cfg.model.loops, tc.loops.budget_range(cfg.model.loops)[1] if tc.loops.samples_budgets else 0) \
        + tc.loops.jitter
    check_fits(estimate(cfg.model.replace(loops=hi), batch=max(1, tc.batch_size // (world * tc.grad_accum)),
                        training=True, read_outs=loss_loops(tc.losses, hi) or 1, ema=tc.select.ema_decay > 0,
                        act_bytes=2 if half else 4), device,
               "training", hint="lower the model's sizes or train.batch_size (or raise train.grad_accum), "
                                "or set model.checkpoint=true")


class Trainer:
    """One process's training state: data, model (and its DDP / compiled wrapper), optimiser, gradient scaler,
    the open log window, and the run folder it writes (rank 0)."""

    def __init__(self, cfg: RunConfig, d: Dist, resume: bool, overwrite: bool = False):
        self.cfg, self.d, tc = cfg, d, cfg.train
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.B = tc.batch_size
        if self.B % (d.world * tc.grad_accum):
            raise UserError(f"train.batch_size={self.B} must be divisible by processes × grad_accum = "
                            f"{d.world} × {tc.grad_accum}")
        self.run_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.run_dir / run.CKPT_DIR
        self.resume = resume
        # train.init_from: the weights this run starts from, checked before the run folder is touched
        self.init_from = check_init_from(tc.init_from, cfg.model) if tc.init_from and not resume else None
        if d.main:
            run.prepare(self.run_dir, resume, overwrite)
        barrier(d)

        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % 2 ** 32)
        self.data: DataSource = make_data(cfg.task)
        check_eval_config(cfg.eval, cfg.model.total_loops)     # the evaluation section too, before the first step
        if cfg.eval.votes:
            self.data.check_votes()
        self.total = steps_for(tc.steps, tc.epochs, self.data.n_train, self.B)
        # the loop counts' schedule: train.loops, its curriculum started at the task's K steps (start_at_steps)
        self.loop_cfg = replace(tc.loops, start=self.data.intermediate_steps() or 0) if tc.loops.start_at_steps \
            else tc.loops
        self.clock = 0                           # the curriculum's clock (train.loops.gate; else the step is);
        #                                          0 until the gate first opens
        self.val_data = self.data.validation() if tc.select.keep_best else None   # what keep_best selects by
        self.keeper = BestKeeper(self.data.higher_is_better) if tc.select.keep_best else None
        self.last_test: dict | None = None       # keep_best: the last step's test metrics, when other weights win
        self.rule = LoopRule.parse(cfg.model.loop_rule)     # loops from each row's size (length generalisation)
        check_covers(self.rule, cfg.model.loops, self.data.largest_size())
        if cfg.eval.lengths:                     # the final evaluation's lengths, checked before the first step
            plan_lengths(self.data, cfg.model, cfg.eval.lengths, loops=cfg.eval.loops,
                         max_loops=cfg.eval.max_loops, limit=cfg.eval.n)
        self.autocast, use_scaler = autocast_for(cfg, d.device)
        if cfg.memory_check:    # before anything is allocated: one micro-batch's step on this process's device
            self._check_memory()
        self.model = LoopedTransformer(cfg.model).to(d.device)
        if self.init_from is not None:          # fine-tuning: these weights, a fresh optimiser and schedule
            load_weights(self.model, self.init_from, d.device, start_past=True)
        freeze(self.model, tc.optim.freeze)      # train.optim.freeze: these groups keep the values they start with
        if d.sharded:                            # before the optimiser: sharding replaces the parameters
            shard_model(self.model, d.device, precision_for(cfg, d.device))
        self.optimizer = make_optimizer(self.model, tc.optim)
        named = list(self.model.named_parameters())
        self.gate_params = [p for n, p in named if n.startswith("exit_gate.")]
        self.trunk_params = [p for n, p in named if not n.startswith("exit_gate.")]
        self.ema: EMA | ShardedEMA | None = None
        if tc.select.ema_decay > 0:
            decay = tc.select.ema_decay
            self.ema = ShardedEMA(self.model, decay) if d.sharded else EMA(self.model, decay)
        # a sharded model's full weights (and average) on rank 0, for evaluation, dynamics and checkpoints
        self.replica: LoopedTransformer | None = None
        self.ema_replica: LoopedTransformer | None = None
        self.replica_step = -1                   # the step whose weights the replicas hold
        self.scaler = torch.amp.GradScaler(d.device.type) if use_scaler else None
        self.trains_gate = cfg.model.exit_gate and tc.losses.exit_loss_weight > 0   # the exit loss enters the step
        sel = tc.select
        self.spikes = SpikeGuard(sel.skip_spikes, sel.spike_window) if sel.skip_spikes > 0 else None
        if sel.rollback and not self.data.classifies:
            raise UserError("train.select.rollback watches the training accuracy: this task has none (set it to 0)")
        self.rollback = RollbackGuard(sel.rollback, sel.rollback_learned) if sel.rollback else None
        self.start, self.state, self.finished = 0, None, False   # the first step, the checkpoint's training state
        # the module the steps run (`wrap`: inside DDP, the step compiled)
        self.net: torch.nn.Module = self.model
        self.compiled: Callable[..., tuple[torch.Tensor, LoopOutput]] | None = None   # compiled _forward_loss
        self.compile_s = 0.0                     # seconds of the first compiled step (compilation included)
        self.compile_t0 = 0.0                    # when the compilation under way began
        self.step_now = 0                        # the step under way (0-based)
        self._start_window()
        if resume:
            self._restore()

    def _check_memory(self) -> None:
        check_memory(self.cfg, self.d.device, self.d.world)

    def _start_window(self) -> None:
        """The run's outputs, the log window and the latest step's record, empty (`open_log` fills them)."""
        cfg, d, tc = self.cfg, self.d, self.cfg.train
        # the run's outputs (`open_log`): metrics log, progress bar, training time (restored on resume)
        self.log: MetricsLog | None = None
        self.bar: tqdm | None = None
        self.train_time = 0.0
        # the log window: loss and accuracy sums stay on the device between log steps (no host synchronisation
        # in the step); counts of supervised positions and tokens on the host; its start time
        self.acc_dtype = torch.float32 if d.device.type == "mps" else torch.float64
        self.acc_loss = torch.zeros((), dtype=self.acc_dtype, device=d.device)
        self.acc_correct = torch.zeros((), dtype=self.acc_dtype, device=d.device)
        self.acc_count = self.acc_tokens = 0.0
        self.window_t0 = 0.0
        self.last_eval: dict | None = None    # the latest periodic evaluation (shown on the bar)
        self.dyn_every = (cfg.log.dynamics_every or tc.log_every) if cfg.log.dynamics else 0   # 0: no dynamics
        self.dyn_grads: dict[str, float] = {}    # per-group gradient norms of the latest dynamics step
        # the latest step (`step`): its lr, loop count (per-row budgets: the largest), last micro-batch, and the
        # trunk's gradient norm before clipping (None: no clipping)
        self.lr = 0.0
        self.loops = cfg.model.loops
        self.last_micro: dict[str, torch.Tensor] = {}
        self.gnorm: torch.Tensor | None = None

    def _restore(self) -> None:
        """Weights, optimiser, scaler, step and this process's RNG state from the run's checkpoint (a sharded
        model's from the checkpoint's sharded folder, written by any number of processes)."""
        state = load_training_state(self.ckpt_dir)
        if state is None:
            raise UserError(f"cannot resume: {self.ckpt_dir} holds no training state")
        layout = "fsdp" if state.get("sharded") else "ddp"
        if layout != self.cfg.train.system.parallel:
            raise UserError(f"cannot resume from {self.ckpt_dir}: it was written with train.system.parallel={layout}, "
                            f"this run has train.system.parallel={self.cfg.train.system.parallel} (resume with "
                            f"{layout})")
        if self.d.sharded:
            load_sharded(self.ckpt_dir / SHARDED, self.model, self.optimizer,
                         None if self.ema is None else self.ema.tensors, expect=state.get("shards"))
        else:
            self._restore_plain(state)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.spikes is not None and state.get("spikes") is not None:
            try:
                self.spikes.load_state_dict(state["spikes"])
            except UserError as exc:
                raise UserError(f"cannot resume from {self.ckpt_dir}: {exc}") from None
        if self.keeper is not None:
            self.keeper.load(self.ckpt_dir, state.get("keep_best"), self.model, at=int(state["step"]))
        if self.rollback is not None and state.get("rollback") is not None:
            try:
                self.rollback.load_state_dict(state["rollback"])
            except UserError as exc:
                raise UserError(f"cannot resume from {self.ckpt_dir}: {exc}") from None
        self.start, self.state = int(state["step"]), state
        self.clock = int(state.get("curriculum_clock", 0))
        if self.start >= self.total and run.results_done(self.run_dir, self.start):
            self.finished = True
            return
        rngs = state["rng"]
        _set_rng_state(rngs[self.d.rank] if self.d.rank < len(rngs) else rngs[0], self.d.device)

    def _restore_plain(self, state: dict) -> None:
        """The weights (and average) from model.safetensors, the optimiser from the training state."""
        load_weights(self.model, self.ckpt_dir, self.d.device)
        if self.ema is not None:
            load_weights(self.ema.module, self.ckpt_dir, self.d.device, ema=True)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise UserError(f"cannot resume from {self.ckpt_dir}: its optimizer state does not fit this model "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None

    def wrap(self) -> None:
        """The module the steps run: the model, inside DDP when several processes train, compiled when asked
        (`self.net`; checkpoints always save the raw `self.model`)."""
        self.net = self.model
        if self.d.active and not self.d.sharded:       # sharded: the model reduces its own gradients
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.d.device] if self.d.device.type == "cuda" else None)
        self.compiled, self.regional = None, False
        if compiles(self.cfg, self.d.device, self.total):
            if step_scope(self.cfg) == "block":  # regional: each layer of the shared block (`train/compiling.py`)
                compile_block(self.model, self.cfg.train.system.compile_mode)
                self.regional = True
            else:
                self.compiled = torch.compile(self._forward_loss, mode=self.cfg.train.system.compile_mode)
        if (self.compiled is not None or self.regional) and self.cfg.threads:
            import torch._inductor.config as inductor  # heavy: only when compiling
            inductor.compile_threads = self.cfg.threads  # the compiler's worker pool keeps to the thread budget
        self.compile_s = 0.0

    def forward_loss(self, mb: MicroBatch, state: torch.Tensor | None, offset: int) -> tuple[torch.Tensor, LoopOutput]:
        """One supervision step of micro-batch `mb` from `state` (None: the read-in) at loop offset `offset`: the
        forward and its summed task loss (`_forward_loss`), compiled at the model's final loop count when `compiles`
        says so (a loop curriculum's shorter steps stay eager: each loop count would be a graph of its own). With
        train.system.compile=auto a compilation that fails falls back to eager with one warning."""
        args = (mb.inputs, state, offset, mb.at, mb.targets, mb.weight, mb.loops, mb.return_all, mb.read_loops,
                mb.n_read, mb.rows, mb.read_only)
        if self.regional:                        # the block's layers compiled: every loop count runs them
            fn = self._forward_loss
        elif self.compiled is None or mb.loops != self.cfg.model.loops:
            return self._forward_loss(*args)
        else:
            fn = self.compiled
        if self.compile_s:
            return fn(*args)
        t0 = time.perf_counter()
        self._compiling("compiling")
        try:
            out = fn(*args)
        except Exception as exc:                 # noqa: BLE001 - any compiler failure: auto falls back
            self._compiling("compile failed")
            if self.cfg.train.system.compile != "auto":
                raise
            print(f"loopformer: compiling the training step failed, training eagerly ({configio.one_line(exc)})",
                  file=sys.stderr)
            self.compiled, self.regional = None, False
            uncompile_block(self.model)
            return self._forward_loss(*args)
        self.compile_s = time.perf_counter() - t0
        self._compiling("compiled")
        return out

    def _compiling(self, event: str) -> None:
        """Say that the first compiled step is being compiled (`event` "compiling") or that it is over
        ("compiled", "compile failed"): in the bar's description and as an "event" record of the metrics log,
        which a sweep's bar reads."""
        on = event == "compiling"
        if self.bar is not None:
            self.bar.set_description(f"{self.cfg.name} (compiling the step)" if on else self.cfg.name)
        if self.log is not None:
            rec = {"split": "event", "step": self.step_now, "event": event}
            self.log.write(rec if on else {**rec, "seconds": round(time.perf_counter() - self.compile_t0, 1)})
        self.compile_t0 = time.perf_counter()

    def _forward_loss(self, x: torch.Tensor, state: torch.Tensor | None, offset: int, at: torch.Tensor | None,
                      targets: torch.Tensor, weight: torch.Tensor | None, R: int, return_all: bool,
                      read_loops: int | None, n_read: int | None, row_loops: torch.Tensor | None = None,
                      read_only: bool = False) -> tuple[torch.Tensor, LoopOutput]:
        """One supervision step: the forward from `state` (None: the read-in) and its summed loss over the last
        `n_read` read-outs (None: the final one) at the positions `at` — one graph when compiled. `row_loops`: a
        loop count per row (budgets drawn per row). `read_only`: nothing but the loss reads the output, so the last
        loop computes the positions `at` only (`LoopedTransformer.forward`)."""
        out = self.net(x, loops=R, return_all=return_all,
                       opts=LoopOptions(state=state, loop_offset=offset, read_at=at, read_loops=read_loops,
                                        row_loops=row_loops, read_only=read_only))
        logits = out.logits if n_read is None else out.all_logits[-n_read:]
        if out.all_logits is not None:   # a copy, not a view of all_logits: compiled graphs whose outputs alias
            out.logits = out.logits.clone()   # each other fail when replayed from torch's compilation cache
        return loss_sum(*at_read(at, logits, targets, weight), kind=self.cfg.train.losses.kind), out

    def open_log(self, progress: bool | None) -> None:
        """Write config.yaml and run.json, open the metrics log, start the bar and the log window (restored from
        the checkpoint when resuming)."""
        cfg, d, state = self.cfg, self.d, self.state
        if d.main:
            reach = curriculum_end(self.loop_cfg, cfg.model.loops)   # the first step at model.loops (a curriculum;
            #                                                          with a gate, the earliest)
            info = {"name": cfg.name, "config": to_dict(cfg), "seed": cfg.seed, "git": run.git_commit(),
                    "versions": run.package_versions(), "command": sys.argv, "world_size": d.world,
                    "device": str(d.device), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "resumed_from_step": self.start if self.resume else None, "total_steps": self.total,
                    "params": self.model.num_params(), "curriculum_reaches_loops_at": reach,
                    "curriculum_start": self.loop_cfg.start or None,
                    "init_from": None if self.init_from is None else str(self.init_from.resolve())}
            run.write_start(self.run_dir, cfg, info)
            if reach is not None and reach >= self.total and not self.resume:
                print(f"loopformer: warning: the loop curriculum reaches model.loops = {cfg.model.loops} at step "
                      f"{reach:,}, after this run's {self.total:,} steps: it never trains {cfg.model.loops} loops"
                      f"{' nor draws past them' if cfg.train.loops.samples_budgets else ''} (raise train.steps or "
                      f"lower train.loops.every)", file=sys.stderr)
        self.log = MetricsLog(self.run_dir, cfg, self.start if self.resume else None, d.main, final_step=self.total)
        show = d.main and (cfg.log.progress if progress is None else progress)
        self.bar = tqdm(total=self.total, initial=self.start, desc=cfg.name, disable=not show, dynamic_ncols=True)
        self.train_time = float(state.get("train_time", 0.0)) if state else 0.0
        if state is not None and state.get("window"):   # the log window the checkpoint cut (exact metrics on resume)
            win = state["window"]
            if len(win) == d.world:
                w = [float(x) for x in win[d.rank]]
            else:   # written by another number of processes: the sums all go to rank 0 (log_train adds them up)
                w = [sum(float(r[i]) for r in win) if d.main else 0.0 for i in range(4)]
            self.acc_loss.fill_(w[0])
            self.acc_correct.fill_(w[1])
            self.acc_count, self.acc_tokens = w[2], w[3]
        self.window_t0 = time.perf_counter()
        self.model.train()

    # ------------------------------------------------------------------ one optimiser step
    def step(self, step: int) -> None:
        """Forward and backward over this process's slice of the global batch of `step` (in grad_accum
        micro-batches), then clip and update; the loss and accuracy sums go into the log window."""
        t_step = time.perf_counter()
        self.step_now = step
        self.lr = lr = lr_at(self.cfg.train.optim, step, self.total) * (self.rollback.lr_scale if self.rollback else 1)
        shut = self.loop_cfg.gate_modulation and self.clock == 0   # the modulations wait for the gate's opening
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0 if shut and g.get("timestep") else lr * g.get("lr_mult", 1.0)
        micro, counts = self._micro_batches(step)
        global_count = max(all_sum(self.d, [float(sum(counts))])[0], 1.0)
        for i, mb in enumerate(micro):
            self._micro_step(mb, counts[i], global_count, len(micro), last=i == len(micro) - 1)
        self.last_micro = micro[-1]
        self._update(step)
        self.train_time += time.perf_counter() - t_step
        self.bar.update(1)

    def _micro_batches(self, step: int) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
        """This process's micro-batches of step `step` on the device (with each row's loop budget, `row_loops`,
        and the positions the read-out looks at, `read_at`) and their supervised positions, counted on the host;
        sets the step's loop count `self.loops`."""
        cfg, d, tc, data = self.cfg, self.d, self.cfg.train, self.data
        per_row = tc.loops.samples_budgets and tc.loops.sample_per == "row"
        budgets = sample_loops(self.loop_cfg, step, cfg.model.loops, cfg.seed, self.B if per_row else 1,
                               clock=self.clock if self.loop_cfg.gate else None)   # [B] | [1]
        self.loops = int(budgets.max())                         # the step's loop count (per row: the largest)
        keys = data.plan(step, self.B)                           # [B] global batch
        mine = np.array_split(keys, d.world)[d.rank]
        fetched = [data.fetch(k, step) for k in np.array_split(mine, tc.grad_accum)]
        if per_row:                                              # each row's budget travels with it
            mine_b = np.array_split(budgets, d.world)[d.rank]
            for m, b in zip(fetched, np.array_split(mine_b, tc.grad_accum)):
                m["row_loops"] = torch.from_numpy(b)
        if not self.rule.fixed:                                  # T(n) per row (+ jitter), from the rows' sizes
            extra = np.array_split(jitter(cfg.seed, step, self.B, tc.loops.jitter), d.world)[d.rank]   # [B] -> mine
            for m, j in zip(fetched, np.array_split(extra, tc.grad_accum)):
                m["row_loops"] = torch.from_numpy(self.rule.loops(m["size"].numpy(), cfg.model.loops) + j)
            self.loops = max(int(m["row_loops"].max()) for m in fetched)
        counts = [supervised_count(m["targets"], m.get("weight")) for m in fetched]   # before the copy
        if not self.trains_gate and cfg.model.head != "sequence":   # the read-out only where the loss looks
            for m in fetched:
                at = read_positions(m)
                if at is not None:
                    m["read_at"] = at
        return [_to(m, d.device) for m in fetched], counts

    def _micro_batch(self, batch: dict[str, torch.Tensor]) -> MicroBatch:
        """What the forward and the loss of `batch` (one micro-batch on the device) read: its loop count, the
        read-outs in the loss, per-loop targets from the task's intermediate states, the read positions."""
        cfg, lc = self.cfg, self.cfg.train.losses
        N, R = cfg.model.supervision_steps, self.loops
        n_read = loss_loops(lc, R)                                      # read-outs in the loss (None: the last)
        per_loop_gate = self.trains_gate and N == 1                      # the exit gate reads every loop
        rows = batch.get("row_loops")                                   # [b] | None
        targets = batch["targets"] if "step_targets" not in batch else \
            loop_targets(batch["step_targets"], R, n_read, per_row=not self.rule.fixed)   # [n_read,b,T]
        return MicroBatch(inputs=batch["inputs"], targets=targets, weight=batch.get("weight"),
                          at=batch.get("read_at"), rows=rows, loops=R if rows is None else int(rows.max()),
                          return_all=n_read is not None or per_loop_gate,
                          read_loops=None if per_loop_gate else n_read, n_read=n_read,
                          # nothing but the loss reads the final state: no later step, gate or fixed-point loss
                          read_only=N == 1 and not self.trains_gate and lc.fixed_point == 0)

    def _micro_step(self, batch: dict[str, torch.Tensor], count: int, global_count: float, n_micro: int,
                    last: bool) -> None:
        """Forward and backward of one micro-batch over its N supervision steps (deep supervision: step j starts
        from step j−1's detached state, at loop offset `step_offset`; one step in memory), each with its loss
        (`step_loss`) scaled to the global batch's mean; DDP synchronises the gradients on the `last` micro-batch's
        last step. Sums go into the log window."""
        cfg, d = self.cfg, self.d
        mb, N = self._micro_batch(batch), cfg.model.supervision_steps
        k = 1 if mb.n_read is None else mb.n_read
        scale = StepScale(task=d.world / (global_count * k * N), gate=n_micro * N,
                          per_loop_gate=self.trains_gate and N == 1)
        state: torch.Tensor | None = None
        for j in range(N):                                   # h <- the step's loops from the previous step's state
            with gradient_sync(self.net, (last and j == N - 1) or not d.active):
                with self.autocast():
                    s, out = self.forward_loss(mb, state, step_offset(cfg.model.step_timestep, j, mb.loops))
                loss = step_loss(s, out, mb, batch["targets"], self.model, cfg.train, scale, self.autocast)
                if loss.requires_grad:           # train.optim.freeze: a loss that reads no trained parameter has none
                    (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            with torch.no_grad():
                self.acc_loss += s.detach().to(self.acc_dtype) / (k * N)
            state = out.hidden.detach()
        with torch.no_grad():
            if self.data.classifies:
                logits, targets, _ = at_read(mb.at, out.logits, batch["targets"])
                self.acc_correct += ((logits.argmax(-1) == targets) & supervised(targets)).sum().to(self.acc_dtype)
            self.acc_count += count
            self.acc_tokens += mb.inputs.shape[0] * mb.inputs.shape[1]

    def _update(self, step: int) -> None:
        """Unscale, record the gradient norms (dynamics steps), clip the trunk's and the exit gate's gradients
        apart, step the optimiser and the weight average."""
        d, tc = self.d, self.cfg.train
        if d.sharded:                            # the step's gradients are reduced: free the gathered weights
            reshard(self.model)
        if tc.optim.freeze and all(p.grad is None for g in self.optimizer.param_groups for p in g["params"]):
            self.gnorm = None                    # train.optim.freeze: a step whose loss read no trained parameter (e.g.
            return                               # R = r with only the loops past r trained) changes nothing
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if (d.main or d.sharded) and self.dyn_every and (step + 1) % self.dyn_every == 0:
            self.dyn_grads = grad_norms(self.model,                # before clipping (sharded: summed over ranks)
                                        reduce=(lambda v: all_sum(d, v)) if d.sharded else None)
        self.gnorm = (torch.nn.utils.clip_grad_norm_(self.trunk_params, tc.optim.grad_clip) if tc.optim.grad_clip > 0
                      else None)
        if self.spikes is not None:              # a gradient spike: the step is dropped (`train/spikes.py`)
            norm = self.gnorm if self.gnorm is not None else \
                torch.nn.utils.clip_grad_norm_(self.trunk_params, math.inf)
            if self.spikes.check(float(full(norm))):
                if self.scaler is not None:
                    self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                return
        if tc.optim.grad_clip > 0 and self.gate_params:   # the exit gate's own norm: its loss never rescales the trunk
            torch.nn.utils.clip_grad_norm_(self.gate_params, tc.optim.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.model)

    # ------------------------------------------------------------------ logging
    def log_train(self, done: int) -> None:
        """The "train" record of the log window that ends at step `done` (summed over processes)."""
        loss_sum, correct, count, tokens = all_sum(self.d, [float(self.acc_loss), float(self.acc_correct),
                                                            self.acc_count, self.acc_tokens])
        now = time.perf_counter()
        rec = {"split": "train", "step": done, "loss": loss_sum / max(count, 1.0), "lr": self.lr, "loops": self.loops,
               "grad_norm": float(full(self.gnorm)) if self.gnorm is not None else None,
               "tokens_per_s": tokens / max(now - self.window_t0, 1e-9),
               "train_time": self.train_time}
        if self.data.classifies:
            rec["accuracy"] = correct / max(count, 1.0)
        if self.spikes is not None:
            rec["skipped_steps"] = self.spikes.skipped         # the run's total so far
        if self.rollback is not None and "accuracy" in rec and \
                self.rollback.update(rec["accuracy"], done, self._good_state, loops_at(
                    self.loop_cfg, self.clock if self.loop_cfg.gate else done - 1, self.cfg.model.loops)):
            self.log.write(self._roll_back(done))              # the last good window's state is back
        if self.loop_cfg.gate and "accuracy" in rec:           # the window's steps count if it reached the gate
            L = self.cfg.train.log_every
            self.clock = gate_clock(self.clock, rec["accuracy"], done - (done - 1) // L * L, self.loop_cfg.gate)
            rec["curriculum_clock"] = self.clock
        if not math.isfinite(rec["loss"]):
            raise UserError(f"training diverged: the loss became {rec['loss']} at step {done}; the last good "
                            f"checkpoint is kept (lower train.optim.lr or enable train.optim.grad_clip)")
        self.log.write(rec)
        post = {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
        if "accuracy" in rec:
            post["acc"] = f"{rec['accuracy']:.3f}"
        if self.last_eval is not None:
            post[f"test_{self.data.metric}"] = f"{self.last_eval['metrics'][self.data.metric]:.4g}"
        self.bar.set_postfix(post, refresh=False)
        self.acc_loss.zero_()
        self.acc_correct.zero_()
        self.acc_count = self.acc_tokens = 0.0
        self.window_t0 = now

    def _good_state(self) -> dict:
        """What a rollback puts back (`loopformer.train.rollback`): weights, optimiser, average, scaler, spikes."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "ema": self.ema.module.state_dict() if isinstance(self.ema, EMA) else None,
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "spikes": self.spikes.state_dict() if self.spikes else None}

    def _roll_back(self, done: int) -> dict:
        """Put the rollback guard's snapshot back in place; the log's "rollback" record."""
        snap = self.rollback.snapshot
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        if snap["ema"] is not None:
            self.ema.module.load_state_dict(snap["ema"])
        if snap["scaler"] is not None:
            self.scaler.load_state_dict(snap["scaler"])
        if snap["spikes"] is not None:
            self.spikes.load_state_dict(snap["spikes"])
        return {"split": "rollback", "step": done, "to": snap["step"], "lr_scale": self.rollback.lr_scale,
                "rollbacks": self.rollback.count}

    def log_dynamics(self, done: int) -> None:
        model, _ = self.full_models(done)
        if self.d.main:
            with eager(model):                  # measurements run eagerly (other shapes, eval mode)
                self.log.write(dynamics_record(model, self.last_micro, self.loops, done, self.dyn_grads))

    # ------------------------------------------------------------------ evaluation, checkpoints, results
    def check_finite(self, step: int) -> None:
        """Stop before NaN / inf weights or a non-finite loss reach a checkpoint or the metrics log."""
        bad = nonfinite_parameter(self.model, self.d)
        if bad is None and not bool(torch.isfinite(self.acc_loss)):
            bad = "the training loss"
        if bad is not None:
            raise UserError(f"training diverged: {bad} is not finite at step {step}; the last good checkpoint is "
                            f"kept (lower train.optim.lr or enable train.optim.grad_clip)")

    def evaluate(self, step: int, final: bool) -> dict | None:
        """Test metrics (rank 0; on the final evaluation also loop by loop, and the halting rules, sweep and loop
        budgets of `cfg.eval`: `loopformer.eval.run.evaluate_all`), logged and shared with every process."""
        cfg, res = self.cfg, None
        self.check_finite(step)
        model, ema = self.full_models(step)
        if self.d.main:
            kw = dict(loopwise=final, device=self.d.device, autocast=self.autocast)
            with eager(model):                   # evaluation runs eagerly (a compiled block: other shapes)
                res = evaluate_all(model, self.data, cfg.eval, extras=final, **kw)
                if self.keeper is not None and not final:
                    self.score_validation(model, step)
            rec = {"split": "test", "step": step, "loops": res["loops"], **res["metrics"]}
            if ema is not None:
                res_ema = evaluate_all(ema, self.data, cfg.eval, extras=False, **kw)
                res["ema"] = res_ema
                rec.update({f"ema_{k}": v for k, v in res_ema["metrics"].items()})
            self.log.write(rec)
        return broadcast_object(self.d, res)

    def score_validation(self, model: torch.nn.Module, step: int) -> None:
        """train.select.keep_best (rank 0): `model`'s headline metric at r on the validation split — with
        `train.select.keep_best_depth=trained` the worst of it over loops r..R, the deepest loop count training draws
        (`held_score`) — logged as a "val" record; its weights kept when it is the best so far
        (`loopformer.train.selection`)."""
        tc, metric = self.cfg.train, self.data.metric
        deep = tc.select.keep_best_depth == "trained"
        ecfg = replace(self.cfg.eval, loopwise=True, max_loops=tc.loops.budget_range(self.cfg.model.loops)[1]) \
            if deep else self.cfg.eval
        res = evaluate_all(model, self.val_data, ecfg, loopwise=deep, extras=False, device=self.d.device,
                           autocast=self.autocast)
        at_r = float(res["metrics"][metric])
        score = held_score(res) if deep else at_r
        kept = self.keeper.offer(unwrap(model), score, step, tie=at_r if deep else None)
        self.log.write({"split": "val", "step": step, "loops": res["loops"], **res["metrics"],
                        **({"held": score, "held_to": res["max_loops"]} if deep else {}), "kept": kept})

    def score_start(self) -> None:
        """train.select.keep_best with train.init_from (rank 0): the starting weights are scored as step 0, so a
        fine-tuning run that never does better on the validation split finishes with the weights it started from."""
        if self.keeper is None or not self.cfg.train.init_from or not self.d.main:
            return
        model = self.model
        with eager(model):
            self.score_validation(model, 0)

    def select(self, step: int) -> None:
        """train.select.keep_best at the end (rank 0): score the last weights too, and when earlier ones scored better,
        note the last weights' test metrics and load the kept weights for the final evaluation and checkpoint."""
        if self.keeper is None or not self.d.main:
            return
        model = self.model
        with eager(model):
            self.score_validation(model, step)
            if self.keeper.step != step:
                self.last_test = evaluate_all(model, self.data, self.cfg.eval, loopwise=False, extras=False,
                                              device=self.d.device, autocast=self.autocast)["metrics"]
        if self.keeper.step != step:
            self.keeper.restore(model)

    def full_models(self, step: int) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
        """The model and its weight average (None without one) with full weights, for evaluation, dynamics and
        checkpoints on rank 0: the model itself, or for a sharded model replicas gathered from the shards (once per
        step; every process must call it, the others get None)."""
        if not self.d.sharded:
            return self.model, None if self.ema is None else self.ema.module
        if self.replica_step != step:
            weights = full_state(self.model)
            average = None if self.ema is None else gather_tensors(self.ema.tensors, self.d.main)
            if self.d.main:
                if self.replica is None:
                    self.replica = LoopedTransformer(self.cfg.model).to(self.d.device)
                self.replica.load_state_dict(weights)
                if average is not None:
                    if self.ema_replica is None:
                        self.ema_replica = LoopedTransformer(self.cfg.model).to(self.d.device).eval()
                    self.ema_replica.load_state_dict({**weights, **average})
            self.replica_step = step
        return self.replica, self.ema_replica

    def checkpoint(self, step: int) -> None:
        """Weights, optimiser, scaler, every process's RNG state and log window, written by rank 0 (a sharded
        model's weights, optimiser state and average by every process into the checkpoint's sharded folder, and
        by rank 0 whole as model.safetensors and ema.safetensors)."""
        self.check_finite(step)
        window = [float(self.acc_loss), float(self.acc_correct), float(self.acc_count), float(self.acc_tokens)]
        mine = gather_objects(self.d, {"rng": _rng_state(self.d.device), "window": window})
        model, ema = self.full_models(step)
        sharded = self.d.sharded

        # the sharded folder's identity, in its manifest and the training state: shards never mix across checkpoints
        shards = {"id": uuid.uuid4().hex, "step": step} if sharded and self.d.main else None

        def write_shards(tmp: Path | None) -> None:      # every process: the sharded state into the new folder
            folder = Path(broadcast_object(self.d, None if tmp is None else str(tmp / SHARDED)))
            save_sharded(folder, self.model, self.optimizer, None if self.ema is None else self.ema.tensors,
                         identity=shards)
            barrier(self.d)

        if self.d.main:
            save_checkpoint(self.ckpt_dir, model, run=to_dict(self.cfg), task=self.data.describe(),
                            training_state={"step": step,
                                            "optimizer": {} if sharded else self.optimizer.state_dict(),
                                            "sharded": sharded, **({"shards": shards} if shards else {}),
                                            "scaler": self.scaler.state_dict() if self.scaler else None,
                                            "spikes": self.spikes.state_dict() if self.spikes else None,
                                            "rollback": self.rollback.state_dict() if self.rollback else None,
                                            "curriculum_clock": self.clock,
                                            "keep_best": self.keeper.state_dict() if self.keeper else None,
                                            "rng": [m["rng"] for m in mine], "window": [m["window"] for m in mine],
                                            "train_time": self.train_time, "total_steps": self.total},
                            ema=ema, extra=write_shards if sharded else (self.keeper.save if self.keeper else None))
        elif sharded:
            write_shards(None)
        barrier(self.d)

    def finish(self, final: dict) -> dict:
        """results.json (rank 0) from the final evaluation; every process returns it."""
        cfg, d, tc, results = self.cfg, self.d, self.cfg.train, None
        if d.main:
            halting, budgets, sweep, drift = (final.get(k) for k in ("halting", "budgets", "halting_sweep", "drift"))
            results = run.write_results(self.run_dir, {
                "name": cfg.name, "task": self.data.describe(), "variant": cfg.model.variant,
                "loops": cfg.model.loops, "n_layers": cfg.model.n_layers, "timestep": cfg.model.timestep,
                "d_model": cfg.model.d_model, "params": self.model.num_params(), "steps": self.total,
                "batch_size": self.B, "train_time_s": self.train_time,
                "compiled": self.compiled is not None or self.regional,
                "compile_scope": "block" if self.regional else "step" if self.compiled is not None else None,
                "compile_s": self.compile_s, "peak_memory_mb": peak_memory_mb(d.device), "metric": final["metric"],
                "higher_is_better": final["higher_is_better"], "test": final["metrics"],
                "loopwise": final["loopwise"], "max_loops": final["max_loops"], "world_size": d.world,
                "device": str(d.device), "seed": cfg.seed, "supervision_steps": cfg.model.supervision_steps,
                "total_loops": cfg.model.total_loops, "stepwise": final["stepwise"],
                **({"test_ema": final["ema"]["metrics"], "loopwise_ema": final["ema"]["loopwise"]}
                   if "ema" in final else {}),
                **({"halting": halting} if halting else {}),
                **({"budgets": budgets} if budgets else {}),
                **({"halting_sweep": sweep} if sweep else {}),
                **({"drift": drift} if drift else {}),
                **({"lengths": final["lengths"]} if "lengths" in final else {}),
                **({"keep_best": {"step": self.keeper.step, "val": self.keeper.score, "metric": self.data.metric,
                                  "last_test": self.last_test}} if self.keeper is not None else {}),
                **({"loop_rule": cfg.model.loop_rule, "loop_jitter": tc.loops.jitter}
                   if cfg.model.loop_rule != "fixed" else {}),
                **({"skipped_steps": self.spikes.skipped} if self.spikes is not None else {}),
                **({"rollbacks": self.rollback.count} if self.rollback is not None else {}),
                **({"loops_sample": {"kind": "hold" if tc.loops.hold else tc.loops.sample, "per": tc.loops.sample_per,
                                     "range": list(tc.loops.budget_range(cfg.model.loops))}}
                   if tc.loops.samples_budgets else {}),
                **({"references": refs} if (refs := self.data.references()) else {}),
            })
        self.log.close()
        return broadcast_object(d, results)


__all__ = ["train", "Trainer", "autocast_for", "check_memory", "dynamics_record", "nonfinite_parameter"]
