"""`loopformer data`: generate, inspect and import task datasets (see `loopformer.data` for the folder format).

    loopformer data gen TASK --out DIR --train N --test M [--seed S] [--workers W] [--opt key=value ...]
    loopformer data show DIR [--split test] [-n 5] [--verify]
    loopformer data import {radcliffe,extreme,kaggle} CSV --out DIR [--min-difficulty 3.0] [--test M] [--train N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from loopformer.commandline import add_group, add_quiet, add_rows, parse_options
from loopformer.data.dataset import default_chunk_size, open_dataset, read_manifest, write_dataset, write_splits
from loopformer.errors import UserError
from loopformer.fileio import remove_stale_temps
from loopformer.model.memory import GiB, available_bytes
from loopformer.tasks import TASKS, get_task
from loopformer.tasks.sudoku import import_csv


def _count(text: str) -> int:
    """A non-negative sample count; accepts 1000, 1e6, 1_000_000."""
    shown = text if len(text) <= 40 else text[:37] + "..."
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {shown!r}") from None
    if not math.isfinite(value) or value < 0 or value != int(value):     # 1e400 is infinite
        raise argparse.ArgumentTypeError(f"not a non-negative integer: {shown!r}")
    return int(value)


def _check_out(out: str, force: bool) -> None:
    """The output folder must be empty or absent unless --force (checked before any work). The temporary folder
    of an earlier writer of it that was killed outright (`.OUT.tmp-<pid>-*` beside it) is removed."""
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise UserError(f"output folder is not empty: {out} (pass --force to replace it)")
    dest = Path(os.path.abspath(out))
    remove_stale_temps(dest.parent, f".{dest.name}.tmp-")


MAX_CHUNK = 1 << 20          # rows per generation chunk
BYTES_PER_TOKEN = 16         # what generating holds per token: inputs and targets, drawn and then gathered


def _check_gen_sizes(task, args) -> None:
    """One-line UserErrors, before anything is drawn, for a `data gen` whose processes, chunks or samples are out of
    reach: at most 4 worker processes per CPU core, chunks of at most 2^20 rows, and the samples (with the chunks
    in flight) must fit in the memory available."""
    cores = os.cpu_count() or 1
    if not 1 <= args.workers <= 4 * cores:
        raise UserError(f"--workers must be in 1..{4 * cores} (4 per CPU core; got {args.workers})")
    chunk = default_chunk_size(task) if args.chunk_size is None else args.chunk_size
    if not 1 <= chunk <= MAX_CHUNK:
        raise UserError(f"--chunk-size must be in 1..{MAX_CHUNK:,} (got {chunk})")
    if args.seed < 0:
        raise UserError(f"--seed must be a non-negative integer (got {args.seed})")
    rows = args.train + args.test + chunk * (4 * args.workers + 1)
    per_row = task.row_bytes() if hasattr(task, "row_bytes") else max(int(task.seq_len), 1) * BYTES_PER_TOKEN
    need = rows * per_row                     # a row's intermediate states (K × T) included
    avail = available_bytes("cpu")
    if need > avail:
        states = f" and {task.steps:,} intermediate states" if getattr(task, "steps", 0) else ""
        raise UserError(f"data gen would hold about {need / GiB:,.1f} GiB of samples ({rows:,} rows of "
                        f"{task.seq_len} tokens{states}) but {avail / GiB:,.1f} GiB are available; lower --train / "
                        f"--test")


def _gen(args) -> int:
    _check_out(args.out, args.force)
    task = get_task(args.task, **parse_options(args.opt))
    _check_gen_sizes(task, args)
    t0 = time.perf_counter()
    manifest = write_dataset(args.out, task, args.train, args.test, seed=args.seed, workers=args.workers,
                             chunk_size=args.chunk_size, overwrite=args.force, progress=not args.quiet)
    dt = time.perf_counter() - t0
    total = args.train + args.test
    print(f"wrote {args.out}: {task.name} {json.dumps(manifest['options'])}, train {manifest['counts']['train']}, "
          f"test {manifest['counts']['test']}, seq_len {task.seq_len}, vocab {task.vocab_size} "
          f"({dt:.1f} s, {total / max(dt, 1e-9):,.0f} samples/s)")
    return 0


def _show(args) -> int:
    manifest = read_manifest(args.dir)
    task, splits = open_dataset(args.dir, verify=args.verify)
    if args.split not in splits:
        raise UserError(f"dataset {args.dir} has no split {args.split!r} (splits: {', '.join(splits)})")
    counts = ", ".join(f"{k} {v}" for k, v in manifest["counts"].items())
    print(f"{args.dir}: task {task.name} {json.dumps(manifest['options'])}")
    print(f"  {counts}; seq_len {task.seq_len}; vocab {task.vocab_size}; causal {task.causal}; "
          f"seed {manifest.get('seed')}; source {manifest.get('source', 'generator')}"
          + ("; checksums verified" if args.verify else ""))
    batch = splits[args.split]
    n = min(args.n, len(batch["inputs"]))
    rows = {k: np.asarray(v[:n]) for k, v in batch.items()}
    for i in range(n):
        print(f"--- {args.split}[{i}]")
        print(task.decode_row(rows, i))
    return 0


def _import(args) -> int:
    _check_out(args.out, args.force)
    t0 = time.perf_counter()
    task, splits, provenance = import_csv(args.csv, args.layout, n_test=args.test, n_train=args.train,
                                          seed=args.seed, min_difficulty=args.min_difficulty, test_csv=args.test_csv)
    manifest = write_splits(args.out, task, splits, args.seed, provenance, overwrite=args.force)
    print(f"wrote {args.out}: sudoku from {args.layout} file {args.csv} ({manifest['rows_read']} rows read"
          + (f", {manifest['rows_kept']} with difficulty >= {args.min_difficulty}"
             if args.min_difficulty is not None else "")
          + f"), train {manifest['counts']['train']}, test {manifest['counts']['test']} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


def register(subparsers) -> None:
    sub = add_group(subparsers, "data", "generate, inspect and import task datasets",
                    "Generate, inspect and import datasets of the paper's tasks.")

    gen = sub.add_parser("gen", help="generate a dataset folder",
                         description="Generate distinct train/test samples of a task into a dataset folder.")
    gen.add_argument("task", choices=sorted(TASKS), help="task name")
    gen.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    gen.add_argument("--train", type=_count, required=True, help="number of training samples (e.g. 1e6)")
    gen.add_argument("--test", type=_count, required=True, help="number of test samples")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--workers", type=int, default=1, help="processes (the output does not depend on it)")
    gen.add_argument("--opt", nargs="+", action="extend", metavar="KEY=VALUE",
                     help="task options, e.g. --opt length=60 alphabet_max=10")
    gen.add_argument("--chunk-size", type=int, default=None, help="rows per generation chunk (changes the data)")
    gen.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    add_quiet(gen)
    gen.set_defaults(func=_gen)

    show = sub.add_parser("show", help="print decoded examples of a dataset",
                          description="Print a dataset's manifest summary and decoded examples.")
    show.add_argument("dir", help="dataset folder")
    show.add_argument("--split", default="test")
    add_rows(show, 5, "number of examples")
    show.add_argument("--verify", action="store_true", help="check the SHA-256 of every array")
    show.set_defaults(func=_show)

    imp = sub.add_parser("import", help="convert a public Sudoku CSV",
                         description="Convert a public Sudoku CSV (Radcliffe's sudoku-3m, Sudoku-Extreme or the "
                                     "Kaggle 1M set) into a dataset folder.")
    imp.add_argument("layout", choices=["radcliffe", "extreme", "kaggle"])
    imp.add_argument("csv", help="the CSV file")
    imp.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    imp.add_argument("--min-difficulty", type=float, default=None,
                     help="keep puzzles rated at least this (radcliffe: the paper's hard set uses 3.0)")
    imp.add_argument("--test", type=_count, default=1000, help="test puzzles (default 1000)")
    imp.add_argument("--train", type=_count, default=None, help="train puzzles (default: all the rest)")
    imp.add_argument("--test-csv", metavar="CSV", default=None,
                     help="take the test split from this file (all its puzzles; --test is then ignored)")
    imp.add_argument("--seed", type=int, default=0, help="shuffle seed")
    imp.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    imp.set_defaults(func=_import)
