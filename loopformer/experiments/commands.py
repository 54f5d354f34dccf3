"""The `loopformer sweep | report | demo | reproduce` commands: grids of runs tabulated like the paper's Tables 2-4,
and every registered claim with a verdict."""

from __future__ import annotations

import argparse

from loopformer.commandline import (
    add_device,
    add_quiet,
    add_rows,
    check_overrides,
    check_runs_folder,
    intermixed,
    parse_options,
    split_items,
)
from loopformer.errors import UserError
from loopformer.experiments.demo import run_demo
from loopformer.experiments.report import write_report
from loopformer.experiments.reproduce import DEFAULT_MAX_SEEDS, reproduce
from loopformer.experiments.stale import POLICIES
from loopformer.experiments.sweep import parse_grid, run_sweep


def cmd_sweep(args: argparse.Namespace) -> int:
    config, overrides = split_items(args.items, config_required=True)
    if args.device:
        overrides.append(f"device={args.device}")
    grid = parse_grid(args.grid or [])
    baseline = list(args.baseline or [])
    for b in baseline:
        if "=" not in b:
            raise UserError(f"--baseline entry {b!r} is not of the form key=value")
    check_overrides([f"{k}={v}" for k, vals in grid for v in vals], "--grid value")
    check_overrides(baseline, "--baseline entry")
    check_runs_folder(args.out)
    if not grid and not baseline:
        raise UserError("give --grid key=v1,v2 ... (and/or --baseline key=value ...)")
    run_sweep(config, grid, baseline, args.out, overrides, jobs=args.jobs, threads=args.threads,
              progress=not args.quiet, stale=args.stale)
    rep = write_report(args.out)
    print(rep["markdown"])
    print("wrote " + ", ".join(str(p) for p in rep["files"].values()))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    opts = parse_options(args.task_opt, "--task-opt") if args.task_opt else None
    rep = write_report(args.folder, args.out, data_dir=args.data, task_opts=opts, device=args.device or "auto",
                       limit=args.n)
    print(rep["markdown"])
    if "generalisation" in rep:
        print(rep["generalisation"])
    print(f"{rep['runs']} runs; wrote " + ", ".join(str(p) for p in rep["files"].values()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    check_runs_folder(args.out)
    run_demo(args.out, quick=args.quick, jobs=args.jobs, threads=args.threads, stale=args.stale)
    return 0


# reproduce's options and their defaults: --paper-tables prints a table and reads none of them
REPRODUCE_DEFAULTS = {"claims": None, "quick": False, "seeds": None, "max_seeds": DEFAULT_MAX_SEEDS, "jobs": 2,
                      "threads": 1, "out": "reproduce", "scale": "cpu", "registry": None, "dry_run": False,
                      "export": None, "readme": None, "stale": "stop", "quiet": False}


def cmd_reproduce(args: argparse.Namespace) -> int:
    if args.paper_tables:            # the paper-scale plan of Tables 2-4, nothing run
        from loopformer.experiments.paper import paper_table
        given = ["--" + k.replace("_", "-") for k, v in REPRODUCE_DEFAULTS.items() if getattr(args, k) != v]
        if given:
            raise UserError(f"--paper-tables prints the paper-scale plan and takes no other option (got "
                            f"{', '.join(given)})")
        print(paper_table())
        return 0
    check_runs_folder(args.out)
    ids = [i.strip() for part in args.claims or [] for i in part.split(",") if i.strip()] or None
    parts = ["loopformer reproduce"] + (["--claims", ",".join(ids)] if ids else []) + \
        (["--quick"] if args.quick else []) + ([f"--seeds {args.seeds}"] if args.seeds else []) + \
        ([f"--max-seeds {args.max_seeds}"] if args.max_seeds != DEFAULT_MAX_SEEDS else []) + \
        ([f"--scale {args.scale}"] if args.scale != "cpu" else []) + [f"--out {args.out}"]
    res = reproduce(ids, quick=args.quick, seeds=args.seeds, jobs=args.jobs, threads=args.threads, out=args.out,
                    scale=args.scale, registry=args.registry, progress=not args.quiet, dry_run=args.dry_run,
                    readme=args.readme, command=" ".join(parts), export_to=args.export, max_seeds=args.max_seeds,
                    stale=args.stale)
    if res["ran"]:
        for j in res["judged"]:
            print(f"{j['claim'].id:<22} {j['verdict'].verdict:<15} {j['verdict'].reason}")
        print("wrote " + ", ".join(str(p) for p in res["files"].values()))
    return 0


def add_stale(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stale", choices=POLICIES, default="stop",
                   help="run folders trained with other settings than asked for now: stop (default: one error line), "
                        "retrain (move them to OUT/.stale/ and train again) or keep (use them as they are)")


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="run a grid of configs and tabulate it like Table 2",
                              description="Runs CONFIG for every combination of --grid values (plus --baseline), "
                                          "skipping finished runs, then writes table.md/.csv and plots into --out.")
    p.add_argument("items", nargs="+", metavar="CONFIG [key=value ...]")
    p.add_argument("--grid", nargs="+", metavar="KEY=V1,V2", help="e.g. model.loops=4,8 model.timestep=false,true")
    p.add_argument("--baseline", nargs="+", metavar="KEY=VALUE", help="overrides of the standard Transformer run, "
                                                                      "e.g. model.n_layers=6 model.loops=1")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per run (0: torch's default)")
    add_stale(p)
    add_device(p, default=None)
    add_quiet(p)
    p.set_defaults(func=cmd_sweep)
    intermixed(p)

    p = subparsers.add_parser("report", help="rebuild the table and plots of a sweep folder")
    p.add_argument("folder", metavar="DIR")
    p.add_argument("--out", metavar="DIR", help="write the files here (default: DIR)")
    p.add_argument("--data", metavar="DIR", help="also evaluate every run on this dataset folder (generalisation.md)")
    p.add_argument("--task-opt", action="append", metavar="KEY=VALUE",
                   help="also evaluate every run on its task regenerated with this option (repeatable), e.g. length=8")
    add_rows(p, 0, "with --data / --task-opt: only the first N test rows (0: all)")
    add_device(p, default=None)
    p.set_defaults(func=cmd_report)

    p = subparsers.add_parser("demo", help="the CPU reproduction: standard vs looped vs timestep-encoded",
                              description="Trains a standard Transformer and looped Transformers with and without "
                                          "timestep encoding on a small reasoning task (minutes on 2 CPU cores), "
                                          "then prints the Table-2-style table and writes the plots.")
    p.add_argument("--out", default="demo", metavar="DIR")
    p.add_argument("--quick", action="store_true", help="a one-minute smoke version (too short to learn)")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel processes (default 2)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (default 1)")
    add_stale(p)
    p.set_defaults(func=cmd_demo)

    p = subparsers.add_parser("reproduce", help="every registered claim of the paper, with a verdict per claim",
                              description="Runs what the registered claims need (finished runs are reused, "
                                          "interrupted ones resumed), then writes OUT/report.md with, per claim, the "
                                          "paper's numbers, ours (median [min-max] over seeds) and a verdict.")
    p.add_argument("--claims", action="append", metavar="ID[,ID]",
                   help="only these claims (default: all); a family by the start of its ids, e.g. iso-depth")
    p.add_argument("--quick", action="store_true", help="one seed, the claims marked quick (about 30 min on 2 cores)")
    p.add_argument("--seeds", type=int, help="model seeds per arm (default: each experiment's, 3)")
    p.add_argument("--max-seeds", type=int, default=DEFAULT_MAX_SEEDS,
                   help="a claim still inconclusive gets one more seed at a time up to this many (default "
                        f"{DEFAULT_MAX_SEEDS}; the sign test concludes on 6 of 7)")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel processes (default 2)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (default 1)")
    p.add_argument("--out", default="reproduce", metavar="DIR", help="runs, report.md, report.json and plots")
    p.add_argument("--scale", choices=["cpu", "paper"], default="cpu",
                   help="paper: the paper-scale configs (GPU; without one, print the plan and its cost)")
    p.add_argument("--registry", metavar="FILE", help="a claims registry of your own (default: the shipped one)")
    p.add_argument("--dry-run", action="store_true", help="print the runs and the estimate, start nothing")
    p.add_argument("--paper-tables", action="store_true",
                   help="print every row of the paper's Tables 2-4 at paper scale (configs, sizes, estimated GPU "
                        "hours; scripts/paper_row.sh N runs row N) and exit")
    p.add_argument("--export", metavar="DIR", help="also copy the report, plots and every run's results.json (no "
                                                   "checkpoints) to DIR, e.g. studies/reproduce/full")
    p.add_argument("--readme", metavar="FILE", help="also fill FILE's reproduce block with the summary table")
    add_stale(p)
    add_quiet(p)
    p.set_defaults(func=cmd_reproduce)


__all__ = ["register"]
