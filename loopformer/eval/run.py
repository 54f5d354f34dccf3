"""One evaluation of a model as an `EvalConfig` asks (paper Sec. 5, Table 2, and the adaptive-depth and
loop-budget measurements): fixed depth at r with the loop-wise curve, voting and halting across supervision
steps (`loopformer.eval.evaluate`), the halting rules and the threshold sweep next to fixed depth
(`loopformer.eval.halting`), the runs with each loop budget (`loopformer.eval.budgets`).

`evaluate_all` is the one path the trainer, the `eval` command and `perplexity` take. It checks the arguments
once, against the model (`check_eval_config`), and calls the pieces on checked arguments. One depth for
everything: the loops `cfg.loops`, default the trained r times the supervision steps (N·r) — fixed depth, the
halting rules (unless a rule has its own `max`) and the sweep run it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from loopformer.eval.budgets import budget_runs
from loopformer.eval.config import EvalConfig
from loopformer.eval.drift import drift_report
from loopformer.eval.evaluate import check_eval_args, fixed_depth
from loopformer.eval.halting import check_halting_args, rules_side_by_side, threshold_sweep
from loopformer.eval.lengths import length_curve
from loopformer.model.looped import unwrap
from loopformer.model.memory import check_loops, loop_cap
from loopformer.sources import DataSource

EXTRAS = ("halting", "budgets", "halting_sweep", "drift", "lengths")   # what evaluate_all adds to `evaluate`'s result


def check_eval_config(cfg: EvalConfig, trained: int) -> None:
    """One-line UserErrors for what `cfg` asks of a model trained with `trained` loops (supervision steps × r):
    loop counts past `loop_cap(trained)`, a halting rule's own most loops past it."""
    check_eval_args(cfg.loops or None, cfg.max_loops or None, cfg.batch_size, cfg.n, trained=trained)
    check_halting_args(trained, cfg.rules, cfg.loops or None, cfg.batch_size, cfg.n)
    for b in cfg.budgets:
        check_loops(int(b), trained, "loops")


@torch.no_grad()
def evaluate_all(model: torch.nn.Module, data: DataSource, cfg: EvalConfig, *, loopwise: bool = True,
                 extras: bool = True, device: torch.device | None = None,
                 autocast: Callable[[], Any] = contextlib.nullcontext, progress: bool = False) -> dict[str, Any]:
    """`model` on `data`'s test split as `cfg` asks: `evaluate`'s result (metrics at r, the loop-wise curve up to
    `cfg.max_loops`, default 2r, unless `loopwise` or `cfg.loopwise` is off), and with `extras` also "halting"
    (`cfg.halt`: `evaluate_halting`), "budgets" (`cfg.budgets`: `evaluate_budgets`, the halting rules capped at
    each budget), "halting_sweep" (`cfg.halt_sweep`: `halting_sweep`) and "drift" (`cfg.drift`: the drift
    diagnostics up to 4r, `loopformer.eval.drift`, reusing the loop-wise curve where it reaches 4r) and "lengths"
    (`cfg.lengths`: the metric at each input length, `loopformer.eval.lengths`) where asked for. `autocast`: the
    precision of the fixed-depth and budget forwards (halting rules run in the model's own)."""
    raw = unwrap(model)
    trained = raw.config.total_loops
    check_eval_config(cfg, trained)
    r = cfg.loops or trained
    wise = loopwise and cfg.loopwise
    common = dict(batch_size=cfg.batch_size, limit=cfg.n, device=device, progress=progress)
    want = (cfg.max_loops or min(2 * r, loop_cap(trained))) if wise else 0
    drift = extras and cfg.drift and 4 * r <= loop_cap(trained)
    # one pass to 4r serves the loop-wise curve and the drift diagnostics (cut back to the curve asked for), except
    # for a budget-aware model, whose loop t depends on the run's length
    share = drift and wise and want < 4 * r and raw.config.timestep_time != "normalized"
    res = fixed_depth(raw, data, loops=r, max_loops=4 * r if share else want, loopwise=wise, autocast=autocast,
                      votes=cfg.votes, step_halt=cfg.step_halt, **common)
    curve = [float(p[data.metric]) for p in res["loopwise"]]
    if share:
        res["max_loops"] = R = max(r, want)
        res["loopwise"] = res["loopwise"][:R]
        res["stepwise"] = [p for p in res["stepwise"] if p["loop"] <= R]
    if not extras:
        return res
    rules = cfg.rules                                                              # parsed by EvalConfig
    if rules:
        res["halting"] = rules_side_by_side(raw, data, rules, loops=cfg.loops or None, **common)
    if cfg.budgets:
        res["budgets"] = budget_runs(raw, data, sorted(set(cfg.budgets)), autocast=autocast, halt=rules, **common)
    if cfg.halt_sweep:
        res["halting_sweep"] = threshold_sweep(raw, data, cfg.halt_sweep, loops=r, **common)
    if cfg.lengths:
        res["lengths"] = length_curve(raw, data, cfg.lengths, loops=cfg.loops, max_loops=cfg.max_loops,
                                      batch_size=cfg.batch_size, limit=cfg.n,
                                      device=device, autocast=autocast, progress=progress)
    if drift:
        res["drift"] = drift_report(raw, data, loops=r, batch_size=cfg.batch_size, limit=cfg.n, device=device,
                                    autocast=autocast, curve=curve if len(curve) >= 4 * r else None)
    return res


__all__ = ["evaluate_all", "check_eval_config", "EXTRAS"]
