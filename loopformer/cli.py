"""The `loopformer` command.

Sub-commands live next to the code they drive: each module listed in `_COMMAND_MODULES` exposes
`register(subparsers)`, which adds its sub-parser(s) and sets `func` (called with the parsed args; returns an exit
code or None). A `UserError` anywhere prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from loopformer.errors import UserError

_COMMAND_MODULES = [
    "loopformer.model.commands",    # info, presets, convert
    "loopformer.tasks.commands",    # data gen / show / import
    "loopformer.train.commands",    # train, eval, sweep, report, demo
    "loopformer.theory.commands",   # theory verify / rate
    "loopformer.text.commands",     # text prepare, generate, perplexity
    "loopformer.analysis.commands",  # analyze continuity
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loopformer", description="Looped transformers with timestep encoding.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that part of the package is not there: skip it
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)
    except UserError as exc:
        print(f"loopformer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loopformer: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
