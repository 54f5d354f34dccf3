"""The `loopformer eval` command: a checkpoint's test metrics and its metric after every loop (paper Table 2); with
`--halt RULE` (repeatable) or `--halt-sweep CRITERIA` also adaptive depth: accuracy, loops used and wall time next
to fixed depth (`loopformer.eval.halting`); with `--budgets 1,2,4,...` the metric when run with each loop budget,
next to other runs (`--against`; `loopformer.eval.budgets`); with `--quant int8` the shared block quantized
weight-only, loop by loop to 4r beside full precision with the drift verdict of each (`loopformer.eval.quant`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from loopformer.commandline import HALT_HELP, add_device, add_quiet, add_rows, parse_options
from loopformer.configio import from_dict
from loopformer.device import pick_device
from loopformer.errors import UserError
from loopformer.eval.budgets import budgets_plot, evaluate_budgets, format_budgets, parse_budgets
from loopformer.eval.config import EvalConfig
from loopformer.eval.drift import drift_table
from loopformer.eval.evaluate import format_results
from loopformer.eval.halting import format_halting, sweep_plot
from loopformer.eval.lengths import format_lengths, lengths_plot, parse_lengths
from loopformer.eval.quant import KINDS, check_kind, profile_table, quantize_block
from loopformer.eval.run import EXTRAS, check_eval_config, evaluate_all
from loopformer.fileio import check_figure_path, write_json
from loopformer.model.halting import CRITERIA
from loopformer.model.io import load, read_config, resolve_checkpoint
from loopformer.model.memory import check_loops
from loopformer.sources import TaskConfig, check_data_fits, make_data, source_class


def other_data(task_cfg: TaskConfig, recorded: dict, data_dir: str | None, task_opts: dict | None
               ) -> TaskConfig:
    """The task section to evaluate on instead of the run's own test split: a dataset folder `data_dir` of the same
    task, or the run's task regenerated with `task_opts` replacing some of its options (`recorded`: the task the
    checkpoint records, the data folder's task for runs trained on one)."""
    if data_dir and task_opts:
        raise UserError("--data and --task-opt exclude each other (a data folder fixes its task's options)")
    trained = recorded.get("name") or task_cfg.name
    if data_dir:
        new = dataclasses.replace(task_cfg, data_dir=data_dir)
        if source_class(new).kind == "vectors":
            raise UserError("--data: in-context learning samples its prompts (there is no data folder); use "
                            "--task-opt to change them")
        name = source_class(new).task_name(new)
        if name != trained:
            raise UserError(f"--data {data_dir} holds the {name} task; the model was trained on {trained}")
        return new
    options = {**dict(recorded.get("options") or task_cfg.options), **task_opts}
    try:
        return dataclasses.replace(task_cfg, name=trained, options=options, data_dir=None)
    except ValueError as exc:
        raise UserError(f"--task-opt: {exc}") from None


def evaluate_checkpoint(path: str, cfg: EvalConfig | None = None, *, device: str = "auto", ema: bool = False,
                        timestep_past: str | None = None, data_dir: str | None = None,
                        task_opts: dict | None = None, against: list[str] | None = None,
                        progress: bool = True, quant: str | None = None) -> dict:
    """Load a checkpoint (or run folder), rebuild its task's test split and evaluate it as `cfg` asks
    (`loopformer.eval.run.evaluate_all`: loop-wise, "halting", "halting_sweep", "budgets"). `timestep_past`
    overrides the model's behaviour past its trained loops; `ema`: the averaged weights. `data_dir` / `task_opts`:
    evaluate on another dataset folder of the task, or on a test split regenerated with other task options
    (`other_data`); results["data"] names the data. With `cfg.budgets`, results["budgets"] is {name:
    `evaluate_budgets` result}: this checkpoint first, then each of `against` (checkpoints of the same task, on the
    same data). `quant`: the shared block quantized weight-only (`loopformer.eval.quant`, "int8" or "int4")."""
    cfg = cfg or EvalConfig(drift=False)
    if against and not cfg.budgets:
        raise UserError("--against compares loop budgets: give --budgets too")
    p = resolve_checkpoint(path)
    model_cfg, extra = read_config(p)
    check_eval_config(cfg, model_cfg.total_loops)
    run = extra.get("run") or {}
    if not run.get("task"):
        raise UserError(f"{p} records no task (it was not written by `loopformer train`)")
    task_cfg = from_dict(TaskConfig, run["task"])
    elsewhere = bool(data_dir or task_opts)
    if elsewhere:
        task_cfg = other_data(task_cfg, extra.get("task") or {}, data_dir, task_opts)
    dev = pick_device(device)
    model = load(p, device=dev, ema=ema, **({"timestep_past": timestep_past} if timestep_past else {}))
    if quant:
        model = quantize_block(model, quant, inplace=True)
    data = make_data(task_cfg)
    if elsewhere:
        check_data_fits(data, task_cfg, model.config)
    found = evaluate_all(model, data, cfg, device=dev, progress=progress)
    res = {k: v for k, v in found.items() if k not in EXTRAS}
    res["checkpoint"] = str(p)
    res["data"] = data.describe()
    res["weights"] = "ema" if ema else "raw"
    res["trained_loops"] = model.config.total_loops
    res["timestep_past"] = model.config.timestep_past
    res["causal"] = model.config.causal
    res.update({k: found[k] for k in EXTRAS if k in found})
    if "budgets" in res:
        res["budgets"] = {run_name(p): res["budgets"]}
        for other in against or []:
            q = resolve_checkpoint(other)
            other_run = read_config(q)[1].get("run") or {}
            if (other_run.get("task") or {}) != run["task"]:
                raise UserError(f"--against {other}: it was trained on another task than {p} (compare runs of one "
                                f"task config)")
            name = run_name(q)
            while name in res["budgets"]:
                name += "'"
            res["budgets"][name] = evaluate_budgets(load(q, device=dev), data, cfg.budgets, batch_size=cfg.batch_size,
                                                    limit=cfg.n, device=dev, progress=progress)
    return res


def eval_config(args: argparse.Namespace) -> EvalConfig:
    """The evaluation the `eval` flags ask for — the one place they are read (flags left out: EvalConfig's
    defaults, the model's loop counts). EvalConfig checks every value (a flag out of range is one line naming it);
    what depends on the model is checked once more where the model is known (`check_eval_config`)."""
    for name, v in (("loops", args.loops), ("max_loops", args.max_loops)):
        if v is not None and v < 1:          # a flag's 0 is not the config's "the model's default"
            check_loops(v, 0, name)
    sweep = [] if args.halt_sweep is None else \
        (list(CRITERIA) if args.halt_sweep == "all" else [c.strip() for c in args.halt_sweep.split(",")])
    try:
        return EvalConfig(batch_size=args.batch_size, n=args.n, loops=args.loops or 0, max_loops=args.max_loops or 0,
                          loopwise=not args.no_loopwise, halt=list(args.halt or []), halt_sweep=sweep,
                          budgets=parse_budgets(args.budgets) if args.budgets is not None else [],
                          votes=args.votes, step_halt=args.step_halt, drift=args.drift,
                          lengths=parse_lengths(args.lengths) if args.lengths is not None else [])
    except ValueError as exc:
        raise UserError(str(exc)) from None


def run_name(checkpoint: Path) -> str:
    """A checkpoint's name in tables: its run folder's name (the folder itself when it is not a run's)."""
    return checkpoint.parent.name if checkpoint.name == "checkpoint" else checkpoint.name


def print_extras(res: dict) -> None:
    """The parts of an evaluation beyond fixed depth, each under its title: halting, drift, budgets, lengths."""
    for key, title in (("halting", "adaptive depth"), ("halting_sweep", "adaptive depth, threshold sweep")):
        if key in res:
            print(f"\n{title} (at most {res[key]['loops']} loops; loops per "
                  f"{'supervised token' if res['causal'] else 'row'}):")
            print(format_halting(res[key]))
    if "drift" in res:
        print(f"\ndrift past r (loops up to 4r):\n{drift_table(res['drift'])}")
    if "budgets" in res:
        print(f"\n{res['metric']} when run with each loop budget:")
        print(format_budgets(res["budgets"]))
    if "lengths" in res:
        print(f"\n{res['metric']} at each input length:")
        print(format_lengths(res["lengths"]))


def draw(res: dict, path: str) -> None:
    """The one figure an evaluation asked for (checked before it ran): the lengths, the sweep or the budgets."""
    name = run_name(Path(res["checkpoint"]))
    if "lengths" in res:
        lengths_plot(res["lengths"], path, title=f"{name}: loops T(n) = {res['lengths']['formula']}")
    elif "halting_sweep" in res:
        sweep_plot(res["halting_sweep"], path, title=f"{Path(res['checkpoint']).parent.name}: adaptive depth")
    else:
        budgets_plot(res["budgets"], path)
    print(f"wrote {path}")


def cmd_eval(args: argparse.Namespace) -> int:
    cfg = eval_config(args)
    if args.json:   # checked before the evaluation runs
        parent = Path(args.json).resolve().parent
        if not parent.is_dir():
            raise UserError(f"--json {args.json}: folder {parent} does not exist")
        if Path(args.json).is_dir():
            raise UserError(f"--json {args.json} is a folder")
    sweep = cfg.halt_sweep
    drawn = [f for f, on in (("--halt-sweep", sweep), ("--budgets", args.budgets), ("--lengths", cfg.lengths)) if on]
    if args.plot and not drawn:
        raise UserError("--plot draws the --halt-sweep, the --budgets or the --lengths; give one of them")
    if args.plot and len(drawn) > 1:
        raise UserError(f"--plot draws one figure: give one of {', '.join(drawn)}")
    if args.plot:
        check_figure_path(args.plot)
    if args.quant:
        check_kind(args.quant)
        if args.against or args.budgets or cfg.lengths or cfg.halt or cfg.halt_sweep:
            raise UserError("--quant compares the loop-wise curve and the drift verdict; give it without --budgets, "
                            "--against, --lengths and halting rules")
        cfg = dataclasses.replace(cfg, drift=True)
    res = evaluate_checkpoint(args.checkpoint, cfg, device=args.device, ema=args.ema, timestep_past=args.past_r,
                              data_dir=args.data,
                              task_opts=parse_options(args.task_opt, "--task-opt") if args.task_opt else None,
                              against=args.against, progress=not args.quiet)
    per = res["stepwise"][0]["loop"] if res["stepwise"] else 0
    steps = f"{res['trained_loops'] // per} supervision steps of {per} loops, " if per else ""
    print(f"checkpoint: {res['checkpoint']}{' (averaged weights)' if args.ema else ''} (trained with {steps}r = "
          f"{res['trained_loops']}; evaluated at r = {res['loops']}; loop index past r: {res['timestep_past']})")
    if args.data or args.task_opt:
        d = res["data"]
        print(f"data: {d.get('data_dir') or 'generated'} ({d.get('name')}, options {d.get('options')}, "
              f"{d.get('n_test')} test rows)")
    print(format_results(res["metric"], res["metrics"], res["loopwise"], res["trained_loops"], res["stepwise"]))
    print_extras(res)
    if args.quant:
        q = evaluate_checkpoint(args.checkpoint, cfg, device=args.device, ema=args.ema, timestep_past=args.past_r,
                                data_dir=args.data,
                                task_opts=parse_options(args.task_opt, "--task-opt") if args.task_opt else None,
                                progress=not args.quiet, quant=args.quant)
        res["quant"] = {"kind": args.quant, "metrics": q["metrics"], "drift": q["drift"]}
        print(f"\n{profile_table(args.quant, res['drift'], q['drift'])}")
    if args.plot:
        draw(res, args.plot)
    if args.json:
        write_json(args.json, res)
        print(f"wrote {args.json}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="evaluate a checkpoint, loop by loop",
                              description="Test metrics of a checkpoint and the metric after each loop t = 1..R.")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder or a run folder")
    p.add_argument("--loops", type=int, help="loops to run (default: the trained r, times the supervision steps)")
    p.add_argument("--max-loops", type=int, help="loop-wise curve up to this many loops (default: 2 × loops; "
                                                 "at most 1024)")
    p.add_argument("--no-loopwise", action="store_true", help="only the metrics at --loops")
    p.add_argument("--ema", action="store_true",
                   help="evaluate the averaged weights (trained with train.select.ema_decay)")
    p.add_argument("--votes", type=int, default=0, metavar="K",
                   help="test-time augmentation: also vote over K symmetric copies of every test row (Sudoku)")
    p.add_argument("--step-halt", type=float, default=0.5, metavar="P",
                   help="halting across supervision steps (a model with an exit gate and supervision steps): stop a "
                        "row at the first step whose stop probability reaches P (default 0.5)")
    add_rows(p, 0, "only the first N test rows (0: all)")
    p.add_argument("--batch-size", type=int, default=256)
    add_device(p)
    p.add_argument("--halt", action="append", metavar="RULE", help=HALT_HELP + " (repeat to compare rules)")
    p.add_argument("--halt-sweep", metavar="CRITERIA",
                   help="accuracy against mean loops over a range of thresholds for each criterion (comma-separated, "
                        "or all), next to the fixed-depth curve")
    p.add_argument("--budgets", metavar="LIST",
                   help="also the metric when the model is run with each of these loop counts (comma-separated, e.g. "
                        "1,2,4,8,16,32; with --halt, the rules capped at each)")
    p.add_argument("--against", action="append", metavar="RUN",
                   help="with --budgets: the same budgets for this run too (same task; repeatable), e.g. models "
                        "trained at fixed r")
    p.add_argument("--drift", action="store_true",
                   help="also the drift diagnostics up to 4r: metric, state change, spectral radius of the loop map, "
                        "a verdict settling / marginal / drifting")
    p.add_argument("--lengths", metavar="LIST",
                   help="also the metric at each of these input lengths (comma-separated, e.g. 8,16,32,64), the task "
                        "regenerated at each with the model's loops T(n) (its loop rule; --loops: that many), and "
                        "against loops up to 2·T(n) (--max-loops: that many)")
    p.add_argument("--quant", choices=None, metavar="KIND",
                   help=f"also the shared block quantized weight-only ({', '.join(KINDS)}; torchao: pip install "
                        "'loopformer[quant]'): the metric after every loop to 4r beside full precision and the drift "
                        "verdict of each")
    p.add_argument("--plot", metavar="FILE", help="draw the --halt-sweep, the --budgets or the --lengths (PNG)")
    p.add_argument("--past-r", choices=["continue", "clamp", "hold"], default=None,
                   help="the timestep encoding's loop index past the trained loops: continue the sinusoid, clamp to "
                        "r - 1, or hold at the index r (default: the checkpoint's)")
    p.add_argument("--data", metavar="DIR", help="evaluate on this dataset folder of the model's task (another seed, "
                                                 "more blanks, an imported file) instead of the run's test split")
    p.add_argument("--task-opt", action="append", metavar="KEY=VALUE",
                   help="evaluate on a test split regenerated with this task option changed (repeatable), e.g. "
                        "length=8 for longer strings")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    add_quiet(p, "no progress bar")
    p.set_defaults(func=cmd_eval)


__all__ = ["register", "evaluate_checkpoint", "eval_config"]
