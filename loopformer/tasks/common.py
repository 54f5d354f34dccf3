"""Helpers shared by the token tasks: seeding, option checks, causal answer masks and exact-match metrics.

The causal tasks (edit distance, LCS, Countdown; paper App. C.1.1) all use one layout: a prompt followed by an
answer, packed left-aligned into a row of length T and padded with `pad_id`:

    inputs  [N, T]   prompt tokens, answer tokens, pad ...
    targets [N, T]   IGNORE, ..., IGNORE, answer tokens (shifted left by one), IGNORE ...
    answer_start [N] index in `inputs` of the first answer token
    length       [N] number of non-pad tokens in `inputs`

so `targets[i, t] = inputs[i, t + 1]` for `answer_start[i] - 1 <= t < length[i] - 1` and IGNORE elsewhere; a
model that is right on every non-IGNORE position has produced the whole answer (greedy decoding from
`inputs[i, :answer_start[i]]` reproduces it exactly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from loopformer.errors import UserError
from loopformer.tasks.base import IGNORE

# Split names map to integer stream ids so (seed, split) gives an independent random stream per split.
SPLIT_IDS = {"train": 0, "test": 1, "val": 2, "valid": 2, "validation": 2}


def split_id(split: str) -> int:
    try:
        return SPLIT_IDS[split]
    except KeyError:
        raise UserError(f"unknown split {split!r} (expected one of: train, test, val)") from None


def make_rng(seed: int, split: str, *extra: int) -> np.random.Generator:
    """The random generator for `generate(n, seed, split)`: independent streams per (seed, split, *extra)."""
    if int(seed) < 0:
        raise UserError(f"seed must be >= 0, got {seed}")
    return np.random.default_rng(np.random.SeedSequence([int(seed), split_id(split), *map(int, extra)]))


def check_range(name: str, value: Any, lo: float | None = None, hi: float | None = None, integer: bool = True):
    """Raise a one-line UserError unless lo <= value <= hi (and an integer if `integer`)."""
    if integer and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
        raise UserError(f"option {name} must be an integer, got {value!r}")
    if not integer and (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))):
        raise UserError(f"option {name} must be a number, got {value!r}")
    if lo is not None and value < lo:
        raise UserError(f"option {name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise UserError(f"option {name} must be <= {hi}, got {value}")


def dataclass_options(obj) -> dict[str, Any]:
    """The init fields of a task dataclass as a plain dict (what manifests record)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


def causal_targets(inputs: np.ndarray, answer_start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """targets [N, T]: inputs shifted left by one inside [answer_start - 1, length - 1), IGNORE elsewhere."""
    n, t = inputs.shape
    targets = np.full((n, t), IGNORE, dtype=np.int32)
    pos = np.arange(t)[None, :]
    mask = (pos >= (answer_start[:, None] - 1)) & (pos < (length[:, None] - 1))
    shifted = np.empty_like(inputs, dtype=np.int32)
    shifted[:, :-1] = inputs[:, 1:]
    shifted[:, -1] = 0
    targets[mask] = shifted[mask]
    return targets


def exact_match(pred: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """[N] bool: prediction right at every non-IGNORE position of the row."""
    pred = np.asarray(pred)
    targets = np.asarray(targets)
    if pred.shape != targets.shape:
        raise ValueError(f"pred has shape {pred.shape} but targets have shape {targets.shape}")
    mask = targets != IGNORE
    return np.all((pred == targets) | ~mask, axis=1)


def token_accuracy(pred: np.ndarray, targets: np.ndarray) -> float:
    mask = np.asarray(targets) != IGNORE
    total = int(mask.sum())
    return float(((np.asarray(pred) == targets) & mask).sum() / total) if total else float("nan")


def answer_region(generated: np.ndarray, answer_start: np.ndarray, width: int) -> np.ndarray:
    """[N, width] tokens of `generated` from each row's answer start (pad 0 past the end of the row)."""
    generated = np.asarray(generated)
    n, t = generated.shape
    idx = answer_start[:, None] + np.arange(width)[None, :]
    out = np.zeros((n, width), dtype=generated.dtype)
    ok = idx < t
    rows = np.broadcast_to(np.arange(n)[:, None], idx.shape)
    out[ok] = generated[rows[ok], idx[ok]]
    return out
