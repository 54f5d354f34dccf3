"""The `loopformer` command.

Sub-commands live next to the code they drive: each module listed in `_COMMAND_MODULES` exposes
`register(subparsers)`, which adds its sub-parser(s) and sets `func` (called with the parsed args; returns an exit
code or None). A `UserError` anywhere prints one line and exits with status 2; so do a bad command line and a
failed file operation (disk full, read-only folder, missing file): `loopformer: error: ...`, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys

from loopformer.errors import UserError

_COMMAND_MODULES = [
    "loopformer.model.commands",    # info, presets, convert
    "loopformer.data.commands",     # data gen / show / import
    "loopformer.train.commands",    # train, eval, sweep, report, demo
    "loopformer.theory.commands",   # theory verify / rate
    "loopformer.text.commands",     # text prepare, generate, perplexity
    "loopformer.analysis.commands",  # analyze continuity
]


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (`loopformer: error: ...`, exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"loopformer: error: {self.prog}: {' '.join(message.split())}\n")


def os_error_line(exc: OSError) -> str:
    """One line for a failed file operation, naming the file."""
    what = exc.strerror or (exc.args[0] if exc.args else type(exc).__name__)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on the device"
    names = [str(f) for f in (exc.filename, exc.filename2) if f]
    return f"{what}: {' -> '.join(names)}" if names else str(what)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loopformer", description="Looped transformers with timestep encoding.")
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
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:     # --help (0) or a bad command line (2, one line printed)
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)
    except UserError as exc:
        print(f"loopformer: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:       # disk full, read-only folder, missing or unreadable file
        print(f"loopformer: error: {os_error_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loopformer: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
