"""The training loop: one function, `train(cfg)`, for every task, model variant and launch (1 process or torchrun).

Recipe (paper App. C.1.3 / C.2 / C.3, set by the run config): AdamW, warm-up then linear or cosine decay, gradient
clipping and accumulation, the loss on the last loop, on every loop or on a window of the last loops, optional
loop / in-context curricula, periodic evaluation with a checkpoint each time, and a final loop-wise evaluation.

Exact resumption: the global batch of step s is a pure function of (data seed, s) (see `loopformer.sources`),
the learning rate a pure function of s, and the checkpoint holds the weights, the optimiser state, every
process's RNG state and s — so `--resume` after a crash continues exactly where the last checkpoint left off, and
the metrics log is cut back to that step.

The run folder (`out_dir`):
    config.yaml       the resolved run config (what `--resume` reloads)
    run.json          provenance: config, seed, git commit, package versions, command line, world size, device
    metrics.jsonl     one JSON object per line: {"split": "train"|"test", "step": s, ...}
    checkpoint/       the latest checkpoint (model.safetensors, config.json, training_state.pt)
    results.json      written last: final test metrics, loop-wise curve, parameter count, time
    tb/               TensorBoard events (when the tensorboard package is installed)
Shapes: B batch, T length, R loops, C classes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from loopformer.configio import to_dict
from loopformer.errors import UserError
from loopformer.eval.evaluate import evaluate
from loopformer.fileio import write_json, write_text
from loopformer.model.diagnostics import grad_norms, loop_dynamics, modulation_stats, summarize_settle
from loopformer.model.io import load_training_state, load_weights, recover_checkpoint, save_checkpoint, unwrap
from loopformer.tasks.base import IGNORE
from loopformer.model.looped import LoopedTransformer
from loopformer.sources import DataSource, make_data
from loopformer.train.config import RunConfig, load_run_config
from loopformer.train.distributed import Dist, all_sum, barrier, broadcast_object, gather_objects, setup, teardown
from loopformer.train.optim import loops_at, loss_loops, lr_at, make_optimizer, steps_for, summed_loss

CONFIG_FILE, RUN_FILE, METRICS_FILE, RESULTS_FILE, CKPT_DIR = (
    "config.yaml", "run.json", "metrics.jsonl", "results.json", "checkpoint")


# ------------------------------------------------------------------------------------------------- run folder
def git_commit(path: str | os.PathLike = ".") -> Optional[dict]:
    """{"commit", "dirty"} of the git checkout holding `path`, or None outside one."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("loopformer", "torch", "numpy", "omegaconf", "safetensors", "numba"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def config_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


def nonfinite_key(record: dict) -> Optional[str]:
    """The first key of `record` holding a NaN or infinite number (also inside lists), or None."""
    for k, v in record.items():
        vals = v if isinstance(v, (list, tuple)) else [v]
        for x in vals:
            if isinstance(x, dict):
                bad = nonfinite_key(x)
                if bad is not None:
                    return f"{k}.{bad}"
            elif isinstance(x, float) and not math.isfinite(x):
                return k
    return None


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def nonfinite_parameter(model: torch.nn.Module) -> Optional[str]:
    """The name of the first parameter holding a NaN or an infinity, or None (one host sync)."""
    params = [(n, p) for n, p in unwrap(model).named_parameters()]
    if not params:
        return None
    flags = torch.stack([torch.isfinite(p.detach()).all() for _, p in params])
    if bool(flags.all()):
        return None
    return params[int((~flags).nonzero()[0, 0])][0]


def read_results(run_dir: str | os.PathLike) -> Optional[dict]:
    f = Path(run_dir) / RESULTS_FILE
    if not f.is_file():
        return None
    try:
        res = json.loads(f.read_text())
    except ValueError:     # bad JSON or not UTF-8
        raise UserError(f"{f} is not valid JSON") from None
    if not isinstance(res, dict):
        raise UserError(f"{f} is not a JSON object")
    return res


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    f = Path(run_dir) / METRICS_FILE
    if not f.is_file():
        return []
    out = []
    for line in f.read_bytes().splitlines():
        line = line.strip()
        if line:
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError:   # a line cut by a kill (or damaged): the log ends before it
                break
            if not isinstance(rec, dict) or not isinstance(rec.get("step", 0), int):
                break
            out.append(rec)
    return out


class MetricsLog:
    """metrics.jsonl (rank 0), mirrored to TensorBoard / Weights & Biases when those are installed and enabled."""

    def __init__(self, run_dir: Path, cfg: RunConfig, keep_until: Optional[int], enabled: bool,
                 final_step: Optional[int] = None):
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.tb = self.wandb = None
        if not enabled:
            return
        if keep_until is not None:   # resuming: drop what was logged after the checkpoint
            kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= keep_until
                    and not (final_step is not None and keep_until == final_step and r.get("step") == final_step
                             and r.get("split") == "test")]    # the final evaluation is written again
            write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.unlink()
        self.fh = open(self.path, "a")
        if cfg.log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            except Exception:  # tensorboard not installed
                self.tb = None
        if cfg.log.wandb:
            try:
                import wandb

                self.wandb = wandb.init(project=cfg.log.wandb_project, name=cfg.name, config=to_dict(cfg),
                                        dir=str(run_dir), resume="allow")
            except Exception:  # wandb not installed or not logged in
                self.wandb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        bad = nonfinite_key({k: record[k] for k in ("loss", "ppl") if k in record})
        if bad is None:    # JSON has no NaN: an undefined statistic (no parsable answer, ...) is written as null
            record = _finite_or_none(record)
        else:              # a diverged loss: stop rather than log it
            raise UserError(f"training diverged: {record.get('split', 'train')} {bad} is {record[bad.split('.')[0]]} "
                            f"at step {record.get('step')}; the last good checkpoint is kept (lower train.lr or "
                            f"enable train.grad_clip)")
        self.fh.write(json.dumps(record, allow_nan=False) + "\n")
        self.fh.flush()
        split, step = record.get("split", "train"), record.get("step", 0)
        scalars = {}
        for k, v in record.items():
            if k in ("split", "step") or isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                scalars[f"{split}/{k}"] = v
            elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                scalars.update({f"{split}/{k}/t{t + 1:02d}": x for t, x in enumerate(v)})   # per-loop lists
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.fh.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


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


def results_done(run_dir: Path, step: int) -> bool:
    """Whether the run in `run_dir` finished at `step` (results.json written for that many steps)."""
    try:
        res = read_results(run_dir)
    except (ValueError, OSError):
        return False
    return bool(res) and res.get("steps") == step


def resumable(run_dir: str | os.PathLike) -> bool:
    """Whether `run_dir` holds a checkpoint to resume from (repairing a checkpoint swap cut short by a kill).
    Call it only while no process is training in `run_dir`."""
    ckpt = Path(run_dir) / CKPT_DIR
    if ckpt.parent.is_dir():
        recover_checkpoint(ckpt)
    return (ckpt / "training_state.pt").is_file()


def resolve_resume(path: str | os.PathLike) -> Path:
    """The run folder of `--resume PATH` (PATH may be the run folder or its checkpoint folder)."""
    p = Path(path)
    if (p / CONFIG_FILE).is_file():
        return p
    if p.name == CKPT_DIR and (p.parent / CONFIG_FILE).is_file():
        return p.parent
    raise UserError(f"cannot resume from {p}: no {CONFIG_FILE} there (not a loopformer run folder)")


def load_for_resume(path: str | os.PathLike, overrides: list[str] = ()) -> RunConfig:
    """The stored config of a run folder, with `overrides` applied (e.g. a longer `train.steps`)."""
    run_dir = resolve_resume(path)
    cfg = load_run_config(run_dir / CONFIG_FILE, list(overrides))
    cfg.out_dir = str(run_dir)
    return cfg


# ------------------------------------------------------------------------------------------------- training
def train(cfg: RunConfig, *, resume: bool = False, on_step: Optional[Callable[[int], None]] = None,
          progress: Optional[bool] = None) -> dict:
    """Train per `cfg`; returns the final results dict (also written to `out_dir/results.json` by rank 0).

    resume: continue from `out_dir/checkpoint` (the same run folder). on_step(step) is called after each
    optimiser step (tests use it to interrupt a run). Under torchrun every process calls this.
    """
    d = setup(cfg.device)
    try:
        return _train(cfg, d, resume, on_step, progress)
    finally:
        teardown()


def _train(cfg: RunConfig, d: Dist, resume: bool, on_step, progress) -> dict:
    tc = cfg.train
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    B = tc.batch_size
    if B % (d.world * tc.grad_accum):
        raise UserError(f"train.batch_size={B} must be divisible by processes × grad_accum = "
                        f"{d.world} × {tc.grad_accum}")
    run_dir = Path(cfg.out_dir)
    ckpt_dir = run_dir / CKPT_DIR
    if d.main:
        if ckpt_dir.parent.is_dir():
            recover_checkpoint(ckpt_dir)           # a swap cut short by a kill: put the checkpoint back in place
        if resume and not (ckpt_dir / "training_state.pt").is_file():
            raise UserError(f"cannot resume: {ckpt_dir} holds no training state")
        if not resume and (ckpt_dir.exists() or (run_dir / RESULTS_FILE).exists()):
            raise UserError(f"{run_dir} already holds a run: resume it with --resume {run_dir} or choose another "
                            f"out_dir")
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier(d)

    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2 ** 32)
    data: DataSource = make_data(cfg.task)
    total = steps_for(tc.steps, tc.epochs, data.n_train, B)
    model = LoopedTransformer(cfg.model).to(d.device)
    optimizer = make_optimizer(model, tc)
    autocast, use_scaler = autocast_for(cfg, d.device)
    scaler = torch.amp.GradScaler(d.device.type) if use_scaler else None

    start = 0
    state = None
    if resume:
        load_weights(model, ckpt_dir, d.device)
        state = load_training_state(ckpt_dir)
        if state is None:
            raise UserError(f"cannot resume: {ckpt_dir} holds no training state")
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise UserError(f"cannot resume from {ckpt_dir}: its optimizer state does not fit this model "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        start = int(state["step"])
        if start >= total and results_done(run_dir, start):
            barrier(d)
            return read_results(run_dir)           # a finished run: nothing to do, nothing rewritten
        rngs = state["rng"]
        _set_rng_state(rngs[d.rank] if d.rank < len(rngs) else rngs[0], d.device)

    if d.main:
        write_text(run_dir / CONFIG_FILE, config_yaml(cfg))
        info = {"name": cfg.name, "config": to_dict(cfg), "seed": cfg.seed, "git": git_commit(),
                "versions": package_versions(), "command": sys.argv, "world_size": d.world,
                "device": str(d.device), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "resumed_from_step": start if resume else None, "total_steps": total,
                "params": unwrap(model).num_params()}
        write_json(run_dir / RUN_FILE, info, default=str)
    log = MetricsLog(run_dir, cfg, start if resume else None, d.main, final_step=total)

    net: torch.nn.Module = model
    if d.active:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[d.device] if d.device.type == "cuda"
                                                        else None)
    if tc.compile:
        net = torch.compile(net)

    show = d.main and (cfg.log.progress if progress is None else progress)
    bar = tqdm(total=total, initial=start, desc=cfg.name, disable=not show, dynamic_ncols=True)
    train_time = float(state.get("train_time", 0.0)) if state else 0.0
    # loss and accuracy sums stay on the device between log steps: no host synchronisation in the step
    acc_dtype = torch.float32 if d.device.type == "mps" else torch.float64
    acc_loss = torch.zeros((), dtype=acc_dtype, device=d.device)
    acc_correct = torch.zeros((), dtype=acc_dtype, device=d.device)
    acc_count = acc_tokens = 0.0
    if state is not None and state.get("window"):   # the log window the checkpoint cut (exact metrics on resume)
        win = state["window"]
        w = [float(x) for x in (win[d.rank] if d.rank < len(win) else win[0])]
        acc_loss.fill_(w[0])
        acc_correct.fill_(w[1])
        acc_count, acc_tokens = w[2], w[3]
    window_t0 = time.perf_counter()
    last_eval = None
    classifies = data.classifies
    dyn_every = (cfg.log.dynamics_every or tc.log_every) if cfg.log.dynamics else 0
    dyn_grads: dict[str, float] = {}

    def check_finite(step: int) -> None:
        """Stop before NaN / inf weights or a non-finite loss reach a checkpoint or the metrics log."""
        bad = nonfinite_parameter(model)
        if bad is None and not bool(torch.isfinite(acc_loss)):
            bad = "the training loss"
        if bad is not None:
            raise UserError(f"training diverged: {bad} is not finite at step {step}; the last good checkpoint is "
                            f"kept (lower train.lr or enable train.grad_clip)")

    def checkpoint(step: int) -> None:
        check_finite(step)
        window = [float(acc_loss), float(acc_correct), float(acc_count), float(acc_tokens)]
        mine = gather_objects(d, {"rng": _rng_state(d.device), "window": window})
        if d.main:
            save_checkpoint(ckpt_dir, model, run=to_dict(cfg), task=data.describe(),
                            training_state={"step": step, "optimizer": optimizer.state_dict(),
                                            "scaler": scaler.state_dict() if scaler else None,
                                            "rng": [m["rng"] for m in mine], "window": [m["window"] for m in mine],
                                            "train_time": train_time, "total_steps": total})
        barrier(d)

    def evaluation(step: int, final: bool) -> Optional[dict]:
        res = None
        check_finite(step)
        if d.main:
            max_loops = (cfg.eval.max_loops or 2 * cfg.model.loops) if final and cfg.eval.loopwise else 0
            res = evaluate(model, data, loops=cfg.model.loops, max_loops=max_loops, batch_size=cfg.eval.batch_size,
                           limit=cfg.eval.n, loopwise=final and cfg.eval.loopwise, device=d.device,
                           autocast=autocast)
            log.write({"split": "test", "step": step, "loops": res["loops"], **res["metrics"]})
        return broadcast_object(d, res)

    model.train()
    for step in range(start, total):
        t_step = time.perf_counter()
        lr = lr_at(tc, step, total)
        for g in optimizer.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
        R = loops_at(tc, step, cfg.model.loops)
        n_read = loss_loops(tc, R)                               # read-outs in the loss (None: the last one)
        keys = data.plan(step, B)                                # [B] global batch
        mine = np.array_split(keys, d.world)[d.rank]
        fetched = [data.fetch(k, step) for k in np.array_split(mine, tc.grad_accum)]
        counts = [int((m["targets"] != IGNORE).sum()) if not m["targets"].dtype.is_floating_point
                  else int(m["weight"].sum()) for m in fetched]          # counted on the host, before the copy
        micro = [_to(m, d.device) for m in fetched]
        global_count = max(all_sum(d, [float(sum(counts))])[0], 1.0)
        for i, mb in enumerate(micro):
            sync = i == len(micro) - 1
            ctx = net.no_sync() if (d.active and not sync) else contextlib.nullcontext()
            with ctx:
                with autocast():
                    out = net(mb["inputs"], loops=R, return_all=n_read is not None)
                logits = out.logits if n_read is None else out.all_logits[-n_read:]
                s, _ = summed_loss(logits, mb["targets"], mb.get("weight"))
                k = 1 if n_read is None else n_read
                loss = s * (d.world / (global_count * k))
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
            with torch.no_grad():
                acc_loss += s.detach().to(acc_dtype) / k
                if classifies:
                    mask = mb["targets"] != IGNORE
                    acc_correct += ((out.logits.argmax(-1) == mb["targets"]) & mask).sum().to(acc_dtype)
                acc_count += counts[i]
                acc_tokens += mb["inputs"].shape[0] * mb["inputs"].shape[1]
        if scaler is not None:
            scaler.unscale_(optimizer)
        if d.main and dyn_every and (step + 1) % dyn_every == 0:
            dyn_grads = grad_norms(model)                        # before clipping
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip) if tc.grad_clip > 0 else None
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t_step
        done = step + 1
        bar.update(1)

        if done % tc.log_every == 0 or done == total:
            loss_sum, correct, count, tokens = all_sum(d, [float(acc_loss), float(acc_correct), acc_count,
                                                           acc_tokens])
            now = time.perf_counter()
            rec = {"split": "train", "step": done, "loss": loss_sum / max(count, 1.0), "lr": lr, "loops": R,
                   "grad_norm": float(gnorm) if gnorm is not None else None,
                   "tokens_per_s": tokens / max(now - window_t0, 1e-9),
                   "train_time": train_time}
            if classifies:
                rec["accuracy"] = correct / max(count, 1.0)
            if not math.isfinite(rec["loss"]):
                raise UserError(f"training diverged: the loss became {rec['loss']} at step {done}; the last good "
                                f"checkpoint is kept (lower train.lr or enable train.grad_clip)")
            log.write(rec)
            post = {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
            if "accuracy" in rec:
                post["acc"] = f"{rec['accuracy']:.3f}"
            if last_eval is not None:
                post[f"test_{data.metric}"] = f"{last_eval['metrics'][data.metric]:.4g}"
            bar.set_postfix(post, refresh=False)
            acc_loss.zero_()
            acc_correct.zero_()
            acc_count = acc_tokens = 0.0
            window_t0 = now
        if d.main and dyn_every and done % dyn_every == 0:
            log.write(dynamics_record(model, micro[-1], R, done, dyn_grads))
        if tc.eval_every and done % tc.eval_every == 0 and done < total:
            last_eval = evaluation(done, final=False)
            checkpoint(done)
            window_t0 = time.perf_counter()
        if on_step is not None:
            on_step(done)
    bar.close()

    final = evaluation(total, final=True)
    checkpoint(total)
    results = None
    if d.main:
        raw = unwrap(model)
        results = {
            "name": cfg.name, "task": data.describe(), "variant": cfg.model.variant, "loops": cfg.model.loops,
            "n_layers": cfg.model.n_layers, "timestep": cfg.model.timestep, "d_model": cfg.model.d_model,
            "params": raw.num_params(), "steps": total, "batch_size": B, "train_time_s": train_time,
            "metric": final["metric"], "higher_is_better": final["higher_is_better"],
            "test": final["metrics"], "loopwise": final["loopwise"], "max_loops": final["max_loops"],
            "world_size": d.world, "device": str(d.device), "seed": cfg.seed,
        }
        results = _finite_or_none(json.loads(json.dumps(results, default=float)))   # strict JSON: NaN -> null
        write_json(run_dir / RESULTS_FILE, results, allow_nan=False)
    log.close()
    return broadcast_object(d, results)
