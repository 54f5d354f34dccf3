"""The run folder (`out_dir`): its layout, and everything that reads or writes it.

    config.yaml       the resolved run config (what `--resume` reloads)
    run.json          provenance: config, seed, git commit, package versions, command line, world size, device
    metrics.jsonl     one JSON object per line: {"split": "train"|"test"|"dynamics"|"event", "step": s, ...} (strict
                      JSON: an undefined statistic is null); events: "compiling", "compiled" (its seconds)
    checkpoint/       the latest checkpoint (`loopformer.model.io`: weights, config.json, training state)
    results.json      written last: final test metrics, loop-wise curve, parameter count, time
    tb/               TensorBoard events (when the tensorboard package is installed)
    .lock             held (an exclusive OS lock, `RunLock`) for the whole life of a `train` / `--resume`
                      process, holding that process's id: a second writer is refused with one line naming it

The trainer (`loopformer.train.trainer`) writes it; sweeps, reports, `analyze dynamics` and `--resume` read it.
Every file is replaced atomically (`loopformer.fileio`); the metrics log is appended line by line and, on resume,
cut back to the checkpoint's step. A fresh run refuses a folder holding files it does not write (the user's own:
its YAML, notes, data) unless asked to overwrite (`train --overwrite`), which leaves such files in place.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from omegaconf import OmegaConf

from loopformer import fileio
from loopformer.configio import to_dict
from loopformer.errors import UserError
from loopformer.fileio import finite_or_none, open_nofollow, write_json, write_text
from loopformer.model.io import RUN_CHECKPOINT, has_training_state, recover_checkpoint
from loopformer.train.config import RunConfig, load_run_config

CONFIG_FILE, RUN_FILE, METRICS_FILE, RESULTS_FILE, CKPT_DIR, LOCK_FILE = (
    "config.yaml", "run.json", "metrics.jsonl", "results.json", RUN_CHECKPOINT, ".lock")
STAGES_FILE, STAGES_DIR = "stages.yaml", "stages"      # a staged run's own config and its earlier stages' folders
RUN_ENTRIES = (CONFIG_FILE, RUN_FILE, METRICS_FILE, RESULTS_FILE, CKPT_DIR, LOCK_FILE, "tb",
               STAGES_FILE, STAGES_DIR)                                                      # what a run writes


# ------------------------------------------------------------------------------------------------- the lock
class RunLock:
    """An exclusive lock on a run folder (`fcntl.flock` on its `.lock` file, which holds the holder's process id),
    held from `acquire` until `release` or the process's end (the OS drops it even after a kill)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode("ascii", "replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"{self.path.parent} is in use by process {holder} (a run is training there); wait for "
                            f"it or stop it first") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def foreign_entries(run_dir: Path) -> list[str]:
    """The names in `run_dir` that a run did not write (ignoring atomic writes' hidden temporary names). A run writes
    run.json first, so in a folder without it every entry is the user's — a `config.yaml` there too."""
    return fileio.foreign_entries(run_dir, RUN_ENTRIES, RUN_FILE, always=(LOCK_FILE,))


# ------------------------------------------------------------------------------------------------- provenance
def git_commit(path: str | os.PathLike = ".") -> dict | None:
    """{"commit", "dirty"} of the git checkout holding loopformer, or None outside one."""
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
    out = {"python": platform.python_version()}
    for name in ("loopformer", "torch", "numpy", "omegaconf", "safetensors", "numba"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def config_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


# ------------------------------------------------------------------------------------------------- strict JSON
def nonfinite_key(record: dict) -> str | None:
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


# ------------------------------------------------------------------------------------------------- reading
def read_results(run_dir: str | os.PathLike) -> dict | None:
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


def results_done(run_dir: str | os.PathLike, step: int) -> bool:
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
    return has_training_state(ckpt)


def stored_config(run_dir: str | os.PathLike) -> Path:
    """The config a run folder was started with: a staged run's `stages.yaml` (its `config.yaml`, once written, is
    the last stage's alone), else `config.yaml` (which may not exist)."""
    staged = Path(run_dir) / STAGES_FILE
    return staged if staged.is_file() else Path(run_dir) / CONFIG_FILE


def continuable(run_dir: str | os.PathLike) -> bool:
    """Whether `run_dir` holds a run to go on with: a checkpoint (`resumable`) or a staged run begun there."""
    return (Path(run_dir) / STAGES_FILE).is_file() or resumable(run_dir)


def resolve_resume(path: str | os.PathLike) -> Path:
    """The run folder of `--resume PATH` (PATH may be the run folder or its checkpoint folder)."""
    p = Path(path)
    if stored_config(p).is_file():
        return p
    if p.name == CKPT_DIR and stored_config(p.parent).is_file():
        return p.parent
    raise UserError(f"cannot resume from {p}: no {CONFIG_FILE} there (not a loopformer run folder)")


def load_for_resume(path: str | os.PathLike, overrides: list[str] = ()) -> RunConfig:
    """The stored config of a run folder (`stored_config`), with `overrides` applied (e.g. a longer `train.steps`)."""
    run_dir = resolve_resume(path)
    cfg = load_run_config(stored_config(run_dir), list(overrides), stored=True)
    cfg.out_dir = str(run_dir)
    return cfg


# ------------------------------------------------------------------------------------------------- writing
def prepare(run_dir: Path, resume: bool, overwrite: bool = False) -> None:
    """Make `run_dir` ready for a fresh run (refusing one that holds a run, or files a run does not write, unless
    `overwrite`) or for resuming (repairing a checkpoint swap cut short by a kill first). Call it holding the
    folder's `RunLock`. `overwrite` deletes an earlier run's checkpoint and results, never other files."""
    ckpt_dir = run_dir / CKPT_DIR
    if ckpt_dir.parent.is_dir():
        recover_checkpoint(ckpt_dir)           # a swap cut short by a kill: put the checkpoint back in place
    if resume and not has_training_state(ckpt_dir):
        raise UserError(f"cannot resume: {ckpt_dir} holds no training state")
    if not resume and not overwrite:
        if ckpt_dir.exists() or (run_dir / RESULTS_FILE).exists():
            raise UserError(f"{run_dir} already holds a run: resume it (train with resume, `loopformer train "
                            f"--resume {run_dir}`), choose another out_dir or pass --overwrite")
        foreign = foreign_entries(run_dir)
        if foreign:
            raise UserError(f"out_dir {run_dir} holds files a run does not write ({', '.join(foreign[:3])}"
                            f"{', ...' if len(foreign) > 3 else ''}): choose an empty or new folder, or pass "
                            f"--overwrite (those files are kept)")
    if not resume and overwrite:
        for old in (ckpt_dir, run_dir / RESULTS_FILE):
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def write_start(run_dir: Path, cfg: RunConfig, info: dict) -> None:
    """run.json (provenance `info`; first: it marks the folder as a run's) and config.yaml of a run that starts or
    resumes."""
    write_json(run_dir / RUN_FILE, info, default=str)
    write_text(run_dir / CONFIG_FILE, config_yaml(cfg))


def write_results(run_dir: Path, results: dict) -> dict:
    """results.json as strict JSON (an undefined metric is null); returns what was written."""
    results = finite_or_none(json.loads(json.dumps(results, default=float)))
    write_json(run_dir / RESULTS_FILE, results, allow_nan=False)
    return results


class MetricsLog:
    """metrics.jsonl (rank 0), mirrored to TensorBoard / Weights & Biases when those are installed and enabled."""

    def __init__(self, run_dir: Path, cfg: RunConfig, keep_until: int | None, enabled: bool,
                 final_step: int | None = None):
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
            try:   # optional and heavy: imported only when asked for
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            except Exception:  # tensorboard not installed
                self.tb = None
        if cfg.log.wandb:
            try:   # optional: imported only when asked for
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
            record = finite_or_none(record)
        else:              # a diverged loss: stop rather than log it
            raise UserError(f"training diverged: {record.get('split', 'train')} {bad} is {record[bad.split('.')[0]]} "
                            f"at step {record.get('step')}; the last good checkpoint is kept (lower train.optim.lr or "
                            f"enable train.optim.grad_clip)")
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


__all__ = ["CONFIG_FILE", "RUN_FILE", "METRICS_FILE", "RESULTS_FILE", "CKPT_DIR", "LOCK_FILE", "STAGES_FILE",
           "STAGES_DIR", "RUN_ENTRIES", "RunLock", "foreign_entries", "MetricsLog", "read_results", "read_metrics",
           "results_done", "resumable", "continuable", "stored_config", "resolve_resume", "load_for_resume",
           "prepare", "write_start", "write_results", "git_commit", "package_versions", "config_yaml",
           "nonfinite_key", "finite_or_none"]
