"""Evaluation on a task's test split, and loop-wise evaluation (paper Sec. 5, Table 2; the metric after each loop).

One forward pass with `return_all=True` and R_max loops gives the read-out after every loop t = 1..R_max, so the
metric at the trained loop count r and at every other t — also beyond r (extrapolation) — comes from one run. The
metrics themselves are the data source's (`DataSource.evaluate_loops` in `loopformer.sources`): the task's metrics
of the argmax for token tasks, loss / perplexity / next-token accuracy for text, squared error for in-context
learning.

Shapes: R loops, N test rows.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from loopformer.errors import UserError
from loopformer.model.io import unwrap
from loopformer.sources import DataSource

MAX_LOOPS = 1024   # the most loops an evaluation runs (loops, max_loops), or twice the trained r if that is more


def check_eval_args(loops: Optional[int] = None, max_loops: Optional[int] = None, batch_size: int = 1,
                    limit: int = 0, trained: int = 0) -> None:
    """One-line UserErrors for evaluation arguments out of range (None: the default). `trained`: the model's
    trained loop count (raises the cap to 2 × trained when that exceeds MAX_LOOPS)."""
    cap = max(MAX_LOOPS, 2 * trained)
    for name, v in (("loops", loops), ("max_loops", max_loops)):
        if v is not None and not 1 <= v <= cap:
            raise UserError(f"{name} must be in 1..{cap} (got {v})")
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1 (got {batch_size})")
    if limit < 0:
        raise UserError(f"the number of test rows must be >= 0 (0: all; got {limit})")


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataSource, *, loops: Optional[int] = None, max_loops: Optional[int] = None,
             batch_size: int = 256, limit: int = 0, loopwise: bool = True, device: Optional[torch.device] = None,
             autocast: Callable[[], Any] = contextlib.nullcontext, progress: bool = False) -> dict[str, Any]:
    """Metrics of `model` on `data`'s test split at `loops` (default: the model's), plus the loop-wise curve.

    Returns {"loops": r, "max_loops": R, "metric": name, "metrics": {...at r}, "loopwise": [{"loop": t, ...}]}.
    `loops` and `max_loops` are at most MAX_LOOPS; max_loops 0 / None means the default.
    """
    raw = unwrap(model)
    cfg = raw.config
    check_eval_args(loops or None, max_loops or None, batch_size, limit, trained=cfg.loops)
    r = int(loops or cfg.loops)
    R = max(r, int(max_loops or 0)) if loopwise else r
    device = device or next(raw.parameters()).device
    was_training = raw.training
    raw.eval()
    try:
        per_loop = data.evaluate_loops(raw, R, loopwise and R > 1, batch_size, limit, device, autocast, progress)
    finally:
        raw.train(was_training)
    # per_loop: a list of metric dicts, loop 1..R (only loop R when not loop-wise)
    if loopwise and R > 1:
        curve = [{"loop": t + 1, **m} for t, m in enumerate(per_loop)]
        at_r = per_loop[r - 1]
    else:
        curve, at_r = [], per_loop[-1]
    return {"loops": r, "max_loops": R, "metric": data.metric, "higher_is_better": data.higher_is_better,
            "metrics": at_r, "loopwise": curve}


def headline(result: dict[str, Any]) -> float:
    """The headline metric's value at the trained loop count."""
    return float(result["metrics"][result["metric"]])


def format_results(metric: str, metrics: dict, loopwise: list[dict], trained: int) -> str:
    """The test metrics on one line, then the headline metric after every loop with the trained r marked."""
    lines = ["test: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))]
    if loopwise:
        lines += [f"loop-wise {metric} (trained r = {trained}):", "  loop  " + metric]
        for p in loopwise:
            mark = "  <- trained r" if p["loop"] == trained else ""
            lines.append(f"  {p['loop']:>4}  {p[metric]:.4f}{mark}")
    return "\n".join(lines)


__all__ = ["evaluate", "headline", "format_results", "check_eval_args", "MAX_LOOPS"]
