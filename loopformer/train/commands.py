"""The `loopformer train | eval | sweep | report | demo` commands (paper Sec. 5: Tables 2-4, App. C)."""

from __future__ import annotations

import argparse
from pathlib import Path

from loopformer.errors import UserError
from loopformer.fileio import pick_device, write_json


def _split_items(items: list[str], config_required: bool) -> tuple[str | None, list[str]]:
    """CONFIG [key=value ...]: the first item is the config file unless it is an override."""
    items = list(items)
    config = None
    if items and "=" not in items[0]:
        config = items.pop(0)
    bad = [x for x in items if "=" not in x]
    if bad:
        raise UserError(f"expected key=value overrides after the config file, got {bad[0]!r}")
    if config_required and config is None:
        raise UserError("give a config file (e.g. configs/cpu/lcs.yaml)")
    return config, items


# ------------------------------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> int:
    from loopformer.train.config import load_run_config
    from loopformer.train.trainer import load_for_resume, train

    config, overrides = _split_items(args.items, config_required=False)
    if config is None and args.resume is None:
        raise UserError("give a config file (e.g. loopformer train configs/cpu/lcs.yaml) or --resume RUN_DIR")
    if args.device:
        overrides.append(f"device={args.device}")
    if args.resume is not None:
        if config is not None:
            raise UserError("with --resume the run's own config.yaml is used; give only key=value overrides")
        cfg = load_for_resume(args.resume, overrides)
    else:
        cfg = load_run_config(config, overrides)
    results = train(cfg, resume=args.resume is not None, progress=False if args.quiet else None)
    if results is not None and not args.quiet:
        _print_eval(results["metric"], results["test"], results.get("loopwise", []), results["loops"])
        print(f"run folder: {cfg.out_dir}")
    return 0


def _print_eval(metric: str, metrics: dict, loopwise: list[dict], trained: int) -> None:
    print("test: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float))))
    if loopwise:
        print(f"loop-wise {metric} (trained r = {trained}):")
        print("  loop  " + metric)
        for p in loopwise:
            mark = "  <- trained r" if p["loop"] == trained else ""
            print(f"  {p['loop']:>4}  {p[metric]:.4f}{mark}")


# ------------------------------------------------------------------------------------------------- eval
def evaluate_checkpoint(path: str, loops: int | None = None, max_loops: int | None = None, device: str = "auto",
                        limit: int = 0, batch_size: int = 256, loopwise: bool = True) -> dict:
    """Load a checkpoint (or run folder), rebuild its task's test split and evaluate it (loop-wise)."""
    from loopformer.configio import from_dict
    from loopformer.eval.evaluate import MAX_LOOPS, check_eval_args, evaluate
    from loopformer.model.io import load, read_config
    from loopformer.train.config import TaskConfig
    from loopformer.train.data import make_data

    check_eval_args(None, None, batch_size, limit)
    p = Path(path)
    if (p / "checkpoint" / "config.json").is_file():
        p = p / "checkpoint"
    model_cfg, extra = read_config(p)
    check_eval_args(loops, max_loops, batch_size, limit, trained=model_cfg.loops)
    run = extra.get("run") or {}
    if not run.get("task"):
        raise UserError(f"{p} records no task (it was not written by `loopformer train`)")
    task_cfg = from_dict(TaskConfig, run["task"])
    dev = pick_device(device)
    model = load(p, device=dev)
    data = make_data(task_cfg)
    r = loops or model.config.loops
    cap = max(MAX_LOOPS, 2 * model.config.loops)
    res = evaluate(model, data, loops=r, max_loops=max_loops or (min(2 * r, cap) if loopwise else 0),
                   batch_size=batch_size, limit=limit, loopwise=loopwise, device=dev, progress=True)
    res["checkpoint"] = str(p)
    res["trained_loops"] = model.config.loops
    return res


def cmd_eval(args: argparse.Namespace) -> int:
    from loopformer.eval.evaluate import check_eval_args

    check_eval_args(None, None, args.batch_size, args.n)
    if args.json:   # checked before the evaluation runs
        parent = Path(args.json).resolve().parent
        if not parent.is_dir():
            raise UserError(f"--json {args.json}: folder {parent} does not exist")
        if Path(args.json).is_dir():
            raise UserError(f"--json {args.json} is a folder")
    res = evaluate_checkpoint(args.checkpoint, args.loops, args.max_loops, args.device or "auto", args.n,
                              args.batch_size, loopwise=not args.no_loopwise)
    print(f"checkpoint: {res['checkpoint']} (trained with r = {res['trained_loops']}; evaluated at r = "
          f"{res['loops']})")
    _print_eval(res["metric"], res["metrics"], res["loopwise"], res["trained_loops"])
    if args.json:
        write_json(args.json, res)
        print(f"wrote {args.json}")
    return 0


# ------------------------------------------------------------------------------------------------- sweep / report
def cmd_sweep(args: argparse.Namespace) -> int:
    from loopformer.eval.report import write_report
    from loopformer.eval.sweep import parse_grid, run_sweep

    config, overrides = _split_items(args.items, config_required=True)
    if args.device:
        overrides.append(f"device={args.device}")
    grid = parse_grid(args.grid or [])
    baseline = list(args.baseline or [])
    for b in baseline:
        if "=" not in b:
            raise UserError(f"--baseline entry {b!r} is not of the form key=value")
    if not grid and not baseline:
        raise UserError("give --grid key=v1,v2 ... (and/or --baseline key=value ...)")
    run_sweep(config, grid, baseline, args.out, overrides, jobs=args.jobs, threads=args.threads,
              progress=not args.quiet)
    rep = write_report(args.out)
    print(rep["markdown"])
    print("wrote " + ", ".join(str(p) for p in rep["files"].values()))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from loopformer.eval.report import write_report

    rep = write_report(args.folder, args.out)
    print(rep["markdown"])
    print(f"{rep['runs']} runs; wrote " + ", ".join(str(p) for p in rep["files"].values()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from loopformer.train.demo import run_demo

    run_demo(args.out, quick=args.quick, jobs=args.jobs, threads=args.threads)
    return 0


# ------------------------------------------------------------------------------------------------- parser
def _intermixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let `key=value` overrides come before or after the options (`train cfg.yaml --device cpu lr=1`)."""
    plain = type(parser).parse_known_args
    busy = []

    def known(args=None, namespace=None):
        if busy:                        # the intermixed parser calls back into the plain one
            return plain(parser, args, namespace)
        busy.append(1)
        try:
            return type(parser).parse_known_intermixed_args(parser, args, namespace)
        finally:
            busy.pop()

    parser.parse_known_args = known  # type: ignore[method-assign]
    return parser


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a model from a run config",
                              description="Train from CONFIG with dotted key=value overrides; "
                                          "launch with torchrun --nproc_per_node=N for data parallelism.")
    p.add_argument("items", nargs="*", metavar="CONFIG [key=value ...]")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR (its run folder or checkpoint)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_train)
    _intermixed(p)

    p = subparsers.add_parser("eval", help="evaluate a checkpoint, loop by loop",
                              description="Test metrics of a checkpoint and the metric after each loop t = 1..R.")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder or a run folder")
    p.add_argument("--loops", type=int, help="loops to run (default: the trained r)")
    p.add_argument("--max-loops", type=int, help="loop-wise curve up to this many loops (default: 2 × loops; "
                                                 "at most 1024)")
    p.add_argument("--no-loopwise", action="store_true", help="only the metrics at --loops")
    p.add_argument("--n", type=int, default=0, help="only the first N test rows")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.set_defaults(func=cmd_eval)

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
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_sweep)
    _intermixed(p)

    p = subparsers.add_parser("report", help="rebuild the table and plots of a sweep folder")
    p.add_argument("folder", metavar="DIR")
    p.add_argument("--out", metavar="DIR", help="write the files here (default: DIR)")
    p.set_defaults(func=cmd_report)

    p = subparsers.add_parser("demo", help="the CPU reproduction: standard vs looped vs timestep-encoded",
                              description="Trains a standard Transformer and looped Transformers with and without "
                                          "timestep encoding on a small reasoning task (minutes on 2 CPU cores), "
                                          "then prints the Table-2-style table and writes the plots.")
    p.add_argument("--out", default="demo", metavar="DIR")
    p.add_argument("--quick", action="store_true", help="a one-minute smoke version (too short to learn)")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel processes (default 2)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (default 1)")
    p.set_defaults(func=cmd_demo)


__all__ = ["register", "evaluate_checkpoint"]
