"""Pieces shared by the sub-command modules (`*/commands.py`), so every command reads its arguments one way.

    add_group      a command group (`data`, `text`, `theory`, `analyze`): given without an action it prints its
                   help and exits with status 2
    add_device     --device: auto (CUDA, then Apple MPS, then CPU), cpu, cuda, cuda:N or mps
    add_quiet      --quiet (alias --no-progress): no progress bars
    add_rows       -n / --n N: only the first N rows
    add_halt       --halt RULE: adaptive depth by a halting rule (loopformer.model.halting)
    split_items    CONFIG [key=value ...]: the config file and the dotted overrides of `train` / `sweep`
    check_overrides  key=value overrides that the config loader cannot read (bad YAML) as one line
    check_runs_folder  a folder of runs (`sweep` / `demo` / `reproduce --out`) whose runs' paths read back as paths
    parse_options  key=value task options (`data gen --opt`, `eval --task-opt`), values read as YAML scalars
    intermixed     let key=value overrides come before or after the options
    interrupt_on_signals
                   while a command runs, SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main thread, so its
                   cleanup runs (temporary folders removed) and it ends with one line and exit status 128 + signal
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
from collections.abc import Iterable, Iterator

import yaml
from omegaconf import OmegaConf

from loopformer.configio import one_line
from loopformer.device import check_device
from loopformer.errors import UserError


def add_group(subparsers, name: str, help: str, description: str | None = None, metavar: str = "ACTION"):
    """A command group's parser; returns its sub-parsers (the group's own when another module made it: actions of
    one group may live in several packages). Without an action the group prints its help, exit 2."""
    if name in subparsers.choices:
        return subparsers.choices[name].actions
    group = subparsers.add_parser(name, help=help, description=description or help[:1].upper() + help[1:] + ".")
    group.set_defaults(func=lambda args: (group.print_help(), 2)[1])
    group.actions = group.add_subparsers(dest=f"{name}_command", metavar=metavar)
    return group.actions


def _device(text: str) -> str:
    try:
        return check_device(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_device(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """--device; `default=None` leaves the choice to the run config."""
    where = "the config's `device`" if default is None else default
    parser.add_argument("--device", type=_device, default=default, metavar="DEVICE",
                        help=f"auto (CUDA, then Apple MPS, then CPU), cpu, cuda, cuda:N or mps (default: {where})")


def add_quiet(parser: argparse.ArgumentParser, help: str = "no progress bars") -> None:
    parser.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help=help)


def add_rows(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    parser.add_argument("-n", "--n", dest="n", type=int, default=default, metavar="N", help=help)


HALT_HELP = ("adaptive depth: stop each row (causal models: each token) by CRITERION:THRESHOLD[,patience=K][,max=M]"
             "[,min=N] with CRITERION latent | kl | entropy | argmax | gate, e.g. kl:1e-3, argmax:2, gate:0.5")


def add_halt(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--halt", default=None, metavar="RULE", help=HALT_HELP)


def split_items(items: list[str], config_required: bool) -> tuple[str | None, list[str]]:
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
    check_overrides(items)
    return config, items


def check_overrides(items: Iterable[str], what: str = "override") -> None:
    """Each `key=value` must be one the config loader reads (a YAML value: no control characters, no unknown
    `!tag`, balanced brackets); otherwise a one-line UserError naming it."""
    for item in items:
        try:
            OmegaConf.from_dotlist([item])
        except Exception as exc:       # yaml's and OmegaConf's errors alike
            shown = item if len(item) <= 80 else item[:77] + "..."
            raise UserError(f"bad {what} {shown!r}: {one_line(exc)}") from None


def check_runs_folder(out: str, flag: str = "--out") -> None:
    """`out` will hold runs, each given its folder as an `out_dir=OUT/runs/NAME` override: that must read back as
    the same path (a name like `a: b`, `[x]`, `!x` or one with control characters would not)."""
    path = os.path.join(out, "runs", "x")
    try:
        back = OmegaConf.from_dotlist([f"out_dir={path}"]).get("out_dir")
    except Exception:       # yaml's and OmegaConf's errors alike
        back = None
    if back != path:
        raise UserError(f"{flag} {out!r} cannot hold runs: a config reads the path {path!r} back as {back!r}; "
                        "choose a plain folder name")


def intermixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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


def parse_options(pairs: list[str] | None, flag: str = "--opt") -> dict:
    """`key=value` strings to a dict; values are read as YAML scalars (60 -> int, 0.5 -> float, null -> None).
    `flag` names the option in messages."""
    out: dict = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise UserError(f"{flag} {pair!r} is not of the form key=value")
        key, raw = pair.split("=", 1)
        key = key.strip().replace("-", "_")
        if not key:
            raise UserError(f"{flag} {pair!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) and value.lower() == "none":
            value = None
        out[key] = value
    return out


class Interrupted(KeyboardInterrupt):
    """A signal that ends a command (SIGINT, SIGTERM, SIGHUP), raised in the main thread. A KeyboardInterrupt, so
    whatever cleans up after Ctrl-C cleans up after `kill` too; `code` is the exit status (128 + the signal)."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.name = signal.Signals(signum).name
        self.code = 128 + self.signum
        super().__init__(self.name)


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """While the block runs, SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main thread (a plain SIGTERM
    would end the process on the spot, leaving its temporary folders behind). The first signal raises; one that
    follows during the cleanup is ignored. A signal ignored when the block starts (`nohup`, a background job)
    stays ignored; the previous handlers are restored afterwards. Outside the main thread it does nothing (signals
    reach only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise Interrupted(signum)

    old = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, signal.SIG_DFL if h is None else h)


__all__ = ["split_items", "intermixed", "parse_options", "Interrupted", "interrupt_on_signals"]
