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
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from loopformer import configio
from loopformer.configio import to_dict
from loopformer.errors import UserError
from loopformer.eval.budgets import evaluate_budgets
from loopformer.eval.evaluate import evaluate
from loopformer.eval.halting import evaluate_halting
from loopformer.fileio import can_compile
from loopformer.model.diagnostics import grad_norms, loop_dynamics, modulation_stats, summarize_settle
from loopformer.model.io import load_training_state, load_weights, save_checkpoint
from loopformer.model.looped import LoopedTransformer, LoopOutput, unwrap
from loopformer.model.memory import check_fits, estimate
from loopformer.model.recursion import step_offset
from loopformer.sources import DataSource, make_data
from loopformer.tasks import IGNORE
from loopformer.train import run
from loopformer.train.config import RunConfig
from loopformer.train.ema import EMA
from loopformer.train.distributed import Dist, all_sum, barrier, broadcast_object, gather_objects, setup, teardown
from loopformer.train.optim import (budget_range, consistency_loss, exit_loss, fixed_point_loss, loop_targets,
                                   loss_loops, loss_sum, lr_at, make_optimizer, sample_loops, steps_for)
from loopformer.train.run import MetricsLog


# ------------------------------------------------------------------------------------------------- helpers
def autocast_for(cfg: RunConfig, device: torch.device) -> tuple[Callable[[], Any], bool]:
    """(context factory, needs a gradient scaler) for the configured precision on `device`."""
    prec = cfg.train.precision
    if prec == "auto":
        prec = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if prec == "fp32":
        return contextlib.nullcontext, False
    dtype = torch.bfloat16 if prec == "bf16" else torch.float16
    if prec == "fp16" and device.type != "cuda":
        raise UserError("train.precision=fp16 needs a CUDA device (use bf16 or fp32)")
    return (lambda: torch.autocast(device.type, dtype=dtype)), prec == "fp16"


def nonfinite_parameter(model: torch.nn.Module) -> Optional[str]:
    """The name of the first parameter holding a NaN or an infinity, or None (one host sync)."""
    params = [(n, p) for n, p in unwrap(model).named_parameters()]
    if not params:
        return None
    flags = torch.stack([torch.isfinite(p.detach()).all() for _, p in params])
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


COMPILE_MIN_STEPS = 1000   # train.compile=auto: steps at the final loop count that repay a compilation (~20-60 s)


def compiles(cfg: RunConfig, device: torch.device, total: int) -> bool:
    """Whether the training step runs compiled (`train.compile`): "true" / "false" as said; "auto" when at least
    COMPILE_MIN_STEPS steps run at the final loop count (after any loop curriculum) on a CUDA device with Triton or
    on a CPU with a C++ compiler (what torch.compile's code generation needs)."""
    mode = cfg.train.compile
    if mode != "auto":
        return mode == "true"
    tc, R = cfg.train, cfg.model.loops
    if tc.loops_sample != "fixed":           # drawn loop counts: few steps at any one of them
        return False
    # the first step of the loop curriculum (`loops_at`) at R loops: after ceil((R − start) / increment) rises
    first = 0 if tc.loops_start <= 0 else -(-max(0, R - tc.loops_start) // tc.loops_increment) * tc.loops_every
    return total - first >= COMPILE_MIN_STEPS and can_compile(device)


def read_positions(batch: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """[n] int64: the flattened B·T positions a batch's loss looks at — a target (or, with per-loop targets, any
    loop's target), or a weight above 0 for regression — or None when that is every position."""
    t = batch["targets"]
    if t.dtype.is_floating_point:
        seen = batch["weight"] > 0 if "weight" in batch else torch.ones_like(t, dtype=torch.bool)
    else:
        seen = t != IGNORE
        if "step_targets" in batch:
            seen = seen | (batch["step_targets"] != IGNORE).any(1)                      # [B,K,T] -> [B,T]
    return None if bool(seen.all()) else seen.flatten().nonzero().squeeze(1)


def at_read(at: Optional[torch.Tensor], logits: torch.Tensor, targets: torch.Tensor,
            weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Read-outs taken at the positions `at` ([..., n, C], `read_positions`) with targets [..., B,T] (and weight
    [B,T]) as one row of n positions: ([..., 1, n, C], [..., 1, n], [1, n]), the layout `summed_loss` reads.
    Unchanged when `at` is None."""
    if at is None:
        return logits, targets, weight
    pick = (lambda z: z.flatten(-2).index_select(-1, at).unsqueeze(-2))                 # [..., B,T] -> [..., 1,n]
    return logits.unsqueeze(-3), pick(targets), None if weight is None else pick(weight)


def dynamics_record(model: torch.nn.Module, batch: dict[str, torch.Tensor], loops: int, step: int,
                    grads: dict[str, float]) -> dict:
    """A "dynamics" metrics record: per-loop modulation magnitudes, update sizes, read-out loss / accuracy and
    settle loops on `batch` (in eval mode: no dropout, no RNG drawn, so training is unchanged), and the gradient
    norm of every parameter group at this step."""
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
    return rec


# ------------------------------------------------------------------------------------------------- training
def train(cfg: RunConfig, *, resume: bool = False, on_step: Optional[Callable[[int], None]] = None,
          progress: Optional[bool] = None, overwrite: bool = False) -> dict:
    """Train per `cfg`; returns the final results dict (also written to `out_dir/results.json` by rank 0).

    resume: continue from `out_dir/checkpoint` (the same run folder). on_step(step) is called after each
    optimiser step (tests use it to interrupt a run). overwrite: start afresh in a folder holding an earlier run or
    other files (see `loopformer.train.run.prepare`). Rank 0 holds the run folder's lock throughout. Under torchrun
    every process calls this.
    """
    d = setup(cfg.device)
    lock = run.RunLock(cfg.out_dir) if d.main else None
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
        final = t.evaluate(t.total, final=True)
        t.checkpoint(t.total)
        return t.finish(final)
    finally:
        if lock is not None:
            lock.release()
        teardown()


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
        if d.main:
            run.prepare(self.run_dir, resume, overwrite)
        barrier(d)

        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % 2 ** 32)
        self.data: DataSource = make_data(cfg.task)
        self.total = steps_for(tc.steps, tc.epochs, self.data.n_train, self.B)
        self.autocast, use_scaler = autocast_for(cfg, d.device)
        if cfg.memory_check:    # before anything is allocated: one micro-batch's step on this process's device
            half = self.autocast is not contextlib.nullcontext
            hi = max(cfg.model.loops, budget_range(tc, cfg.model.loops)[1] if tc.loops_sample != "fixed" else 0)
            check_fits(estimate(cfg.model.replace(loops=hi), batch=self.B // (d.world * tc.grad_accum), training=True,
                                read_outs=loss_loops(tc, hi) or 1, ema=tc.ema_decay > 0,
                                act_bytes=2 if half else 4), d.device,
                       "training", hint="lower the model's sizes or train.batch_size (or raise train.grad_accum), "
                                        "or set model.checkpoint=true")
        self.model = LoopedTransformer(cfg.model).to(d.device)
        self.optimizer = make_optimizer(self.model, tc)
        named = list(self.model.named_parameters())
        self.gate_params = [p for n, p in named if n.startswith("exit_gate.")]
        self.trunk_params = [p for n, p in named if not n.startswith("exit_gate.")]
        self.ema = EMA(self.model, tc.ema_decay) if tc.ema_decay > 0 else None
        self.scaler = torch.amp.GradScaler(d.device.type) if use_scaler else None
        self.start, self.state, self.finished = 0, None, False
        if resume:
            self._restore()

    def _restore(self) -> None:
        """Weights, optimiser, scaler, step and this process's RNG state from the run's checkpoint."""
        load_weights(self.model, self.ckpt_dir, self.d.device)
        if self.ema is not None:
            load_weights(self.ema.module, self.ckpt_dir, self.d.device, ema=True)
        state = load_training_state(self.ckpt_dir)
        if state is None:
            raise UserError(f"cannot resume: {self.ckpt_dir} holds no training state")
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise UserError(f"cannot resume from {self.ckpt_dir}: its optimizer state does not fit this model "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.start, self.state = int(state["step"]), state
        if self.start >= self.total and run.results_done(self.run_dir, self.start):
            self.finished = True
            return
        rngs = state["rng"]
        _set_rng_state(rngs[self.d.rank] if self.d.rank < len(rngs) else rngs[0], self.d.device)

    def wrap(self) -> None:
        """The module the steps run: the model, inside DDP when several processes train, compiled when asked
        (`self.net`; checkpoints always save the raw `self.model`)."""
        self.net: torch.nn.Module = self.model
        if self.d.active:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.d.device] if self.d.device.type == "cuda" else None)
        self.compiled = torch.compile(self._forward_loss, mode=self.cfg.train.compile_mode) \
            if compiles(self.cfg, self.d.device, self.total) else None
        if self.compiled is not None and self.cfg.threads:
            import torch._inductor.config as inductor   # heavy: only when compiling
            inductor.compile_threads = self.cfg.threads  # the compiler's worker pool keeps to the thread budget
        self.compile_s = 0.0                     # seconds of the first compiled step (compilation included)

    def forward_loss(self, x: torch.Tensor, state: Optional[torch.Tensor], offset: int, at: Optional[torch.Tensor],
                     targets: torch.Tensor, weight: Optional[torch.Tensor], R: int, return_all: bool,
                     read_loops: Optional[int], n_read: Optional[int], row_loops: Optional[torch.Tensor] = None,
                     read_only: bool = False) -> tuple[torch.Tensor, LoopOutput]:
        """`_forward_loss`, compiled at the model's final loop count when `compiles` says so (a loop curriculum's
        shorter steps stay eager: each loop count would be a graph of its own). With train.compile=auto a
        compilation that fails falls back to eager with one warning."""
        args = (x, state, offset, at, targets, weight, R, return_all, read_loops, n_read, row_loops, read_only)
        if self.compiled is None or R != self.cfg.model.loops:
            return self._forward_loss(*args)
        if self.compile_s:
            return self.compiled(*args)
        t0 = time.perf_counter()
        try:
            out = self.compiled(*args)
        except Exception as exc:                 # noqa: BLE001 - any compiler failure: auto falls back
            if self.cfg.train.compile != "auto":
                raise
            print(f"loopformer: compiling the training step failed, training eagerly ({configio.one_line(exc)})",
                  file=sys.stderr)
            self.compiled = None
            return self._forward_loss(*args)
        self.compile_s = time.perf_counter() - t0
        return out

    def _forward_loss(self, x: torch.Tensor, state: Optional[torch.Tensor], offset: int, at: Optional[torch.Tensor],
                      targets: torch.Tensor, weight: Optional[torch.Tensor], R: int, return_all: bool,
                      read_loops: Optional[int], n_read: Optional[int], row_loops: Optional[torch.Tensor] = None,
                      read_only: bool = False) -> tuple[torch.Tensor, LoopOutput]:
        """One supervision step: the forward from `state` (None: the read-in) and its summed loss over the last
        `n_read` read-outs (None: the final one) at the positions `at` — one graph when compiled. `row_loops`: a
        loop count per row (budgets drawn per row). `read_only`: nothing but the loss reads the output, so the last
        loop computes the positions `at` only (`LoopedTransformer.forward`)."""
        out = self.net(x, loops=R, state=state, loop_offset=offset, return_all=return_all, read_at=at,
                       read_loops=read_loops, row_loops=row_loops, read_only=read_only)
        logits = out.logits if n_read is None else out.all_logits[-n_read:]
        if out.all_logits is not None:   # a copy, not a view of all_logits: compiled graphs whose outputs alias
            out.logits = out.logits.clone()   # each other fail when replayed from torch's compilation cache
        return loss_sum(*at_read(at, logits, targets, weight)), out

    def elastic_losses(self, mb: dict[str, torch.Tensor], out: LoopOutput, R: int,
                       scale: float) -> torch.Tensor | float:
        """The consistency and fixed-point losses of one micro-batch (`train.consistency`, `train.fixed_point`;
        0 when both are off): the final read-out at R against a stop-gradient read-out at budget min(2R, loops_max)
        or loops_max (`consistency_budget`; a budget per row: each row's own), scaled like the task loss (`scale`:
        processes / supervised positions); the state after fixed_point_loops more loops against the state at R, a
        mean over positions. Extra forwards run on the raw model (DDP reduces their gradients with the main
        forward's)."""
        tc, total = self.cfg.train, 0.0
        x, at, rows = mb["inputs"], mb.get("read_at"), mb.get("row_loops")
        if tc.consistency > 0:
            hi = budget_range(tc, self.cfg.model.loops)[1] if tc.loops_sample != "fixed" else 2 * R
            double = tc.consistency_budget == "double"
            R2 = (min(2 * R, hi) if double else hi) if rows is None else \
                int(torch.clamp(2 * rows, max=hi).max()) if double else hi
            if R2 > R or rows is not None:
                t_rows = None if rows is None else (torch.clamp(2 * rows, max=hi) if double
                                                    else torch.full_like(rows, hi))
                with torch.no_grad():
                    teacher = self.model(x, loops=R2, read_at=at, row_loops=t_rows).logits
                t = mb["targets"]
                keep = (t != IGNORE) if not t.dtype.is_floating_point else \
                    (mb["weight"] > 0 if "weight" in mb else torch.ones_like(t, dtype=torch.bool))
                keep = keep.flatten().index_select(0, at) if at is not None else keep
                total = total + tc.consistency * scale * consistency_loss(out.logits, teacher, keep)
        if tc.fixed_point > 0:
            nxt = self.model(x, loops=tc.fixed_point_loops, state=out.hidden, loop_offset=R, budget=R).hidden
            n_pos = out.hidden.shape[0] * out.hidden.shape[1] * tc.grad_accum
            total = total + tc.fixed_point * fixed_point_loss(nxt, out.hidden) / n_pos
        return total

    def open_log(self, progress: Optional[bool]) -> None:
        """Write config.yaml and run.json, open the metrics log, start the bar and the log window (restored from
        the checkpoint when resuming)."""
        cfg, d, state = self.cfg, self.d, self.state
        if d.main:
            info = {"name": cfg.name, "config": to_dict(cfg), "seed": cfg.seed, "git": run.git_commit(),
                    "versions": run.package_versions(), "command": sys.argv, "world_size": d.world,
                    "device": str(d.device), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "resumed_from_step": self.start if self.resume else None, "total_steps": self.total,
                    "params": unwrap(self.model).num_params()}
            run.write_start(self.run_dir, cfg, info)
        self.log = MetricsLog(self.run_dir, cfg, self.start if self.resume else None, d.main, final_step=self.total)
        show = d.main and (cfg.log.progress if progress is None else progress)
        self.bar = tqdm(total=self.total, initial=self.start, desc=cfg.name, disable=not show, dynamic_ncols=True)
        self.train_time = float(state.get("train_time", 0.0)) if state else 0.0
        # loss and accuracy sums stay on the device between log steps: no host synchronisation in the step
        self.acc_dtype = torch.float32 if d.device.type == "mps" else torch.float64
        self.acc_loss = torch.zeros((), dtype=self.acc_dtype, device=d.device)
        self.acc_correct = torch.zeros((), dtype=self.acc_dtype, device=d.device)
        self.acc_count = self.acc_tokens = 0.0
        if state is not None and state.get("window"):   # the log window the checkpoint cut (exact metrics on resume)
            win = state["window"]
            w = [float(x) for x in (win[d.rank] if d.rank < len(win) else win[0])]
            self.acc_loss.fill_(w[0])
            self.acc_correct.fill_(w[1])
            self.acc_count, self.acc_tokens = w[2], w[3]
        self.window_t0 = time.perf_counter()
        self.last_eval: Optional[dict] = None
        self.dyn_every = (cfg.log.dynamics_every or cfg.train.log_every) if cfg.log.dynamics else 0
        self.dyn_grads: dict[str, float] = {}
        self.model.train()

    # ------------------------------------------------------------------ one optimiser step
    def step(self, step: int) -> None:
        """Forward and backward over this process's slice of the global batch of `step` (in grad_accum
        micro-batches), then clip and update; the loss and accuracy sums go into the log window."""
        cfg, d, tc, data = self.cfg, self.d, self.cfg.train, self.data
        t_step = time.perf_counter()
        self.lr = lr = lr_at(tc, step, self.total)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
        per_row = tc.loops_sample != "fixed" and tc.loops_sample_per == "row"
        budgets = sample_loops(tc, step, cfg.model.loops, cfg.seed, self.B if per_row else 1)   # [B] | [1]
        self.loops = R = int(budgets.max())                     # the step's loop count (per row: the largest)
        n_read = loss_loops(tc, R)                               # read-outs in the loss (None: the last one)
        keys = data.plan(step, self.B)                           # [B] global batch
        mine = np.array_split(keys, d.world)[d.rank]
        fetched = [data.fetch(k, step) for k in np.array_split(mine, tc.grad_accum)]
        if per_row:                                              # each row's budget travels with it
            mine_b = np.array_split(budgets, d.world)[d.rank]
            for m, b in zip(fetched, np.array_split(mine_b, tc.grad_accum)):
                m["row_loops"] = torch.from_numpy(b)
        counts = [int((m["targets"] != IGNORE).sum()) if not m["targets"].dtype.is_floating_point
                  else int(m["weight"].sum()) for m in fetched]          # counted on the host, before the copy
        N = cfg.model.supervision_steps                          # deep supervision: N steps, each with its loss
        gated = cfg.model.exit_gate and tc.exit_loss_weight > 0
        per_loop_gate = gated and N == 1                         # the exit gate reads every loop (else every step)
        if not gated and cfg.model.head != "sequence":           # the read-out only where the loss looks
            for m in fetched:
                at = read_positions(m)
                if at is not None:
                    m["read_at"] = at
        micro = [_to(m, d.device) for m in fetched]
        global_count = max(all_sum(d, [float(sum(counts))])[0], 1.0)
        k = 1 if n_read is None else n_read
        step_timestep = cfg.model.step_timestep
        return_all, read_loops = n_read is not None or per_loop_gate, None if per_loop_gate else n_read
        read_only = N == 1 and not gated and tc.fixed_point == 0   # nothing reads the final hidden state
        for i, mb in enumerate(micro):
            at = mb.get("read_at")                               # [n] | None: every position
            targets = mb["targets"] if "step_targets" not in mb else \
                loop_targets(mb["step_targets"], R, n_read)                      # [n_read,B,T] per-loop targets
            state = None
            for j in range(N):                   # step j starts from step j-1's detached state; one step in memory
                sync = i == len(micro) - 1 and j == N - 1
                ctx = self.net.no_sync() if (d.active and not sync) else contextlib.nullcontext()
                with ctx:
                    rows = mb.get("row_loops")                                     # [b] | None
                    R_mb = R if rows is None else int(rows.max())
                    with self.autocast():
                        s, out = self.forward_loss(mb["inputs"], state, step_offset(step_timestep, j, R_mb), at,
                                                   targets, mb.get("weight"), R_mb, return_all, read_loops, n_read,
                                                   rows, read_only)
                        loss = s * (d.world / (global_count * k * N)) + self.elastic_losses(mb, out, R_mb,
                                                                                             d.world / global_count)
                    if gated:   # a mean over this micro-batch: DDP averages it over processes
                        gate = unwrap(self.model).exit_gate                # the gate reads, never steers: detached
                        stops_, reads = ((gate(out.all_hidden.detach()), out.all_logits) if per_loop_gate  # [R,B,T(,C)]
                                         else (gate(out.hidden.detach())[None], out.logits[None]))  # step's [1,...]
                        loss = loss + tc.exit_loss_weight / (len(micro) * N) * exit_loss(
                            tc, reads, stops_, mb["targets"], mb.get("weight"), cfg.model.causal)
                    if self.scaler is not None:
                        self.scaler.scale(loss).backward()
                    else:
                        loss.backward()
                with torch.no_grad():
                    self.acc_loss += s.detach().to(self.acc_dtype) / (k * N)
                state = out.hidden.detach()
            with torch.no_grad():
                if data.classifies:
                    logits, targets, _ = at_read(at, out.logits, mb["targets"])
                    mask = targets != IGNORE
                    self.acc_correct += ((logits.argmax(-1) == targets) & mask).sum().to(self.acc_dtype)
                self.acc_count += counts[i]
                self.acc_tokens += mb["inputs"].shape[0] * mb["inputs"].shape[1]
        self.last_micro = micro[-1]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if d.main and self.dyn_every and (step + 1) % self.dyn_every == 0:
            self.dyn_grads = grad_norms(self.model)              # before clipping
        self.gnorm = (torch.nn.utils.clip_grad_norm_(self.trunk_params, tc.grad_clip) if tc.grad_clip > 0
                      else None)
        if tc.grad_clip > 0 and self.gate_params:   # the exit gate's own norm: its loss never rescales the trunk's
            torch.nn.utils.clip_grad_norm_(self.gate_params, tc.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.model)
        self.train_time += time.perf_counter() - t_step
        self.bar.update(1)

    # ------------------------------------------------------------------ logging
    def log_train(self, done: int) -> None:
        """The "train" record of the log window that ends at step `done` (summed over processes)."""
        loss_sum, correct, count, tokens = all_sum(self.d, [float(self.acc_loss), float(self.acc_correct),
                                                            self.acc_count, self.acc_tokens])
        now = time.perf_counter()
        rec = {"split": "train", "step": done, "loss": loss_sum / max(count, 1.0), "lr": self.lr, "loops": self.loops,
               "grad_norm": float(self.gnorm) if self.gnorm is not None else None,
               "tokens_per_s": tokens / max(now - self.window_t0, 1e-9),
               "train_time": self.train_time}
        if self.data.classifies:
            rec["accuracy"] = correct / max(count, 1.0)
        if not math.isfinite(rec["loss"]):
            raise UserError(f"training diverged: the loss became {rec['loss']} at step {done}; the last good "
                            f"checkpoint is kept (lower train.lr or enable train.grad_clip)")
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

    def log_dynamics(self, done: int) -> None:
        if self.d.main:
            self.log.write(dynamics_record(self.model, self.last_micro, self.loops, done, self.dyn_grads))

    # ------------------------------------------------------------------ evaluation, checkpoints, results
    def check_finite(self, step: int) -> None:
        """Stop before NaN / inf weights or a non-finite loss reach a checkpoint or the metrics log."""
        bad = nonfinite_parameter(self.model)
        if bad is None and not bool(torch.isfinite(self.acc_loss)):
            bad = "the training loss"
        if bad is not None:
            raise UserError(f"training diverged: {bad} is not finite at step {step}; the last good checkpoint is "
                            f"kept (lower train.lr or enable train.grad_clip)")

    def evaluate(self, step: int, final: bool) -> Optional[dict]:
        """Test metrics (rank 0; on the final evaluation also loop by loop), logged and shared with every process."""
        cfg, res = self.cfg, None
        self.check_finite(step)
        if self.d.main:
            total = cfg.model.total_loops                        # supervision_steps × loops
            max_loops = (cfg.eval.max_loops or 2 * total) if final and cfg.eval.loopwise else 0
            kw = dict(loops=total, max_loops=max_loops, batch_size=cfg.eval.batch_size, limit=cfg.eval.n,
                      loopwise=final and cfg.eval.loopwise, device=self.d.device, autocast=self.autocast,
                      votes=cfg.eval.votes, step_halt=cfg.eval.step_halt)
            res = evaluate(self.model, self.data, **kw)
            rec = {"split": "test", "step": step, "loops": res["loops"], **res["metrics"]}
            if self.ema is not None:
                res_ema = evaluate(self.ema.module, self.data, **kw)
                res["ema"] = res_ema
                rec.update({f"ema_{k}": v for k, v in res_ema["metrics"].items()})
            self.log.write(rec)
        return broadcast_object(self.d, res)

    def checkpoint(self, step: int) -> None:
        """Weights, optimiser, scaler, every process's RNG state and log window, written by rank 0."""
        self.check_finite(step)
        window = [float(self.acc_loss), float(self.acc_correct), float(self.acc_count), float(self.acc_tokens)]
        mine = gather_objects(self.d, {"rng": _rng_state(self.d.device), "window": window})
        if self.d.main:
            save_checkpoint(self.ckpt_dir, self.model, run=to_dict(self.cfg), task=self.data.describe(),
                            training_state={"step": step, "optimizer": self.optimizer.state_dict(),
                                            "scaler": self.scaler.state_dict() if self.scaler else None,
                                            "rng": [m["rng"] for m in mine], "window": [m["window"] for m in mine],
                                            "train_time": self.train_time, "total_steps": self.total},
                            ema=None if self.ema is None else self.ema.module)
        barrier(self.d)

    def finish(self, final: dict) -> dict:
        """results.json (rank 0) from the final evaluation; every process returns it."""
        cfg, d, tc, results = self.cfg, self.d, self.cfg.train, None
        if d.main:
            halting = None if not cfg.eval.halt else evaluate_halting(
                self.model, self.data, cfg.eval.halt, batch_size=cfg.eval.batch_size, limit=cfg.eval.n,
                device=d.device)
            budgets = None if not cfg.eval.budgets else evaluate_budgets(
                self.model, self.data, sorted(set(cfg.eval.budgets)), batch_size=cfg.eval.batch_size,
                limit=cfg.eval.n, device=d.device, autocast=self.autocast)
            results = run.write_results(self.run_dir, {
                "name": cfg.name, "task": self.data.describe(), "variant": cfg.model.variant,
                "loops": cfg.model.loops, "n_layers": cfg.model.n_layers, "timestep": cfg.model.timestep,
                "d_model": cfg.model.d_model, "params": unwrap(self.model).num_params(), "steps": self.total,
                "batch_size": self.B, "train_time_s": self.train_time,
                "compiled": self.compiled is not None, "compile_s": self.compile_s, "metric": final["metric"],
                "higher_is_better": final["higher_is_better"], "test": final["metrics"],
                "loopwise": final["loopwise"], "max_loops": final["max_loops"], "world_size": d.world,
                "device": str(d.device), "seed": cfg.seed, "supervision_steps": cfg.model.supervision_steps,
                "total_loops": cfg.model.total_loops, "stepwise": final["stepwise"],
                **({"test_ema": final["ema"]["metrics"], "loopwise_ema": final["ema"]["loopwise"]}
                   if "ema" in final else {}),
                **({"halting": halting} if halting else {}),
                **({"budgets": budgets} if budgets else {}),
                **({"loops_sample": {"kind": tc.loops_sample, "per": tc.loops_sample_per,
                                     "range": list(budget_range(tc, cfg.model.loops))}}
                   if tc.loops_sample != "fixed" else {}),
                **({"references": refs} if (refs := self.data.references()) else {}),
            })
        self.log.close()
        return broadcast_object(d, results)


__all__ = ["train", "Trainer", "autocast_for", "dynamics_record", "nonfinite_parameter"]
