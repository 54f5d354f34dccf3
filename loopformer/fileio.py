"""File-system helpers used across loopformer: atomic writes of files and folders, reading a folder's JSON
manifest, choosing the torch device, and whether torch.compile can generate code for it.

Atomic writes: the content goes to a hidden temporary name next to its destination (`.NAME.tmp-*`) and is renamed
into place (`os.replace`), so a reader never sees a half-written file and a failure leaves nothing behind. A folder
is written the same way (`new_folder`); one that replaces an existing folder is swapped in with two renames: the old
folder is first renamed aside (`.NAME.old-*`) and deleted after the swap (`replace_dir`). An output folder a command
made is removed again when the command fails or is interrupted (`removed_on_failure`); the temporary folders of a
process killed outright (kill -9, an abort) are removed by the next run into their folder (`remove_stale_temps`).

Owned folders: a command writes only into a folder it made or one holding its own marker file (`foreign_entries`,
`check_owned_folder`); lock and log files are opened without following a symbolic link (`open_nofollow`).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from loopformer.errors import UserError


# ------------------------------------------------------------------------------------------------- atomic files
def temp_path(path: str | os.PathLike) -> Path:
    """The hidden temporary name next to `path` that an atomic write of it uses."""
    p = Path(path)
    return p.with_name(f".{p.name}.tmp-{os.getpid()}")


def write_with(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Atomically create or replace the file `path`: `write(tmp)` writes the content to a temporary file, which is
    then renamed to `path`. On any failure the temporary file is removed and the error raised."""
    dest = Path(path)
    tmp = temp_path(dest)
    try:
        write(tmp)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Atomically write `text` to `path`."""
    return write_with(path, lambda tmp: tmp.write_text(text))


def finite_or_none(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, **dumps: Any) -> Path:
    """Atomically write `obj` as strict JSON (`json.dumps(obj, indent=indent, **dumps)` and a newline) to `path`:
    a NaN or infinite number is written as null, never as the non-standard `NaN` / `Infinity`."""
    dumps.setdefault("allow_nan", False)
    return write_text(path, json.dumps(finite_or_none(obj), indent=indent, **dumps) + "\n")


FIGURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")


def check_figure_path(path: str | os.PathLike) -> str:
    """The image format of the figure file `path` (its extension; none: png), or a UserError for an extension that
    is no image format or a missing folder — checked before the work that draws it."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    if fmt not in FIGURE_FORMATS:
        raise UserError(f"cannot draw a figure into {path}: .{fmt} is no image format (use one of "
                        f"{', '.join('.' + f for f in FIGURE_FORMATS)})")
    if not Path(path).resolve().parent.is_dir():
        raise UserError(f"cannot draw a figure into {path}: the folder {Path(path).parent} does not exist")
    return fmt


def write_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Atomically save a matplotlib figure; the format is the extension of `path` (e.g. .png)."""
    fmt = check_figure_path(path)
    return write_with(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=fmt))


# ------------------------------------------------------------------------------------------------- atomic folders
def replace_dir(tmp: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Move the finished folder `tmp` to `dest`, replacing an existing `dest` with only a rename-sized window
    (between the two renames `dest` is missing and `.NAME.old-*` holds it)."""
    tmp, dest = Path(tmp), Path(dest)
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


@contextlib.contextmanager
def new_folder(dest: str | os.PathLike) -> Iterator[Path]:
    """`with new_folder(DEST) as tmp:` fill the folder `tmp`; when the block ends without an error `tmp` replaces
    DEST (`replace_dir`), otherwise it is deleted and DEST is left as it was."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))
    try:
        yield tmp
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def removed_on_failure(folder: str | os.PathLike) -> Iterator[Path]:
    """`with removed_on_failure(OUT):` a command that makes the folder OUT and writes its outputs there: if the
    block fails or is interrupted (Ctrl-C, SIGTERM) and OUT did not exist before it, OUT is removed, so no partial
    set of outputs is left; an existing OUT keeps what it held (each file in it is written atomically)."""
    folder = Path(folder)
    existed = os.path.lexists(folder)
    try:
        yield folder
    except BaseException:
        if not existed and folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
        raise


def owner_dead(path: str | os.PathLike, prefix: str) -> bool:
    """Whether the hidden temporary `path`, named PREFIX<pid>-..., was left by a process that no longer runs."""
    pid = Path(path).name[len(prefix):].split("-", 1)[0]
    if not Path(path).name.startswith(prefix) or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):       # another user's process, or no such number
        return False
    return False


def remove_stale_temps(folder: str | os.PathLike, prefix: str) -> None:
    """Delete the temporary folders PREFIX<pid>-* in `folder` whose writer no longer runs (killed mid-write)."""
    folder = Path(folder)
    if folder.is_dir():
        for p in folder.iterdir():
            if p.is_dir() and not p.is_symlink() and owner_dead(p, prefix):
                shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- owned folders
def foreign_entries(folder: str | os.PathLike, ours: Collection[str], marker: str, always: Collection[str] = ()
                    ) -> list[str]:
    """The names in `folder` that a command writing the entries `ours` (names or fnmatch patterns) did not write.

    A command writes only into a folder it made or one that holds its own `marker` file (a regular file, not a
    link): in a folder holding the marker every name outside `ours` is foreign, in any other folder every name
    (but `always`). A symbolic link is always foreign (no command writes one); the hidden temporary names of the
    atomic writes of `ours` never are — exactly those names (`temporary_of`): a hidden file of the user's that
    merely starts like one (`.config.json.orig`, `.model.safetensors.bak`) is foreign."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return []
    mark = folder / marker
    allowed = list(always) + (list(ours) if mark.is_file() and not mark.is_symlink() else [])
    return sorted(p.name for p in folder.iterdir()
                  if p.is_symlink() or not (any(fnmatch.fnmatchcase(p.name, pat) for pat in allowed)
                                            or temporary_of(p.name, ours)))


# the hidden names the atomic writers give: `.NAME.tmp-<pid>` (`write_with`), `.NAME.tmp-<pid>-<random>`
# (`new_folder`), `.NAME.old-<pid>` (`replace_dir`), `.NAME.old-broken-<pid>` (a checkpoint's repair)
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?:tmp|old|old-broken)-[0-9]+(?:-[A-Za-z0-9_]+)?")


def temporary_of(name: str, ours: Collection[str]) -> bool:
    """Whether `name` is the hidden temporary name an atomic write of one of `ours` (names or fnmatch patterns)
    gives."""
    m = _TEMPORARY.fullmatch(name)
    return m is not None and any(fnmatch.fnmatchcase(m.group("name"), pat) for pat in ours)


def check_owned_folder(folder: str | os.PathLike, ours: Collection[str], marker: str, what: str,
                       always: Collection[str] = (), hint: str = "choose an empty or new folder") -> Path:
    """`folder` if `what` (a command) may write into it: missing, empty, or holding only what it wrote
    (`foreign_entries`); otherwise a one-line UserError naming what is in the way (the user's files are never
    replaced, not even with --force / --overwrite: those replace only what the command wrote)."""
    folder = Path(folder)
    if folder.is_symlink() or (os.path.lexists(folder) and not folder.is_dir()):
        raise UserError(f"{folder} exists and is not a folder {what} wrote (a file or a link); {hint}")
    foreign = foreign_entries(folder, ours, marker, always)
    if foreign:
        raise UserError(f"{folder} holds files {what} does not write ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}); {hint}")
    return folder


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags)` refusing a symbolic link at `path` (a lock or log file: its target would be written)."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise UserError(f"{path} is a symbolic link; refusing to write through it (remove it)") from None
        raise


# ------------------------------------------------------------------------------------------------- manifests
def read_manifest(folder: str | os.PathLike, missing: str, name: str = "manifest.json") -> dict:
    """The JSON object in `folder/name`; a missing file is the UserError `missing`, bad JSON or a value that is not
    an object is a UserError naming the file. The caller checks the fields it reads."""
    path = os.path.join(os.fspath(folder), name)
    if not os.path.isfile(path):
        raise UserError(missing)
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except (ValueError, OSError) as exc:    # bad JSON, not UTF-8, unreadable
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"malformed manifest {path}: {first}") from None
    if not isinstance(manifest, dict):
        raise UserError(f"malformed manifest {path}: expected a JSON object")
    return manifest


__all__ = ["temp_path", "write_with", "write_text", "write_json", "write_figure", "check_figure_path", "replace_dir",
           "new_folder", "removed_on_failure",
           "foreign_entries", "temporary_of", "check_owned_folder", "open_nofollow", "owner_dead",
           "remove_stale_temps", "read_manifest"]
