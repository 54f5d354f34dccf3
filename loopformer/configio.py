"""Typed configuration loading: YAML files plus dotted overrides into validated dataclasses.

Every config in loopformer is a (possibly nested) dataclass whose `__post_init__` validates its values. This module
uses OmegaConf to merge a YAML file and `key=value` overrides onto the dataclass schema, so unknown keys and values
of the wrong type are rejected with the offending key named, and then builds the dataclass (running its checks).
All failures surface as one-line `UserError`s. A config class whose keys were renamed in a release may define
`upgrade(raw, notice)` (a static method): every raw layer — the base dict, the YAML file's dict, the list of `key=value`
overrides — passes through it before the typed load, so the keys of the earlier release still load. The configs shipped
with the package live in `CONFIG_DIR` (`loopformer/configs/`; a clone reaches the same files as `configs/`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loopformer.errors import UserError

T = TypeVar("T")

CONFIG_DIR = Path(__file__).resolve().parent / "configs"   # the YAML configs shipped with the package


def one_line(exc: BaseException) -> str:
    """The first line of an OmegaConf / YAML error, with the offending key when it names one."""
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else type(exc).__name__
    # OmegaConf appends "full_key: ..." lines; keep the key, it is the most useful part.
    for line in msg[1:]:
        line = line.strip()
        if line.startswith("full_key:") and line != "full_key:":
            return f"{first} ({line})"
    return first


MAX_STRING = 4096                                   # the longest string a config value may hold
_RESOLVER = re.compile(r"\$\{\s*[\w.\-]+\s*:")        # ${name:...}: a resolver (oc.env, oc.decode, ...)


def check_values(layer: Any, where: str, key: str = "") -> None:
    """Refuse what must not reach a run folder: resolver interpolations (`${oc.env:SECRET}` would be written, resolved,
    into config.yaml and the checkpoint's config.json — which may be pushed to a hub) and strings longer than
    MAX_STRING (every config is copied into several files of each run). References to other keys (`${model.loops}`)
    are fine."""
    if isinstance(layer, dict):
        for k, v in layer.items():
            check_values(v, where, f"{key}.{k}" if key else str(k))
    elif isinstance(layer, list):
        for i, v in enumerate(layer):
            check_values(v, where, f"{key}[{i}]")
    elif isinstance(layer, str):
        if len(layer) > MAX_STRING:
            raise UserError(f"{where}: {key} holds a string of {len(layer):,} characters (at most {MAX_STRING:,})")
        if _RESOLVER.search(layer):
            raise UserError(f"{where}: {key} = {layer[:80]!r} uses a resolver interpolation; its value (e.g. from the "
                            "environment) would be written into the run folder and checkpoints: give the value itself")


def user_layers(path: str | os.PathLike | None = None, overrides: Iterable[str] = (),
                upgrade: Callable[[Any, bool], Any] | None = None, notice: bool = True) -> list:
    """The YAML file at `path` and the dotted `overrides`, parsed but not yet checked against a schema (see
    `check_values` for what is refused). `upgrade(raw, notice)`: renames the keys of an earlier release in the file's
    dict and in the overrides (see the module docstring); `notice` False: it names none of them on stderr (a run
    folder's stored config), the overrides' keys excepted."""
    layers = []
    if path is not None:
        if not os.path.isfile(path):
            raise UserError(f"config file not found: {path}")
        try:
            layer = OmegaConf.load(path)
        except Exception as exc:  # yaml errors, unreadable or non-UTF-8 files
            raise UserError(f"cannot parse config {path}: {one_line(exc)}") from None
        if not isinstance(layer, DictConfig):
            raise UserError(f"config {path} must hold key: value pairs at the top level (it holds a list)")
        raw = OmegaConf.to_container(layer, resolve=False)
        check_values(raw, f"config {path}")
        if upgrade is not None:
            new = upgrade(raw, notice)
            layer = layer if new is raw else OmegaConf.create(new)
        layers.append(layer)
    overrides = list(overrides)
    for ov in overrides:
        if "=" not in ov:
            raise UserError(f"override {ov!r} is not of the form key=value")
        check_values(ov.split("=", 1)[1], "override", ov.split("=", 1)[0])
    if upgrade is not None:
        overrides = upgrade(overrides, True)              # the keys, in order: the later of two still wins
    if overrides:
        try:
            layer = OmegaConf.from_dotlist(overrides)
        except (OmegaConfBaseException, ValueError, TypeError) as exc:   # e.g. a.b=1 after a=[1, 2]
            raise UserError(f"bad override: {one_line(exc)}") from None
        if upgrade is not None:                           # ... and what their values hold (a section, stages)
            raw = OmegaConf.to_container(layer, resolve=False)
            new = upgrade(raw, True)
            layer = layer if new is raw else OmegaConf.create(new)
        layers.append(layer)
    return layers


def load_config(cls: type[T], path: str | os.PathLike | None = None, overrides: Iterable[str] = (),
                base: dict | None = None, stored: bool = False) -> T:
    """Build `cls` from defaults, then `base` (a dict), then the YAML file at `path`, then dotted `overrides`.
    `stored`: the file is one loopformer wrote (a run folder's config): the renamed keys it holds (`cls.upgrade`)
    load without a notice.

    >>> from loopformer.model.config import ModelConfig
    >>> load_config(ModelConfig, overrides=["loops=8", "timestep=true"]).loops
    8
    """
    upgrade = getattr(cls, "upgrade", None)
    try:
        schema = OmegaConf.structured(cls)
        layers = [schema]
        if base:
            layers.append(OmegaConf.create(upgrade(base, True) if upgrade else base))
        layers += user_layers(path, overrides, upgrade, notice=not stored)
        merged = OmegaConf.merge(*layers)
        obj = OmegaConf.to_object(merged)
    except UserError:
        raise
    except OmegaConfBaseException as exc:
        raise UserError(f"config error: {one_line(exc)}") from None
    except (ValueError, TypeError) as exc:  # raised by __post_init__ validation
        raise UserError(f"config error: {one_line(exc)}") from None
    return obj  # type: ignore[return-value]


def shipped_config(name: str) -> Path:
    """The path of a config shipped with loopformer, e.g. `shipped_config("cpu/demo.yaml")`."""
    path = CONFIG_DIR / name
    if not path.is_file():
        raise UserError(f"no shipped config {name!r} (see {CONFIG_DIR})")
    return path


def to_dict(cfg: Any) -> dict:
    """A plain, JSON-serialisable dict of a (nested) config dataclass."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type[T], data: dict) -> T:
    """Strictly rebuild a config dataclass from `to_dict` output (unknown keys are errors)."""
    return load_config(cls, base=data)
