"""Evaluation with adaptive depth: accuracy, loops used and wall time of halting rules next to fixed depth.

`evaluate_halting` runs the fixed-depth model (R loops) and every halting rule (`loopformer.model.halting`) side by
side on each test batch (they take turns, so the wall times see the same machine) and reports, per rule, the task's
metrics, the mean and 90th-percentile loops used (per row; per supervised token in a causal model) and the wall
time of the forward passes. `halting_sweep` does this over a range of thresholds per criterion and adds the
fixed-depth curve (the metric after every loop t = 1..R), the trade-off `sweep_plot` draws: accuracy against mean
loops, the halting rules next to the fixed loop counts.

Shapes: R loops, N counted units (rows or tokens).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from loopformer.errors import UserError
from loopformer.eval.evaluate import check_eval_args, fixed_depth
from loopformer.fileio import write_figure
from loopformer.model.halting import CRITERIA, HaltRule
from loopformer.model.looped import unwrap
from loopformer.model.options import LoopOptions
from loopformer.sources import DataSource

SWEEP_THRESHOLDS: dict[str, tuple[float, ...]] = {   # from stopping early to stopping late
    "latent": (0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 0.005, 0.002),
    "kl": (1.0, 0.3, 0.1, 0.03, 0.01, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5),
    "entropy": (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 5e-3, 1e-3),
    "argmax": (1, 2, 3, 4, 5),
    "gate": (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, clock: dict[str, float], name: str, device: torch.device):
    """`fn` with its wall time added to clock[name]."""
    def run(*args):
        _sync(device)
        t0 = time.perf_counter()
        out = fn(*args)
        _sync(device)
        clock[name] += time.perf_counter() - t0
        return out
    return run


def side_by_side(forwards: dict[str, Any], data: DataSource, batch_size: int, limit: int, device: torch.device,
                 progress: bool, out_dim: int = 1) -> dict[str, tuple[dict[str, float], np.ndarray | None]]:
    """For each named forward `f(x, positions) -> LoopOutput` (x the inputs of a test batch, positions [b,T] the
    counted positions: `DataSource.counted`, e.g. a token task's supervised ones), its metrics on the test split
    and the exit loop of every counted unit (a row, or a counted token when `exit_loops` is per token; None without
    exits). The forwards take turns on every batch, so their wall times (measured by the caller) see the same
    machine state. Each forward's read-out (the model's `out_dim` outputs per position) is scored by the source
    (`score` / `summarize`, as fixed-depth evaluation does)."""
    parts: dict[str, list] = {k: [] for k in forwards}
    exits: dict[str, list[np.ndarray]] = {k: [] for k in forwards}
    for batch in tqdm(list(data.eval_batches(batch_size, limit, 1, out_dim)), desc="eval", disable=not progress,
                      leave=False):
        t = data.as_tensors(batch, device)
        counted = data.counted(t)                                                          # [b,T]
        for name, forward in forwards.items():
            out = forward(t["inputs"], counted)
            parts[name].append(data.score(out.logits[None], batch))                        # one read-out each
            if out.exit_loops is not None:
                e = out.exit_loops if out.exit_loops.dim() == 1 else out.exit_loops[counted]
                exits[name].append(e.cpu().numpy())
    return {k: (data.summarize(parts[k], limit, 0)[0], np.concatenate(exits[k]) if exits[k] else None)
            for k in forwards}


@torch.no_grad()
def evaluate_halting(model: torch.nn.Module, data: DataSource, rules: Sequence[HaltRule | str], *,
                     loops: int | None = None, batch_size: int = 256, limit: int = 0,
                     device: torch.device | None = None, progress: bool = False) -> dict[str, Any]:
    """Fixed depth (R = `loops`, default the depth `evaluate` runs: the trained r times the supervision steps) and
    each rule, side by side on `data`'s test split (a rule with its own `max` runs up to it when `loops` is not
    given).

    Returns {"loops": R, "metric", "fixed": {"metrics", "wall_s"}, "rules": [{"rule", "metrics", "mean_loops",
    "p90_loops", "loops_saved", "wall_s", "speedup"}]} — loops_saved = 1 − mean_loops / R, speedup = fixed wall
    time / the rule's.
    """
    raw = unwrap(model)
    parsed = parse_rules(rules)
    check_halting_args(raw.config.total_loops, parsed, loops, batch_size, limit)
    return rules_side_by_side(raw, data, parsed, loops=loops, batch_size=batch_size, limit=limit, device=device,
                              progress=progress)


def parse_rules(rules: Sequence[HaltRule | str]) -> list[HaltRule]:
    """Halting rules, each a `HaltRule` or its text."""
    return [HaltRule.parse(r) if isinstance(r, str) else r for r in rules]


def check_halting_args(trained: int, rules: Sequence[HaltRule], loops: int | None, batch_size: int,
                       limit: int) -> None:
    """One-line UserErrors for `evaluate_halting`'s arguments (each rule's own `max` when `loops` is not given),
    for a model trained with `trained` loops (supervision steps × r)."""
    check_eval_args(loops or None, None, batch_size, limit, trained=trained)
    for r in rules:
        if not loops and r.max_loops is not None:
            check_eval_args(r.max_loops, None, batch_size, limit, trained=trained)


@torch.no_grad()
def rules_side_by_side(raw: torch.nn.Module, data: DataSource, parsed: Sequence[HaltRule], *,
                       loops: int | None, batch_size: int, limit: int, device: torch.device | None,
                       progress: bool) -> dict[str, Any]:
    """`evaluate_halting` on arguments already checked (`raw`: the model itself, not a wrapper)."""
    R = int(loops or raw.config.total_loops)
    if any(r.criterion == "gate" for r in parsed) and raw.exit_gate is None:
        raise UserError("halting criterion 'gate' needs a model with an exit gate (exit_gate=true)")
    device = device or next(raw.parameters()).device
    was_training = raw.training
    raw.eval()
    clock = {"fixed": 0.0, **{str(r): 0.0 for r in parsed}}
    forwards = {"fixed": _timed(lambda x, P: raw(x, loops=R), clock, "fixed", device)}
    for r in parsed:   # a rule's own max bounds it unless `loops` is given
        budget = R if loops or r.max_loops is None else r.max_loops
        forwards[str(r)] = _timed(lambda x, P, r=r, b=budget: raw(x, loops=b, halt=r,
                                                                   opts=LoopOptions(halt_positions=P)),
                                  clock, str(r), device)
    try:
        first = next(data.test_batches(min(batch_size, 8), 8))          # warm-up: first-call costs are not timed
        raw(data.as_tensors(first, device)["inputs"], loops=R)
        res = side_by_side(forwards, data, batch_size, limit, device, progress, raw.config.out_dim)
    finally:
        raw.train(was_training)
    out_rules = []
    for r in parsed:
        metrics, exits = res[str(r)]
        mean = float(exits.mean())
        out_rules.append({"rule": str(r), "criterion": r.criterion, "threshold": r.threshold, "metrics": metrics,
                          "mean_loops": mean, "p90_loops": float(np.percentile(exits, 90)),
                          "loops_saved": 1.0 - mean / R, "wall_s": clock[str(r)],
                          "speedup": clock["fixed"] / max(clock[str(r)], 1e-12)})
    return {"loops": R, "metric": data.metric, "higher_is_better": data.higher_is_better,
            "fixed": {"metrics": res["fixed"][0], "wall_s": clock["fixed"]}, "rules": out_rules}


def sweep_rules(criteria: Sequence[str], max_loops: int | None = None) -> list[HaltRule]:
    """The sweep's rules: every threshold of `SWEEP_THRESHOLDS` for each criterion."""
    rules = []
    for c in criteria:
        if c not in CRITERIA:
            raise UserError(f"unknown halting criterion {c!r} (choose from {', '.join(CRITERIA)})")
        for th in SWEEP_THRESHOLDS[c]:
            rules.append(HaltRule(c, float(th), patience=int(th) if c == "argmax" else 1, max_loops=max_loops))
    return rules


def halting_sweep(model: torch.nn.Module, data: DataSource, criteria: Sequence[str], *, loops: int | None = None,
                  batch_size: int = 256, limit: int = 0, device: torch.device | None = None,
                  progress: bool = False) -> dict[str, Any]:
    """`evaluate_halting` over the sweep's thresholds for each criterion (`criteria`; "gate" only for a model with
    an exit gate), plus the fixed-depth curve: the metric after every loop t = 1..R ("fixed_curve"; R = `loops`,
    default the depth `evaluate` runs)."""
    raw = unwrap(model)
    check_eval_args(loops or None, None, batch_size, limit, trained=raw.config.total_loops)
    return threshold_sweep(raw, data, criteria, loops=loops, batch_size=batch_size, limit=limit, device=device,
                           progress=progress)


@torch.no_grad()
def threshold_sweep(raw: torch.nn.Module, data: DataSource, criteria: Sequence[str], *, loops: int | None,
                    batch_size: int, limit: int, device: torch.device | None, progress: bool) -> dict[str, Any]:
    """`halting_sweep` on arguments already checked (`raw`: the model itself, not a wrapper)."""
    R = int(loops or raw.config.total_loops)
    crits = [c for c in criteria if c != "gate" or raw.exit_gate is not None]
    if not crits:
        raise UserError("no halting criterion to sweep (the gate needs a model with an exit gate)")
    res = rules_side_by_side(raw, data, sweep_rules(crits), loops=R, batch_size=batch_size, limit=limit,
                             device=device, progress=progress)
    curve = fixed_depth(raw, data, loops=R, max_loops=R, batch_size=batch_size, limit=limit, loopwise=True,
                        device=device, autocast=contextlib.nullcontext, progress=False, votes=0, step_halt=0.5)
    res["fixed_curve"] = curve["loopwise"] or [{"loop": R, **curve["metrics"]}]
    return res


def best_rule(res: dict[str, Any], max_loss: float = 0.005) -> dict[str, Any] | None:
    """The rule with the fewest mean loops whose metric is at most `max_loss` worse than fixed depth (below it, or
    above it for a metric where lower is better; None: none)."""
    m, sign = res["metric"], 1.0 if res.get("higher_is_better", True) else -1.0
    ref = res["fixed"]["metrics"][m]
    ok = [r for r in res["rules"] if sign * (r["metrics"][m] - ref) >= -max_loss]
    return min(ok, key=lambda r: r["mean_loops"]) if ok else None


def format_halting(res: dict[str, Any]) -> str:
    """A markdown table: fixed depth, then every rule with its metric, loops (mean, p90, saved), wall time, speedup."""
    m, R = res["metric"], res["loops"]
    fixed = res["fixed"]
    lines = [f"| rule | {m} | mean loops | p90 loops | loops saved | wall s | speedup |",
             "|---|---|---|---|---|---|---|",
             f"| fixed r = {R} | {fixed['metrics'][m]:.4f} | {R:.2f} | {R} | 0 % | {fixed['wall_s']:.3f} | 1.00× |"]
    for r in res["rules"]:
        lines.append(f"| {r['rule']} | {r['metrics'][m]:.4f} | {r['mean_loops']:.2f} | {r['p90_loops']:.0f} | "
                     f"{100 * r['loops_saved']:.0f} % | {r['wall_s']:.3f} | {r['speedup']:.2f}× |")
    return "\n".join(lines)


def sweep_plot(res: dict[str, Any], path: str, title: str = "") -> None:
    """Accuracy (the headline metric) against mean loops: one line per criterion, the fixed-depth curve beside."""
    import matplotlib  # heavy: only for plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = res["metric"]
    fig, ax = plt.subplots(figsize=(6, 4))
    curve = res.get("fixed_curve") or []
    ax.plot([p["loop"] for p in curve], [p[m] for p in curve], "k-o", ms=3, label="fixed loops t")
    for c in dict.fromkeys(r["criterion"] for r in res["rules"]):
        pts = sorted((r["mean_loops"], r["metrics"][m]) for r in res["rules"] if r["criterion"] == c)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-s", ms=3, label=f"halting: {c}")
    ax.set_xlabel("mean loops used")
    ax.set_ylabel(m)
    ax.set_title(title or f"adaptive depth (R = {res['loops']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    write_figure(fig, path)
    plt.close(fig)


__all__ = ["evaluate_halting", "rules_side_by_side", "check_halting_args", "parse_rules", "side_by_side",
           "halting_sweep", "threshold_sweep", "sweep_rules", "best_rule", "format_halting", "sweep_plot",
           "SWEEP_THRESHOLDS"]
