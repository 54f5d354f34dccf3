"""Field documentation of the typed config dataclasses, read from the source: the `# ...` comment on a field's line
and the comment lines aligned under it (the reference page `docs/reference/configs.md` and `loopformer config`
print the same text, so neither can drift from the code)."""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any


@cache
def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} from the class source: the `# ...` on the field's line and the comment-only lines aligned
    under it; a comment-only line at the fields' own indentation (a heading over a group of fields) goes to the
    next field that has no comment of its own."""
    out: dict[str, str] = {}
    current, pending = None, ""
    src = inspect.getsource(cls)
    lines = src.splitlines()
    fields = {f.name for f in dataclasses.fields(cls)}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NAME and tok.string in fields and tok.start[1] == 4 and current != tok.string:
            if pending and tok.string not in out:
                out[tok.string] = pending
                pending = ""
        if tok.type != tokenize.COMMENT:
            continue
        row = tok.start[0] - 1
        code = lines[row][:tok.start[1]].strip()
        text = tok.string.lstrip("#").strip()
        if code:
            name = code.split(":")[0].strip()
            current = name if name in fields else None
            if current:
                out[current] = (out[current] + " — " if current in out else "") + text
        elif tok.start[1] > 4 and current:                   # a continuation aligned under a field's comment
            out[current] += " " + text
        else:                                                # a heading over the next fields
            current, pending = None, text
    return out


def default_text(f: dataclasses.Field) -> str:
    """A field's default as the reference shows it: its repr, "(section)" for a nested config, "(required)"."""
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return repr(value) if not dataclasses.is_dataclass(value) else "(section)"
    return "(required)"


def class_summary(cls: type) -> str:
    """The first paragraph of a config class's docstring on one line ("" for dataclasses' generated one)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{cls.__name__}(") else inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ")


@dataclass(frozen=True)
class FieldDoc:
    key: str          # the dotted key from the run config's top (train.optim.lr)
    kind: str         # the annotation as written (float, list[str], ...)
    default: str      # default_text
    meaning: str      # field_comments
    section: type | None = None   # the section's class, for a field that holds a section


def fields_of(cls: type, prefix: str = "") -> list[FieldDoc]:
    """One FieldDoc per init field of `cls`, keys under `prefix` (a nested section: one row with `section` set)."""
    hints = typing.get_type_hints(cls)
    notes = field_comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        sub = hints.get(f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append(FieldDoc(f"{prefix}{f.name}", kind, default_text(f), notes.get(f.name, ""),
                            sub if dataclasses.is_dataclass(sub) else None))
    return out


def lookup(cls: type, key: str) -> tuple[type, FieldDoc | None]:
    """The section class and field that the dotted `key` names under `cls` ("" or a section: (its class, None));
    ValueError naming the first unknown part."""
    section, row = cls, None
    done: list[str] = []
    for part in [p for p in key.split(".") if p] if key else []:
        if row is not None and row.section is None:
            raise ValueError(f"{'.'.join(done)} is a field, not a section: it has no {part!r}")
        rows = {r.key.rsplit(".", 1)[-1]: r for r in fields_of(section, ".".join(done + [""]) if done else "")}
        if part not in rows:
            where = ".".join(done) or "the run config"
            raise ValueError(f"{where} has no field {part!r} (it has: {', '.join(rows)})")
        row = rows[part]
        done.append(part)
        if row.section is not None:
            section, row = row.section, None
    return section, row


def value_text(value: Any) -> str:
    """A current value as the `config` command prints it."""
    return repr(value)


__all__ = ["FieldDoc", "field_comments", "default_text", "class_summary", "fields_of", "lookup", "value_text"]
