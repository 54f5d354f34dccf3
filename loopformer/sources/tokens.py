"""Token tasks (edit distance, LCS, Sudoku, Countdown and any task registered in `loopformer.tasks.TASKS`; paper
Sec. 5.1.1): fixed-length rows `inputs` / `targets` [N,T] generated in memory from the config or read from a
prepared data folder (`loopformer.data`), visited in epochs, each a fresh permutation `default_rng([seed, epoch])`.
Scoring: argmax predictions [R,N,T] → the task's metrics per loop (headline: exact-match 'accuracy'); for tasks
with intermediate states also `step_accuracy`, loop t against the state after step j(t) it is trained on with
`task.loop_targets` (`loopformer.tasks.common.loop_steps`; past the trained r, the answer), the task's own
`step_metrics` beside it, and at r their means over loops 1..r (`loops_` prefix). `test_rows` and
`metrics` serve evaluation's other loops (adaptive depth, voting, halting across steps: `loopformer.eval`).
Tasks with symmetries (Sudoku): `augment` draws training rows under random symmetries, a pure function of
(seed, step, row key), so any process count and a resumed run see the same bytes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from loopformer.data.dataset import open_dataset, read_manifest
from loopformer.errors import UserError
from loopformer.sources.base import DataSource, TaskConfig, check_dir, eval_rows, plain, stream_indices
from loopformer.tasks import IGNORE, TASKS, TokenTask, get_task, task_options
from loopformer.tasks.common import exact_match, loop_steps

NO_SPAN = ("task.answer_only and task.full_output need a task with an answer span (edit_distance, lcs, countdown, "
           "parity, copy, addition, binary_sum)")


def hide_answers(batch: dict[str, np.ndarray], pad_id: int = 0) -> dict[str, np.ndarray]:
    """`task.answer_only` / `task.full_output`: the answer tokens (from `answer_start`) are replaced by padding in
    the inputs, so the model must produce them all at once from the prompt; targets are unchanged (position i
    still predicts the token after it: the blank before an answer token is where that token is read)."""
    if "answer_start" not in batch:
        raise UserError(NO_SPAN)
    out = dict(batch)
    inputs = np.array(batch["inputs"], copy=True)
    pos = np.arange(inputs.shape[1])[None, :]
    inputs[pos >= np.asarray(batch["answer_start"])[:, None]] = pad_id
    out["inputs"] = inputs
    return out


class TokenData(DataSource):
    kind = "tokens"

    @classmethod
    def handles(cls, name: str) -> bool:
        return name in TASKS

    @classmethod
    def choices(cls) -> list[str]:
        return list(TASKS)

    @staticmethod
    def task_from(cfg: TaskConfig) -> TokenTask:
        """The task of `cfg`: the one a data folder's manifest names, or `name` with `options`."""
        if cfg.data_dir:
            check_dir(cfg.data_dir)
            manifest = read_manifest(cfg.data_dir)
            return get_task(manifest["task"], **dict(manifest["options"]))
        return get_task(cfg.name, **dict(cfg.options))

    @classmethod
    def model_fields(cls, cfg: TaskConfig) -> dict[str, Any]:
        task = cls.task_from(cfg)
        fields = {"vocab_size": task.vocab_size, "input_dim": 0, "max_len": task.seq_len,
                  "causal": bool(task.causal) and not cfg.answer_only, "head": "lm"}
        if cfg.full_output and not task.causal:
            raise UserError(f"task.full_output keeps a causal task's mask; the {task.name} task is not causal "
                            "(its inputs hold no answer to hide)")
        if cfg.position_factors:
            factors = task.position_factors()
            if factors is None:
                raise UserError(f"task.position_factors: the {task.name} task has no position factors "
                                "(Sudoku has: row, column, box)")
            fields["pos_factors"] = factors
        return fields

    @classmethod
    def epoch_rows(cls, cfg: TaskConfig) -> int | None:
        return cfg.n_train

    @classmethod
    def task_name(cls, cfg: TaskConfig) -> str:
        return cls.task_from(cfg).name

    def validation(self) -> TokenData:
        """A copy of this source whose test rows are its validation rows (`task.n_val`): what `train.select.keep_best`
        scores."""
        if self.val is None:
            raise UserError("train.select.keep_best selects by a validation split: set task.n_val (rows of the "
                            "task's own val stream)" + ("; a data folder holds train and test only: generate the task "
                                                        "in memory" if self.cfg.data_dir else ""))
        other = copy.copy(self)
        other.test = self.val
        if self.cfg.hides_answers:
            other.test = hide_answers(self.val, self.task.pad_id)
        return other

    def at_length(self, n: int, rows: int) -> tuple[TokenData, TaskConfig]:
        """The task regenerated with option length = n (and min_length 0: every row of size n): `rows` test rows of
        the run's data seed (disjoint from its training rows: the split is a hash of the row); one training row."""
        options = dict(self.task.options())
        if "length" not in options:
            raise UserError(f"the {self.task.name} task has no length option to vary (tasks with one: "
                            f"{', '.join(k for k, c in TASKS.items() if 'length' in task_options(k))})")
        options["length"] = int(n)
        if "min_length" in options:
            options["min_length"] = 0
        if options.get("scan") is True:          # no per-loop targets at other lengths: no intermediate states
            options["scan"] = False              # (parity, copy; the word problem's scan names its kind: kept)
            if options.get("scan_every"):
                options["scan_every"] = False
        cfg = dataclasses.replace(self.cfg, name=self.task.name, options=options, data_dir=None, n_train=1,
                                  n_test=int(rows), n_val=0, loop_targets=False, augment=False, length_start=0)
        try:
            return TokenData(cfg), cfg
        except UserError as exc:
            raise UserError(f"length {n}: {exc}") from None

    def largest_size(self) -> int | None:
        if "size" not in self.train or "size" not in self.test:
            return None
        return max(int(np.max(self.train["size"])), int(np.max(self.test["size"])))

    def max_input_id(self) -> int | None:
        return int(np.max(self.test["inputs"])) if len(self.test["inputs"]) else None

    def intermediate_steps(self) -> int | None:
        return int(self.train["step_targets"].shape[1]) if "step_targets" in self.train else None

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        if cfg.data_dir:
            check_dir(cfg.data_dir)
            self.task, splits = open_dataset(cfg.data_dir, verify=True)   # checksums and token ids
            self.train, self.test = dict(splits["train"]), dict(splits["test"])
            self.val = None                                              # data folders: train and test only
        else:
            self.task = get_task(cfg.name, **dict(cfg.options))
            self.train = self.task.generate(cfg.n_train, cfg.seed, "train")
            self.test = self.task.generate(cfg.n_test, cfg.seed, "test")
            self.val = self.task.generate(cfg.n_val, cfg.seed, "val") if cfg.n_val else None
        if cfg.hides_answers:   # the test split now; training rows batch by batch (memory-mapped)
            if "answer_start" not in self.train:
                raise UserError(NO_SPAN)
            self.test = hide_answers(self.test, self.task.pad_id)
        if cfg.loop_targets and "step_targets" not in self.train:
            raise UserError(f"task.loop_targets: the {self.task.name} task has no intermediate states "
                            "(step_targets; e.g. word_problem, pointer_chase, schedule; parity and copy with "
                            "task.options.scan=true)")
        if cfg.augment and not self.task.augments:
            raise UserError(f"task.augment: the {self.task.name} task defines no augmentation")
        self.n_train = len(self.train["inputs"])
        self.size_order = None        # a length curriculum's (rows sorted by size, their sizes)
        if cfg.length_start:
            if "size" not in self.train:
                sized = ", ".join(k for k in TASKS if "min_length" in task_options(k))
                raise UserError(f"task.length_start: the {self.task.name} task's rows record no size (tasks that do: "
                                f"{sized})")
            sizes = np.asarray(self.train["size"])
            order = np.argsort(sizes, kind="stable")
            self.size_order = (order, sizes[order])
            if cfg.length_start < int(sizes.min()):
                raise UserError(f"task.length_start={cfg.length_start} is below the smallest training size "
                                f"{int(sizes.min())}: no row to start with")
        for split, rows in (("train", self.n_train), ("test", len(self.test["inputs"]))):
            if rows == 0:
                raise UserError(f"{cfg.data_dir or 'the task'} holds no {split} rows: nothing to train on or score "
                                f"(write the dataset with --{split} N, N >= 1)")

    def plan(self, step: int, batch_size: int) -> np.ndarray:
        """The training rows of step `step`: the data seed's stream over all rows, or with a length curriculum
        (`task.length_start`) over the rows of size <= the step's largest (`curriculum_size`), sorted by size."""
        largest = self.curriculum_size(step)
        if largest is None:
            return stream_indices(self.cfg.seed, self.n_train, step * batch_size, batch_size)
        allowed = int(np.searchsorted(self.size_order[1], largest, side="right"))
        return self.size_order[0][stream_indices(self.cfg.seed, allowed, step * batch_size, batch_size)]

    def curriculum_size(self, step: int) -> int | None:
        """The largest size a length curriculum admits at step `step` (None: no curriculum, or every size by now)."""
        c = self.cfg
        if not c.length_start or self.size_order is None:
            return None
        largest = c.length_start + (step // c.length_every) * c.length_increment
        return None if largest >= self.size_order[1][-1] else largest

    def fetch(self, keys: np.ndarray, step: int) -> dict[str, torch.Tensor]:
        idx = np.asarray(keys, dtype=np.int64)
        rows = {"inputs": np.asarray(self.train["inputs"][idx], dtype=np.int64),           # [b,T]
                "targets": np.asarray(self.train["targets"][idx], dtype=np.int64)}
        if self.cfg.hides_answers:
            rows["answer_start"] = np.asarray(self.train["answer_start"][idx])
            rows = hide_answers(rows, self.task.pad_id)
        if self.cfg.augment:
            rows = self.augment_rows(rows, idx, step)
        out = {"inputs": torch.from_numpy(rows["inputs"]), "targets": torch.from_numpy(rows["targets"])}
        if "size" in self.train:                                                         # [b] the rows' sizes n
            out["size"] = torch.from_numpy(np.asarray(self.train["size"][idx], dtype=np.int64))
        if self.cfg.loop_targets:
            out["step_targets"] = torch.from_numpy(np.asarray(self.train["step_targets"][idx], dtype=np.int64))
        return out

    def augment_rows(self, rows: dict[str, np.ndarray], keys: np.ndarray, step: int) -> dict[str, np.ndarray]:
        """Each row under its own random symmetry, drawn from (data seed, step, row key) alone."""
        out = [self.task.augment({k: v[i:i + 1] for k, v in rows.items()},
                                 np.random.default_rng([self.cfg.seed, int(step), int(key), 0xA6]))
               for i, key in enumerate(keys)]
        return {k: np.concatenate([o[k] for o in out]).astype(rows[k].dtype) for k in rows}

    def test_rows(self, limit: int = 0) -> dict[str, np.ndarray]:
        """The first `limit` test rows (0: all) as one batch."""
        return next(self.test_batches(len(self.test["inputs"]), limit))

    def test_batches(self, batch_size: int, limit: int = 0) -> Iterator[dict[str, np.ndarray]]:
        n = len(self.test["inputs"]) if not limit else min(limit, len(self.test["inputs"]))
        for i in range(0, n, batch_size):
            yield {k: np.asarray(v)[i:min(i + batch_size, n)] for k, v in self.test.items()
                   if np.ndim(v) >= 1 and len(v) == len(self.test["inputs"])}

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        return {k: float(v) for k, v in self.task.metrics(pred, batch).items()}

    def counted(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["targets"] != IGNORE                                                  # the supervised positions

    def content(self, x: torch.Tensor) -> torch.Tensor:
        return x != self.task.pad_id

    def check_votes(self) -> None:
        if not self.task.votes:
            raise UserError(f"test-time voting: the {self.task.name} task defines no symmetries")

    def views(self, inputs: np.ndarray, copies: int, seed: int) -> tuple[np.ndarray, Any]:
        self.check_votes()
        return self.task.views(inputs, copies, seed=seed)

    def unview(self, pred: np.ndarray, sym: Any, prob: np.ndarray) -> np.ndarray:
        return self.task.unview(pred, sym, prob)

    def eval_batches(self, batch_size: int, limit: int, read_outs: int, out_dim: int
                     ) -> Iterator[dict[str, np.ndarray]]:
        rows = self.test_rows(limit)
        n, T = rows["inputs"].shape
        step = eval_rows(batch_size, read_outs, T, out_dim)
        for i in range(0, n, step):
            yield {k: v[i:i + step] for k, v in rows.items()}

    def score(self, read_outs: torch.Tensor, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        return read_outs.argmax(-1).cpu().numpy(), batch                                   # [R,b,T] predictions

    def summarize(self, parts: list, limit: int, trained_loops: int) -> list[dict[str, float]]:
        pred = np.concatenate([p for p, _ in parts], axis=1)                               # [R,N,T]
        full = {k: np.concatenate([b[k] for _, b in parts]) for k in parts[0][1]}
        out = [self.metrics(pred[t], full) for t in range(pred.shape[0])]
        if "step_targets" in full and len(out) > 1:   # intermediate states: loop t against the state it learns
            steps = full["step_targets"]                                                  # [N,K,T]
            j = loop_steps(trained_loops, steps.shape[1])                                # [r]: 1..K
            for t, m in enumerate(out):
                state = steps[:, (j[t] if t < len(j) else j[-1]) - 1]                     # [N,T]
                m["step_accuracy"] = float(exact_match(pred[t], state).mean())
                m.update(self.task.step_metrics(pred[t], state))                          # the task's own, if any
            if 1 < trained_loops <= len(out):        # the task's step metrics averaged over loops 1..r, at r
                for k in self.task.step_metrics(pred[0][:0], steps[:0, 0]):
                    out[trained_loops - 1][f"loops_{k}"] = float(np.mean([m[k] for m in out[:trained_loops]]))
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": self.task.name, "options": plain(self.task.options()), "data_dir": self.cfg.data_dir,
                "n_train": self.n_train, "n_test": len(self.test["inputs"]), "seed": self.cfg.seed,
                "answer_only": self.cfg.answer_only, "full_output": self.cfg.full_output, "augment": self.cfg.augment,
                "loop_targets": self.cfg.loop_targets,
                "metric": self.metric}


__all__ = ["TokenData", "hide_answers"]
