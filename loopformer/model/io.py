"""Checkpoint folders.

    DIR/model.safetensors   weights of the raw module (never a compiled or DDP wrapper)
    DIR/config.json         the ModelConfig fields at top level (what `PyTorchModelHubMixin` expects, so
                            `LoopedTransformer.from_pretrained(DIR)` and `push_to_hub` work), plus "run" (the
                            resolved run config), "task" and "loopformer_version"
    DIR/training_state.pt   optional: optimizer, scheduler, RNG states, step, data position

A folder is written next to its destination and renamed into place, so a crash never leaves a half-written
checkpoint; loading is strict (missing or unexpected weights are errors).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_model, save_model

from loopformer.configio import from_dict, to_dict
from loopformer.errors import UserError
from loopformer.model.config import ModelConfig
from loopformer.model.looped import RESERVED_KEYS, LoopedTransformer

WEIGHTS, CONFIG, STATE = "model.safetensors", "config.json", "training_state.pt"


def unwrap(model: torch.nn.Module) -> LoopedTransformer:
    """The raw module inside DDP / FSDP / torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        else:
            return model  # type: ignore[return-value]


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished folder `tmp` to `dest`, replacing an existing `dest` with only a rename-sized window."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, *, run: Optional[dict] = None,
                    task: Optional[dict] = None, training_state: Optional[dict] = None) -> Path:
    """Write a checkpoint folder atomically; returns its path."""
    from loopformer import __version__

    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    raw = unwrap(model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        save_model(raw, str(tmp / WEIGHTS))
        cfg = to_dict(raw.config)
        cfg.update({"run": run or {}, "task": task or {}, "loopformer_version": __version__})
        _write_json(tmp / CONFIG, cfg)
        if training_state is not None:
            torch.save(training_state, tmp / STATE)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def read_config(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """(model config, the rest of config.json) of a checkpoint folder."""
    p = Path(path)
    if not (p / CONFIG).is_file() or not (p / WEIGHTS).is_file():
        raise UserError(f"{p} is not a loopformer checkpoint (needs {CONFIG} and {WEIGHTS})")
    try:
        data = json.loads((p / CONFIG).read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{p / CONFIG} is not valid JSON: {exc}") from None
    extra = {k: data.pop(k) for k in list(data) if k in RESERVED_KEYS}
    return from_dict(ModelConfig, data), extra


def load(path: str | os.PathLike, device: str | torch.device = "cpu", **overrides: Any) -> LoopedTransformer:
    """Load a checkpoint folder strictly and return the model in eval mode, ready for inference.

    `overrides` replace config fields that do not change the weights (e.g. `loops=64`, `dropout=0.0`).
    """
    cfg, _ = read_config(path)
    if overrides:
        cfg = cfg.replace(**overrides)
    model = LoopedTransformer(cfg)
    try:
        missing, unexpected = load_model(model, str(Path(path) / WEIGHTS), strict=False, device=str(device))
    except (RuntimeError, OSError) as exc:  # shape mismatch, truncated file
        first = str(exc).strip().splitlines()
        detail = next((line.strip() for line in first if "mismatch" in line), first[0] if first else "")
        raise UserError(f"checkpoint {path} does not match its config: {detail[:200]}") from None
    if missing or unexpected:
        raise UserError(f"checkpoint {path} does not match its config: missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}")
    return model.to(device).eval()


def load_training_state(path: str | os.PathLike) -> Optional[dict]:
    f = Path(path) / STATE
    return torch.load(f, map_location="cpu", weights_only=False) if f.is_file() else None
