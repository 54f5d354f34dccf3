"""Training and evaluation data behind one small interface, for every kind of task the trainer runs.

    TokenData   the token tasks (edit distance, LCS, Sudoku, Countdown; paper Sec. 5.1.1): fixed-length rows
                `inputs`/`targets` [N,T] generated in memory from the config or read from a prepared data folder
    VectorData  in-context learning (Sec. 5.1.2, App. C.2): real-valued prompts sampled on the fly, with the
                dimension / points curriculum
    TextData    language modelling (App. C.3): random windows of a prepared token corpus (`loopformer.text`)

Every source answers `plan(step, B)` with the B row keys of the *global* batch of optimiser step `step` — a pure
function of (data seed, step) — and `fetch(keys, step)` with the rows as tensors. The trainer splits the global
batch over processes and accumulation micro-steps, so resuming needs only the step counter and 2 processes with
batch B/2 see exactly the rows of 1 process with batch B. Token rows are visited in epochs, each a fresh
permutation `default_rng([seed, epoch])`.

Batches are dicts: inputs [B,T] (ids) or [B,T,Din] (reals); targets [B,T] (ids, IGNORE = -100 outside the loss)
or [B,T] reals with `weight` [B,T] marking the supervised positions.
"""

from __future__ import annotations

import functools

import math
import os
from typing import Any, Iterator, Optional

import numpy as np
import torch

from loopformer.errors import UserError
from loopformer.tasks.base import IGNORE
from loopformer.train.config import TaskConfig

TOKEN_TASKS = ("edit_distance", "lcs", "sudoku", "countdown")


# ------------------------------------------------------------------------------------------------- task building
def build_task(name: str, options: dict[str, Any]):
    """The token task `name` with generator `options` (through `loopformer.tasks.get_task` when present)."""
    try:
        from loopformer.tasks import get_task  # type: ignore[attr-defined]
    except ImportError:
        get_task = None
    if get_task is not None:
        return get_task(name, **dict(options))
    import importlib

    classes = {"edit_distance": ("edit_distance", "EditDistanceTask"), "lcs": ("lcs", "LCSTask"),
               "sudoku": ("sudoku", "SudokuTask"), "countdown": ("countdown", "CountdownTask")}
    if name not in classes:
        raise UserError(f"unknown task {name!r}; choose from {', '.join(TOKEN_TASKS + ('icl', 'text'))}")
    mod, cls = classes[name]
    try:
        return getattr(importlib.import_module(f"loopformer.tasks.{mod}"), cls)(**dict(options))
    except TypeError as exc:
        raise UserError(f"bad option for task {name}: {exc}") from None


def _check_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise UserError(f"data directory not found: {path}")


def model_fields(cfg: TaskConfig) -> dict[str, Any]:
    """The ModelConfig fields the task fixes: read-in (vocab_size / input_dim), max_len, causal, read-out."""
    if cfg.name == "text":
        if not cfg.data_dir:
            raise UserError("task text needs task.data_dir (a folder made by `loopformer text prepare`)")
        _check_dir(cfg.data_dir)
        from loopformer.text.dataset import TokenCorpus

        corpus = TokenCorpus(cfg.data_dir)
        return {"vocab_size": corpus.vocab_size, "input_dim": 0, "max_len": cfg.block_size, "causal": True,
                "head": "lm"}
    if cfg.name == "icl":
        task = icl_task(cfg)
        cur = icl_curriculum(cfg, task.n_dims)
        return {"vocab_size": 0, "input_dim": task.token_dim, "max_len": 2 * max(cur.points_end, cur.points_start),
                "causal": True, "head": "regression", "n_out": 1}
    task = TokenData.task_from(cfg)
    return {"vocab_size": task.vocab_size, "input_dim": 0, "max_len": task.seq_len,
            "causal": bool(task.causal) and not cfg.answer_only, "head": "lm"}


# ------------------------------------------------------------------------------------------------- base class
class DataSource:
    kind = "tokens"
    metric = "accuracy"               # the headline metric of result tables
    higher_is_better = True
    n_train: Optional[int] = None     # rows per epoch (None: sampled on the fly)

    def plan(self, step: int, batch_size: int) -> np.ndarray:
        raise NotImplementedError

    def fetch(self, keys: np.ndarray, step: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def test_batches(self, batch_size: int, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
        raise NotImplementedError

    def metrics(self, pred: Any, batch: dict[str, np.ndarray]) -> dict[str, float]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What the checkpoint records under "task"."""
        raise NotImplementedError


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


# ------------------------------------------------------------------------------------------------- token tasks
def hide_answers(batch: dict[str, np.ndarray], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Bidirectional reading of a causal task: the answer tokens (from `answer_start`) are replaced by padding in
    the inputs, so the model must produce them all at once from the prompt; targets are unchanged."""
    if "answer_start" not in batch:
        raise UserError("task.answer_only needs a task with an answer span (edit_distance, lcs, countdown)")
    out = dict(batch)
    inputs = np.array(batch["inputs"], copy=True)
    pos = np.arange(inputs.shape[1])[None, :]
    inputs[pos >= np.asarray(batch["answer_start"])[:, None]] = pad_id
    out["inputs"] = inputs
    return out


class TokenData(DataSource):
    kind = "tokens"

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        if cfg.data_dir:
            _check_dir(cfg.data_dir)
            from loopformer.data import open_dataset  # type: ignore[attr-defined]

            self.task, splits = open_dataset(cfg.data_dir, verify=True)   # checksums and token ids
            self.train, self.test = dict(splits["train"]), dict(splits["test"])
        else:
            self.task = build_task(cfg.name, cfg.options)
            self.train = self.task.generate(cfg.n_train, cfg.seed, "train")
            self.test = self.task.generate(cfg.n_test, cfg.seed, "test")
        if cfg.answer_only:   # the test split now; training rows batch by batch (they may be memory-mapped)
            if "answer_start" not in self.train:
                raise UserError("task.answer_only needs a task with an answer span (edit_distance, lcs, countdown)")
            self.test = hide_answers(self.test, self.task.pad_id)
        self.n_train = len(self.train["inputs"])

    @staticmethod
    def task_from(cfg: TaskConfig):
        if cfg.data_dir:
            _check_dir(cfg.data_dir)
            from loopformer.data import read_manifest

            manifest = read_manifest(cfg.data_dir)
            return build_task(manifest["task"], manifest["options"])
        return build_task(cfg.name, cfg.options)

    def plan(self, step: int, batch_size: int) -> np.ndarray:
        return stream_indices(self.cfg.seed, self.n_train, step * batch_size, batch_size)

    def fetch(self, keys: np.ndarray, step: int) -> dict[str, torch.Tensor]:
        idx = np.asarray(keys, dtype=np.int64)
        rows = {"inputs": np.asarray(self.train["inputs"][idx], dtype=np.int64),           # [b,T]
                "targets": np.asarray(self.train["targets"][idx], dtype=np.int64)}
        if self.cfg.answer_only:
            rows["answer_start"] = np.asarray(self.train["answer_start"][idx])
            rows = hide_answers(rows, self.task.pad_id)
        return {"inputs": torch.from_numpy(rows["inputs"]), "targets": torch.from_numpy(rows["targets"])}

    def test_batches(self, batch_size: int, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
        n = len(self.test["inputs"]) if not limit else min(limit, len(self.test["inputs"]))
        for i in range(0, n, batch_size):
            yield {k: np.asarray(v)[i:min(i + batch_size, n)] for k, v in self.test.items()
                   if np.ndim(v) >= 1 and len(v) == len(self.test["inputs"])}

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        return {k: float(v) for k, v in self.task.metrics(pred, batch).items()}

    def describe(self) -> dict[str, Any]:
        return {"name": self.task.name, "options": _plain(self.task.options()), "data_dir": self.cfg.data_dir,
                "n_train": self.cfg.n_train, "n_test": self.cfg.n_test, "seed": self.cfg.seed,
                "answer_only": self.cfg.answer_only, "metric": self.metric}


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return obj


# ------------------------------------------------------------------------------------------------- language modelling
class TextData(DataSource):
    kind = "text"
    metric = "ppl"
    higher_is_better = False

    def __init__(self, cfg: TaskConfig):
        from loopformer.text.dataset import RandomWindows, TokenCorpus

        if not cfg.data_dir:
            raise UserError("task text needs task.data_dir (a folder made by `loopformer text prepare`)")
        _check_dir(cfg.data_dir)
        self.cfg = cfg
        self.corpus = TokenCorpus(cfg.data_dir)
        self.train_tokens = self.corpus.tokens("train")
        self.eval_split = "val" if "val" in self.corpus.splits else "test"
        self.block = cfg.block_size
        self._windows = RandomWindows(self.train_tokens, self.block, 1, seed=cfg.seed, rank=0)

    def plan(self, step: int, batch_size: int) -> np.ndarray:
        self._windows.batch_size = batch_size
        return self._windows.offsets(step)                  # [B] window starts of the global batch

    def fetch(self, keys: np.ndarray, step: int) -> dict[str, torch.Tensor]:
        T = self.block
        win = np.stack([np.asarray(self.train_tokens[o:o + T + 1]) for o in keys]).astype(np.int64)  # [B,T+1]
        w = torch.from_numpy(win)
        return {"inputs": w[:, :-1], "targets": w[:, 1:]}

    def test_batches(self, batch_size: int, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
        toks = self.corpus.tokens(self.eval_split)
        T = self.block
        n = min(limit or self.cfg.eval_windows, max(0, (len(toks) - 1) // T))
        if n == 0:
            raise UserError(f"the {self.eval_split} split of {self.cfg.data_dir} is shorter than one window")
        for i in range(0, n, batch_size):
            win = np.stack([np.asarray(toks[s * T:s * T + T + 1]) for s in range(i, min(i + batch_size, n))])
            win = win.astype(np.int64)
            yield {"inputs": win[:, :-1], "targets": win[:, 1:]}

    def eval_scope(self, limit: int = 0) -> dict[str, Any]:
        """What `test_batches(…, limit)` covers: the first n non-overlapping windows of the evaluation split, so
        the perplexity computed from them is over those windows only unless `whole_split`."""
        toks = self.corpus.tokens(self.eval_split)
        T = self.block
        total = max(0, (len(toks) - 1) // T)
        n = min(limit or self.cfg.eval_windows, total)
        whole = n == total
        over = (f"{self.eval_split}: all {total:,} non-overlapping {T}-token windows" if whole else
                f"{self.eval_split}: first {n:,} of {total:,} non-overlapping {T}-token windows")
        over += f" ({n * T:,} of {max(0, len(toks) - 1):,} next-token targets)"
        return {"eval_split": self.eval_split, "windows": n, "windows_in_split": total,
                "tokens_in_split": max(0, len(toks) - 1), "whole_split": whole, "ppl_over": over}

    def metrics(self, pred: Any, batch: dict[str, np.ndarray]) -> dict[str, float]:
        raise NotImplementedError  # text metrics come from the summed log-likelihood (see eval.evaluate)

    def describe(self) -> dict[str, Any]:
        return {"name": "text", "data_dir": self.cfg.data_dir, "block_size": self.block, "seed": self.cfg.seed,
                "eval_windows": self.cfg.eval_windows, "metric": self.metric,
                "corpus": {k: self.corpus.manifest.get(k) for k in ("source", "tokenizer", "vocab_size")}}


# ------------------------------------------------------------------------------------------------- in-context learning
def icl_task(cfg: TaskConfig):
    from loopformer.tasks.icl import ICLTask

    try:
        return ICLTask(**dict(cfg.options))
    except TypeError as exc:
        raise UserError(f"bad option for task icl: {exc}") from None


def icl_curriculum(cfg: TaskConfig, n_dims: int):
    """The dims / points curriculum (App. C.2); without one, all dims and `points` points from the start."""
    from loopformer.tasks.icl import Curriculum

    fields = dict(cfg.curriculum)
    if not fields:
        fields = {"dims_start": n_dims, "dims_end": n_dims, "points_start": cfg.points, "points_end": cfg.points}
    try:
        cur = Curriculum(**fields)
    except (TypeError, ValueError) as exc:
        raise UserError(f"task.curriculum: {exc}") from None
    if cur.dims_end > n_dims:
        raise UserError(f"task.curriculum.dims_end={cur.dims_end} exceeds n_dims={n_dims}")
    return cur


class VectorData(DataSource):
    """In-context learning prompts, sampled per step from `default_rng([seed, 0, step])` (the global batch), with
    the curriculum of Garg et al.; the test set is fixed: `n_test` prompts at the final dims and points."""

    kind = "vector"
    metric = "mse"
    higher_is_better = False

    def __init__(self, cfg: TaskConfig):
        from loopformer.tasks.icl import interleave

        self.cfg = cfg
        self.task = icl_task(cfg)
        self.curriculum = icl_curriculum(cfg, self.task.n_dims)
        self._interleave = interleave
        self._cache: tuple[int, int, dict[str, torch.Tensor]] | None = None
        rng = np.random.default_rng([cfg.seed, 1])
        s = self.task.sample(cfg.n_test, rng, self.curriculum.dims_end, self.curriculum.points_end)
        self.test = self._format(s["xs"], s["ys"])
        self.error_scale = float(self.curriculum.dims_end)     # squared error / d (Garg et al.)

    def _format(self, xs: np.ndarray, ys: np.ndarray) -> dict[str, np.ndarray]:
        zs, pos = self._interleave(xs, ys)                                   # [B,2n,d+1], [n]
        targets = np.zeros(zs.shape[:2], dtype=np.float32)                   # [B,2n]
        weight = np.zeros(zs.shape[:2], dtype=np.float32)
        targets[:, pos] = ys
        weight[:, pos] = 1.0
        return {"inputs": zs.astype(np.float32), "targets": targets, "weight": weight}

    def plan(self, step: int, batch_size: int) -> np.ndarray:
        return np.arange(batch_size, dtype=np.int64) + (int(batch_size) << 32)   # row ids (batch size folded in)

    def fetch(self, keys: np.ndarray, step: int) -> dict[str, torch.Tensor]:
        B = int(keys[0]) >> 32
        if self._cache is None or self._cache[:2] != (step, B):
            dims, points = self.curriculum.at(step)
            rng = np.random.default_rng([self.cfg.seed, 0, step])
            s = self.task.sample(B, rng, dims, points)
            batch = {k: torch.from_numpy(v) for k, v in self._format(s["xs"], s["ys"]).items()}
            self._cache = (step, B, batch)
        rows = torch.from_numpy(np.asarray(keys, dtype=np.int64) & 0xFFFFFFFF)
        return {k: v[rows] for k, v in self._cache[2].items()}

    def test_batches(self, batch_size: int, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
        n = len(self.test["inputs"]) if not limit else min(limit, len(self.test["inputs"]))
        for i in range(0, n, batch_size):
            yield {k: v[i:min(i + batch_size, n)] for k, v in self.test.items()}

    def describe(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"name": "icl", "options": _plain(self.task.options()), "curriculum": asdict(self.curriculum),
                "n_test": self.cfg.n_test, "seed": self.cfg.seed, "metric": self.metric}


def make_data(cfg: TaskConfig) -> DataSource:
    if cfg.name == "text":
        return TextData(cfg)
    if cfg.name == "icl":
        return VectorData(cfg)
    return TokenData(cfg)


def steps_for(cfg_steps: int, epochs: float, n_train: Optional[int], batch_size: int) -> int:
    """Optimiser steps: `steps` if set, else `epochs` passes over n_train rows."""
    if cfg_steps:
        return cfg_steps
    if n_train is None:
        raise UserError("this task samples data on the fly: set train.steps instead of train.epochs")
    return max(1, math.ceil(epochs * n_train / batch_size))


__all__ = ["DataSource", "TokenData", "TextData", "VectorData", "make_data", "model_fields", "build_task",
           "stream_indices",
           "hide_answers", "steps_for", "IGNORE", "TOKEN_TASKS"]
