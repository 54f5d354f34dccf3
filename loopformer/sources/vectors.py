"""In-context learning (paper Sec. 5.1.2, App. C.2): real-valued prompts sampled on the fly, with the dimension /
points curriculum of Garg et al. Evaluation: the squared error / d of the read-out at the supervised positions per
loop → 'mse' (mean over positions) and 'mse_last' (the last position).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from loopformer.errors import UserError
from loopformer.sources.base import DataSource, TaskConfig, plain
from loopformer.tasks.icl import Curriculum, ICLTask, baseline_curves, interleave


def icl_task(cfg: TaskConfig) -> ICLTask:
    try:
        return ICLTask(**dict(cfg.options))
    except TypeError as exc:
        raise UserError(f"bad option for task icl: {exc}") from None


def icl_curriculum(cfg: TaskConfig, n_dims: int) -> Curriculum:
    """The dims / points curriculum (App. C.2); without one, all dims and `points` points from the start."""
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
    classifies = False

    @classmethod
    def handles(cls, name: str) -> bool:
        return name == ICLTask.name

    @classmethod
    def choices(cls) -> list[str]:
        return [ICLTask.name]

    @classmethod
    def model_fields(cls, cfg: TaskConfig) -> dict[str, Any]:
        task = icl_task(cfg)
        cur = icl_curriculum(cfg, task.n_dims)
        return {"vocab_size": 0, "input_dim": task.token_dim, "max_len": 2 * max(cur.points_end, cur.points_start),
                "causal": True, "head": "regression", "n_out": 1}

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.task = icl_task(cfg)
        self.curriculum = icl_curriculum(cfg, self.task.n_dims)
        self._cache: tuple[int, int, dict[str, torch.Tensor]] | None = None
        rng = np.random.default_rng([cfg.seed, 1])
        s = self.task.sample(cfg.n_test, rng, self.curriculum.dims_end, self.curriculum.points_end)
        self.test = self._format(s["xs"], s["ys"])
        self.error_scale = float(self.curriculum.dims_end)     # squared error / d (Garg et al.)

    @staticmethod
    def _format(xs: np.ndarray, ys: np.ndarray) -> dict[str, np.ndarray]:
        zs, pos = interleave(xs, ys)                                         # [B,2n,d+1], [n]
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

    def as_tensors(self, batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(np.asarray(batch[k], dtype=np.float32), device=device)
                for k in ("inputs", "targets", "weight")}

    def counted(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["weight"] > 0                                                         # the prediction positions

    def score(self, read_outs: torch.Tensor, batch: dict[str, np.ndarray]) -> tuple:
        b = self.as_tensors(batch, read_outs.device)
        y, w = b["targets"], b["weight"]                                                  # [b,T], [b,T]
        err = (read_outs.float()[..., 0] - y) ** 2 * w                                    # [R,b,T]
        last_pos = int(torch.nonzero(w[0]).max())
        return (err.sum(dim=(1, 2)).cpu().numpy(), err[:, :, last_pos].sum(1).cpu().numpy(), y.shape[0],
                float(w.sum()))

    def summarize(self, parts: list, limit: int, trained_loops: int) -> list[dict[str, float]]:
        n_loops = len(parts[0][0])
        sq, last, rows, count = np.zeros(n_loops), np.zeros(n_loops), 0, 0.0
        for p_sq, p_last, p_rows, p_count in parts:
            sq += p_sq
            last += p_last
            count += p_count
            rows += p_rows
        scale = self.error_scale
        return [{"mse": sq[t] / max(count, 1.0) / scale, "mse_last": last[t] / max(rows, 1) / scale}
                for t in range(n_loops)]

    def references(self) -> dict[str, dict[str, float]]:
        """The reference predictors on the same test prompts, scored like the model ("mse", "mse_last"): predicting
        0, least squares, 3-nearest neighbours, and for decision trees a fitted tree (`loopformer.tasks.icl`)."""
        rng = np.random.default_rng([self.cfg.seed, 1])          # the test split's draw (see __init__)
        s = self.task.sample(self.cfg.n_test, rng, self.curriculum.dims_end, self.curriculum.points_end)
        names = ["zero", "least_squares", "knn"] + (["decision_tree"] if self.task.function_class == "decision_tree"
                                                     else [])
        curves = baseline_curves(s["xs"], s["ys"], self.curriculum.dims_end, names)
        return {k: {"mse": float(c.mean()), "mse_last": float(c[-1])} for k, c in curves.items()}

    def describe(self) -> dict[str, Any]:
        return {"name": "icl", "options": plain(self.task.options()), "curriculum": asdict(self.curriculum),
                "n_test": self.cfg.n_test, "seed": self.cfg.seed, "metric": self.metric}


__all__ = ["VectorData", "icl_task", "icl_curriculum"]
