"""The `loopformer train` command (paper Sec. 5, App. C): a run from a config file, or `--resume` of a run folder."""

from __future__ import annotations

import argparse

from loopformer.commandline import add_device, add_quiet, intermixed, split_items
from loopformer.errors import UserError
from loopformer.eval.evaluate import format_results
from loopformer.train.config import load_run_config
from loopformer.train.run import load_for_resume
from loopformer.train.stages import train_run


def cmd_train(args: argparse.Namespace) -> int:
    config, overrides = split_items(args.items, config_required=False)
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
    results = train_run(cfg, resume=args.resume is not None, progress=False if args.quiet else None,
                    overwrite=args.overwrite)
    if results is not None:
        summary = format_results(results["metric"], results["test"], results.get("loopwise", []), results["loops"])
        print(summary.splitlines()[0] if args.quiet else summary)      # --quiet: the final metrics line only
        if not args.quiet:
            print(f"run folder: {cfg.out_dir}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from loopformer.train.sharding import export_sharded  # torch.distributed.checkpoint: only for this command
    print(f"wrote {export_sharded(args.checkpoint, args.out)}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a model from a run config",
                              description="Train from CONFIG with dotted key=value overrides; "
                                          "launch with torchrun --nproc_per_node=N for data parallelism.")
    p.add_argument("items", nargs="*", metavar="CONFIG [key=value ...]")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR (its run folder or checkpoint)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in out_dir even if it holds an earlier run (deleted) or other files (kept)")
    add_device(p, default=None)
    add_quiet(p, "no progress bar; of the summary only the final metrics line")
    p.set_defaults(func=cmd_train)
    intermixed(p)

    p = subparsers.add_parser("export", help="a sharded (train.system.parallel=fsdp) checkpoint as one weights file",
                              description="Rebuild the full weights of a sharded checkpoint (RUN's checkpoint or a "
                                          "checkpoint folder) from its sharded/ folder, in one process, as a "
                                          "checkpoint folder that load, eval and generate read.")
    p.add_argument("checkpoint", metavar="RUN")
    p.add_argument("--out", required=True, help="checkpoint folder to write (new, empty or an earlier export)")
    p.set_defaults(func=cmd_export)


__all__ = ["register"]
