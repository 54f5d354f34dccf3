"""File-system helpers used across loopformer: atomic writes of files and folders, reading a folder's JSON
manifest, choosing the torch device, and whether torch.compile can generate code for it.

Atomic writes: the content goes to a hidden temporary name next to its destination (`.NAME.tmp-*`) and is renamed
into place (`os.replace`), so a reader never sees a half-written file and a failure leaves nothing behind. A folder
is written the same way (`new_folder`); one that replaces an existing folder is swapped in with two renames: the old
folder is first renamed aside (`.NAME.old-*`) and deleted after the swap (`replace_dir`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from loopformer.errors import UserError

DEVICES = ("auto", "cpu", "cuda", "mps")   # device choices (also `cuda:N` where a device index is accepted)


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


def write_json(path: str | os.PathLike, obj: Any, *, indent: Optional[int] = 2, **dumps: Any) -> Path:
    """Atomically write `obj` as strict JSON (`json.dumps(obj, indent=indent, **dumps)` and a newline) to `path`:
    a NaN or infinite number is written as null, never as the non-standard `NaN` / `Infinity`."""
    dumps.setdefault("allow_nan", False)
    return write_text(path, json.dumps(finite_or_none(obj), indent=indent, **dumps) + "\n")


def write_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Atomically save a matplotlib figure; the format is the extension of `path` (e.g. .png)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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


# ------------------------------------------------------------------------------------------------- devices
def check_device(name: str) -> str:
    """`name` if it names a device kind loopformer knows (auto, cpu, cuda, cuda:N, mps), else a UserError."""
    kind, _, index = name.partition(":")
    if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise UserError(f"device must be one of auto, cpu, cuda, cuda:N, mps (got {name!r})")
    return name


def pick_device(choice: Optional[str] = "auto", local_rank: int = 0) -> torch.device:
    """'auto' (or None) → CUDA if available, else Apple MPS, else CPU; an explicit choice must be available.
    Plain 'cuda' is the process's GPU under torchrun (`local_rank`), 'cuda:N' a given one."""
    choice = check_device(choice or "auto")
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else ("mps" if has_mps else "cpu")
    if choice.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"device {choice} was asked for but no CUDA device is available")
        if ":" in choice:
            return torch.device(choice)
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if choice == "mps":
        if not has_mps:
            raise UserError("device mps was asked for but Apple MPS is not available")
        return torch.device("mps")
    return torch.device("cpu")


def can_compile(device: torch.device) -> bool:
    """Whether torch.compile's code generation is available on `device`: Triton on a CUDA device, a C++ compiler
    on a CPU."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return device.type == "cpu" and any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++",
                                                                      "clang++"))


__all__ = ["temp_path", "write_with", "write_text", "write_json", "write_figure", "replace_dir", "new_folder",
           "read_manifest", "check_device", "pick_device", "can_compile", "DEVICES"]
