"""The paper's Tables 2-4 at paper scale: every row's cells with their configs, sizes and estimated GPU hours.

The rows are data (`loopformer/configs/paper_tables.yaml`): a shipped config, the grid of the row's cells (loops,
timestep encoding) and its standard baseline, how its data is made and the paper's numbers. For each cell the
estimate is

    training FLOPs = 3 × (FLOPs of one forward pass over one sequence, `loopformer.model.flops`) × batch × steps
    GPU hours      = training FLOPs / (GPU_FLOPS × 3600)

(3×: the backward pass costs about twice the forward), at an assumed sustained GPU_FLOPS = 1e14 (bf16 on one
recent data-centre GPU at a third of its peak; small models reach less). A row whose data must be fetched first is
sized from its `sizing` overrides (generated data of the same shape) or its `size` hints (rows per epoch, the
model's vocabulary and length). `loopformer reproduce --paper-tables` prints the table; `scripts/paper_row.sh N`
makes row N's data and runs its sweep.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from loopformer.configio import load_config, shipped_config
from loopformer.errors import UserError

GPU_FLOPS = 1.0e14           # assumed sustained rate of one GPU (bf16), as reproduce's --scale paper estimate


@dataclass
class PaperRow:
    table: str = ""
    task: str = ""
    config: str = ""                                      # a shipped config (paper scale)
    grid: dict[str, list[Any]] = field(default_factory=dict)   # the row's cells: every combination
    baseline: list[str] = field(default_factory=list)     # the standard transformer's overrides
    data: str = ""                                        # how the row's data is made
    data_dir: str = ""                                    # where that puts it (task.data_dir of the row's runs)
    sizing: list[str] = field(default_factory=list)       # overrides that size the row without its data
    size: dict[str, Any] = field(default_factory=dict)    # or hints: rows, vocab_size, max_len, causal, n_out
    paper: str = ""


@dataclass
class PaperTables:
    rows: list[PaperRow] = field(default_factory=list)


def load_tables(path: str | None = None) -> PaperTables:
    return load_config(PaperTables, path or shipped_config("paper_tables.yaml"))


def cells(row: PaperRow) -> list[tuple[str, list[str]]]:
    """(name, overrides) of the row's cells: the baseline first, then the grid's combinations in order."""
    layers = next((o.split("=", 1)[1] for o in row.baseline if o.startswith("model.n_layers=")), "?")
    out = [(f"standard L = {layers}", list(row.baseline))]
    keys = list(row.grid)
    for combo in itertools.product(*(row.grid[k] for k in keys)):
        d = dict(zip(keys, combo))
        ov = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items()]
        name = "TMLT" if d.get("model.timestep") else "looped"
        out.append((name + (f" r = {d['model.loops']}" if "model.loops" in d else ""), ov))
    return out


def row_commands(row: PaperRow, out: str) -> tuple[list[str] | None, list[str]]:
    """The `loopformer` arguments that make the row's data (None: made on the fly or fetched by hand) and that run
    its sweep into `out` (every cell, one seed, reported as the paper's table)."""
    data = row.data.split(" (")[0].split() if row.data.startswith("loopformer ") else None
    grid = [f"{k}={','.join(str(v).lower() if isinstance(v, bool) else str(v) for v in vals)}"
            for k, vals in row.grid.items()]
    data_dir = [f"task.data_dir={row.data_dir}"] if row.data_dir else []
    sweep = ["sweep", str(shipped_config(row.config)), *data_dir, "--grid", *grid, "--baseline", *row.baseline,
             "--out", out]
    return (data[1:] if data else None), sweep


def size_cell(row: PaperRow, overrides: list[str]) -> dict[str, Any]:
    """{params, loops (× layers), flops (one forward over one sequence), seq_len, batch, steps, train_flops,
    gpu_hours} of one cell."""
    from loopformer.model.flops import forward_flops, layer_applications
    from loopformer.model.memory import param_count
    from loopformer.sources import source_class
    from loopformer.train.config import RunConfig, load_run_config
    from loopformer.train.optim import steps_for

    path = str(shipped_config(row.config))
    if row.size:
        cfg = load_config(RunConfig, path, overrides)
        hints = {k: v for k, v in row.size.items() if k != "rows"}
        model, n_rows = cfg.model.replace(**hints), int(row.size["rows"])
    else:
        cfg = load_run_config(path, [*row.sizing, *overrides])
        model, n_rows = cfg.model, source_class(cfg.task).epoch_rows(cfg.task)
    steps = steps_for(cfg.train.steps, cfg.train.epochs, n_rows, cfg.train.batch_size)
    T = model.max_len
    fwd = forward_flops(model, T)
    train_flops = 3 * fwd * cfg.train.batch_size * steps
    return {"params": param_count(model), "loops": layer_applications(model), "flops": fwd, "seq_len": T,
            "batch": cfg.train.batch_size, "steps": steps, "train_flops": train_flops,
            "gpu_hours": train_flops / GPU_FLOPS / 3600}


def paper_table(tables: PaperTables | None = None) -> str:
    """Markdown: every row of Tables 2-4, one line per cell, with its estimate and a total per row and overall."""
    from loopformer.model.flops import format_flops
    tables = tables or load_tables()
    lines = [f"Every cell of the paper's Tables 2-4 at paper scale, one seed; GPU hours at an assumed sustained "
             f"{GPU_FLOPS:.0e} FLOP/s (bf16), training FLOPs = 3 × forward FLOPs × batch × steps.", "",
             "| row | table | task | cell | config + overrides | parameters | loops × layers | FLOPs / answer | "
             "batch × steps | GPU hours |", "|---:|---|---|---|---|---:|---:|---:|---:|---:|"]
    total = 0.0
    for i, row in enumerate(tables.rows, 1):
        row_hours = 0.0
        for name, ov in cells(row):
            try:
                c = size_cell(row, ov)
            except UserError as exc:
                raise UserError(f"row {i} ({row.task}), {name}: {exc}") from None
            row_hours += c["gpu_hours"]
            lines.append(f"| {i} | {row.table} | {row.task} | {name} | `{row.config}` {' '.join(ov)} | "
                         f"{c['params']:,} | {c['loops']} | {format_flops(c['flops'])} | {c['batch']} × "
                         f"{c['steps']:,} | {c['gpu_hours']:.1f} |")
        total += row_hours
        lines.append(f"| {i} | {row.table} | {row.task} | **row total** | data: {row.data} | | | | | "
                     f"**{row_hours:.1f}** |")
    lines += ["", f"All rows: **{total:.0f} GPU hours** for one seed of every cell. The paper's numbers per row: "
              + "; ".join(f"{r.task}: {r.paper}" for r in tables.rows) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m loopformer.experiments.paper N OUT`: row N's data command (or "-") and sweep command, one per
    line, shell-quoted (what `scripts/paper_row.sh` runs)."""
    import shlex
    import sys

    args = sys.argv[1:] if argv is None else argv
    rows = load_tables().rows
    if len(args) != 2 or not args[0].isdigit() or not 1 <= int(args[0]) <= len(rows):
        print(f"usage: python -m loopformer.experiments.paper ROW OUT (ROW in 1..{len(rows)})", file=sys.stderr)
        return 2
    data, sweep = row_commands(rows[int(args[0]) - 1], args[1])
    print("-" if data is None else shlex.join(data))
    print(shlex.join(sweep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["GPU_FLOPS", "PaperRow", "PaperTables", "cells", "load_tables", "main", "paper_table", "row_commands",
           "size_cell"]
