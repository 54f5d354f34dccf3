"""Evaluation on a task's test split, and loop-wise evaluation (paper Sec. 5, Table 2; the metric after each loop).

One forward pass with `return_all=True` and R_max loops gives the read-out after every loop t = 1..R_max, so the
metric at the trained loop count r and at every other t — also beyond r (extrapolation) — comes from one run. The
metrics themselves are the data source's (`DataSource.evaluate_loops` in `loopformer.sources`): the task's metrics
of the argmax for token tasks, loss / perplexity / next-token accuracy for text, squared error for in-context
learning.

Deep supervision (`ModelConfig.supervision_steps` N of r loops each, `loopformer.model.recursion`): at inference
N steps are N·r loops, so a model trained that way is evaluated at N·r loops and the curve over steps is the
loop-wise curve at t = r, 2r, ... ("stepwise"). Test-time augmentation (`votes` copies, tasks with symmetries)
adds the metrics of the per-cell vote as voted_*; a model with an exit gate trained across steps adds the metrics
when every row stops at the step its gate chooses (halted_*, halted_steps: the mean steps run).

Shapes: R loops, N test rows.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from loopformer.errors import UserError
from loopformer.model.io import unwrap
from loopformer.model.memory import MAX_LOOPS, check_loops
from loopformer.sources import DataSource



def check_eval_args(loops: Optional[int] = None, max_loops: Optional[int] = None, batch_size: int = 1,
                    limit: int = 0, trained: int = 0) -> None:
    """One-line UserErrors for evaluation arguments out of range (None: the default). `trained`: the model's
    trained loop count (raises the cap to 2 × trained when that exceeds MAX_LOOPS)."""
    for name, v in (("loops", loops), ("max_loops", max_loops)):
        check_loops(v, trained, name)
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1 (got {batch_size})")
    if limit < 0:
        raise UserError(f"the number of test rows must be >= 0 (0: all; got {limit})")


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataSource, *, loops: Optional[int] = None, max_loops: Optional[int] = None,
             batch_size: int = 256, limit: int = 0, loopwise: bool = True, device: Optional[torch.device] = None,
             autocast: Callable[[], Any] = contextlib.nullcontext, progress: bool = False,
             votes: int = 0, step_halt: float = 0.5) -> dict[str, Any]:
    """Metrics of `model` on `data`'s test split at `loops` (default: the model's supervision_steps × loops), plus
    the loop-wise curve (and, for a model trained with deep supervision, the curve over steps).

    Returns {"loops": r, "max_loops": R, "metric": name, "metrics": {...at r}, "loopwise": [{"loop": t, ...}],
    "stepwise": [{"step": s, "loop": s·r, ...}]}. `loops` and `max_loops` are at most MAX_LOOPS; max_loops 0 / None
    means the default. votes > 0: also the metrics of test-time augmentation with voting (`voted_` prefix). A model
    with an exit gate and supervision steps is also evaluated halting across steps (`halted_` prefix): each row stops
    at the first step whose stop probability reaches `step_halt`.
    """
    raw = unwrap(model)
    cfg = raw.config
    check_eval_args(loops or None, max_loops or None, batch_size, limit, trained=cfg.total_loops)
    if votes < 0:
        raise UserError(f"votes must be >= 0 (got {votes})")
    if not 0 < step_halt <= 1:
        raise UserError(f"the step-halting threshold must be in (0, 1] (got {step_halt})")
    r = int(loops or cfg.total_loops)
    R = max(r, int(max_loops or 0)) if loopwise else r
    device = device or next(raw.parameters()).device
    was_training = raw.training
    raw.eval()
    try:
        per_loop = data.evaluate_loops(raw, R, loopwise and R > 1, batch_size, limit, device, autocast, progress)
        voted = data.evaluate_votes(raw, r, votes, batch_size, limit, device, autocast) if votes else {}
        halted = data.evaluate_halting(raw, cfg.loops, cfg.supervision_steps, step_halt, batch_size, limit, device,
                                       autocast) if (cfg.exit_gate and cfg.supervision_steps > 1) else {}
    finally:
        raw.train(was_training)
    # per_loop: a list of metric dicts, loop 1..R (only loop R when not loop-wise)
    if loopwise and R > 1:
        curve = [{"loop": t + 1, **m} for t, m in enumerate(per_loop)]
        at_r = per_loop[r - 1]
    else:
        curve, at_r = [], per_loop[-1]
    steps = [{"step": p["loop"] // cfg.loops, **p} for p in curve if p["loop"] % cfg.loops == 0] \
        if cfg.supervision_steps > 1 else []
    return {"loops": r, "max_loops": R, "metric": data.metric, "higher_is_better": data.higher_is_better,
            "metrics": {**at_r, **{f"voted_{k}": v for k, v in voted.items()},
                        **{f"halted_{k}": v for k, v in halted.items()}}, "loopwise": curve,
            "stepwise": steps}


def headline(result: dict[str, Any]) -> float:
    """The headline metric's value at the trained loop count."""
    return float(result["metrics"][result["metric"]])


def format_results(metric: str, metrics: dict, loopwise: list[dict], trained: int,
                   stepwise: Optional[list[dict]] = None) -> str:
    """The test metrics on one line, then the headline metric after every loop with the trained r marked (and after
    every supervision step when the model was trained with deep supervision)."""
    lines = ["test: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))]
    if stepwise:
        lines += [f"step-wise {metric} (supervision steps of {stepwise[0]['loop']} loops):", "  step  loops  " + metric]
        lines += [f"  {p['step']:>4}  {p['loop']:>5}  {p[metric]:.4f}{'  <- trained' if p['loop'] == trained else ''}"
                  for p in stepwise]
    if loopwise:
        lines += [f"loop-wise {metric} (trained r = {trained}):", "  loop  " + metric]
        for p in loopwise:
            mark = "  <- trained r" if p["loop"] == trained else ""
            lines.append(f"  {p['loop']:>4}  {p[metric]:.4f}{mark}")
    return "\n".join(lines)


__all__ = ["evaluate", "headline", "format_results", "check_eval_args", "MAX_LOOPS"]
