"""Checkpoint folders.

    DIR/model.safetensors   weights of the raw module (never a compiled or DDP wrapper)
    DIR/ema.safetensors     optional: the exponential moving average of those weights (`train.select.ema_decay`), in the
                            same layout (`load(DIR, ema=True)` loads it as the model)
    DIR/config.json         the ModelConfig fields at top level (what `PyTorchModelHubMixin` expects, so
                            `LoopedTransformer.from_pretrained(DIR)` and `push_to_hub` work), plus "run" (the
                            resolved run config), "task" and "loopformer_version"
    DIR/training_state.pt   optional: optimizer, scheduler, RNG states, step, data position — tensors and plain
                            values only, loaded with `weights_only=True` (a file that needs anything else is
                            refused: unpickling arbitrary objects could run code)

A folder is written next to its destination (`.NAME.tmp-<pid>-*`, config.json last) and renamed into place; an
existing folder is first renamed aside (`.NAME.old-*`) and deleted after the swap, so a crash never leaves a
half-written checkpoint. A
process killed between the two renames leaves no `NAME/` but complete hidden folders: `recover_checkpoint` puts
the newest complete one back in place and deletes the leftovers. Loading is strict (missing or unexpected weights
are errors) and a truncated or corrupt file is a one-line `UserError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from loopformer.configio import from_dict, to_dict
from loopformer.errors import UserError
from loopformer.fileio import check_owned_folder, new_folder, owner_dead
from loopformer.model.config import LIMITS, ModelConfig, migrate
from loopformer.model.looped import LoopedTransformer, unwrap
from loopformer.model.memory import check_fits, param_count
from loopformer.version import __version__

WEIGHTS, CONFIG, STATE, EMA_WEIGHTS = "model.safetensors", "config.json", "training_state.pt", "ema.safetensors"
RUN_CHECKPOINT = "checkpoint"   # the checkpoint folder's name inside a run folder (`loopformer.train.run`)
RESERVED_KEYS = ("run", "task", "loopformer_version", "source")   # config.json keys that are not model fields


def _hidden(dest: Path) -> list[Path]:
    """The swap's hidden folders next to `dest` (`.NAME.tmp-*`, `.NAME.old-*`)."""
    if not dest.parent.is_dir():
        return []
    return sorted(p for p in dest.parent.iterdir()
                  if p.name.startswith((f".{dest.name}.tmp-", f".{dest.name}.old-")) and p.is_dir())


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """{tensor name: shape} from a .safetensors file's header, reading nothing else."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        return {k: [int(x) for x in v["shape"]] for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        raise UserError(f"{path} is truncated or corrupt") from None


def check_shapes(cfg: ModelConfig, path: Path) -> None:
    """The config's parameter shapes (a model built on the meta device: nothing allocated) against the weights
    file's header: a checkpoint whose config.json and weights disagree is refused before the model is built."""
    with torch.device("meta"):
        want = {k: list(v.shape) for k, v in LoopedTransformer(cfg).state_dict().items()}
    have = safetensors_shapes(path)
    for name, shape in want.items():
        if name in have and have[name] != shape:
            raise UserError(f"checkpoint {path.parent} does not match its config: {name} has shape {have[name]} "
                            f"in {path.name}, the config asks for {shape}")


def safetensors_complete(path: Path) -> bool:
    """Whether a .safetensors file is whole: its header parses and the file is as long as the header says."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return False
            header = json.loads(fh.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        return 8 + n + max(ends, default=0) == size
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a complete checkpoint folder (-1 without training state), or None when it is incomplete."""
    p = Path(path)
    try:
        json.loads((p / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    if not safetensors_complete(p / WEIGHTS):
        return None
    if not (p / STATE).is_file():
        return -1
    try:
        state = load_training_state(p)
    except UserError:
        return None
    return int(state["step"]) if state else None


STALE_S = 60.0   # a hidden temporary folder untouched this long belongs to no running writer


def _stale(folder: Path) -> bool:
    """Whether nothing in `folder` (nor the folder) was modified in the last STALE_S seconds."""
    try:
        newest = max([folder.stat().st_mtime] + [p.stat().st_mtime for p in folder.rglob("*")])
    except OSError:
        return True
    return time.time() - newest > STALE_S


def recover_checkpoint(path: str | os.PathLike) -> Path | None:
    """Repair a checkpoint swap cut short, then delete its leftovers.

    If `path` is missing (a kill between the two renames of `loopformer.fileio.replace_dir`) or incomplete, the
    newest complete hidden folder of the swap is renamed into place. Leftovers are deleted: `.NAME.old-*` folders, and
    `.NAME.tmp-<pid>-*` folders of a process that no longer runs or untouched for STALE_S seconds (a younger one may
    be a running writer's; the next `save_checkpoint` removes it). A folder is complete once its config.json, written
    last, is whole. Returns `path` if a checkpoint is there afterwards, else None.
    """
    dest = Path(path)
    hidden = _hidden(dest)
    if not hidden:
        return dest if dest.exists() else None
    if not dest.exists() or checkpoint_step(dest) is None:
        best: tuple[int, Path] | None = None
        for h in hidden:
            step = checkpoint_step(h)
            if step is not None and (best is None or step > best[0]):
                best = (step, h)
        if best is not None:
            if dest.exists():
                broken = dest.with_name(f".{dest.name}.old-broken-{os.getpid()}")
                os.replace(dest, broken)
                hidden.append(broken)
            os.replace(best[1], dest)
    for h in hidden:
        if h.exists() and (f".{dest.name}.old-" in h.name or _stale(h) or owner_dead(h, f".{dest.name}.tmp-")):
            shutil.rmtree(h, ignore_errors=True)
    return dest if dest.exists() else None


@contextlib.contextmanager
def _write_errors(dest: Path) -> Iterator[None]:
    """The errors the weight writers raise for a failed write (a full disk: safetensors' SafetensorError,
    torch.save's RuntimeError) as one-line UserErrors; the checkpoint already at `dest` stays."""
    try:
        yield
    except (RuntimeError, SafetensorError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"cannot write the checkpoint {dest} ({first}; is the disk full?); the last checkpoint "
                        f"is kept") from None


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, *, run: dict | None = None,
                    task: dict | None = None, training_state: dict | None = None,
                    ema: torch.nn.Module | None = None, extra: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint folder atomically (with `ema`, the averaged weights too); returns its path. `extra(tmp)`
    writes more into the new folder before its config.json (a sharded model's distributed checkpoint)."""
    dest = Path(path)
    raw = unwrap(model)
    with new_folder(dest) as tmp, _write_errors(dest):
        save_model(raw, str(tmp / WEIGHTS))
        if ema is not None:
            save_model(unwrap(ema), str(tmp / EMA_WEIGHTS))
        if training_state is not None:
            torch.save(training_state, tmp / STATE)
        if extra is not None:
            extra(tmp)
        cfg = to_dict(raw.config)      # last: a folder without a whole config.json is incomplete (`checkpoint_step`)
        cfg.update({"run": run or {}, "task": task or {}, "loopformer_version": __version__})
        (tmp / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=False, default=str) + "\n")
    for h in _hidden(dest):           # leftovers of earlier swaps cut short (this process writes this checkpoint)
        shutil.rmtree(h, ignore_errors=True)
    return dest


def check_checkpoint_out(out: str | os.PathLike, what: str, marker: str, hint: str) -> None:
    """A UserError unless `out` is missing, empty or a checkpoint folder the command `what` wrote (its config.json
    records `run.<marker>`): anything else in it is the user's and is never replaced."""
    check_owned_folder(out, (WEIGHTS, CONFIG, EMA_WEIGHTS), CONFIG, what, hint=hint)
    cfg = Path(out) / CONFIG
    if cfg.is_file():
        try:
            ours = marker in (json.loads(cfg.read_text()).get("run") or {})
        except (ValueError, OSError, AttributeError, TypeError):
            ours = False
        if not ours:
            raise UserError(f"{out} holds a checkpoint that {what} did not write; {hint}")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder `path`, or the one inside the run folder `path`."""
    p = Path(path)
    return p / RUN_CHECKPOINT if (p / RUN_CHECKPOINT / CONFIG).is_file() else p


def read_config(path: str | os.PathLike, weights: bool = True) -> tuple[ModelConfig, dict]:
    """(model config, the rest of config.json) of a checkpoint folder (or of the one inside a run folder);
    `weights`: the folder must hold model.safetensors too."""
    p = resolve_checkpoint(path)
    if not p.exists():
        raise UserError(f"checkpoint not found: {p}")
    if not (p / CONFIG).is_file() or (weights and not (p / WEIGHTS).is_file()):
        raise UserError(f"{p} is not a loopformer checkpoint (needs {CONFIG}{f' and {WEIGHTS}' if weights else ''})")
    try:
        data = json.loads((p / CONFIG).read_text())
    except (ValueError, OSError) as exc:   # bad JSON, not UTF-8, unreadable
        raise UserError(f"{p / CONFIG} is not valid JSON: {str(exc).splitlines()[0] if str(exc) else exc!r}") from None
    except RecursionError:                  # nested deeper than any config
        raise UserError(f"{p / CONFIG} is nested too deeply to be a loopformer config") from None
    if not isinstance(data, dict):
        raise UserError(f"{p / CONFIG} is not a JSON object")
    extra = {k: data.pop(k) for k in list(data) if k in RESERVED_KEYS}
    for key, value in [*((k, extra[k]) for k in ("run", "task") if k in extra),
                       ("run.task", (extra.get("run") or {}).get("task") if isinstance(extra.get("run"), dict)
                        else None)]:
        if value is not None and not isinstance(value, dict):
            raise UserError(f"{p / CONFIG}: {key} must be a JSON object (got {type(value).__name__})")
    try:
        data = migrate(data)                 # fields that left the core since the checkpoint was written
    except ValueError as exc:
        raise UserError(f"{p / CONFIG}: {exc}") from None
    factors = _position_factors(data.pop("pos_factors", None), p / CONFIG)
    cfg = from_dict(ModelConfig, data)
    if factors is not None:                  # checked as plain lists: a long one through the schema takes seconds
        try:
            cfg = cfg.replace(pos_factors=factors)
        except ValueError as exc:
            raise UserError(f"{p / CONFIG}: {exc}") from None
    return cfg, extra


MAX_FACTORS = 64    # position factors a config may list (a grid task has a few: row, column, box)


def _position_factors(factors: Any, where: Path) -> list[list[int]] | None:
    """config.json's `pos_factors` checked as plain JSON before anything else reads it — at most MAX_FACTORS lists,
    each of at most LIMITS["max_len"] non-negative integers below it — so a huge or malformed list is one line at
    once; ModelConfig then checks it against max_len."""
    if factors is None:
        return None
    limit = LIMITS["max_len"]
    if not isinstance(factors, list) or len(factors) > MAX_FACTORS or not all(
            isinstance(f, list) and len(f) <= limit for f in factors):
        raise UserError(f"{where}: pos_factors must be a list of at most {MAX_FACTORS} lists of at most {limit:,} "
                        f"position indices each")
    for f in factors:
        if not all(type(i) is int and 0 <= i < limit for i in f):
            raise UserError(f"{where}: pos_factors must hold integers in 0..{limit - 1:,}")
    return factors


def load(path: str | os.PathLike, device: str | torch.device = "cpu", ema: bool = False, memory_check: bool = True,
         **overrides: Any) -> LoopedTransformer:
    """Load a checkpoint folder (or the one inside a run folder) strictly and return the model in eval mode, ready
    for inference. Before anything is allocated the parameters are compared with the memory available
    (`memory_check`) and the config's shapes with the weights file's header; weights holding NaN or infinities
    are refused (a diverged model's metrics mean nothing).

    ema: load the averaged weights (ema.safetensors) instead of the raw ones.
    `overrides` replace config fields that do not change the weights (e.g. `loops=64`, `dropout=0.0`).
    """
    path = resolve_checkpoint(path)
    cfg, _ = read_config(path)
    if overrides:
        cfg = cfg.replace(**overrides)
    if memory_check:
        check_fits({"parameters": 4 * param_count(cfg)}, device, f"the model of {path}")
    check_shapes(cfg, path / (EMA_WEIGHTS if ema and (path / EMA_WEIGHTS).is_file() else WEIGHTS))
    model = LoopedTransformer(cfg)
    load_weights(model, path, device, ema=ema)
    return model.to(device).eval()


def load_weights(model: torch.nn.Module, path: str | os.PathLike, device: str | torch.device = "cpu",
                 ema: bool = False, start_past: bool = False) -> None:
    """Load `path/model.safetensors` (`ema`: `path/ema.safetensors`) into `model` strictly; a missing or truncated
    file, a shape mismatch or a non-finite value is a UserError. `start_past` (fine-tuning, `train.init_from`): a
    model with `timestep_past="own"` may start from weights without the loops past r's own modulation, which then
    starts as the hold index's (`LoopedTransformer.start_past_modulation`)."""
    f = Path(path) / (EMA_WEIGHTS if ema else WEIGHTS)
    if ema and not f.is_file():
        raise UserError(f"{path} holds no averaged weights ({EMA_WEIGHTS}; train with train.select.ema_decay > 0)")
    if not safetensors_complete(f):
        raise UserError(f"{f} is truncated or corrupt")
    try:
        missing, unexpected = load_model(unwrap(model), str(f), strict=False, device=str(device))
    except (RuntimeError, OSError, SafetensorError) as exc:  # shape mismatch, unreadable file
        first = str(exc).strip().splitlines()
        detail = next((line.strip() for line in first if "mismatch" in line), first[0] if first else "")
        raise UserError(f"checkpoint {path} does not match its config: {detail[:200]}") from None
    fill = start_past and bool(missing) and all(k.endswith(("past_modulation", "past_injection")) for k in missing)
    if fill:
        unwrap(model).start_past_modulation()
        missing = []
    if missing or unexpected:
        raise UserError(f"checkpoint {path} does not match its config: missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}")
    for name, p in unwrap(model).state_dict().items():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            raise UserError(f"{f} holds NaN or infinite values ({name}): the model diverged or the file was "
                            f"damaged; refusing to use it")


def check_init_from(path: str | os.PathLike, cfg: ModelConfig) -> Path:
    """The checkpoint folder of `path` (a run folder or a checkpoint) for a run that starts from its weights
    (`train.init_from`), checked before anything is written: it must be a loopformer checkpoint whose weights have
    the shapes of the model `cfg` builds. Its other settings (loops, timestep handling past r, …) may differ."""
    p = resolve_checkpoint(path)
    read_config(p)
    check_shapes(cfg, p / WEIGHTS)
    return p


def has_training_state(path: str | os.PathLike) -> bool:
    """Whether the checkpoint folder `path` holds a training state (what `--resume` needs)."""
    return (Path(path) / STATE).is_file()


def load_training_state(path: str | os.PathLike) -> dict | None:
    """The training state of a checkpoint folder (None if it has none), loaded without unpickling code.

    Only tensors and plain values (dict, list, tuple, str, int, float, bool, None) are accepted
    (`torch.load(weights_only=True)`); anything else, a truncated file or a state without step / optimizer / RNG
    is a one-line UserError.
    """
    f = Path(path) / STATE
    if not f.is_file():
        return None
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower() or "weights_only" in str(exc).lower():
            raise UserError(f"{f} holds objects other than tensors and plain values; refusing to load it "
                            f"(unpickling them could run code)") from None
        raise UserError(f"{f} is truncated or corrupt") from None
    except Exception:  # truncated zip, bad pickle stream
        raise UserError(f"{f} is truncated or corrupt") from None
    ok = (isinstance(state, dict) and isinstance(state.get("step"), int) and not isinstance(state["step"], bool)
          and state["step"] >= 0 and isinstance(state.get("optimizer"), dict)
          and isinstance(state.get("rng"), (list, tuple)) and len(state["rng"]) > 0
          and all(isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) for r in state["rng"]))
    if not ok:
        raise UserError(f"{f} is not a loopformer training state (needs step, optimizer and rng)")
    return state
