"""Sweeps: one run per point of a grid of config overrides, plus baseline runs — the experiments of Table 2.

    loopformer sweep configs/cpu/lcs.yaml --grid model.loops=2,4,8 model.timestep=false,true \\
        --baseline model.n_layers=4 model.loops=1 --out sweeps/lcs

Each run lives in `OUT/runs/<name>` (name from its overrides, e.g. `loops=4_timestep=true`), is skipped when it
has finished (`results.json`) and resumed from its checkpoint when it was interrupted, so re-running a sweep
completes it. With `jobs > 1` runs go to parallel worker processes (each with `threads` CPU threads) under one
progress bar weighted by compute (steps × loops × layers); afterwards `loopformer.experiments.report` writes the
table and plots.

Signals: SIGINT, SIGTERM and SIGHUP (Ctrl-C, `kill`, `docker stop`, a scheduler's kill, a closed terminal) stop the
sweep cleanly: the workers are sent SIGTERM and waited for, so a re-run finds every run folder resumable and no
worker still writing. On Linux a worker also receives SIGTERM if the sweep itself dies without cleanup (SIGKILL).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from loopformer.commandline import interrupt_on_signals
from loopformer.errors import UserError
from loopformer.experiments.stale import resolve_stale
from loopformer.fileio import open_nofollow
from loopformer.sources import source_class
from loopformer.train.config import RunConfig, load_run_config
from loopformer.train.optim import steps_for
from loopformer.train.run import STAGES_DIR, continuable, load_for_resume, read_metrics, stored_config
from loopformer.train.stages import stage_configs, train_run

RUNS = "runs"
MAX_RUNS = 10_000    # the most runs one sweep's grid may hold (checked before any run is listed)


@dataclass
class RunSpec:
    name: str
    overrides: list[str]
    out_dir: Path
    cost: float = 1.0                 # steps × mean loops × layers over its stages (progress bar, scheduling)
    steps: int = 1
    baseline: bool = False
    extra: dict = field(default_factory=dict)
    config: str | None = None      # the run's own config file (runs of several configs in one call: `run_specs`)


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """["model.loops=2,4", "model.timestep=false,true"] → [("model.loops", ["2", "4"]), ...]."""
    grid = []
    for item in items:
        if "=" not in item:
            raise UserError(f"grid entry {item!r} is not of the form key=v1,v2,...")
        key, vals = item.split("=", 1)
        values = [v.strip() for v in vals.split(",") if v.strip()]
        if not key or not values:
            raise UserError(f"grid entry {item!r} needs a key and at least one value")
        key = key.strip()
        if any(k == key for k, _ in grid):
            raise UserError(f"grid key {key!r} is given twice; give its values once ({key}=v1,v2,...)")
        grid.append((key, values))
    runs = math.prod(len(v) for _, v in grid)
    if runs > MAX_RUNS:
        raise UserError(f"the grid holds {runs:,} runs, more than a sweep takes ({MAX_RUNS:,}); split it into "
                        f"smaller sweeps")
    return grid


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def run_name(overrides: list[str], prefix: str = "") -> str:
    parts = [f"{_short(k)}={v}" for k, v in (o.split("=", 1) for o in overrides)]
    name = "_".join(parts) or "default"
    name = "".join(c if c.isalnum() or c in "=-_.," else "-" for c in name)
    return f"{prefix}{name}"


def expand(grid: list[tuple[str, list[str]]], baseline: list[str], out: Path) -> list[RunSpec]:
    """The runs of a sweep: the baseline (if any) first, then the grid's cartesian product."""
    specs = []
    if baseline:
        name = run_name(baseline, "baseline_")
        specs.append(RunSpec(name, list(baseline), out / RUNS / name, baseline=True))
    keys = [k for k, _ in grid]
    for combo in itertools.product(*[vals for _, vals in grid]):
        ovs = [f"{k}={v}" for k, v in zip(keys, combo)]
        name = run_name(ovs)
        specs.append(RunSpec(name, ovs, out / RUNS / name))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise UserError("two runs of the sweep would share a folder name; make the grid values distinct")
    return specs


def _config_of(config: str | None, spec: RunSpec, overrides: list[str]) -> RunConfig:
    """The config a run of the sweep is trained with when it starts now."""
    return load_run_config(spec.config or config, [*overrides, *spec.overrides, f"out_dir={spec.out_dir}",
                                                   f"name={spec.name}"])


def run_size(cfg: RunConfig) -> tuple[int, float]:
    """(optimiser steps, compute in step × loop × layer units) of a run: over every stage of a staged config, each
    step counted at its mean loop count — r, or (lo + hi) / 2 where steps draw their loop count from lo..hi
    (`train.loops.hold`, `train.loops.sample`). Loads every stage's config strictly, so a bad one fails here."""
    steps, cost = 0, 0.0
    for c in stage_configs(cfg) if cfg.stages else [cfg]:
        n_train = source_class(c.task).epoch_rows(c.task)
        k = steps_for(c.train.steps, c.train.epochs, n_train, c.train.batch_size)
        r = c.model.loops
        lo, hi = c.train.loops.budget_range(r) if c.train.loops.samples_budgets else (r, r)
        steps += k
        cost += k * (lo + hi) / 2 * c.model.n_layers
    return steps, cost


def prepare_specs(config: str | None, specs: list[RunSpec], overrides: list[str]) -> None:
    """Check every run's config (a bad one fails before anything runs) and estimate its cost (`run_size`)."""
    for s in specs:
        s.steps, s.cost = run_size(_config_of(config, s, overrides))


def _done(spec: RunSpec) -> bool:
    return (spec.out_dir / "results.json").is_file()


def run_progress(spec: RunSpec) -> tuple[int, bool]:
    """A run's steps finished so far (over its stages: each earlier stage's folder under STAGES_DIR, the last stage
    in the run folder itself) and whether it is compiling its step, from one read of each metrics log."""
    if _done(spec):
        return spec.steps, False
    stages = spec.out_dir / STAGES_DIR
    folders = sorted(p for p in stages.iterdir() if p.is_dir()) if stages.is_dir() else []
    total, event = 0, None
    for folder in [*folders, spec.out_dir]:
        steps = 0
        for r in read_metrics(folder):
            if r.get("split") == "train":
                steps = max(steps, r.get("step", 0))
            elif r.get("split") == "event":
                event = r.get("event")
        total += steps
    return total, event == "compiling"


def _command(config: str | None, spec: RunSpec, overrides: list[str], threads: int) -> list[str]:
    cmd = [sys.executable, "-m", "loopformer.cli", "train"]
    extra = [f"threads={threads}"] if threads else []
    if continuable(spec.out_dir):
        return cmd + extra + ["--resume", str(spec.out_dir), "--quiet"]
    if spec.config or config:
        cmd.append(str(spec.config or config))
    return cmd + [*overrides, *spec.overrides, f"out_dir={spec.out_dir}", f"name={spec.name}", *extra, "--quiet"]


def _run_inprocess(config: str | None, spec: RunSpec, overrides: list[str], threads: int,
                   progress: bool) -> None:
    resume = continuable(spec.out_dir)
    if resume:
        cfg = load_for_resume(spec.out_dir, [f"threads={threads}"] if threads else [])
    else:
        extra = [f"threads={threads}"] if threads else []
        cfg = load_run_config(spec.config or config, [*overrides, *spec.overrides, f"out_dir={spec.out_dir}",
                                                      f"name={spec.name}", *extra])
    train_run(cfg, resume=resume, progress=progress)


def _die_with_parent() -> None:
    """In a worker (Linux): receive SIGTERM when the sweep process dies, even by SIGKILL (prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):   # no prctl (not Linux): the sweep's own cleanup still stops its workers
        pass


def run_sweep(config: str | None, grid: list[tuple[str, list[str]]], baseline: list[str], out: str | os.PathLike,
              overrides: list[str] = (), jobs: int = 1, threads: int = 0, progress: bool = True,
              desc: str = "sweep", stale: str = "stop") -> list[RunSpec]:
    """Run (or complete) a sweep; returns its runs. Raises UserError naming the runs that failed. `stale`: what to
    do with run folders trained with other settings than asked for now (`loopformer.experiments.stale`)."""
    out = Path(out)
    overrides = list(overrides)
    for ov in overrides:
        if ov.split("=", 1)[0] in ("out_dir", "name"):
            raise UserError("out_dir and name are set per run by the sweep; the sweep folder is `out`")
    specs = expand(grid, baseline, out)
    prepare_specs(config, specs, overrides)
    run_specs(specs, config, overrides, jobs, threads, progress, desc, out, stale)
    return specs


def run_specs(specs: list[RunSpec], config: str | None = None, overrides: list[str] = (), jobs: int = 1,
              threads: int = 0, progress: bool = True, desc: str = "sweep", out: str | os.PathLike = ".",
              stale: str | None = "stop") -> None:
    """Run (or complete) prepared runs (`prepare_specs`), each with its own config when it names one: finished runs are
    skipped, interrupted ones resumed — unless they were trained with other settings than asked for now, which
    `stale` decides ("stop" | "retrain" | "keep", `loopformer.experiments.stale`; None: the caller has checked);
    worker logs go to `out`/logs.
    Raises UserError naming the runs that failed."""
    out = Path(out)
    overrides = list(overrides)
    if stale is not None:
        resolve_stale([(s.out_dir, _config_of(config, s, overrides)) for s in specs
                       if stored_config(s.out_dir).is_file()], out, stale, progress, desc)
    out.mkdir(parents=True, exist_ok=True)
    todo = [s for s in specs if not _done(s)]
    if progress and len(todo) < len(specs):
        print(f"{desc}: {len(specs) - len(todo)} of {len(specs)} runs already finished, skipped", file=sys.stderr)
    with interrupt_on_signals():   # SIGTERM / SIGHUP too: the cleanup below stops the workers
        if jobs <= 1:
            for i, s in enumerate(todo):
                if progress:
                    print(f"{desc}: run {i + 1}/{len(todo)}: {s.name}", file=sys.stderr)
                _run_inprocess(config, s, overrides, threads, progress)
            return
        _run_parallel(config, todo, specs, overrides, jobs, threads, progress, desc, out)


def _run_parallel(config, todo: list[RunSpec], specs: list[RunSpec], overrides, jobs: int, threads: int,
                  progress: bool, desc: str, out: Path) -> None:
    """Worker processes, at most `jobs` at a time, costliest first; one progress bar over all runs."""
    queue = sorted(todo, key=lambda s: -s.cost)
    total = sum(s.cost for s in specs)
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    running: dict[str, tuple[subprocess.Popen, RunSpec, object]] = {}
    failed: list[str] = []
    bar = tqdm(total=round(total), desc=desc, disable=not progress, unit="step·loop", dynamic_ncols=True)
    try:
        while queue or running:
            while queue and len(running) < jobs:
                s = queue.pop(0)
                fh = os.fdopen(open_nofollow(log_dir / f"{s.name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w")
                proc = subprocess.Popen(_command(config, s, overrides, threads), stdout=fh, stderr=subprocess.STDOUT,
                                        env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
                running[s.name] = (proc, s, fh)
            time.sleep(1.0)
            for name in list(running):
                proc, s, fh = running[name]
                if proc.poll() is not None:
                    fh.close()
                    if proc.returncode != 0:
                        failed.append(f"{name} (exit {proc.returncode}; see {log_dir / (name + '.log')})")
                    del running[name]
            state = {s.name: run_progress(s) for s in specs}            # (steps, compiling) per run
            done = sum(s.cost * min(state[s.name][0], s.steps) / max(s.steps, 1) for s in specs)
            bar.n = round(done)
            post = {"runs": f"{sum(_done(s) for s in specs)}/{len(specs)}", "active": len(running)}
            compiling = sum(state[name][1] for name in running)
            if compiling:
                post["compiling"] = compiling
            bar.set_postfix(post, refresh=False)
            bar.refresh()
    finally:
        for proc, _, fh in running.values():   # interrupted: stop the workers (they resume on the next call)
            proc.terminate()
            proc.wait()
            fh.close()
        bar.close()
    if failed:
        raise UserError(f"{len(failed)} run(s) failed: {'; '.join(failed)}")
