"""Data files checked against the SHA-256 of their manifest before training or evaluation reads them.

Hashing a large file on every open would cost seconds per run, so a verified file is remembered by (path, size,
modification time): `verify_file` hashes a file the first time it is opened and again only when its size or
modification time changed. As git does for its index, a record is trusted only if the file had not been modified
for 2 seconds when it was hashed (a change within the file system's timestamp granularity cannot hide). Records
live in `verified.json` under `$LOOPFORMER_CACHE_DIR` (default `$XDG_CACHE_HOME/loopformer`, i.e.
`~/.cache/loopformer`) and in memory for this process; where that is not writable the file is simply hashed on
each open. Alongside the hash a record keeps what the caller computed at verification time (e.g. the smallest and
largest token id), so those checks are cached too.

A mismatch is a one-line `UserError`: the file is corrupt or was changed after its manifest was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from loopformer.errors import UserError
from loopformer.fileio import write_json

CACHE_FILE = "verified.json"
RACY_NS = 2_000_000_000      # a file modified this shortly before it was hashed is hashed again next time
_MEMO: dict[str, dict[str, Any]] = {}


def cache_dir() -> str:
    d = os.environ.get("LOOPFORMER_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "loopformer")


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def _read_cache() -> dict:
    try:
        with open(os.path.join(cache_dir(), CACHE_FILE)) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: str, entry: dict) -> None:
    """Best effort: an unwritable cache folder or a full disk only means hashing again next time."""
    folder = cache_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        data = _read_cache()
        data = {k: v for k, v in data.items() if os.path.exists(k)} if len(data) > 10000 else data
        data[path] = entry
        write_json(os.path.join(folder, CACHE_FILE), data, indent=1, sort_keys=True)
    except OSError:
        pass


def verify_file(path: str | os.PathLike, sha256: str | None, label: str,
                extra: Callable[[], dict] | None = None, shown: str | None = None) -> dict:
    """Check `path` against `sha256` unless it was verified before at its current size and modification time.

    `extra()`, if given, is run once when the file is (re)verified and its JSON-able result is stored with the
    record under "extra". Returns the record: {"size", "mtime_ns", "sha256", "extra"}. `label` starts the error
    message and `shown` names the file in it (default: its name).
    """
    path = os.path.abspath(os.fspath(path))
    name = os.path.basename(path)
    shown = shown or name
    if not isinstance(sha256, str) or not sha256:
        raise UserError(f"{label}: the manifest has no SHA-256 for {shown}")
    try:
        st = os.stat(path)
    except OSError:
        raise UserError(f"{label}: {shown} is missing") from None
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}

    def fresh(rec: Any) -> bool:
        return (isinstance(rec, dict) and all(rec.get(k) == v for k, v in key.items())
                and isinstance(rec.get("verified_ns"), int) and rec["verified_ns"] - st.st_mtime_ns > RACY_NS
                and (extra is None or "extra" in rec))

    rec = _MEMO.get(path)
    if not fresh(rec):
        rec = _read_cache().get(path)
    if not fresh(rec):
        began = time.time_ns()
        if sha256_file(path) != sha256:
            raise UserError(f"{label}: checksum mismatch for {shown} (the file is corrupt or was changed after its "
                            f"manifest was written)")
        rec = dict(key, verified_ns=began)
        if extra is not None:
            rec["extra"] = extra()
        _write_cache(path, rec)
    _MEMO[path] = rec
    return rec


def forget(path: str | os.PathLike | None = None) -> None:
    """Drop the in-process memory of verified files (all, or one path); the on-disk record stays."""
    if path is None:
        _MEMO.clear()
    else:
        _MEMO.pop(os.path.abspath(os.fspath(path)), None)


__all__ = ["verify_file", "sha256_file", "forget", "cache_dir", "CACHE_FILE"]
