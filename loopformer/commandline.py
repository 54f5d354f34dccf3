"""Pieces shared by the sub-command modules (`*/commands.py`), so every command reads its arguments one way.

    split_items    CONFIG [key=value ...]: the config file and the dotted overrides of `train` / `sweep`
    intermixed     let key=value overrides come before or after the options
"""

from __future__ import annotations

import argparse
from typing import Optional

from loopformer.errors import UserError


def split_items(items: list[str], config_required: bool) -> tuple[Optional[str], list[str]]:
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


__all__ = ["split_items", "intermixed"]
