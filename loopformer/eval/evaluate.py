"""Evaluation on a task's test split, and loop-wise evaluation (paper Sec. 5, Table 2; the metric after each loop).

One forward pass with `return_all=True` and R_max loops gives the read-out after every loop t = 1..R_max, so the
metric at the trained loop count r and at every other t — also beyond r (extrapolation) — comes from one run.
Every forward-and-score loop of the library lives in this package: `loop_metrics` here (fixed depth, loop-wise),
`voted_metrics` (test-time voting) and `step_halted_metrics` (halting across supervision steps) below, adaptive
depth in `loopformer.eval.halting`, all of them run as an `EvalConfig` asks by `loopformer.eval.run.evaluate_all`.
The data source only answers data questions and scores read-outs (`DataSource.eval_batches` / `score` /
`summarize`: the task's metrics of the argmax for token tasks, loss / perplexity / next-token accuracy for text,
squared error for in-context learning; `views` / `unview` for voting, `content` for halting across steps).

Deep supervision (`ModelConfig.supervision_steps` N of r loops each, `loopformer.model.recursion`): at inference
N steps are N·r loops, so a model trained that way is evaluated at N·r loops and the curve over steps is the
loop-wise curve at t = r, 2r, ... ("stepwise"). Test-time augmentation (`votes` copies, tasks with symmetries)
adds the metrics of the per-cell vote as voted_*; a model with an exit gate trained across steps adds the metrics
when every row stops at the step its gate chooses (halted_*, halted_steps: the mean steps run).

Shapes: R loops, N test rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from loopformer.errors import UserError
from loopformer.model.halting import row_mean
from loopformer.model.lengths import LoopRule
from loopformer.model.looped import unwrap
from loopformer.model.memory import MAX_LOOPS, check_loops
from loopformer.model.options import LoopOptions
from loopformer.model.recursion import step_exits
from loopformer.sources import DataSource


def check_eval_args(loops: int | None = None, max_loops: int | None = None, batch_size: int = 1,
                    limit: int = 0, trained: int = 0) -> None:
    """One-line UserErrors for evaluation arguments out of range (None: the default). `trained`: the model's
    trained loop count (raises the cap to 2 × trained when that exceeds MAX_LOOPS)."""
    for name, v in (("loops", loops), ("max_loops", max_loops)):
        check_loops(v, trained, name)
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1 (got {batch_size})")
    if limit < 0:
        raise UserError(f"the number of test rows must be >= 0 (0: all; got {limit})")


def read_outs(model: torch.nn.Module, x: torch.Tensor, loops: int, all_loops: bool,
              autocast: Callable[[], Any], rows: torch.Tensor | None = None) -> torch.Tensor:
    """The read-out after every loop [R,B,T,C] (`all_loops`), or after the last [1,B,T,C]; `rows` [B]: a loop count
    per row (each row keeps its state after its own loops)."""
    with autocast():
        out = model(x, loops=loops, return_all=all_loops) if rows is None else \
            model(x, loops=loops, return_all=all_loops, opts=LoopOptions(row_loops=rows))
    return out.all_logits if all_loops else out.logits[None]


def rule_rows(model: torch.nn.Module, batch: dict[str, np.ndarray], loops: int,
              device: torch.device) -> torch.Tensor | None:
    """The loops of every row of `batch` under the model's loop rule (`model.loop_rule`: T(n) from the row's size,
    at most `loops`), [B]; None for a fixed rule or rows without sizes."""
    rule = LoopRule.parse(getattr(model.config, "loop_rule", "fixed"))
    if rule.fixed or "size" not in batch:
        return None
    return torch.from_numpy(np.minimum(rule.loops(batch["size"], model.config.loops), loops)).to(device)


def loop_metrics(model: torch.nn.Module, data: DataSource, loops: int, all_loops: bool, batch_size: int, limit: int,
                 device: torch.device, autocast: Callable[[], Any], progress: bool,
                 per_row: bool = True) -> list[dict[str, float]]:
    """The metrics of `model` (in eval mode, no gradients) on the test split after every loop 1..`loops`
    (`all_loops`), or after the last only (a list of one): the source's evaluation batches through the model, each
    batch's read-outs scored by the source. A model with a loop rule runs every row T(n) loops (at most `loops`)
    and keeps its state after them, so loop t reads each row after min(t, T(n)) loops (`per_row` off: every row
    runs every loop, as a fixed rule)."""
    n_read = loops if all_loops else 1
    parts = []
    for batch in tqdm(list(data.eval_batches(batch_size, limit, n_read, model.config.out_dim)), desc="eval",
                      disable=not progress, leave=False):
        x = data.as_tensors(batch, device)["inputs"]
        rows = rule_rows(model, batch, loops, device) if per_row else None              # [b] | None: T(n) per row
        parts.append(data.score(read_outs(model, x, loops, all_loops, autocast, rows), batch))
    return data.summarize(parts, limit, model.config.loops)


def voted_metrics(model: torch.nn.Module, data: DataSource, loops: int, copies: int, batch_size: int, limit: int,
                  device: torch.device, autocast: Callable[[], Any]) -> dict[str, float]:
    """Test-time augmentation: the metrics after `loops` loops of the per-cell vote over the test rows and `copies`
    symmetric copies of each (sources whose task defines symmetries: `DataSource.views` / `unview`)."""
    preds: list[np.ndarray] = []
    rows: list[dict[str, np.ndarray]] = []
    for batch in data.test_batches(max(1, batch_size // (1 + copies)), limit):
        views, sym = data.views(batch["inputs"], copies, seed=len(rows))                   # [1+K,b,T]
        K1, b, T = views.shape
        x = torch.as_tensor(np.asarray(views.reshape(K1 * b, T), dtype=np.int64), device=device)
        logits = read_outs(model, x, loops, False, autocast)[0].float()                   # [(1+K)·b,T,C]
        prob, arg = logits.softmax(-1).max(-1)
        pred = arg.cpu().numpy().reshape(K1, b, T)
        preds.append(data.unview(pred, sym, prob.cpu().numpy().reshape(K1, b, T)))
        rows.append(batch)
    full = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    return data.metrics(np.concatenate(preds), full)


def step_halted_metrics(model: torch.nn.Module, data: DataSource, loops: int, steps: int, threshold: float,
                        batch_size: int, limit: int, device: torch.device, autocast: Callable[[], Any]
                        ) -> dict[str, float]:
    """Halting across supervision steps: the metrics when every test row stops after the first of `steps` steps of
    `loops` loops whose exit gate says stop (`loopformer.model.recursion.step_exits`), and the mean number of steps
    run ("steps"). Sources that say which input positions hold content (`DataSource.content`: token tasks)."""
    parts = []
    ran: list[np.ndarray] = []
    for batch in data.eval_batches(batch_size, limit, loops * steps, model.config.out_dim):
        x = data.as_tensors(batch, device)["inputs"]
        with autocast():
            out = model(x, loops=loops * steps, return_all=True)
        at = torch.arange(1, steps + 1, device=device) * loops - 1                        # each step's last loop
        stop = row_mean(out.all_stop_logits[at], data.content(x))                         # [N,b]
        exit_ = step_exits(stop, threshold)                                                # [b]
        logits = out.all_logits[at][exit_, torch.arange(len(x), device=device)]           # [b,T,C]
        parts.append(data.score(logits[None], batch))
        ran.append(exit_.cpu().numpy() + 1)
    return {**data.summarize(parts, limit, 0)[0], "steps": float(np.concatenate(ran).mean())}


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataSource, *, loops: int | None = None, max_loops: int | None = None,
             batch_size: int = 256, limit: int = 0, loopwise: bool = True, device: torch.device | None = None,
             autocast: Callable[[], Any] = contextlib.nullcontext, progress: bool = False,
             votes: int = 0, step_halt: float = 0.5) -> dict[str, Any]:
    """Metrics of `model` on `data`'s test split at `loops` (default: the model's supervision_steps × loops), plus
    the loop-wise curve (and, for a model trained with deep supervision, the curve over steps).

    A budget-aware model (`timestep_time="normalized"`) is scored at r by a run of r loops; its loop-wise curve is
    the read-out after each loop t of one run of R_max loops (`loopformer.eval.budgets` runs each budget).

    Returns {"loops": r, "max_loops": R, "metric": name, "metrics": {...at r}, "loopwise": [{"loop": t, ...}],
    "stepwise": [{"step": s, "loop": s·r, ...}]}. `loops` and `max_loops` are at most MAX_LOOPS; max_loops 0 / None
    means the default. votes > 0: also the metrics of test-time augmentation with voting (`voted_` prefix). A model
    with an exit gate and supervision steps is also evaluated halting across steps (`halted_` prefix): each row stops
    at the first step whose stop probability reaches `step_halt`.
    """
    raw = unwrap(model)
    check_eval_args(loops or None, max_loops or None, batch_size, limit, trained=raw.config.total_loops)
    if votes < 0:
        raise UserError(f"votes must be >= 0 (got {votes})")
    if not 0 < step_halt <= 1:
        raise UserError(f"the step-halting threshold must be in (0, 1] (got {step_halt})")
    return fixed_depth(raw, data, loops=loops, max_loops=max_loops, batch_size=batch_size, limit=limit,
                       loopwise=loopwise, device=device, autocast=autocast, progress=progress, votes=votes,
                       step_halt=step_halt)


@torch.no_grad()
def fixed_depth(raw: torch.nn.Module, data: DataSource, *, loops: int | None, max_loops: int | None,
                batch_size: int, limit: int, loopwise: bool, device: torch.device | None,
                autocast: Callable[[], Any], progress: bool, votes: int, step_halt: float,
                per_row: bool = True) -> dict[str, Any]:
    """`evaluate` on arguments already checked (`raw`: the model itself, not a wrapper); `per_row` off: a model with
    a loop rule runs every row every loop (`loop_metrics`)."""
    cfg = raw.config
    r = int(loops or cfg.total_loops)
    R = max(r, int(max_loops or 0)) if loopwise else r
    device = device or next(raw.parameters()).device
    was_training = raw.training
    raw.eval()
    try:
        per_loop = loop_metrics(raw, data, R, loopwise and R > 1, batch_size, limit, device, autocast, progress,
                                per_row)
        voted = voted_metrics(raw, data, r, votes, batch_size, limit, device, autocast) if votes else {}
        halted = step_halted_metrics(raw, data, cfg.loops, cfg.supervision_steps, step_halt, batch_size, limit,
                                     device, autocast) if (cfg.exit_gate and cfg.supervision_steps > 1) else {}
    finally:
        raw.train(was_training)
    # per_loop: a list of metric dicts, loop 1..R (only loop R when not loop-wise)
    if loopwise and R > 1:
        curve = [{"loop": t + 1, **m} for t, m in enumerate(per_loop)]
        at_r = per_loop[r - 1]
        # a budget-aware model times its loops by the run's length: loop r of R loops is not a run of r loops
        if cfg.timestep_time == "normalized" and R > r:
            raw.eval()
            try:
                at_r = loop_metrics(raw, data, r, False, batch_size, limit, device, autocast, progress)[-1]
            finally:
                raw.train(was_training)
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
                   stepwise: list[dict] | None = None) -> str:
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


__all__ = ["evaluate", "fixed_depth", "loop_metrics", "voted_metrics", "step_halted_metrics", "read_outs", "headline",
           "format_results", "check_eval_args", "MAX_LOOPS"]
