"""The `loopformer train` command (paper Sec. 5, App. C): a run from a config file, or `--resume` of a run folder."""

from __future__ import annotations

import argparse
import os
import shutil
import textwrap

from loopformer.commandline import add_device, add_quiet, intermixed, split_items
from loopformer.configdoc import class_summary, fields_of, lookup
from loopformer.errors import UserError
from loopformer.eval.evaluate import format_results
from loopformer.model.config import REMOVED
from loopformer.train.config import RENAMED, TRAIN_REMOVED, RunConfig, load_run_config
from loopformer.train.distributed import launch_env
from loopformer.train.run import load_for_resume
from loopformer.train.stages import train_run


def cmd_train(args: argparse.Namespace) -> int:
    launch_env()                          # torchrun's variables, before anything is read or written
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
    launch_env(joins=cfg.train.system.parallel == "fsdp" and "WORLD_SIZE" in os.environ)
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


def _current(cfg: object, key: str) -> object:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _config_key(key: str) -> str:
    """`key` as the run config has it now: a renamed train key to its new name; a removed switch is one line."""
    head, _, rest = key.partition(".")
    if head == "train" and rest in RENAMED:
        print(f"train.{rest} is now train.{RENAMED[rest]}")
        return f"train.{RENAMED[rest]}"
    if (head == "train" and rest in TRAIN_REMOVED) or (head == "model" and rest in REMOVED):
        raise UserError(f"{key} left the library (see docs/architecture.md, 'What left the core')")
    return key


def cmd_config(args: argparse.Namespace) -> int:
    """The fields under KEY with their type, default and meaning (and the value a config sets, with --config)."""
    key = _config_key(args.key.strip(".")) if args.key else ""
    try:
        section, row = lookup(RunConfig, key)
    except ValueError as exc:
        raise UserError(f"config: {exc}") from None
    cfg = load_run_config(args.config, args.overrides) if args.config or args.overrides else None
    width = max(60, min(120, shutil.get_terminal_size((100, 24)).columns))
    wrap = textwrap.TextWrapper(width=width, initial_indent="    ", subsequent_indent="    ")

    def show(r) -> None:
        head = f"{r.key}: {r.kind} = {r.default}"
        if cfg is not None:
            value = repr(_current(cfg, r.key))
            head += f"   (this config: {value})" if value != r.default else ""
        print(head)
        if r.meaning:
            print(wrap.fill(r.meaning))

    def section_of(cls: type, prefix: str) -> None:
        summary = class_summary(cls)
        print(f"[{prefix.rstrip('.') or 'run config'}] {cls.__name__}" + (f" — {summary}" if summary else ""))
        rows = fields_of(cls, prefix)
        for r in rows:
            if r.section is None:
                show(r)
        for r in rows:
            if r.section is not None:
                print()
                section_of(r.section, r.key + ".")

    if row is not None:
        show(row)
    else:
        section_of(section, f"{key}." if key else "")
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

    p = subparsers.add_parser("config", help="the run config's fields: type, default and meaning",
                              description="Print the fields of the run config under KEY (a section such as "
                                          "train.loops, or one field such as train.optim.lr; all of them without "
                                          "KEY) with their type, default and meaning — the text of "
                                          "docs/reference/configs.md. With --config (and key=value overrides) also "
                                          "the value that config sets where it is not the default.")
    p.add_argument("key", nargs="?", metavar="KEY")
    p.add_argument("--config", metavar="FILE", help="a run config whose values to show beside the defaults")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_config)
    intermixed(p)


__all__ = ["register"]
