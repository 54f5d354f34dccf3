"""The import graph of the package keeps its layers (docs/architecture.md): every import between packages goes to
a lower layer, packages of one layer do not import each other, and no modules import each other in a circle.
Imports inside functions count as well."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "loopformer"

LAYERS = {                      # higher imports lower, never the other way
    "lab": 10,                  # experiments through the extension point: nothing in loopformer imports them
    "cli": 9,
    "experiments": 8, "analysis": 8, "hf_commands": 8,
    "train": 7, "hf": 7,
    "eval": 6,
    "sources": 5,
    "data": 4, "text": 4, "theory": 4,
    "tasks": 3, "model": 3,
    "configio": 1, "configdoc": 1, "fileio": 1, "device": 1, "commandline": 1, "checksums": 1, "errors": 1,
    "version": 1,
}
BASE = 1                        # the base modules may import each other (without circles)


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path) -> set[str]:
    """The loopformer modules that module `name` imports (anywhere in the file)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:          # relative: `from .x import y` is relative to this module's package
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _part(module: str) -> str:
    """The package (or top-level module) a module belongs to: loopformer.train.run -> train."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_layer():
    assert {_part(m) for m in MODULES} - {""} <= set(LAYERS)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down(name):
    src = _part(name)
    if src == "":                   # the package's face (loopformer/__init__.py) hands names on
        return
    for target in GRAPH[name]:
        dst = _part(target)
        if dst == src:
            continue
        if LAYERS[src] == LAYERS[dst] == BASE:
            continue
        assert dst != "", f"{name} imports the package face; import the module that defines the name"
        assert LAYERS[dst] < LAYERS[src], f"{name} ({src}, layer {LAYERS[src]}) imports {target} " \
                                          f"({dst}, layer {LAYERS[dst]})"


def test_no_circles():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


# attributes of objects that are not loopformer's: torch.compile's wrapped module, a multiprocessing pool's workers
FOREIGN_PRIVATE = {"_orig_mod", "_processes"}


def _private_uses(path: Path) -> list[str]:
    """Where a module reaches into another's private names: `obj._name` on anything but `self` / `cls`, and
    `from loopformer.x import _name`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and node.attr not in FOREIGN_PRIVATE:
                out.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loopformer"):
            out += [f"line {node.lineno}: import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_uses_another_modules_private_names(name):
    assert _private_uses(MODULES[name]) == [], f"{name} uses private names of another module"


def test_the_private_name_check_finds_a_planted_use(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from loopformer.model.x import _hidden\n\ndef f(model):\n    return model._block(1)\n")
    assert _private_uses(planted) == ["line 1: import _hidden", "line 4: ._block"]
