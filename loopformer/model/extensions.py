"""The loop's extension point: an experiment changes the loop without editing the core loop or `ModelConfig`.

An extension is a `LoopExtension` subclass, named with its options in a config:

    model:
      extensions: {noise_start: {sigma: 1.0}, sandwich_norm: {}}

A name is looked up among the extensions registered in this process (`register`) and the entry points of the group
`loopformer.extensions` (the package's own lab extensions, `loopformer.lab`, are listed there in pyproject.toml;
any installed package can list its own). The core calls three hooks, each doing nothing by default:

    start(e, h0, training)     the state the first loop starts from, given the core's h0 (None: the read-in e
                               itself): a tensor [B,T,D] has e injected before the first loop too
    after_loop(h, out, t)      the state after loop t from the state before it, h, and the block's output, out
                               (`LoopedTransformer.step`: forward and the exits alike)
    branch_out(cfg, **opts)    (a classmethod) a module each residual branch's output passes before it is added,
                               one per branch and layer, or None

and `check(cfg, **opts)` (a classmethod) refuses a config the extension cannot run, with a ValueError naming the
field. A model builds its extensions once, in config order (`LoopedTransformer.extensions`, state-dict entries
`extensions.<i>.…`), and runs their hooks in that order. The core never imports an extension's module: the
lookup is by name.

Shapes: B batch, T length, D width.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect

import torch
from torch import nn

GROUP = "loopformer.extensions"          # the entry-point group of extension classes
_REGISTERED: dict[str, type[LoopExtension]] = {}


class LoopExtension(nn.Module):
    """The base of an extension: override the hooks it needs (the module docstring says when each runs). The
    options of its config entry arrive as keyword arguments of `__init__`, `check` and `branch_out`."""

    def __init__(self, cfg, **options):
        super().__init__()

    @classmethod
    def check(cls, cfg, **options) -> None:
        """Refuse a config this extension cannot run (a ValueError naming the field); nothing by default."""

    @classmethod
    def branch_out(cls, cfg, **options) -> nn.Module | None:
        """A module for each residual branch's output (None: the output is added as it is)."""
        return None

    def reset_parameters(self) -> None:
        """Set the extension's parameters to their start (called by the model's `reset_parameters`)."""

    def start(self, e: torch.Tensor, h0: torch.Tensor | None, training: bool) -> torch.Tensor | None:
        """The start state from the read-in e [B,T,D] and the core's h0 (None: e itself)."""
        return h0

    def after_loop(self, h: torch.Tensor, out: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        """The state after loop t from the state before it (h) and the block's output (out).  [B,T,D]."""
        return out


def register(name: str):
    """A class decorator: `@register("my_stabiliser")` makes the class available as `model.extensions.my_stabiliser`
    in this process (a package that is installed lists it under the entry-point group instead)."""
    def add(cls: type[LoopExtension]) -> type[LoopExtension]:
        if not (isinstance(cls, type) and issubclass(cls, LoopExtension)):
            raise TypeError(f"extension {name!r} must be a LoopExtension subclass")
        _REGISTERED[name] = cls
        return cls
    return add


@functools.cache
def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def available() -> list[str]:
    """The names an extension may be given: registered in this process or listed as entry points."""
    return sorted({*_REGISTERED, *_entry_points()})


def resolve(name: str) -> type[LoopExtension]:
    """The extension class of `name` (a ValueError naming it and the available ones if there is none)."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    ep = _entry_points().get(name)
    if ep is None:
        raise ValueError(f"extensions: no extension named {name!r} (available: {', '.join(available()) or 'none'})")
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, LoopExtension)):
        raise ValueError(f"extensions: the entry point {name!r} ({ep.value}) is not a LoopExtension subclass")
    return cls


def check(cfg) -> None:
    """`cfg.extensions` checked: every name known, its options a mapping that its class accepts, and the class's
    own `check` passed (ValueError naming the entry: a config error)."""
    for name, options in cfg.extensions.items():
        cls = resolve(name)
        if not isinstance(options, dict):
            raise ValueError(f"extensions.{name} takes its options as key: value pairs (got {options!r})")
        try:
            inspect.signature(cls.__init__).bind(None, cfg, **options)
        except TypeError as exc:
            raise ValueError(f"extensions.{name}: {exc}") from None
        cls.check(cfg, **options)


def build(cfg) -> nn.ModuleList:
    """The model's extensions, in config order."""
    return nn.ModuleList(resolve(name)(cfg, **options) for name, options in cfg.extensions.items())


def branch_out(cfg) -> nn.Module | None:
    """The module a residual branch's output passes (the first extension that gives one), else None."""
    for name, options in cfg.extensions.items():
        module = resolve(name).branch_out(cfg, **options)
        if module is not None:
            return module
    return None


def changes_state(extensions: nn.ModuleList) -> bool:
    """Whether some extension overrides `after_loop` (the state after a loop is not the block's output)."""
    return any(type(ext).after_loop is not LoopExtension.after_loop for ext in extensions)


__all__ = ["GROUP", "LoopExtension", "register", "available", "resolve", "check", "build", "branch_out",
           "changes_state"]
