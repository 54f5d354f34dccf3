"""The `loopformer` command.

Sub-commands live next to the code they drive: each module in `COMMAND_MODULES` exposes `register(subparsers)`,
which adds its sub-parser(s) and sets `func` (called with the parsed args; returns an exit code or None). A
`UserError` anywhere prints one line and exits with status 2; so do a bad command line and a
failed file operation (disk full, read-only folder, missing file): `loopformer: error: ...`, never a traceback.
SIGINT, SIGTERM and SIGHUP end a command the same way everywhere (`loopformer.commandline.interrupt_on_signals`):
its cleanup runs, one line `loopformer: interrupted by SIGTERM` and exit status 128 + the signal (130, 143, 129).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

import yaml

from loopformer import hf_commands
from loopformer.analysis import commands as analysis_commands
from loopformer.commandline import interrupt_on_signals
from loopformer.configio import one_line
from loopformer.data import commands as data_commands
from loopformer.errors import UserError
from loopformer.eval import commands as eval_commands
from loopformer.eval import text_commands as perplexity_commands
from loopformer.experiments import commands as experiments_commands
from loopformer.model import commands as model_commands
from loopformer.model.memory import skip_hint
from loopformer.text import commands as text_commands
from loopformer.theory import commands as theory_commands
from loopformer.train import commands as train_commands

COMMAND_MODULES = [
    model_commands,        # presets, convert, info
    data_commands,         # data gen / show / import
    train_commands,        # train
    eval_commands,         # eval
    experiments_commands,  # sweep, report, demo
    theory_commands,       # theory verify / rate / modulus
    text_commands,         # text prepare, generate
    perplexity_commands,   # [text] perplexity (through the evaluation)
    analysis_commands,     # analyze continuity / dynamics
    hf_commands,           # hf export (transformers)
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


def memory_check_switch(args: argparse.Namespace) -> str | None:
    """How the command in `args` skips its memory check, named in a refusal: its `--no-memory-check`, a run's
    `memory_check=false` override, or nothing where it has neither."""
    if hasattr(args, "no_memory_check"):
        return "--no-memory-check"
    if getattr(args, "command", None) in ("train", "sweep"):
        return "memory_check=false"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loopformer", description="Looped transformers with timestep encoding.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMAND_MODULES:
        mod.register(sub)
    return parser


def _close_progress_bars() -> None:
    """Close the progress bars an interrupted command left open, so that the next line starts a line."""
    try:
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    except Exception:       # only cosmetic
        pass


def main(argv: list[str] | None = None) -> int:
    with interrupt_on_signals():
        try:
            return _main(argv)
        except KeyboardInterrupt as exc:    # Ctrl-C, kill, a closed terminal: the cleanup has run
            name, code = getattr(exc, "name", "SIGINT"), getattr(exc, "code", 130)
            _close_progress_bars()
            print(f"loopformer: interrupted by {name}", file=sys.stderr)
            return code


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:     # --help (0) or a bad command line (2, one line printed)
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with skip_hint(memory_check_switch(args)):
            code = args.func(args)
    except UserError as exc:
        print(f"loopformer: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:      # the reader of the output has gone (`loopformer config | head`): quietly, as the
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # shell's SIGPIPE would (no flush error)
        return 128 + 13
    except OSError as exc:       # disk full, read-only folder, missing or unreadable file
        print(f"loopformer: error: {os_error_line(exc)}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:    # a value given on the command line that a config cannot hold
        print(f"loopformer: error: cannot read a YAML value: {one_line(exc)}", file=sys.stderr)
        return 2
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
