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


def check_bool(name: str, value: Any) -> None:
    """Raise a one-line UserError unless `value` is a bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise UserError(f"option {name} must be true or false, got {value!r}")


def draw_sizes(rng: np.random.Generator, m: int, min_length: int, length: int) -> np.ndarray:
    """[m] row sizes drawn uniformly from min_length..length (min_length 0: every row has size `length`)."""
    return rng.integers(min_length or length, length + 1, size=m)


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


# ------------------------------------------------------------------------------------ splits disjoint by content
# Tasks whose inputs are few enough to repeat across splits (short rows over small alphabets) assign every possible
# input row to one split by a hash of its tokens: a row belongs to the test split when its bucket is 0, to the
# validation split when it is 1, to the training split otherwise (14 of 16 buckets). Splits are then disjoint by
# construction, however many rows are drawn and however a dataset is cut into chunks.
HASH_BUCKETS = 16
_SPLIT_BUCKETS = {0: range(2, HASH_BUCKETS), 1: range(0, 1), 2: range(1, 2)}   # split id -> buckets
_HASH_MULT = np.random.default_rng(0x5EED).integers(1, 2 ** 63, size=4096, dtype=np.uint64) | np.uint64(1)


def row_buckets(rows: np.ndarray) -> np.ndarray:
    """[N] int: the hash bucket (0..15) of every row of token ids [N, T] (T <= 4096): a polynomial hash with fixed
    odd multipliers, finished with splitmix64's mixer (wrap-around uint64 arithmetic)."""
    rows = np.asarray(rows)
    if rows.shape[1] > len(_HASH_MULT):
        raise ValueError(f"rows of length {rows.shape[1]} exceed the hash's {len(_HASH_MULT)} multipliers")
    with np.errstate(over="ignore"):
        h = (rows.astype(np.uint64) * _HASH_MULT[:rows.shape[1]]).sum(axis=1, dtype=np.uint64)
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return (h % np.uint64(HASH_BUCKETS)).astype(np.int64)


def in_split(rows: np.ndarray, split: str) -> np.ndarray:
    """[N] bool: whether each row of token ids belongs to `split` (see `row_buckets`)."""
    buckets = _SPLIT_BUCKETS[split_id(split)]
    b = row_buckets(rows)
    return (b >= buckets.start) & (b < buckets.stop)


MAX_EMPTY_DRAWS = 200    # batches in a row without a row of the split before `draw_in_split` gives up


def available_memory() -> int:
    """Bytes of memory that can be allocated now (the bound of `check_draw`)."""
    import psutil  # light, but only needed here

    return int(psutil.virtual_memory().available)


def check_draw(task: Any, rows: int) -> None:
    """A one-line UserError naming the size, before anything is allocated, when drawing `rows` rows of `task`
    (`TokenTask.row_bytes(drawing=True)` each: the intermediate states of a long row dominate) would take more
    memory than is available."""
    per_row = task.row_bytes(drawing=True)
    need, avail = int(rows) * per_row, available_memory()
    if need > avail:
        gib = 1024 ** 3
        states = f" and {task.steps:,} intermediate states" if getattr(task, "steps", 0) else ""
        raise UserError(f"generating {rows:,} rows of {task.name} ({task.seq_len:,} positions{states} each) would "
                        f"take about {need / gib:,.1f} GiB but {avail / gib:,.1f} GiB are available; choose a shorter "
                        f"length or fewer rows (data gen: a smaller chunk_size)")


def draw_in_split(draw, n: int, rng: np.random.Generator, split: str) -> dict[str, np.ndarray]:
    """`n` samples of `split` by rejection: `draw(rng, m)` returns m samples as a dict of arrays with a leading
    sample axis (one of them "inputs"); the rows whose inputs hash into another split are dropped. Deterministic
    in the state of `rng`. A task whose space holds no row of `split` (tiny options) is a UserError after
    MAX_EMPTY_DRAWS batches in a row without one, never an endless loop. Each draw of a task's method (`draw` bound
    to the task) is sized first (`check_draw`)."""
    n = int(n)
    share = len(_SPLIT_BUCKETS[split_id(split)]) / HASH_BUCKETS
    task = getattr(draw, "__self__", None)
    parts: list[dict[str, np.ndarray]] = []
    have, empty = 0, 0
    while have < n or not parts:
        m = max(64, int(np.ceil((n - have) / share * 1.2)))
        if hasattr(task, "row_bytes"):
            check_draw(task, m)
        batch = draw(rng, m)
        keep = in_split(batch["inputs"], split)
        parts.append({k: v[keep] for k, v in batch.items()})
        have += int(keep.sum())
        empty = 0 if keep.any() else empty + 1
        if empty >= MAX_EMPTY_DRAWS and have < n:
            raise UserError(f"the task's options leave too few distinct samples for the {split} split: none of "
                            f"{empty * m:,} draws fell into it (the splits are disjoint); choose larger options")
    return {k: np.concatenate([p[k] for p in parts])[:n] for k in parts[0]}


def loop_steps(loops: int, steps: int) -> np.ndarray:
    """[R] int: which of a task's K intermediate states (1..K) supervises each loop t = 1..R (per-loop targets).

    R >= K: one step per loop, then the final state held — j(t) = min(t, K). R < K: the steps spread evenly over
    the loops, the last loop on the final state — j(t) = ceil(t·K / R). One formula: j(t) = min(K, ceil(t·max(1,
    K/R)))."""
    t = np.arange(1, int(loops) + 1)
    if loops >= steps:
        return np.minimum(t, steps)
    return (t * steps + loops - 1) // loops
