"""Keeping the best weights a run has seen (`train.select.keep_best`): early stopping by a validation split.

Deep loops often learn a task and then lose it: a gradient spike late in training throws a solved model out of its
basin (docs/stability.md: training accuracy 99.97 % at step 2,800, chance from step 3,050 on). With
`train.select.keep_best` the run scores its weights on a validation split — rows of the task's own `val` stream
(`task.n_val`), disjoint from the training and test rows by the split hash — at every periodic evaluation
(`train.eval_every`) and at the end, and keeps a copy of the best-scoring weights (the headline metric at r; ties keep
the earlier). With `train.select.keep_best_depth=trained` the score is the worst of that metric over loops r..R, R the
deepest loop count the run draws past r (`train.loops.hold`, `train.loops.sample`): the weights kept are those that
hold the answer over every loop count they were trained on, not the ones right at r that drift by R (a run that
learns the task first and the hold later would otherwise keep its weights from before the hold); equal scores —
weights that hold equally, or not at all — are told apart by the metric at r. At the end the
model takes the kept weights before its final evaluation and checkpoint, so results.json, `eval` and `generate` see
the selected model; results.json's "keep_best" records the step it came from, its validation score, and the last
step's test metrics beside it. The test split never chooses.

The copy is part of the checkpoint (`best.safetensors` beside the weights, its step and score in the training
state): a resumed run selects exactly as the uninterrupted one. Not with sharded training (the copy would be the
full model on one process).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loopformer.errors import UserError

BEST_WEIGHTS = "best.safetensors"


def held_score(result: dict) -> float:
    """The worst of a loop-wise evaluation's headline metric over loops r..R (`train.select.keep_best_depth=trained`):
    weights score by the loop count at which they are furthest from the answer, so a model right at r that drifts
    by R scores its drift. `result`: `evaluate_all`'s, loop-wise to R = result["max_loops"]."""
    metric, r = result["metric"], result["loops"]
    values = [float(p[metric]) for p in result["loopwise"] if p["loop"] >= r] or [float(result["metrics"][metric])]
    return min(values) if result["higher_is_better"] else max(values)


class BestKeeper:
    """The best validation score so far, its step and a CPU copy of its weights."""

    def __init__(self, higher_is_better: bool = True):
        self.higher = higher_is_better
        self.score: float | None = None
        self.tie: float | None = None          # the score's tie-break (keep_best_depth=trained: the metric at r)
        self.step: int | None = None
        self.weights: dict[str, torch.Tensor] | None = None

    def better(self, score: float, tie: float | None = None) -> bool:
        """Whether `score` beats the best so far (a NaN never does; the first finite score always does); an equal
        score wins on a better `tie` when both have one."""
        if score != score:                                    # NaN
            return False
        if self.score is None:
            return True
        if score == self.score and tie is not None and self.tie is not None and tie == tie:
            return tie > self.tie if self.higher else tie < self.tie
        return score > self.score if self.higher else score < self.score

    def offer(self, model: torch.nn.Module, score: float, step: int, tie: float | None = None) -> bool:
        """Keep `model`'s weights if `score` (at `step`; ties broken by `tie`) is the best so far; returns whether
        they were kept."""
        if not self.better(score, tie):
            return False
        self.score, self.step = float(score), int(step)
        self.tie = None if tie is None else float(tie)
        self.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return True

    def restore(self, model: torch.nn.Module) -> bool:
        """Load the kept weights into `model` (strict); False when nothing was kept."""
        if self.weights is None:
            return False
        model.load_state_dict(self.weights)
        return True

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {"score": self.score, "step": self.step, "tie": self.tie}

    def save(self, folder: Path) -> None:
        """The kept weights into `folder` (a checkpoint being written); nothing when none are kept."""
        if self.weights is not None:
            save_file({k: v.contiguous() for k, v in self.weights.items()}, str(Path(folder) / BEST_WEIGHTS))

    def load(self, folder: Path, state: Any, model: torch.nn.Module | None = None, at: int | None = None) -> None:
        """Score, step and weights from a checkpoint `folder` and its training state's entry `state`, checked first:
        a score that is not a finite number, a step past the checkpoint's (`at`), a `best.safetensors` that is
        missing, truncated, holds NaN or infinities, or whose tensors are not `model`'s (names, shapes, dtypes) is
        a one-line UserError and nothing is loaded."""
        if state is None:
            return
        where = Path(folder) / BEST_WEIGHTS
        if not isinstance(state, dict):
            raise UserError(f"cannot resume from {folder}: its training state's keep_best is not a record of the "
                            f"best weights (got {type(state).__name__})")
        if state.get("score") is None:
            return
        score, step, tie = state.get("score"), state.get("step"), state.get("tie")
        if not (_number(score) and (tie is None or _number(tie)) and type(step) is int and step >= 0
                and (at is None or step <= at)):
            raise UserError(f"cannot resume from {folder}: its training state's keep_best holds score {score!r:.40}, "
                            f"step {step!r:.40}, tie {tie!r:.40} (a finite score and tie, a step of the run)")
        if where.is_symlink() or not where.is_file():
            raise UserError(f"cannot resume from {folder}: its training state keeps best weights from step {step} "
                            f"but {where} is missing")
        from loopformer.model.io import safetensors_complete
        if not safetensors_complete(where):
            raise UserError(f"cannot resume from {folder}: {where} is truncated or corrupt")
        try:
            weights = load_file(str(where))
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(f"cannot resume from {folder}: {where} is truncated or corrupt "
                            f"({(str(exc).splitlines() or [''])[0][:120]})") from None
        if model is not None:
            want = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
            have = {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}
            diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
            if diff:
                k = diff[0]
                raise UserError(f"cannot resume from {folder}: {where} does not hold this model's weights ({k}: "
                                f"{_shape(have.get(k))} there, {_shape(want.get(k))} in the model)")
        bad = next((k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())),
                   None)
        if bad is not None:
            raise UserError(f"cannot resume from {folder}: {where} holds NaN or infinite values ({bad}); refusing "
                            f"to select it")
        self.score, self.step, self.tie = float(score), step, None if tie is None else float(tie)
        self.weights = weights


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _shape(entry: tuple | None) -> str:
    return "missing" if entry is None else f"{list(entry[0])} {str(entry[1]).removeprefix('torch.')}"


__all__ = ["BestKeeper", "BEST_WEIGHTS", "held_score"]
