"""Pieces shared by the sub-command modules (`*/commands.py`), so every command reads its arguments one way.

    add_group      a command group (`data`, `text`, `theory`, `analyze`): given without an action it prints its
                   help and exits with status 2
    add_device     --device: auto (CUDA, then Apple MPS, then CPU), cpu, cuda, cuda:N or mps
    add_quiet      --quiet (alias --no-progress): no progress bars
    add_rows       -n / --n N: only the first N rows
    add_halt       --halt RULE: adaptive depth by a halting rule (loopformer.model.halting)
    split_items    CONFIG [key=value ...]: the config file and the dotted overrides of `train` / `sweep`
    parse_options  key=value task options (`data gen --opt`, `eval --task-opt`), values read as YAML scalars
    intermixed     let key=value overrides come before or after the options
"""

from __future__ import annotations

import argparse

import yaml

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
    return config, items


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


__all__ = ["split_items", "intermixed", "parse_options"]
