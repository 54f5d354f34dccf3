"""What every data source answers, and the task section of a run config.

A data source is one kind of task (token task, vector task, text corpus) seen by training and evaluation:

    model_fields(cfg)   (class) the ModelConfig fields the task fixes: read-in, max_len, causality, read-out
    epoch_rows(cfg)     (class) rows per epoch as far as the config tells (None: sampled on the fly)
    task_name(cfg)      (class) the task's name (a data folder's: from its manifest)
    plan(step, B)       the B row keys of the *global* batch of optimiser step `step`: a pure function of
                        (data seed, step), so resuming needs only the step and 2 processes with batch B/2 see
                        exactly the rows of 1 process with batch B
    fetch(keys, step)   those rows as tensors
    test_batches(B, n)  the test split (its first n rows; 0: all) in batches of numpy arrays
    eval_batches(...)   the same in the batches evaluation runs (rows per forward bounded by the read-outs' size)
    score(outs, batch)  a batch's share of the metrics from the model's read-outs [R,b,T,C] (the scoring hook:
                        `loopformer.eval` runs the model, a source never does)
    summarize(parts)    the metrics after each read-out from the batches' scores
    counted(batch)      the positions of a batch whose read-outs count (adaptive depth counts their exit loops)
    content(x)          the input positions that are not padding (halting across supervision steps; token tasks)
    views / unview      symmetric copies of test rows and their predictions mapped back (voting; token tasks)
    metrics(pred, b)    the metrics of predicted class ids (sources that classify)
    references()        reference predictors' metrics on the test split (e.g. least squares for regression)
    describe()          what checkpoints and results record under "task"

Batches are dicts: inputs [B,T] (ids) or [B,T,Din] (reals); targets [B,T] (ids, IGNORE outside the loss) or [B,T]
reals with `weight` [B,T] marking the supervised positions; with `task.loop_targets` also step_targets [B,K,T], the
targets after each of the task's K sequential steps.
Shapes: B batch, T length, R loops, C classes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from loopformer.errors import UserError


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass
class TaskConfig:
    """Which data to train on. Either `data_dir` (a folder written by `loopformer data gen` / `text prepare`) or
    the task generated in memory from `name`, `options`, `n_train`, `n_test` and `seed`."""

    name: str = "lcs"                 # a token task (edit_distance | lcs | sudoku | countdown) | icl | text
    options: dict[str, Any] = field(default_factory=dict)   # generator options, e.g. {length: 60}
    data_dir: str | None = None
    n_train: int = 10000
    n_test: int = 1000
    n_val: int = 0                    # validation rows (token tasks, from the task's own `val` stream, disjoint from
                                      # train and test); what train.select.keep_best selects by
    seed: int = 0                     # data seed (independent of the model seed)
    answer_only: bool = False         # causal pair tasks read by a bidirectional model: hide the answer tokens
                                      # from the input and supervise only the answer position
    full_output: bool = False         # causal tasks: hide the answer tokens from the input (blanks) and keep the
                                      # causal mask, so every answer token is produced at once after the loops
                                      # (Fan et al.'s full-output prediction; answer_only without its bidirectional
                                      # reading)
    augment: bool = False             # training rows under the task's random symmetries (tasks that define them,
                                      # e.g. Sudoku), drawn from (seed, step, row): resuming stays exact
    position_factors: bool = False    # tasks on a grid (Sudoku): the model also learns an embedding of each
                                      # position's row, column and box (model.pos_factors, from the task)
    loop_targets: bool = False        # tasks with intermediate states (word_problem, pointer_chase, schedule):
                                      # loop t of the loss is supervised with the state after step j(t) instead of
                                      # the answer (loopformer.tasks.common.loop_steps; needs train.losses.loops all
                                      # or window)
    length_start: int = 0             # a length curriculum (tasks whose rows record a size n): train on rows of size
                                      # <= length_start first (0: off) ...
    length_every: int = 100           # ... and admit length_increment larger sizes every length_every steps
    length_increment: int = 1
    block_size: int = 256             # text: tokens per training window
    eval_windows: int = 64            # text: validation windows per evaluation
    points: int = 41                  # icl: in-context examples per prompt (without a curriculum)
    curriculum: dict[str, Any] = field(default_factory=dict)  # icl: the dims / points curriculum fields

    def __post_init__(self) -> None:
        _need(bool(self.name), "task.name must be set")
        _need(self.n_train >= 1 and self.n_test >= 1, "task.n_train and task.n_test must be >= 1")
        _need(self.n_val >= 0, f"task.n_val must be >= 0 (got {self.n_val})")
        _need(0 <= self.seed < 2 ** 63, f"task.seed must be in [0, 2^63) (got {self.seed})")
        _need(self.length_start >= 0 and self.length_every >= 1 and self.length_increment >= 1,
              "task.length_start must be >= 0, task.length_every and task.length_increment >= 1")
        _need(self.block_size >= 2, "task.block_size must be >= 2")
        _need(self.eval_windows >= 1, "task.eval_windows must be >= 1")
        _need(self.points >= 1, "task.points must be >= 1")
        _need(not (self.answer_only and self.full_output), "task.answer_only (a bidirectional reading) and "
              "task.full_output (the causal mask kept) exclude each other: choose one")

    @property
    def hides_answers(self) -> bool:
        """Whether the answer's tokens are blanks in the inputs (`answer_only` or `full_output`)."""
        return self.answer_only or self.full_output


class DataSource:
    """The base class of the data sources (see the module docstring)."""

    kind = "tokens"
    metric = "accuracy"               # the headline metric of result tables
    higher_is_better = True
    classifies = True                 # targets are token ids: training logs the accuracy of the argmax
    n_train: int | None = None     # rows per epoch (None: sampled on the fly)

    @classmethod
    def handles(cls, name: str) -> bool:
        """Whether `task.name` names a task of this kind."""
        raise NotImplementedError

    @classmethod
    def choices(cls) -> list[str]:
        """The task names of this kind (for messages)."""
        raise NotImplementedError

    @classmethod
    def model_fields(cls, cfg: TaskConfig) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def epoch_rows(cls, cfg: TaskConfig) -> int | None:
        return None

    @classmethod
    def task_name(cls, cfg: TaskConfig) -> str:
        """The name of the task `cfg` serves (for a data folder: the one its manifest names)."""
        return cfg.name

    def validation(self) -> DataSource:
        """This source with its validation rows in place of its test rows (what `train.select.keep_best` scores)."""
        raise UserError(f"train.select.keep_best selects by a validation split; the {self.cfg.name} data has none")

    def at_length(self, n: int, rows: int) -> tuple[DataSource, TaskConfig]:
        """A source whose `rows` test rows all have size n (`loopformer eval --lengths`), and its task section."""
        raise UserError(f"the {self.cfg.name} data cannot be made at another length")

    def largest_size(self) -> int | None:
        """The largest size n of a training or test row (tasks whose rows record one, `size`); None otherwise."""
        return None

    def max_input_id(self) -> int | None:
        """The largest token id in the test split's inputs (None: the inputs are not token ids)."""
        return None

    def intermediate_steps(self) -> int | None:
        """K, the intermediate states each training row carries (step_targets [N,K,T], per-loop targets); None
        without them."""
        return None

    def plan(self, step: int, batch_size: int) -> np.ndarray:
        raise NotImplementedError

    def fetch(self, keys: np.ndarray, step: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def test_batches(self, batch_size: int, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
        raise NotImplementedError

    def as_tensors(self, batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
        """A test batch as model inputs on `device`: inputs, targets (and weight)."""
        return {"inputs": torch.as_tensor(np.asarray(batch["inputs"], dtype=np.int64), device=device),
                "targets": torch.as_tensor(np.asarray(batch["targets"], dtype=np.int64), device=device)}

    def eval_batches(self, batch_size: int, limit: int, read_outs: int, out_dim: int
                     ) -> Iterator[dict[str, np.ndarray]]:
        """The test split (its first `limit` rows) in the batches evaluation runs through the model: each one forward
        keeping `read_outs` read-outs of `out_dim` outputs (default: `test_batches(batch_size, limit)`)."""
        return self.test_batches(batch_size, limit)

    def score(self, read_outs: torch.Tensor, batch: dict[str, np.ndarray]) -> Any:
        """One evaluation batch's share of the metrics, from the model's read-outs [R,b,T,C] on it (R = 1: the last
        loop only). Evaluation (`loopformer.eval`) runs the model; the source only scores."""
        raise NotImplementedError

    def summarize(self, parts: list, limit: int, trained_loops: int) -> list[dict[str, float]]:
        """The metrics after each read-out, from every batch's `score` (in order)."""
        raise NotImplementedError

    def counted(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The positions [b,T] of a batch (`as_tensors`) whose read-outs the metrics count (default: every one):
        adaptive depth reports the exit loops there and halts rows by their criterion there."""
        return torch.ones_like(batch["targets"], dtype=torch.bool)

    def content(self, x: torch.Tensor) -> torch.Tensor:
        """The input positions [b,T] of x that hold content, not padding: a row's stop probability is their mean
        (halting across supervision steps). Only sources that pad say so."""
        raise UserError(f"halting across supervision steps is measured on token tasks (this is {self.kind} data)")

    def check_votes(self) -> None:
        """A UserError unless test-time voting (`views`) is defined for this data (checked before training)."""
        raise UserError(f"test-time voting needs a token task with symmetries (this is {self.kind} data)")

    def views(self, inputs: np.ndarray, copies: int, seed: int) -> tuple[np.ndarray, Any]:
        """Test-time augmentation: every row of inputs [b,T] and `copies` symmetric copies of it [1+K,b,T], with
        the symmetries drawn (`unview` maps predictions back). Only tasks with symmetries have them."""
        self.check_votes()
        raise UserError(f"test-time voting needs a token task with symmetries (this is {self.kind} data)")

    def unview(self, pred: np.ndarray, sym: Any, prob: np.ndarray) -> np.ndarray:
        """The per-cell vote [b,T] over the predictions on `views` [1+K,b,T] mapped back, weighted by `prob`."""
        raise UserError(f"test-time voting needs a token task with symmetries (this is {self.kind} data)")

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """The metrics of predicted class ids [N,T] on the test rows `batch` (sources that score predictions)."""
        raise UserError(f"{self.kind} data is scored from the model's read-outs, not from predicted classes")

    def references(self) -> dict[str, dict[str, float]]:
        """Reference predictors scored on the test split like the model ({name: metrics}; none by default):
        results.json records them next to the model's metrics."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What the checkpoint records under "task"."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------- shared pieces
def check_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise UserError(f"data directory not found: {path}")


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(n)
    order.flags.writeable = False     # shared by every caller through the cache
    return order


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The row order of one epoch: a pure function of (seed, epoch, n), cached because every step reads it."""
    return _epoch_order(int(seed), int(epoch), int(n))


def stream_indices(seed: int, n: int, start: int, count: int) -> np.ndarray:
    """Rows start .. start+count-1 of the endless stream of epochs (each a fresh permutation of n rows)."""
    out = np.empty(count, dtype=np.int64)
    pos, filled = start, 0
    while filled < count:
        epoch, off = divmod(pos, n)
        take = min(count - filled, n - off)
        out[filled:filled + take] = epoch_order(seed, epoch, n)[off:off + take]
        filled += take
        pos += take
    return out


def plain(obj: Any) -> Any:
    """`obj` with numpy scalars as Python numbers (for JSON)."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return obj


def eval_rows(requested: int, loops: int, T: int, C: int, budget: float = 1.5e8) -> int:
    """Rows per forward so the per-loop logits [R,B,T,C] stay within `budget` elements."""
    return int(max(1, min(requested, budget // max(1, loops * T * C))))


__all__ = ["TaskConfig", "DataSource", "check_dir", "epoch_order", "stream_indices", "plain", "eval_rows"]
