"""Evaluation over loop budgets: the metric when a model is *run with* R loops, for each R of a list — elastic depth
(docs/elastic-depth.md).

A run with budget R is `model(x, loops=R)`: for a model that reads the loop index t (or nothing) its read-out
equals the loop-wise curve's value at t = R, but a budget-aware model (`timestep_time="normalized"`) times all its
loops by R, so its run with R loops is not a prefix of a longer one. Next to each budget: the wall time of the
run, and optionally halting rules with that budget as their most loops (adaptive depth inside an elastic model).

Shapes: R loops.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from loopformer.errors import UserError
from loopformer.eval.evaluate import check_eval_args, loop_metrics
from loopformer.eval.halting import parse_rules, rules_side_by_side
from loopformer.fileio import write_figure
from loopformer.model.halting import HaltRule
from loopformer.model.looped import unwrap
from loopformer.model.memory import check_loops
from loopformer.sources import DataSource


def parse_budgets(text: str, trained: int = 0) -> list[int]:
    """"1,2,4,8" -> [1, 2, 4, 8] (sorted, without repeats); a one-line UserError for anything else or a budget
    outside 1..loop_cap(trained)."""
    try:
        budgets = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UserError(f"--budgets takes loop counts separated by commas, e.g. 1,2,4,8 (got {text!r})") from None
    if not budgets:
        raise UserError("--budgets: give at least one loop count")
    for b in budgets:
        check_loops(b, trained, "--budgets: a budget")
    return budgets


@torch.no_grad()
def evaluate_budgets(model: torch.nn.Module, data: DataSource, budgets: Sequence[int], *, batch_size: int = 256,
                     limit: int = 0, device: torch.device | None = None,
                     autocast: Callable[[], Any] = contextlib.nullcontext, progress: bool = False,
                     halt: Sequence[HaltRule | str] = ()) -> dict[str, Any]:
    """The test metrics of `model` run with each budget R in `budgets` (its own forward with R loops).

    Returns {"metric", "higher_is_better", "trained_loops", "budgets": [{"loops": R, "metrics", "wall_s",
    "halting": [{"rule", "metrics", "mean_loops"}] (with `halt` rules, each capped at R loops)}]}."""
    raw = unwrap(model)
    check_eval_args(None, None, batch_size, limit)
    for b in budgets:
        check_loops(int(b), raw.config.total_loops, "loops")
    return budget_runs(raw, data, budgets, batch_size=batch_size, limit=limit, device=device, autocast=autocast,
                       progress=progress, halt=parse_rules(halt))


@torch.no_grad()
def budget_runs(raw: torch.nn.Module, data: DataSource, budgets: Sequence[int], *, batch_size: int, limit: int,
                device: torch.device | None, autocast: Callable[[], Any], progress: bool,
                halt: Sequence[HaltRule]) -> dict[str, Any]:
    """`evaluate_budgets` on arguments already checked (`raw`: the model itself, not a wrapper)."""
    trained = raw.config.total_loops
    rules = list(halt)
    device = device or next(raw.parameters()).device
    was_training = raw.training
    raw.eval()
    rows = []
    try:
        for R in budgets:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            metrics = loop_metrics(raw, data, int(R), False, batch_size, limit, device, autocast, progress)[-1]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            row: dict[str, Any] = {"loops": int(R), "metrics": metrics, "wall_s": time.perf_counter() - t0}
            if rules:
                res = rules_side_by_side(raw, data, rules, loops=int(R), batch_size=batch_size, limit=limit,
                                         device=device, progress=progress)
                row["halting"] = [{"rule": r["rule"], "metrics": r["metrics"], "mean_loops": r["mean_loops"]}
                                  for r in res["rules"]]
            rows.append(row)
    finally:
        raw.train(was_training)
    return {"metric": data.metric, "higher_is_better": data.higher_is_better, "trained_loops": trained,
            "budgets": rows}


def format_budgets(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table: one row per budget, one column per model (name -> `evaluate_budgets` result), with the
    first model's wall time and its halting rules."""
    names = list(results)
    first = results[names[0]]
    m = first["metric"]
    rules = [h["rule"] for h in first["budgets"][0].get("halting", [])]
    head = ["loops R", *(f"{n} (r={results[n]['trained_loops']})" for n in names), f"{names[0]} wall s",
            *(f"{names[0]} + {r} (mean loops)" for r in rules)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {n: {b["loops"]: b for b in results[n]["budgets"]} for n in names}
    for R in sorted({R for n in names for R in by[n]}):
        cells = [str(R)] + [f"{by[n][R]['metrics'][m]:.4f}" if R in by[n] else "" for n in names]
        own = by[names[0]].get(R)
        cells.append(f"{own['wall_s']:.2f}" if own else "")
        for i in range(len(rules)):
            h = own["halting"][i] if own else None
            cells.append(f"{h['metrics'][m]:.4f} ({h['mean_loops']:.2f})" if h else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def budgets_plot(results: dict[str, dict[str, Any]], path: str, title: str = "") -> None:
    """The metric against the budget R (log scale), one line per model, each model's trained r marked."""
    import matplotlib  # heavy: only for plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    m = next(iter(results.values()))["metric"]
    for name, res in results.items():
        pts = [(b["loops"], b["metrics"][m]) for b in res["budgets"]]
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=3, label=name)
        at = [p for p in pts if p[0] == res["trained_loops"]]
        if at:
            ax.plot(*at[0], "*", ms=11, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("loops run R (★ trained r)")
    ax.set_ylabel(m)
    ax.set_title(title or "accuracy over loop budgets")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    write_figure(fig, path)
    plt.close(fig)


__all__ = ["evaluate_budgets", "budget_runs", "parse_budgets", "format_budgets", "budgets_plot"]
