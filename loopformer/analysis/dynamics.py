"""Training dynamics of a trained looped model (`loopformer analyze dynamics RUN|CHECKPOINT`).

Two views of whether the loop is used and whether the timestep modulation is alive:

    after training   on the task's test split, per loop t = 1..R (R may exceed the trained r): the TMLT gates
                     |γ1(t)|, |γ2(t)| and scales |α1(t)|, |α2(t)|, the update size ‖h_t − h_{t−1}‖ / ‖h_{t−1}‖, the
                     read-out's loss and accuracy (or squared error), and the distribution of the settle loop (the
                     first loop after which a sample's answer no longer changes)
    during training  from the run's "dynamics" records in metrics.jsonl (written every log.dynamics_every steps):
                     the gradient norm per parameter group, the mean gate and update size over steps

    ablation         (TMLT) the metric at the trained r as trained, with every loop reading the trained loops'
                     average modulation (the loop index removed, the learned scales kept), and without modulation
                     (the plain looped block with the same weights): whether the loop index is used at all

    drift            past r: the metric, state and read-out change up to 4r, the spectral radius of the next
                     loop's map, a verdict settling / marginal / drifting (`loopformer.eval.drift`)

Writes DIR/dynamics.json, dynamics.md, dynamics_loops.png, dynamics_drift.png and (for a run folder with records)
dynamics_train.png.
The measurements themselves are `loopformer.model.diagnostics`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loopformer.configio import from_dict
from loopformer.device import pick_device
from loopformer.errors import UserError
from loopformer.eval.drift import drift_report, drift_table
from loopformer.eval.evaluate import evaluate
from loopformer.fileio import write_figure, write_json, write_text
from loopformer.model.diagnostics import (
    fixed_modulation,
    loop_dynamics,
    modulation_ablations,
    modulation_stats,
    summarize_settle,
)
from loopformer.model.io import CONFIG, load, read_config, resolve_checkpoint
from loopformer.model.layers import PARAM_GROUPS
from loopformer.model.memory import check_loops
from loopformer.sources import DataSource, TaskConfig, make_data
from loopformer.tasks import IGNORE
from loopformer.train.run import CKPT_DIR, METRICS_FILE, read_metrics

MOD_KEYS = ("gate_attn", "gate_mlp", "alpha_attn", "alpha_mlp")


def dynamics_of(model: torch.nn.Module, data: DataSource, *, loops: int, batch_size: int = 256, limit: int = 0,
                device: torch.device | None = None) -> dict[str, Any]:
    """Per-loop dynamics of `model` on `data`'s test split (the first `limit` rows; 0: all), t = 1..loops."""
    device = device or next(model.parameters()).device
    sums: dict[str, np.ndarray] = {}
    weights: dict[str, float] = {}
    settle: list[int] = []
    for batch in data.test_batches(batch_size, limit):
        b = data.as_tensors(batch, device)
        x, y, w = b["inputs"], b["targets"], b.get("weight")
        res = loop_dynamics(model, x, y, loops=loops, weight=w, ignore_index=IGNORE)
        n = x.shape[0]
        for k in ("update", "loss", "token_accuracy"):
            if k in res:
                sums[k] = sums.get(k, 0.0) + np.asarray(res[k]) * n
                weights[k] = weights.get(k, 0.0) + n
        settle += res["settle"]
    if not settle:
        raise UserError("the test split is empty: nothing to measure")
    out: dict[str, Any] = {"loops": loops, "rows": len(settle)}
    out.update({k: (sums[k] / weights[k]).tolist() for k in sums})
    out.update(summarize_settle(settle, loops))
    mods = modulation_stats(model, loops)
    if mods:
        out.update(mods)
    return out


def training_curves(records: list[dict]) -> dict[str, list]:
    """Series over steps from a run's "dynamics" records: step, grad_norm_<group>, mean gate / update, settle."""
    def num(v: Any) -> float:   # metrics.jsonl writes an undefined value as null; a value of another type
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)       # (a damaged record) counts as undefined
        return float(v) if ok else float("nan")

    def mean(v: Any) -> float:  # a per-loop list's mean (NaN when it is no list of numbers)
        vals = [num(x) for x in v] if isinstance(v, list) else []
        return float(np.mean([x for x in vals if not math.isnan(x)])) if any(not math.isnan(x) for x in vals) \
            else float("nan")

    recs = [r for r in records if r.get("split") == "dynamics" and isinstance(r.get("step"), int)]
    out: dict[str, list] = {"step": [r["step"] for r in recs]}
    for g in PARAM_GROUPS:
        key = f"grad_norm_{g}"
        if any(key in r for r in recs):
            out[key] = [num(r.get(key)) for r in recs]
    for k in (*MOD_KEYS, "update"):
        if any(k in r for r in recs):
            out[f"mean_{k}"] = [mean(r.get(k)) for r in recs]
    if any("settle_mean" in r for r in recs):
        out["settle_mean"] = [num(r.get("settle_mean")) for r in recs]
    return out


def to_markdown(res: dict[str, Any], trained: int) -> str:
    head = [res["metric"]] if res.get("metric") in ("accuracy", "mse") and res["metric"] in res else []
    cols = head + [c for c in ("token_accuracy", "loss", "update", *MOD_KEYS) if c in res]
    lines = ["| t | " + " | ".join(cols) + " | settled at t |", "|---" * (len(cols) + 2) + "|"]
    hist = res["settle_hist"]
    for t in range(res["loops"]):
        mark = f"{t + 1}" + (" (r)" if t + 1 == trained else "")
        vals = [f"{res[c][t]:.4g}" for c in cols]
        lines.append(f"| {mark} | " + " | ".join(vals) + f" | {hist[t]} |")
    lines.append("")
    lines.append(f"settle loop over {res['rows']} test rows: mean {res['settle_mean']:.2f}, median "
                 f"{res['settle_median']:.0f}, 90th percentile {res['settle_p90']:.1f} (of {res['loops']} loops)")
    return "\n".join(lines) + "\n"


def ablation_markdown(ab: dict[str, Any] | None, trained: int) -> str:
    """One line: the metric at r as trained, with the loops' average modulation, and without modulation."""
    if not ab:
        return ""
    metric = ab["metric"]
    fmt = (lambda v: f"{100 * v:.1f} %") if metric == "accuracy" else (lambda v: f"{v:.4g}")
    parts = [f"{k} {fmt(v)}" for k, v in ab.items() if k != "metric"]
    return f"\n{metric} at r = {trained}: " + ", ".join(parts) + "\n"


def plot_loops(res: dict[str, Any], trained: int, path: str | os.PathLike, title: str = "") -> None:
    import matplotlib  # heavy: imported only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.arange(1, res["loops"] + 1)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    ax = axes[0]
    if "token_accuracy" in res:
        ax.plot(t, res["token_accuracy"], marker=".", label="token accuracy")
        if "accuracy" in res:
            ax.plot(t, res["accuracy"], marker=".", label="accuracy")
        ax.set_ylabel("accuracy")
        ax.legend(fontsize=7, loc="lower right")
        ax2 = ax.twinx()
        ax2.plot(t, res["loss"], color="C1", marker=".", label="loss")
        ax2.set_ylabel("loss")
    else:
        ax.plot(t, res["loss"], marker=".")
        ax.set_yscale("log")
        ax.set_ylabel("squared error")
    ax.set_title("read-out after loop t")
    axes[1].plot(t, res["update"], marker=".")
    axes[1].set_yscale("log")
    axes[1].set_title("update ‖h_t − h_{t−1}‖ / ‖h_{t−1}‖")
    if "gate_attn" in res:
        for k in MOD_KEYS:
            axes[2].plot(t, res[k], marker=".", label=k.replace("gate_", "|γ| ").replace("alpha_", "|α| "))
        axes[2].legend(fontsize=7)
        axes[2].set_title("modulation (mean over width)")
    else:
        axes[2].text(0.5, 0.5, "no timestep modulation", ha="center", va="center", transform=axes[2].transAxes)
        axes[2].set_title("modulation")
    axes[3].bar(t, res["settle_hist"])
    axes[3].set_title("settle loop (samples)")
    for ax in axes:
        ax.set_xlabel("loop t")
        ax.axvline(trained, color="grey", lw=0.8, ls="--")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    write_figure(fig, path, dpi=110)
    plt.close(fig)


def plot_drift(rep: dict[str, Any], path: str | os.PathLike, title: str = "") -> None:
    """The metric and the relative state change after every loop up to 4r, with r, 2r, 4r marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = np.arange(1, len(rep["metric_per_loop"]) + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(t, rep["metric_per_loop"])
    a.set_ylabel(rep["metric"])
    b.semilogy(t, np.maximum(np.asarray(rep["state_change"]), 1e-12))
    b.set_ylabel("‖h_t − h_{t−1}‖ / ‖h_{t−1}‖")
    for ax in (a, b):
        for k in (1, 2, 4):
            ax.axvline(k * rep["loops"], color="grey", lw=0.7, ls="--")
        ax.set_xlabel("loop t")
    fig.suptitle(f"{title} — {rep['verdict']}")
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)


def plot_training(curves: dict[str, list], path: str | os.PathLike, title: str = "") -> None:
    import matplotlib  # heavy: imported only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = curves["step"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for g in PARAM_GROUPS:
        if f"grad_norm_{g}" in curves:
            axes[0].plot(steps, curves[f"grad_norm_{g}"], label=g)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[0].set_title("gradient norm per group")
    for k in MOD_KEYS:
        if f"mean_{k}" in curves:
            axes[1].plot(steps, curves[f"mean_{k}"], label=k)
    if any(f"mean_{k}" in curves for k in MOD_KEYS):
        axes[1].legend(fontsize=7)
    axes[1].set_title("modulation, mean over loops")
    if "mean_update" in curves:
        axes[2].plot(steps, curves["mean_update"], label="mean update")
    if "settle_mean" in curves:
        ax2 = axes[2].twinx()
        ax2.plot(steps, curves["settle_mean"], color="C1", label="settle loop (mean)")
        ax2.set_ylabel("settle loop")
    axes[2].set_yscale("log")
    axes[2].set_title("update size (mean over loops)")
    for ax in axes:
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    write_figure(fig, path, dpi=110)
    plt.close(fig)


def analyze_dynamics(path: str, out: str, *, max_loops: int = 0, limit: int = 500, batch_size: int = 250,
                     device: str = "auto") -> dict[str, Any]:
    """The `analyze dynamics` command's work: measure, then write json / md / png into `out`."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"not found: {p}")
    run_dir = None
    if resolve_checkpoint(p) != p:
        run_dir, p = p, resolve_checkpoint(p)
    elif p.name == CKPT_DIR and (p.parent / METRICS_FILE).is_file():
        run_dir = p.parent
    if not (p / CONFIG).is_file():
        raise UserError(f"{path} is neither a run folder nor a checkpoint folder (no {CONFIG})")
    _, extra = read_config(p)
    run = extra.get("run") or {}
    if not run.get("task"):
        raise UserError(f"{p} records no task (it was not written by `loopformer train`)")
    if max_loops < 0 or limit < 0 or batch_size < 1:
        raise UserError("max_loops and limit must be >= 0 and batch_size >= 1")
    dev = pick_device(device)
    model = load(p, device=dev)
    data = make_data(from_dict(TaskConfig, run["task"]))
    trained = model.config.loops
    if max_loops and max_loops < trained:
        raise UserError(f"max_loops={max_loops} is below the model's trained loops ({trained}): the dynamics are "
                        f"measured at least up to r")
    if max_loops:
        check_loops(max_loops, trained, "max_loops")                   # before anything is measured
    R = max_loops or 2 * trained
    res = dynamics_of(model, data, loops=R, batch_size=batch_size, limit=limit, device=dev)
    ev = evaluate(model, data, loops=trained, max_loops=R, batch_size=batch_size, limit=limit, device=dev)
    if ev["loopwise"]:   # the task's headline metric after every loop (e.g. exact-match accuracy)
        res[ev["metric"]] = [float(m[ev["metric"]]) for m in ev["loopwise"]]
        res["metric"] = ev["metric"]
    report: dict[str, Any] = {"checkpoint": str(p), "trained_loops": trained, "variant": model.config.variant,
                              "per_loop": res}
    ablations = modulation_ablations(model, trained)
    if ablations:
        report["ablation"] = {"metric": ev["metric"], "as trained": float(ev["metrics"][ev["metric"]])}
        for name, mod in ablations.items():
            with fixed_modulation(model, mod):
                m = evaluate(model, data, loops=trained, max_loops=trained, loopwise=False, batch_size=batch_size,
                             limit=limit, device=dev)
            report["ablation"][name] = float(m["metrics"][m["metric"]])
    report["drift"] = drift_report(model, data, loops=trained, batch_size=batch_size, limit=limit, device=dev)
    curves = training_curves(read_metrics(run_dir)) if run_dir is not None else {"step": []}
    if curves["step"]:
        report["training"] = curves
    os.makedirs(out, exist_ok=True)
    name = run_dir.name if run_dir is not None else p.name
    table = to_markdown(res, trained) + ablation_markdown(report.get("ablation"), trained) \
        + "\n\n## Drift past r (up to 4r)\n\n" + drift_table(report["drift"]) + "\n"
    write_text(Path(out) / "dynamics.md", f"# Dynamics of {name} ({model.config.variant}, trained r = {trained})\n\n"
           + table)
    write_json(Path(out) / "dynamics.json", report)
    plot_loops(res, trained, Path(out) / "dynamics_loops.png", title=name)
    plot_drift(report["drift"], Path(out) / "dynamics_drift.png", title=name)
    if curves["step"]:
        plot_training(curves, Path(out) / "dynamics_train.png", title=name)
    report["table"] = table
    return report

