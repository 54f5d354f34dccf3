"""`loopformer demo`: the paper's Table 2 in miniature, on a laptop CPU.

A standard Transformer and Looped Transformers with r ∈ {2, 4, 8} loops, each with and without timestep encoding
(Sec. 4.2), are trained on a small longest-common-subsequence task (Sec. 5.1.1: two strings over a few letters,
the answer — the LCS length — read out by a bidirectional model at the answer position; every loop's read-out
in the loss), then the test accuracy
is tabulated in the layout of Table 2 and plotted against r, with the accuracy after every loop in a second plot.
The runs' config is the YAML shipped with the package, `loopformer/configs/cpu/demo.yaml` (also reached as
`configs/cpu/demo.yaml` in a clone), so the same runs can be made by hand with
`loopformer sweep configs/cpu/demo.yaml --grid ... --baseline ...` (`DEMO_GRID`, `DEMO_BASELINE`).

The seven runs go to two worker processes with one thread each and take about seven minutes on two idle cores,
eagerly (the config's `train.system.compile: false`: from an empty compiler cache, compiling costs more than it saves at
this size); re-running the command completes an interrupted demo (finished runs are kept).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from loopformer.configio import shipped_config
from loopformer.experiments.report import write_report
from loopformer.experiments.sweep import run_sweep
from loopformer.fileio import write_text

DEMO_YAML = "cpu/demo.yaml"   # the runs' config, under loopformer/configs
DEMO_GRID: list[tuple[str, list[str]]] = [("model.loops", ["2", "4", "8"]), ("model.timestep", ["false", "true"])]
DEMO_BASELINE: list[str] = ["model.n_layers=4", "model.loops=1"]

# --quick: the same pipeline in about a minute (too short for the models to learn; a smoke test)
QUICK_OVERRIDES = ["train.steps=40", "task.n_train=2000", "task.n_test=200", "eval.max_loops=6", "train.log_every=10"]
QUICK_GRID: list[tuple[str, list[str]]] = [("model.loops", ["2", "3"]), ("model.timestep", ["false", "true"])]
QUICK_BASELINE: list[str] = ["model.n_layers=2", "model.loops=1"]


def demo_yaml() -> str:
    """The text of the demo's run config."""
    return shipped_config(DEMO_YAML).read_text()


def run_demo(out: str | os.PathLike = "demo", quick: bool = False, jobs: int = 2, threads: int = 1,
             progress: bool = True, stale: str = "stop") -> dict:
    """Run (or complete) the demo sweep into `out`, print the table, write the plots; returns the report. `stale`:
    what to do with runs there trained with other settings (`loopformer.experiments.stale`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "demo.yaml"
    text = demo_yaml()
    write_text(config, text)
    length = OmegaConf.create(text).task.options.length
    grid, baseline = (QUICK_GRID, QUICK_BASELINE) if quick else (DEMO_GRID, DEMO_BASELINE)
    overrides = list(QUICK_OVERRIDES) if quick else []
    n_runs = len(baseline and [1]) + len(grid[0][1]) * len(grid[1][1])
    if progress:
        print(f"loopformer demo: {n_runs} runs on LCS (length {length}) — "
              f"standard Transformer L={baseline[0].split('=')[1]}, looped r ∈ "
              f"{{{', '.join(grid[0][1])}}} with and without timestep encoding; {jobs} processes × {threads} "
              f"thread(s); results in {out}/", file=sys.stderr)
    t0 = time.time()
    run_sweep(str(config), grid, baseline, out, overrides, jobs=jobs, threads=threads, progress=progress,
              desc="demo", stale=stale)
    rep = write_report(out)
    if progress:
        print(rep["markdown"])
        print(f"wall time {time.time() - t0:.0f} s; wrote " + ", ".join(str(p) for p in rep["files"].values()))
    return rep
