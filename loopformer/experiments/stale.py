"""Runs trained with other settings than a sweep or a reproduction asks for now ("stale" runs).

A sweep and `loopformer reproduce` reuse a run folder that holds a finished run and resume one that holds an
interrupted run. When the settings behind the folder changed since — a shipped config's default, a claim's
overrides, the sweep's own command line — the reused run would answer another question than the one asked.
Every folder that holds a run's `config.yaml` is therefore compared, key by key, with the config the run would be
trained with now (`config_changes`); what to do with the ones that differ is the caller's `--stale` policy:

    stop     (default) one error line naming the first stale run and its first differing key; nothing runs
    retrain  each stale run folder moves to OUT/.stale/<UTC time>/<its path under OUT> (never deleted) and the run
             is trained again from the start
    keep     they are used as they are, with a warning naming them

Keys that do not change what a run learns are not compared: where the run lives (`name`, `out_dir`), the device
and thread count, the memory check, logging (`log.*`, `train.log_every`), how the step is compiled
(`train.system.compile*`), activation checkpointing and the evaluation batch size. Paths that both exist compare as the
files they name. A run folder without `config.yaml` (e.g. results copied back from an export) cannot be compared
and is reused as before. Shapes: none (orchestration only).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loopformer.configio import to_dict
from loopformer.errors import UserError
from loopformer.train.config import RunConfig, load_run_config
from loopformer.train.run import CONFIG_FILE, RunLock, stored_config

POLICIES = ("stop", "retrain", "keep")
STALE_DIR = ".stale"                 # under a sweep's or reproduction's folder: the stale runs moved aside
IGNORED = frozenset({"name", "out_dir", "device", "threads", "memory_check", "train.system.compile",
                     "train.system.compile_scope", "train.system.compile_mode", "train.log_every", "model.checkpoint",
                     "eval.batch_size"})
IGNORED_PREFIXES = ("log.",)
_MISSING = object()                  # a key one of two configs lacks


def moved_aside(path: str | os.PathLike) -> bool:
    """Whether a path lies in a run folder moved aside as stale (under OUT/.stale/, or a `<run>.stale-<time>`
    folder beside it)."""
    return any(part == STALE_DIR or f"{STALE_DIR}-" in part for part in Path(path).parts)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1} (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if isinstance(a, str) and isinstance(b, str) and a and b and os.path.exists(a) and os.path.exists(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return False


def compared(key: str) -> bool:
    """Whether a difference in `key` makes a run stale (see the module's list of keys that do not)."""
    return key not in IGNORED and not key.startswith(IGNORED_PREFIXES)


def config_changes(run_dir: str | os.PathLike, cfg: RunConfig) -> list[tuple[str, Any, Any]] | None:
    """[(key, the run's value, the value asked for now)] for every compared key where the run folder's
    `config.yaml` and `cfg` differ (in key order); None when the folder holds no config.yaml. A config.yaml that no
    longer loads (a key this version does not know) is one change, ("config.yaml", the error, "loads")."""
    f = stored_config(run_dir)
    if not f.is_file():
        return None
    try:
        theirs = flatten(to_dict(load_run_config(f, stored=True)))
    except UserError as e:
        return [(CONFIG_FILE, str(e), "loads")]
    now = flatten(to_dict(cfg))
    return [(k, theirs.get(k, _MISSING), now.get(k, _MISSING)) for k in sorted(set(theirs) | set(now))
            if compared(k) and not _same(theirs.get(k, _MISSING), now.get(k, _MISSING))]


def describe(change: tuple[str, Any, Any]) -> str:
    key, old, new = change
    if key == CONFIG_FILE:
        return f"its {CONFIG_FILE} no longer loads ({old})"
    show = (lambda v: "(absent)" if v is _MISSING else repr(v))                   # noqa: E731
    return f"{key} {show(old)} → {show(new)}"


def find_stale(runs: Sequence[tuple[Path, RunConfig]]) -> list[tuple[Path, list[tuple[str, Any, Any]]]]:
    """[(run folder, its changes)] for the (folder, config asked for now) pairs whose folder differs."""
    out = []
    for run_dir, cfg in runs:
        changes = config_changes(run_dir, cfg)
        if changes:
            out.append((Path(run_dir), changes))
    return out


def _where(path: Path, out: Path) -> str:
    try:
        return str(path.absolute().relative_to(out.absolute()))
    except ValueError:
        return str(path)


def resolve_stale(runs: Sequence[tuple[Path, RunConfig]], out: str | os.PathLike, policy: str = "stop",
                  progress: bool = True, what: str = "sweep") -> list[Path]:
    """Apply `policy` to the stale runs among `runs` (run folder, config asked for now) under the folder `out`;
    returns the stale run folders (after "retrain" they have been moved to `out`/.stale/<time>/...).
    "stop" raises UserError (one line) when any is stale."""
    if policy not in POLICIES:
        raise UserError(f"--stale must be one of {', '.join(POLICIES)} (got {policy!r})")
    out = Path(out)
    stale = find_stale(runs)
    if not stale:
        return []
    first, changes = stale[0]
    more = f" and {len(changes) - 1} more key(s)" if len(changes) > 1 else ""
    head = (f"{len(stale)} run folder(s) under {out} hold runs trained with other settings than this {what} asks "
            f"for now ({_where(first, out)}: {describe(changes[0])}{more})")
    if policy == "stop":
        raise UserError(f"{head}; --stale retrain moves them to {out / STALE_DIR}/ and trains them again, --stale "
                        f"keep uses them as they are")
    if policy == "keep":
        if progress:
            print(f"{what}: warning: {head}; used as they are (--stale keep)", file=sys.stderr)
        return [p for p, _ in stale]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    moved = []
    for run_dir, changes in stale:
        try:                                                      # OUT/.stale/<time>/<its path under OUT>
            dest = out / STALE_DIR / stamp / run_dir.absolute().relative_to(out.absolute())
        except ValueError:                                        # a run outside OUT: moved beside itself
            dest = run_dir.with_name(f"{run_dir.name}{STALE_DIR}-{stamp}")
        lock = RunLock(run_dir).acquire()     # a run training there now is not moved (one line, nothing moved)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(run_dir, dest)                                   # one rename: never half moved
        finally:
            lock.release()
        moved.append(run_dir)
        if progress:
            print(f"{what}: {_where(run_dir, out)} was trained with {describe(changes[0])}"
                  f"{f' (+{len(changes) - 1} more)' if len(changes) > 1 else ''}: moved to {_where(dest, out)}, "
                  f"training it again", file=sys.stderr)
    return moved
