"""Staged runs: one config, several trainings in a row, each starting from the previous one's weights.

A recipe that learns a task first and then something about it — the circuit's TMLT learns the 32 layers, then
holds the answer past r when fine-tuned on deeper loop counts with its loop index held (docs/stability.md) — is
one config with `stages:`, each stage the run's config with its `set` on top:

    stages:
      - {name: learn, set: {train.steps: 3000}}
      - {name: hold, set: {train.steps: 2000, train.optim.lr: 5.0e-4, train.loops.hold: 4}}

Stage k < n trains in `out_dir/stages/<k>-<name>`, the last in `out_dir` itself, so `eval`, `analyze`, sweeps and
reproduce read a staged run as any other; stage k > 1 starts from stage k − 1's weights (`train.init_from`: a fresh
optimiser and schedule). `out_dir/stages.yaml` holds the staged config: `--resume out_dir` (or a sweep re-run) goes
on from whichever stage was interrupted, finished stages are kept. The last stage's results.json lists every stage's
steps, time and test metrics under `stages`.

Every stage's config is built and checked before anything is written or trained (`check_stages`): its keys and
values, its model's shapes against the previous stage's (the weights it starts from), its batch against the
processes, its task's data (folders, sizes), its evaluation section and lengths, its loop rule and the memory of its
step. A stage sets dotted keys of the run's config (not `out_dir` or `stages`; `train.init_from` only in the first).
A stage that changes the task keeps the model's fields (vocabulary, positions) of the run's config.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loopformer.configio import from_dict, one_line, to_dict
from loopformer.device import pick_device
from loopformer.errors import UserError
from loopformer.eval.lengths import plan_lengths
from loopformer.eval.run import check_eval_config
from loopformer.fileio import write_text
from loopformer.model.config import ModelConfig
from loopformer.model.io import check_init_from
from loopformer.model.lengths import LoopRule, check_covers
from loopformer.model.looped import LoopedTransformer
from loopformer.sources import DataSource, make_data
from loopformer.train import run
from loopformer.train.config import RunConfig, StageConfig
from loopformer.train.distributed import launch_env
from loopformer.train.optim import steps_for
from loopformer.train.trainer import check_memory, train


def stage_folder(cfg: RunConfig, k: int) -> Path:
    """Where stage k (from 1) of `cfg` trains: out_dir/stages/<k>-<name> before the last, out_dir for the last."""
    root = Path(cfg.out_dir)
    if k == len(cfg.stages):
        return root
    name = cfg.stages[k - 1].name
    return root / run.STAGES_DIR / (f"{k}-{name}" if name else str(k))


def _label(k: int, st: StageConfig) -> str:
    return f"stage {k}" + (f" ({st.name})" if st.name else "")


def stage_configs(cfg: RunConfig) -> list[RunConfig]:
    """The run config of every stage of `cfg` (see the module docstring), each loaded strictly: a bad key or value in
    any stage is a UserError naming the stage, before any stage runs."""
    if not cfg.stages:
        raise UserError("not a staged config: it has no stages")
    base = {**to_dict(cfg), "stages": []}
    out = []
    for k, st in enumerate(cfg.stages, 1):
        sets = {**st.set, "out_dir": str(stage_folder(cfg, k))}       # a missing section is created here; the
        if k < len(cfg.stages):                                        # strict load rejects unknown keys
            sets["name"] = f"{cfg.name}-{st.name or k}"
        if k > 1:
            sets["train.init_from"] = str(stage_folder(cfg, k - 1))
        try:
            tree = OmegaConf.create(base)
            for key, value in sets.items():
                OmegaConf.update(tree, key, value, merge=False)
            out.append(from_dict(RunConfig, OmegaConf.to_container(tree)))
        except OmegaConfBaseException as e:
            raise UserError(f"{_label(k, st)}: config error: {one_line(e)}") from None
        except UserError as e:
            raise UserError(f"{_label(k, st)}: {e}") from None
    return out


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the weights a model of `cfg` holds, from the meta device (nothing allocated)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in LoopedTransformer(cfg).state_dict().items()}


def _check_start(prev: ModelConfig, cfg: ModelConfig) -> None:
    """A stage's model must load the previous stage's weights (`train.init_from`): the same names and shapes, but the
    modulation of the loops past r, which a model with `timestep_past="own"` may start without."""
    have, want = _shapes(prev), _shapes(cfg)
    for name, shape in want.items():
        if name in have and have[name] != shape:
            raise UserError(f"its model cannot start from the previous stage's weights: {name} has shape "
                            f"{list(have[name])} there, {list(shape)} here (a stage keeps the model's sizes)")
    missing = [n for n in want if n not in have and not n.endswith(("past_modulation", "past_injection"))]
    extra = [n for n in have if n not in want]
    if missing or extra:
        raise UserError(f"its model cannot start from the previous stage's weights: missing {missing[:3]}, "
                        f"unexpected {extra[:3]}")


def check_stage(cfg: RunConfig, prev: RunConfig | None, world: int, data: dict[str, DataSource]) -> None:
    """The checks the trainer makes at its start, made for one stage before any stage trains: the weights it starts
    from (shapes against `prev`, the previous stage), its batch against the `world` processes, its data (`data`
    caches the sources by task), its evaluation section and lengths, its loop rule and the memory of its step."""
    tc = cfg.train
    launch_env(joins=tc.system.parallel == "fsdp")
    if tc.batch_size % (world * tc.grad_accum):
        raise UserError(f"train.batch_size={tc.batch_size} must be divisible by processes × grad_accum = "
                        f"{world} × {tc.grad_accum}")
    if prev is not None:
        _check_start(prev.model, cfg.model)
    elif tc.init_from:
        check_init_from(tc.init_from, cfg.model)
    key = json.dumps(to_dict(cfg.task), sort_keys=True, default=str)
    if key not in data:
        data[key] = make_data(cfg.task)
    source = data[key]
    check_eval_config(cfg.eval, cfg.model.total_loops)
    if cfg.eval.votes:
        source.check_votes()
    steps_for(tc.steps, tc.epochs, source.n_train, tc.batch_size)
    check_covers(LoopRule.parse(cfg.model.loop_rule), cfg.model.loops, source.largest_size())
    if cfg.eval.lengths:
        plan_lengths(source, cfg.model, cfg.eval.lengths, loops=cfg.eval.loops, max_loops=cfg.eval.max_loops,
                     limit=cfg.eval.n)
    if cfg.memory_check:
        check_memory(cfg, pick_device(cfg.device, launch_env()[2]), world)


def check_stages(cfg: RunConfig, cfgs: list[RunConfig]) -> None:
    """Every stage of `cfg` (`cfgs`, from `stage_configs`) checked by `check_stage` before any trains: a stage
    that would fail at its start is one line naming it, before the first stage's first step."""
    world = launch_env()[0]
    data: dict[str, DataSource] = {}
    for k, sc in enumerate(cfgs, 1):
        try:
            check_stage(sc, cfgs[k - 2] if k > 1 else None, world, data)
        except UserError as e:
            raise UserError(f"{_label(k, cfg.stages[k - 1])}: {e}") from None


def _start(cfg: RunConfig, resume: bool, overwrite: bool) -> None:
    """Make `out_dir` ready for the staged run (rank 0): refuse a folder that holds a run or other files unless
    `overwrite` (which deletes only an earlier staged run's stages), then write stages.yaml."""
    root = Path(cfg.out_dir)
    marker = root / run.STAGES_FILE
    if resume:
        if not marker.is_file():
            raise UserError(f"cannot resume {root} as a staged run: no {run.STAGES_FILE} there")
        return
    if overwrite:
        if marker.is_file():
            shutil.rmtree(root / run.STAGES_DIR, ignore_errors=True)
            marker.unlink()
        elif (root / run.STAGES_DIR).exists():
            raise UserError(f"{root / run.STAGES_DIR} was not written by a staged run: choose another out_dir")
        run.prepare(root, resume=False, overwrite=True)   # an earlier run's checkpoint and results: not resumed
    elif root.is_dir() and any(root.iterdir()):
        what = "a staged run" if marker.is_file() else "a run or other files"
        raise UserError(f"{root} already holds {what}: resume it (`loopformer train --resume {root}`), choose "
                        f"another out_dir or pass --overwrite")
    root.mkdir(parents=True, exist_ok=True)
    write_text(marker, run.config_yaml(cfg))


def run_stages(cfg: RunConfig, *, resume: bool = False, progress: bool | None = None, overwrite: bool = False,
               on_step: Callable[[int], None] | None = None) -> dict:
    """Train every stage of `cfg` in turn (finished ones kept, an interrupted one resumed); returns the last stage's
    results with a `stages` summary (also in out_dir/results.json)."""
    cfgs = stage_configs(cfg)                 # every stage built and checked before anything is written
    check_stages(cfg, cfgs)
    main = launch_env()[1] == 0
    if main:
        _start(cfg, resume, overwrite)
    summary, results = [], {}
    for k, sc in enumerate(cfgs, 1):
        folder = Path(sc.out_dir)
        again = run.resumable(folder)          # a finished stage too: train returns its results at once
        if progress is not False and main:
            print(f"{_label(k, cfg.stages[k - 1])} of {len(cfgs)}: {folder}", flush=True)
        results = train(sc, resume=again, progress=progress, overwrite=not again, on_step=on_step)
        summary.append({"stage": k, "name": cfg.stages[k - 1].name, "out_dir": str(folder),
                        "steps": results.get("steps"), "train_time_s": results.get("train_time_s"),
                        "metric": results.get("metric"), "test": results.get("test")})
    results = {**results, "stages": summary}
    if main:
        results = run.write_results(Path(cfg.out_dir), results)
    return results


def train_run(cfg: RunConfig, **kwargs) -> dict:
    """`train(cfg)` for one run, `run_stages(cfg)` for a staged one: what `loopformer train` and sweeps call."""
    return run_stages(cfg, **kwargs) if cfg.stages else train(cfg, **kwargs)


__all__ = ["check_stage", "check_stages", "stage_folder", "stage_configs", "run_stages", "train_run"]
