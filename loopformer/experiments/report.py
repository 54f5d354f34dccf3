"""Result tables and plots from finished runs, in the layout of the paper's Table 2.

    | Task    | Standard L=6 | Looped r=4 | r=8 | ... | w/ Timestep r=4 | r=8 | ... |

one row per task, the headline metric in % for accuracies (as in the paper) and as-is for errors / perplexities;
cells with several runs (seeds) show their mean. Files written into the sweep folder:

    table.md        the markdown table (and a line per task on the metric)
    table.csv       the same table
    runs.csv        one row per run: task, variant, layers, loops, metric, value, parameters, steps, time, folder
    by_config.md    one row per run configuration (the run's folder name without its `seed=` part): the number
                    of seeds, the median and range over seeds at the trained r and at the last evaluated loop
    loops.png       the metric against the loop count r: one line per variant, the standard Transformer as a
                    dashed level (one panel per task)
    loopwise.png    the metric after each loop t = 1..R of every looped run (the trained r marked): extrapolation
    generalisation.md  with other data (`report --data DIR` / `--task-opt KEY=VALUE`): every run evaluated on it at
                    its trained r next to its own test split (length generalisation, harder puzzles, another seed)
    paired.md       looped vs TMLT runs that differ only in `timestep` (same task, r, other settings and seed):
                    both medians and the per-seed paired differences (only when some run has its twin)
    halting.md      runs evaluated with halting rules (`eval.halt`): each rule's metric, mean loops, loops saved
                    and wall-time speed-up next to fixed depth (only when some run has them)
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from loopformer.errors import UserError
from loopformer.eval.budgets import budgets_plot
from loopformer.eval.commands import evaluate_checkpoint
from loopformer.eval.config import EvalConfig
from loopformer.eval.evaluate import check_eval_args
from loopformer.experiments.stale import moved_aside
from loopformer.fileio import write_figure, write_text
from loopformer.tasks import TASKS, task_options
from loopformer.train.run import STAGES_DIR, STAGES_FILE

VARIANT_TITLES = {"standard": "Standard", "looped": "Looped", "tmlt": "w/ Timestep"}
_TASK_TITLES = {"lcs": "LCS", "edit_distance": "ED", "sudoku": "Sudoku", "countdown": "Countdown", "icl": "ICL",
                "text": "LM", "word_problem": "Word problem", "pointer_chase": "Pointer chase", "schedule": "Circuit",
                "parity": "Parity", "copy": "Copy", "addition": "Addition", "binary_sum": "Binary sum",
                "column_addition": "Column addition"}


def _earlier_stage(f: Path) -> bool:
    """Whether results.json `f` is a staged run's earlier stage (out_dir/stages/<k>-<name>/): the staged run counts
    once, by its last stage's results in out_dir (`loopformer.train.stages`)."""
    stage = f.parent
    return stage.parent.name == STAGES_DIR and (stage.parent.parent / STAGES_FILE).is_file()


def find_runs(folder: str | os.PathLike) -> list[dict]:
    """results.json of every finished run under `folder` (a sweep folder, a run folder, or a folder of runs); runs
    moved aside as stale (`loopformer.experiments.stale`) are not among them."""
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"not a folder: {root}")
    out = []
    for f in sorted(root.rglob("results.json")):
        if "checkpoint" in f.parts or moved_aside(f.relative_to(root)) or _earlier_stage(f):
            continue
        try:
            r = json.loads(f.read_text())
        except json.JSONDecodeError:
            raise UserError(f"{f} is not valid JSON") from None
        r["_dir"] = str(f.parent)
        out.append(r)
    return out


def task_label(task: dict) -> str:
    name = task.get("name", "?")
    title = _TASK_TITLES.get(name, name)
    opts = task.get("options") or {}
    if name in ("lcs", "edit_distance") and "length" in opts:
        return f"{title} ({opts['length']})"
    if name == "icl":
        return f"{title} ({opts.get('function_class', '')})"
    knob = {"word_problem": ("length", "n"), "pointer_chase": ("hops", "k"), "schedule": ("layers", "K")}.get(name)
    if knob and knob[0] in opts:
        return f"{title} ({knob[1]}={opts[knob[0]]})"
    if name in TASKS and "min_length" in task_options(name) and "length" in opts:       # the variable-size tasks
        low = opts.get("min_length") or opts["length"]
        return f"{title} (n={opts['length']})" if low == opts["length"] else f"{title} (n={low}..{opts['length']})"
    return title


def _value(r: dict) -> float:
    return float(r["test"][r["metric"]])


def _fmt(v: float, metric: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if metric == "accuracy":
        return f"{100 * v:.1f}"
    return f"{v:.3g}"


def organise(runs: list[dict]) -> dict[str, Any]:
    """{task: {"metric", "cells": {(variant, size): [values]}}} with size = L for standard, r otherwise."""
    tasks: dict[str, dict] = {}
    for r in runs:
        label = task_label(r.get("task", {}))
        t = tasks.setdefault(label, {"metric": r["metric"], "higher": r.get("higher_is_better", True),
                                     "cells": defaultdict(list)})
        variant = r["variant"]
        size = r["n_layers"] if variant == "standard" else r["loops"]
        t["cells"][(variant, size)].append(_value(r))
    return tasks


def _columns(tasks: dict) -> list[tuple[str, int]]:
    cols = set()
    for t in tasks.values():
        cols.update(t["cells"].keys())
    order = {"standard": 0, "looped": 1, "tmlt": 2}
    return sorted(cols, key=lambda c: (order.get(c[0], 9), c[1]))


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals) if vals else float("nan")


def table(runs: list[dict]) -> tuple[str, str]:
    """(markdown, csv) in the layout of Table 2."""
    if not runs:
        raise UserError("no finished runs found (no results.json)")
    tasks = organise(runs)
    cols = _columns(tasks)
    heads = []
    prev = None
    for variant, size in cols:
        key = "L" if variant == "standard" else "r"
        heads.append(f"{VARIANT_TITLES.get(variant, variant)} {key}={size}" if variant != prev else f"{key}={size}")
        prev = variant
    md = ["| Task | " + " | ".join(heads) + " |", "|---|" + "---|" * len(cols)]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["task", "metric"] + [f"{VARIANT_TITLES.get(v, v)} {'L' if v == 'standard' else 'r'}={s}"
                                     for v, s in cols])
    notes = []
    for label, t in tasks.items():
        vals = [_mean(t["cells"].get(c, [])) for c in cols]
        md.append(f"| {label} | " + " | ".join(_fmt(v, t["metric"]) if c in t["cells"] else ""
                                               for v, c in zip(vals, cols)) + " |")
        w.writerow([label, t["metric"]] + ["" if c not in t["cells"] else f"{v:.6g}" for v, c in zip(vals, cols)])
        unit = " (%)" if t["metric"] == "accuracy" else ""
        arrow = "↑" if t["higher"] else "↓"
        seeds = max(len(v) for v in t["cells"].values())
        notes.append(f"{label}: test {t['metric']}{unit} {arrow}" + (f", mean of up to {seeds} seeds" if seeds > 1
                                                                     else ""))
    return "\n".join(md + [""] + notes) + "\n", buf.getvalue()


def config_key(run_dir: str) -> str:
    """A run's configuration name: its folder name with the `seed=N` part removed (seeds of one cell share it)."""
    parts = [p for p in Path(run_dir).name.split("_") if not p.startswith("seed=")]
    return "_".join(parts) or "default"


def _median(vals: list[float]) -> float:
    v = sorted(vals)
    n = len(v)
    return float("nan") if not n else (v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2]))


def _median_range(vals: list[float], metric: str) -> str:
    """"median [min–max]" of `vals` in the metric's display units."""
    return f"{_fmt(_median(vals), metric)} [{_fmt(min(vals), metric)}–{_fmt(max(vals), metric)}]"


def configs_table(runs: list[dict]) -> str:
    """Markdown: one row per (task, configuration), median [min–max] over its seeds at the trained r and at the
    last loop of the loop-wise curve (each seed's values listed)."""
    if not runs:
        raise UserError("no finished runs found (no results.json)")
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in runs:
        groups[(task_label(r.get("task", {})), config_key(r["_dir"]))].append(r)
    lines = ["| task | configuration | variant | r | params | seeds | median at r [min–max] | per seed | "
             "median at last t [min–max] |", "|---|---|---|---:|---:|---:|---|---|---|"]
    for (label, key), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r.get("seed", 0))
        metric = rs[0]["metric"]
        vals = [_value(r) for r in rs]
        last = [float(r["loopwise"][-1][metric]) for r in rs if r.get("loopwise")]
        last_t = rs[0]["loopwise"][-1]["loop"] if rs[0].get("loopwise") else None
        rng = _median_range(vals, metric)
        per = ", ".join(f"{r.get('seed', '?')}: {_fmt(v, metric)}" for r, v in zip(rs, vals))
        lrng = f"t={last_t}: {_median_range(last, metric)}" if last else ""
        lines.append(f"| {label} | {key} | {rs[0]['variant']} | {rs[0]['loops']} | {rs[0].get('params', '')} | "
                     f"{len(rs)} | {rng} | {per} | {lrng} |")
    return "\n".join(lines) + "\n"


def paired_table(runs: list[dict]) -> str | None:
    """Markdown: looped and TMLT runs paired by seed within one configuration (the folder name without its `seed=`
    and `timestep=` parts, the task and r): each model's median [min–max] and the paired differences TMLT − looped,
    with how many seeds the TMLT is at or ahead of its looped twin (higher accuracy, lower error). None when no
    run has a twin."""
    groups: dict[tuple[str, str, int], dict[str, dict]] = defaultdict(lambda: {"looped": {}, "tmlt": {}})
    for r in runs:
        if r["variant"] not in ("looped", "tmlt"):
            continue
        key = "_".join(p for p in config_key(r["_dir"]).split("_") if not p.startswith("timestep=")) or "default"
        groups[(task_label(r.get("task", {})), key, r["loops"])][r["variant"]][r.get("seed", 0)] = r
    lines = ["| task | configuration | r | seeds | looped median [min–max] | TMLT median [min–max] | "
             "TMLT − looped per seed | median difference | TMLT at or ahead |",
             "|---|---|---:|---:|---|---|---|---:|---:|"]
    for (label, key, loops), g in sorted(groups.items()):
        seeds = sorted(set(g["looped"]) & set(g["tmlt"]))
        if not seeds:
            continue
        first = g["looped"][seeds[0]]
        metric, higher = first["metric"], first.get("higher_is_better", True)
        sc = _scale(metric)
        a = [_value(g["looped"][s]) for s in seeds]
        b = [_value(g["tmlt"][s]) for s in seeds]
        diff = [sc(y) - sc(x) for x, y in zip(a, b)]
        ahead = sum((d >= 0) == higher or d == 0 for d in diff)
        digits = 1 if metric == "accuracy" else 4
        per = ", ".join(f"{s}: {d:+.{digits}f}" for s, d in zip(seeds, diff))
        lines.append(f"| {label} | {key} | {loops} | {len(seeds)} | {_median_range(a, metric)} | "
                     f"{_median_range(b, metric)} | {per} | "
                     f"{_median(diff):+.{digits}f} | {ahead} of {len(seeds)} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else None


def _budget_groups(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in runs:
        if r.get("budgets"):
            groups[(task_label(r.get("task", {})), config_key(r["_dir"]))].append(r)
    return groups


def budgets_table(runs: list[dict]) -> str | None:
    """Markdown: for the runs evaluated over loop budgets (results.json "budgets", `eval.budgets`), one row per
    (task, configuration) and one column per budget R: the metric when run with R loops, median [min–max] over
    its seeds; then the same for each run. None when no run has budgets."""
    groups = _budget_groups(runs)
    if not groups:
        return None
    budgets = sorted({b["loops"] for rs in groups.values() for r in rs for b in r["budgets"]["budgets"]})
    lines = ["| task | configuration | r | seeds | " + " | ".join(f"R = {b}" for b in budgets) + " |",
             "|---|---|---:|---:|" + "---|" * len(budgets)]
    for (label, key), rs in sorted(groups.items()):
        metric = rs[0]["metric"]
        cells = []
        for R in budgets:
            vals = [float(b["metrics"][metric]) for r in rs for b in r["budgets"]["budgets"] if b["loops"] == R]
            cells.append(_median_range(vals, metric) if len(vals) > 1 else (_fmt(vals[0], metric) if vals else ""))
        lines.append(f"| {label} | {key} | {rs[0]['loops']} | {len(rs)} | " + " | ".join(cells) + " |")
    lines += ["", "Each run:", "", "| task | configuration | seed | " + " | ".join(f"R = {b}" for b in budgets) + " |",
              "|---|---|---:|" + "---|" * len(budgets)]
    for (label, key), rs in sorted(groups.items()):
        metric = rs[0]["metric"]
        for r in sorted(rs, key=lambda r: r.get("seed", 0)):
            at = {b["loops"]: b["metrics"][metric] for b in r["budgets"]["budgets"]}
            lines.append(f"| {label} | {key} | {r.get('seed', '')} | "
                         + " | ".join(_fmt(at[R], metric) if R in at else "" for R in budgets) + " |")
    return "\n".join(lines) + "\n"


def _length_cells(rs: list[dict], lengths: list[int], field: str) -> list[str]:
    """One cell per length: the runs' `field` of their lengths entry ("metric", "vote"), median [min–max] over them
    (the value alone for one run, empty for none)."""
    metric, cells = rs[0]["metric"], []
    for n in lengths:
        vals = [float(p[field]) for r in rs for p in r["lengths"]["lengths"]
                if p["length"] == n and p.get(field) is not None]
        cells.append(_median_range(vals, metric) if len(vals) > 1 else (_fmt(vals[0], metric) if vals else ""))
    return cells


def lengths_table(runs: list[dict]) -> str | None:
    """Markdown: for the runs evaluated at other input lengths (results.json "lengths", `eval.lengths`), one row per
    (task, configuration) and one column per length n: the metric with the model's loops T(n), median [min–max]
    over its seeds; the same read by the vote of each row's loops T(n)..2·T(n) (where the runs have it); then each
    run with its loops per length. None when no run has lengths."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in runs:
        if r.get("lengths"):
            groups[(task_label(r.get("task", {})), config_key(r["_dir"]))].append(r)
    if not groups:
        return None
    lengths = sorted({p["length"] for rs in groups.values() for r in rs for p in r["lengths"]["lengths"]})
    head = " | ".join(f"n = {n}" for n in lengths)
    lines = [f"| task | configuration | loops T(n) | trained up to | seeds | {head} |",
             "|---|---|---|---:|---:|" + "---|" * len(lengths)]
    for (label, key), rs in sorted(groups.items()):
        info = rs[0]["lengths"]
        lines.append(f"| {label} | {key} | {info['formula']} | {info.get('trained_size') or ''} | {len(rs)} | "
                     + " | ".join(_length_cells(rs, lengths, "metric")) + " |")
    voted = {g: rs for g, rs in groups.items()
             if any(p.get("vote") is not None for r in rs for p in r["lengths"]["lengths"])}
    if voted:
        lines += ["", "Every row read by the vote of its loops T(n)..2·T(n) (the answer most of them give; no label "
                  "read):", "", f"| task | configuration | seeds | {head} |", "|---|---|---:|" + "---|" * len(lengths)]
        for (label, key), rs in sorted(voted.items()):
            lines.append(f"| {label} | {key} | {len(rs)} | " + " | ".join(_length_cells(rs, lengths, "vote")) + " |")
    lines += ["", "Each run (the metric, and the loops it ran, at each length):", "",
              f"| task | configuration | seed | {head} |", "|---|---|---:|" + "---|" * len(lengths)]
    for (label, key), rs in sorted(groups.items()):
        metric = rs[0]["metric"]
        for r in sorted(rs, key=lambda r: r.get("seed", 0)):
            at = {p["length"]: p for p in r["lengths"]["lengths"]}
            lines.append(f"| {label} | {key} | {r.get('seed', '')} | " + " | ".join(
                f"{_fmt(at[n]['metric'], metric)} ({at[n]['loops']})" if n in at else "" for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def plot_budgets(runs: list[dict], path: str | os.PathLike) -> Path | None:
    """The median over seeds of the metric when run with each budget, one line per configuration."""
    groups = _budget_groups(runs)
    if not groups:
        return None
    curves = {}
    for (label, key), rs in sorted(groups.items()):
        metric = rs[0]["metric"]
        Rs = sorted({b["loops"] for r in rs for b in r["budgets"]["budgets"]})
        curves[key if len({g[0] for g in groups}) == 1 else f"{label}: {key}"] = {
            "metric": metric, "trained_loops": rs[0]["total_loops"],
            "budgets": [{"loops": R, "metrics": {metric: _median([float(b["metrics"][metric]) for r in rs
                                                                  for b in r["budgets"]["budgets"]
                                                                  if b["loops"] == R])}} for R in Rs]}
    budgets_plot(curves, str(path), title="median over seeds, run with R loops")
    return Path(path)


def runs_csv(runs: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["task", "variant", "n_layers", "loops", "metric", "value", "params", "steps", "train_time_s",
                "seed", "run"])
    for r in sorted(runs, key=lambda r: (task_label(r.get("task", {})), r["variant"], r["n_layers"], r["loops"])):
        w.writerow([task_label(r.get("task", {})), r["variant"], r["n_layers"], r["loops"], r["metric"],
                    f"{_value(r):.6g}", r.get("params", ""), r.get("steps", ""),
                    f"{r.get('train_time_s', float('nan')):.1f}", r.get("seed", ""), r["_dir"]])
    return buf.getvalue()


def _scale(metric: str):
    return (lambda v: 100 * v) if metric == "accuracy" else (lambda v: v)


def plot_loops(runs: list[dict], path: str | os.PathLike) -> Path:
    """The metric against r, one line per variant, the standard Transformer(s) as dashed levels."""
    import matplotlib  # heavy: imported only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = organise(runs)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    colors = {"looped": "tab:blue", "tmlt": "tab:red"}
    for ax, (label, t) in zip(axes[0], tasks.items()):
        sc = _scale(t["metric"])
        for variant in ("looped", "tmlt"):
            pts = sorted((s, _mean(v)) for (var, s), v in t["cells"].items() if var == variant)
            if pts:
                ax.plot([p[0] for p in pts], [sc(p[1]) for p in pts], marker="o", color=colors[variant],
                        label=VARIANT_TITLES[variant])
        for i, ((_var, s), v) in enumerate(sorted((k, v) for k, v in t["cells"].items() if k[0] == "standard")):
            ax.axhline(sc(_mean(v)), color="gray", linestyle="--" if i == 0 else ":", label=f"Standard L={s}")
        loops = sorted({s for (var, s) in t["cells"] if var != "standard"})
        if loops and max(loops) / max(min(loops), 1) >= 4:
            ax.set_xscale("log", base=2)
        if loops:
            ax.set_xticks(loops)
            ax.set_xticklabels([str(r) for r in loops])
        ax.set_xlabel("loops r")
        ax.set_ylabel(f"test {t['metric']}" + (" (%)" if t["metric"] == "accuracy" else ""))
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = write_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_loopwise(runs: list[dict], path: str | os.PathLike) -> Path | None:
    """The metric after each loop t of every looped run, its trained r marked; None when no run has a curve."""
    import matplotlib  # heavy: imported only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r.get("loopwise") and r["variant"] != "standard"]
    if not runs:
        return None
    labels = sorted({task_label(r.get("task", {})) for r in runs})
    fig, axes = plt.subplots(1, len(labels), figsize=(5.2 * len(labels), 3.8), squeeze=False)
    cmap = {"looped": plt.get_cmap("Blues"), "tmlt": plt.get_cmap("Reds")}
    for ax, label in zip(axes[0], labels):
        group = sorted((r for r in runs if task_label(r.get("task", {})) == label),
                       key=lambda r: (r["variant"], r["loops"]))
        rs = sorted({r["loops"] for r in group})
        for r in group:
            sc = _scale(r["metric"])
            shade = 0.4 + 0.6 * (rs.index(r["loops"]) + 1) / len(rs)
            c = cmap.get(r["variant"], plt.get_cmap("Greens"))(shade)
            xs = [p["loop"] for p in r["loopwise"]]
            ys = [sc(p[r["metric"]]) for p in r["loopwise"]]
            ax.plot(xs, ys, color=c, label=f"{VARIANT_TITLES.get(r['variant'], r['variant'])} r={r['loops']}")
            ax.plot([r["loops"]], [ys[r["loops"] - 1]], marker="o", color=c)
        metric = group[0]["metric"]
        ax.set_xlabel("loop t (dot: trained r)")
        ax.set_ylabel(f"test {metric}" + (" (%)" if metric == "accuracy" else ""))
        ax.set_title(f"{label}: metric after each loop")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = write_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def halting_table(runs: list[dict]) -> str | None:
    """One row per (run, halting rule) of the runs evaluated with `eval.halt` (None when no run was)."""
    rows = [r for r in runs if r.get("halting")]
    if not rows:
        return None
    lines = ["| run | rule | metric | fixed r | halting | mean loops | loops saved | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h = r["halting"]
        m = h["metric"]
        fixed = _fmt(h["fixed"]["metrics"][m], m)
        for q in h["rules"]:
            lines.append(f"| {Path(r['_dir']).name} | {q['rule']} | {m} | {fixed} (r = {h['loops']}) | "
                         f"{_fmt(q['metrics'][m], m)} | {q['mean_loops']:.2f} | {100 * q['loops_saved']:.0f} % | "
                         f"{q['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def generalisation_table(runs: list[dict], data_dir: str | None = None, task_opts: dict | None = None,
                         device: str = "auto", limit: int = 0) -> str:
    """Markdown: every run evaluated at its trained r on other data (a dataset folder `data_dir`, or its task with
    `task_opts` changed: `loopformer.eval.commands.evaluate_checkpoint`) next to its own test split; one row per
    (task, configuration), median [min–max] over seeds. A run the data cannot fit shows why."""
    if not runs:
        raise UserError("no finished runs found (no results.json)")
    what = f"the dataset folder {data_dir}" if data_dir else \
        "the test split regenerated with " + ", ".join(f"{k}={v}" for k, v in (task_opts or {}).items())
    groups: dict[tuple[str, str], list[tuple[dict, Any]]] = defaultdict(list)
    check_eval_args(limit=limit)
    cfg = EvalConfig(n=limit, loopwise=False, drift=False)
    for r in runs:
        try:
            other = evaluate_checkpoint(r["_dir"], cfg, device=device,
                                        progress=False, data_dir=data_dir, task_opts=task_opts)
        except UserError as exc:
            other = str(exc)
        groups[(task_label(r.get("task", {})), config_key(r["_dir"]))].append((r, other))
    lines = [f"Each run at its trained r on {what}, next to its own test split.", "",
             "| task | configuration | seeds | own test: median [min–max] | other data: median [min–max] | per seed |",
             "|---|---|---:|---|---|---|"]
    for (label, key), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda p: p[0].get("seed", 0))
        metric = rs[0][0]["metric"]
        own = [_value(r) for r, _ in rs]
        fits = [(r, o) for r, o in rs if isinstance(o, dict)]
        other = _median_range([float(o["metrics"][metric]) for _, o in fits], metric) if fits else \
            f"does not fit: {rs[0][1]}"
        per = ", ".join(f"{r.get('seed', '?')}: {_fmt(_value(r), metric)} → {_fmt(float(o['metrics'][metric]), metric)}"
                        for r, o in fits)
        lines.append(f"| {label} | {key} | {len(rs)} | {_median_range(own, metric)} | {other} | {per} |")
    return "\n".join(lines) + "\n"


def write_report(folder: str | os.PathLike, out: str | os.PathLike | None = None,
                 data_dir: str | None = None, task_opts: dict | None = None, device: str = "auto",
                 limit: int = 0) -> dict[str, Any]:
    """Write table.md, table.csv, runs.csv, loops.png, loopwise.png (and halting.md, budgets.md / .png, lengths.md)
    into `out` (default: `folder`); with `data_dir` or `task_opts` also generalisation.md (`generalisation_table`)."""
    runs = find_runs(folder)
    md, tab = table(runs)
    dest = Path(out or folder)
    dest.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, text in (("table.md", md), ("table.csv", tab), ("runs.csv", runs_csv(runs)),
                       ("by_config.md", configs_table(runs))):
        written[name] = write_text(dest / name, text)
    written["loops.png"] = plot_loops(runs, dest / "loops.png")
    lw = plot_loopwise(runs, dest / "loopwise.png")
    if lw is not None:
        written["loopwise.png"] = lw
    paired = paired_table(runs)
    if paired is not None:
        written["paired.md"] = write_text(dest / "paired.md", paired)
    budgets = budgets_table(runs)
    if budgets is not None:
        written["budgets.md"] = write_text(dest / "budgets.md", budgets)
        written["budgets.png"] = plot_budgets(runs, dest / "budgets.png")
    lengths = lengths_table(runs)
    if lengths is not None:
        written["lengths.md"] = write_text(dest / "lengths.md", lengths)
    halting = halting_table(runs)
    if halting is not None:
        written["halting.md"] = write_text(dest / "halting.md", halting)
    general = generalisation_table(runs, data_dir, task_opts, device, limit) if (data_dir or task_opts) else None
    if general is not None:
        written["generalisation.md"] = write_text(dest / "generalisation.md", general)
    return {"markdown": md, "files": written, "runs": len(runs),
            **({"generalisation": general} if general is not None else {})}
