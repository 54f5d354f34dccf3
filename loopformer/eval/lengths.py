"""Accuracy against input length, and against loops at each length (length generalisation; `loopformer eval RUN
--lengths 8,16,32,64`, `eval.lengths` in a run config).

For every length n the model's task is regenerated with option length = n (every row of size n; for the
variable-size tasks, `loopformer.tasks.algorithmic`, and the word problem, min_length 0), from the run's data seed
(test rows, disjoint from its training rows), and the model runs T(n) loops — its loop rule's (`model.loop_rule`,
`loopformer.model.lengths`; r for a fixed rule) or the loops given — with the read-out after every loop up to
2·T(n) (or the loops given as the most), so one pass gives the metric at T(n), past it (does the answer hold?) and
at the best loop. The best loop reads the labels; a stop that does not: every row read after the loop, among
1..2·T(n), whose greedy answer the model is most confident of (`confident_stop`: the largest log-probability of the
answer, summed over the scored positions; Fan et al.'s stopping rule for looped models run past their training
lengths, ICLR 2025); and every row read with the answer that most of its loops T(n)..2·T(n) give (`loop_vote`: a
model trained to hold its answer past T(n), `train.loops.jitter`, reaches the answer at twice the training length a
few loops after T(n) and then keeps it, so the answer held longest is the one to read). Rows longer than a model
with learned positions has, or loop counts past the evaluation cap, are one-line errors.

Shapes: R loops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from loopformer.errors import UserError
from loopformer.eval.evaluate import fixed_depth, read_outs
from loopformer.fileio import write_figure
from loopformer.model.lengths import LoopRule
from loopformer.model.memory import check_loops
from loopformer.sources import DataSource, check_data_fits
from loopformer.tasks import get_task

MAX_LENGTHS = 64    # lengths in one evaluation


def parse_lengths(text: str | list) -> list[int]:
    """Lengths from "8,16,32" (or a list): sorted, without repeats; anything but integers >= 1 is a UserError."""
    items = [str(p).strip() for p in (text.split(",") if isinstance(text, str) else text)]
    out = []
    for item in items:
        try:
            n = int(item)
        except ValueError:
            raise UserError(f"--lengths: {item!r} is not a whole number (write e.g. 8,16,32)") from None
        if n < 1:
            raise UserError(f"--lengths: every length must be >= 1 (got {n})")
        out.append(n)
    if not out:
        raise UserError("--lengths: give at least one length (e.g. 8,16,32)")
    if len(set(out)) > MAX_LENGTHS:
        raise UserError(f"--lengths: at most {MAX_LENGTHS} lengths in one evaluation (got {len(set(out))})")
    return sorted(set(out))


def plan_lengths(data: DataSource, cfg, lengths: list[int], *, loops: int = 0, max_loops: int = 0,
                 limit: int = 0) -> list[tuple[int, DataSource, int, int]]:
    """Every length checked before anything runs (a run config's `eval.lengths` at the start of training, the
    `eval` command before its first forward): (n, the data at n, T(n) or `loops`, the curve's most loops) per length;
    one-line UserErrors for a task without a length option, rows the model's positions cannot hold, or loops past
    the evaluation cap. `cfg`: the model's config."""
    rule = LoopRule.parse(cfg.loop_rule)
    rows = limit or data.cfg.n_test
    plan = []
    for n in parse_lengths(lengths):
        _check_length_option(data, n)                      # the task's own bounds on n, drawing nothing
        R = loops or rule.at(n, cfg.loops)
        M = max(R, max_loops or 2 * R)
        check_loops(R, cfg.total_loops, "loops")          # before the rows of length n are drawn
        check_loops(M, cfg.total_loops, "max_loops")
        d_n, task_n = data.at_length(n, rows)              # drawn after their size is checked (`check_draw`)
        check_data_fits(d_n, task_n, cfg)
        plan.append((n, d_n, R, M))
    return plan


def _check_length_option(data: DataSource, n: int) -> None:
    """The task of `data` built with option length = n (as `at_length` builds it), which checks n against the
    task's bounds without drawing a row; nothing for data without a task or a length option (`at_length` says
    why)."""
    task = getattr(data, "task", None)
    options = task.options() if task is not None and hasattr(task, "options") else {}
    if "length" not in options:
        return
    options = {**options, "length": int(n), **({"min_length": 0} if "min_length" in options else {})}
    try:
        get_task(task.name, **options)
    except UserError as exc:
        raise UserError(f"length {n}: {exc}") from None


def _read_stopped(raw: torch.nn.Module, data: DataSource, loops: int, choosers: dict[str, Callable], *,
                  batch_size: int, limit: int, device: torch.device | None, autocast: Callable[[], Any] | None
                  ) -> dict[str, tuple[dict[str, float], torch.Tensor, torch.Tensor]]:
    """Every test row run `loops` loops once and scored, for each named chooser, at the loop
    `choose(logits [R,b,T,C], counted [b,T])` picks for it (-> (loop index [b], a per-row value [b])); returns per
    chooser the metrics, the loops chosen (1-based) and the values."""
    device = device or next(raw.parameters()).device
    autocast = autocast or contextlib.nullcontext
    parts = {k: ([], [], []) for k in choosers}
    was_training = raw.training
    raw.eval()
    try:
        with torch.no_grad():
            for batch in data.eval_batches(batch_size, limit, loops, raw.config.out_dim):
                t = data.as_tensors(batch, device)
                counted = data.counted(t)                                                   # [b,T]
                logits = read_outs(raw, t["inputs"], loops, True, autocast).float()         # [R,b,T,C]
                for k, choose in choosers.items():
                    stop, value = choose(logits, counted)                                   # [b], [b]
                    chosen = logits[stop, torch.arange(len(stop), device=stop.device)]      # [b,T,C]
                    parts[k][0].append(data.score(chosen[None], batch))
                    parts[k][1].append(stop + 1)
                    parts[k][2].append(value.float())
    finally:
        raw.train(was_training)
    return {k: (data.summarize(p, limit, raw.config.loops)[0], torch.cat(st).float(), torch.cat(v))
            for k, (p, st, v) in parts.items()}


def _most_confident(logits: torch.Tensor, counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop of largest c_t = Σ_i max_v log p_t(v | position i) over the scored positions (the first of equals)."""
    conf = (logits.log_softmax(-1).amax(-1) * counted).sum(-1)                              # [R,b]
    return conf.argmax(0), conf.amax(0)


def _voter(first: int, last: int) -> Callable:
    """The loop in first..last whose answer (greedy tokens at the scored positions) the most loops of that window
    give (the latest of equals), and the share of the window that gives it."""
    if not 1 <= first <= last:
        raise UserError(f"loop_vote: the window must be 1 <= first <= last (got {first}..{last})")

    def choose(logits, counted):
        pred = logits[first - 1:last].argmax(-1).masked_fill(~counted.bool(), -1)          # [W,b,T]
        W = pred.shape[0]
        votes = torch.zeros(pred.shape[:2], dtype=torch.long, device=pred.device)          # [W,b]
        for s in range(W):          # one loop's answer against all: memory [W,b,T], not [W,W,b,T]
            votes += (pred == pred[s]).all(-1)                                              # a_t = a_s
        latest = W - 1 - votes.flip(0).argmax(0)                                            # [b]: the latest best
        return first - 1 + latest, votes.amax(0) / W
    return choose


def confident_stop(raw: torch.nn.Module, data: DataSource, loops: int, *, batch_size: int = 256, limit: int = 0,
                   device: torch.device | None = None, autocast: Callable[[], Any] | None = None
                   ) -> tuple[dict[str, float], float]:
    """The metrics when every test row is read after the loop t in 1..`loops` where the model is most confident of
    its greedy answer, c_t = Σ_i max_v log p_t(v | position i) over the row's scored positions (`DataSource.counted`;
    ties: the earliest t), and the mean t chosen. Every row runs every loop; no label is read to choose t."""
    metrics, stops, _ = _read_stopped(raw, data, loops, {"c": _most_confident}, batch_size=batch_size, limit=limit,
                                      device=device, autocast=autocast)["c"]
    return metrics, float(stops.mean())


def loop_vote(raw: torch.nn.Module, data: DataSource, first: int, last: int, *, batch_size: int = 256,
              limit: int = 0, device: torch.device | None = None, autocast: Callable[[], Any] | None = None
              ) -> tuple[dict[str, float], float]:
    """The metrics when every test row is read with the answer most of its loops `first`..`last` give: a_t = the
    greedy tokens at the row's scored positions after loop t; the row is read at the t in first..last whose answer
    the most loops of that window share, |{s : a_s = a_t}| (ties: the latest such t); returns the metrics and the
    mean share of the window's loops that give the chosen answer (1.0: the answer held over the whole window). No
    label is read."""
    metrics, _, share = _read_stopped(raw, data, last, {"v": _voter(first, last)}, batch_size=batch_size,
                                      limit=limit, device=device, autocast=autocast)["v"]
    return metrics, float(share.mean())


def length_curve(raw: torch.nn.Module, data: DataSource, lengths: list[int], *, loops: int = 0, max_loops: int = 0,
                 batch_size: int = 256, limit: int = 0, device: torch.device | None = None,
                 autocast: Callable[[], Any] | None = None, progress: bool = False) -> dict[str, Any]:
    """The metric of `raw` (the model itself) at every length of `lengths` on `data`'s task regenerated at that
    length: `limit` rows (0: the run's test rows) per length, T(n) loops (`loops` > 0: that many at every length),
    the loop-wise curve up to `max_loops` (0: 2·T(n)).

    Returns {"rule", "formula", "metric", "higher_is_better", "trained_size" (the largest training size, None when
    the rows record none), "lengths": [{"length", "loops", "max_loops", "metric" (at T(n)), "at_2x" (at 2·T(n), None
    when the curve stops before), "best", "best_loop" (the best single loop, read from the labels), "confident" (the
    metric with every row stopped at its most confident loop up to the curve's end, `confident_stop`; None for data
    without token read-outs), "confident_loops" (the mean loop it stops at), "vote" (the metric with every row read
    with the answer most of its loops T(n)..the curve's end give, `loop_vote`; None likewise), "vote_share" (the mean
    share of those loops that give it), "loopwise" [metric after loop 1..R],
    "metrics" (every metric at T(n))}]}."""
    cfg = raw.config
    rule = LoopRule.parse(cfg.loop_rule)
    plan = plan_lengths(data, cfg, lengths, loops=loops, max_loops=max_loops, limit=limit)
    out = []
    for n, d_n, R, M in plan:
        res = fixed_depth(raw, d_n, loops=R, max_loops=M, batch_size=batch_size, limit=0, loopwise=True,
                          device=device, autocast=autocast or contextlib.nullcontext, progress=progress, votes=0,
                          step_halt=0.5, per_row=False)
        curve = [float(p[data.metric]) for p in res["loopwise"]] or [float(res["metrics"][data.metric])]
        pick = max if data.higher_is_better else min
        best = pick(range(len(curve)), key=lambda t: curve[t])
        conf, conf_loops, vote, vote_share = (None, None, None, None)
        if cfg.head == "lm":           # token read-outs: the most confident loop and the vote, from one pass
            got = _read_stopped(raw, d_n, M, {"c": _most_confident, "v": _voter(R, M)}, batch_size=batch_size,
                                limit=0, device=device, autocast=autocast)
            conf, conf_loops = float(got["c"][0][data.metric]), float(got["c"][1].mean())
            vote, vote_share = float(got["v"][0][data.metric]), float(got["v"][2].mean())
        out.append({"length": n, "loops": R, "max_loops": M, "metric": curve[R - 1],
                    "at_2x": curve[2 * R - 1] if len(curve) >= 2 * R else None, "best": curve[best],
                    "best_loop": best + 1, "confident": conf, "confident_loops": conf_loops, "vote": vote,
                    "vote_share": vote_share, "loopwise": curve,
                    "metrics": res["metrics"]})
    return {"rule": str(rule), "formula": rule.describe(), "metric": data.metric,
            "higher_is_better": data.higher_is_better, "trained_size": data.largest_size(), "lengths": out}


def format_lengths(res: dict[str, Any]) -> str:
    """A markdown table: per length, the loops run, the metric at T(n), at 2·T(n), at the best loop (read from the
    labels), with every row stopped at its most confident loop (the mean loop it stops at) and read by the vote of its
    loops T(n)..2·T(n) (the mean share of the loops that agree)."""
    m, trained = res["metric"], res.get("trained_size")
    pct = (lambda v: "—" if v is None else f"{100 * v:.1f}") if m == "accuracy" else \
        (lambda v: "—" if v is None else f"{v:.4g}")
    lines = [f"loops T(n) = {res['formula']}" + (f"; trained on sizes up to {trained}" if trained else ""), "",
             f"| length n | loops T(n) | {m} at T(n) | at 2·T(n) | best (loop) | most confident loop (mean) "
             "| vote of loops T(n)..2·T(n) (agreeing) |",
             "|---:|---:|---:|---:|---|---|---|"]
    for p in res["lengths"]:
        mark = "" if trained is None or p["length"] <= trained else " ×" + f"{p['length'] / trained:g}"
        conf = "—" if p.get("confident") is None else f"{pct(p['confident'])} ({p['confident_loops']:.1f})"
        vote = "—" if p.get("vote") is None else f"{pct(p['vote'])} ({100 * p['vote_share']:.0f} %)"
        lines.append(f"| {p['length']}{mark} | {p['loops']} | {pct(p['metric'])} | {pct(p['at_2x'])} | "
                     f"{pct(p['best'])} ({p['best_loop']}) | {conf} | {vote} |")
    return "\n".join(lines)


def lengths_plot(res: dict[str, Any], path: str, title: str = "") -> None:
    """Two panels (PNG): the metric at T(n) against the length n (the largest training size marked), and the metric
    against loops at each length (T(n) marked on each curve)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["lengths"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([p["length"] for p in rows], [p["metric"] for p in rows], "o-")
    if res.get("trained_size"):
        a.axvline(res["trained_size"], ls="--", c="gray", lw=1, label="largest training size")
        a.legend(loc="best", fontsize=8)
    a.set_xscale("log", base=2)
    a.set_xlabel("length n")
    a.set_ylabel(f"{res['metric']} at T(n) loops")
    for p in rows:
        t = range(1, len(p["loopwise"]) + 1)
        (line,) = b.plot(t, p["loopwise"], label=f"n = {p['length']}")
        b.plot([p["loops"]], [p["metric"]], "o", c=line.get_color())
    b.set_xlabel("loops")
    b.set_ylabel(res["metric"])
    b.legend(loc="best", fontsize=8)
    fig.suptitle(title or f"loops T(n) = {res['formula']}")
    fig.tight_layout()
    try:
        write_figure(fig, path, dpi=110)        # atomic, replacing a link at `path` rather than writing through it
    finally:
        plt.close(fig)


__all__ = ["parse_lengths", "plan_lengths", "confident_stop", "loop_vote", "length_curve", "format_lengths",
           "lengths_plot"]
