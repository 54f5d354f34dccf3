"""A distributed checkpoint's files checked before anything in them is used.

`torch.distributed.checkpoint` (DCP) keeps a checkpoint's layout in a `.metadata` file that its reader unpickles, and
loads the non-tensor entries of a state (the optimiser's hyperparameters) with `torch.load(weights_only=False)`: a
planted `.metadata` or shard would run code. Here neither happens:

- at save time rank 0 writes `manifest.json` beside the shards: every file's size and SHA-256, every tensor's dtype
  and shape, and the checkpoint's identity (a random id also recorded in its training state, and its step);
- at load time (`verify`) the folder must hold exactly the files its manifest lists, each of the listed size and
  checksum, under the identity the training state expects; `.metadata` is then read by an unpickler that builds only
  DCP's own metadata classes, torch's dtypes, sizes and layouts and paths (anything else stops the read before it is
  built), and its structure is checked (entries of the listed types, storage only in the listed shards, within
  their sizes, the tensors of the manifest);
- DCP then reads through `SafeReader` (the verified metadata, never the file again) and `SafePlanner` (non-tensor
  entries loaded with `weights_only=True`).

A damaged, truncated, mixed (a shard of another checkpoint) or crafted folder is a one-line UserError.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loopformer.errors import UserError
from loopformer.fileio import write_json

MANIFEST = "manifest.json"
METADATA = ".metadata"
FORMAT = "loopformer-sharded-1"
MAX_MANIFEST = 64 << 20          # bytes of manifest.json
MAX_METADATA = 256 << 20         # bytes of .metadata
MAX_FILES = 65_536               # files of one sharded folder
MAX_DIMS = 8                     # dimensions of a stored tensor

_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *((_DCP, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                          "MetadataIndex", "StorageMeta", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch's dtypes, `torch.Size`, layouts and paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a distributed checkpoint's metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent references are not part of a distributed checkpoint's metadata")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_entries(meta: Any) -> dict[str, dict[str, Any]]:
    """{key: {"dtype", "shape"}} of a DCP Metadata's tensors."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return {k: {"dtype": _dtype_name(v.properties.dtype), "shape": [int(x) for x in v.size]}
            for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def write_manifest(folder: Path, meta: Any, identity: dict[str, Any]) -> None:
    """`folder/manifest.json`: every file's size and checksum, every tensor's dtype and shape, and `identity`
    ({"id", "step"}); rank 0 calls it once DCP has written every process's shard and the metadata."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    write_json(folder / MANIFEST, {"format": FORMAT, "id": identity["id"], "step": identity["step"],
                                   "files": files, "tensors": tensor_entries(meta)})


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\\" not in name \
        and name not in (".", "..") and "\0" not in name


def _int(v: Any) -> bool:
    return type(v) is int and v >= 0


def read_manifest(folder: Path) -> dict[str, Any]:
    """`folder/manifest.json`, checked as plain JSON (its format, identity, files and tensors)."""
    f = folder / MANIFEST
    if f.is_symlink() or not f.is_file():
        raise UserError(f"{folder} holds no {MANIFEST} (a sharded checkpoint lists its files' checksums there; one "
                        f"without it is refused)")
    try:
        with open(f, "rb") as fh:
            raw = fh.read(MAX_MANIFEST + 1)
        if len(raw) > MAX_MANIFEST:
            raise ValueError(f"larger than {MAX_MANIFEST:,} bytes")
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise UserError(f"{f} is nested too deeply to be a manifest") from None
    except (ValueError, OSError) as exc:
        raise UserError(f"{f} is not a valid manifest ({str(exc).splitlines()[0][:200]})") from None
    files, tensors = (data.get("files"), data.get("tensors")) if isinstance(data, dict) else (None, None)
    ok = (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("id"), str)
          and len(data["id"]) <= 64 and _int(data.get("step")) and isinstance(files, dict)
          and 0 < len(files) <= MAX_FILES and METADATA in files and isinstance(tensors, dict)
          and all(_plain_name(n) and isinstance(r, dict) and _int(r.get("bytes")) and isinstance(r.get("sha256"), str)
                  and len(r["sha256"]) == 64 for n, r in files.items())
          and all(isinstance(k, str) and isinstance(t, dict) and isinstance(t.get("dtype"), str)
                  and isinstance(t.get("shape"), list) and len(t["shape"]) <= MAX_DIMS
                  and all(_int(x) for x in t["shape"]) for k, t in tensors.items()))
    if not ok:
        raise UserError(f"{f} is not a valid manifest of a sharded checkpoint (format {FORMAT})")
    return data


def _check_files(folder: Path, manifest: dict[str, Any], checksums: bool = True) -> None:
    listed = set(manifest["files"])
    try:
        present = {p.name for p in folder.iterdir()} - {MANIFEST}
    except OSError as exc:
        raise UserError(f"cannot read {folder}: {exc.strerror or exc}") from None
    if present - listed:
        raise UserError(f"{folder} holds files its manifest does not list ({', '.join(sorted(present - listed)[:3])}):"
                        f" shards of another checkpoint are never mixed in")
    if listed - present:
        raise UserError(f"{folder} lacks {', '.join(sorted(listed - present)[:3])}, listed in its manifest")
    for name in sorted(listed):
        p, rec = folder / name, manifest["files"][name]
        if p.is_symlink() or not p.is_file():
            raise UserError(f"{p} is not a regular file")
        size = p.stat().st_size
        if size != rec["bytes"]:
            raise UserError(f"{p} is truncated or damaged: {size:,} bytes, its manifest lists {rec['bytes']:,}")
        if checksums and _sha256(p) != rec["sha256"]:
            raise UserError(f"{p} does not match its manifest's checksum: a damaged shard or one of another "
                            f"checkpoint")


def _load_metadata(folder: Path) -> Any:
    f = folder / METADATA
    raw = f.read_bytes()
    if len(raw) > MAX_METADATA:
        raise UserError(f"{f} is larger than {MAX_METADATA:,} bytes")
    try:
        return _MetadataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise UserError(f"{f} is refused: {str(exc)[:200]} (reading it could run code)") from None
    except RecursionError:
        raise UserError(f"{f} is nested too deeply to be a checkpoint's metadata") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or malformed pickle stream
        raise UserError(f"{f} is truncated or corrupt ({type(exc).__name__})") from None


def _size(v: Any) -> bool:
    return isinstance(v, torch.Size) and len(v) <= MAX_DIMS and all(_int(x) for x in v)


def _check_entries(meta: Any, bad: Callable[[str], UserError]) -> None:
    """The metadata's entries: tensors (dtype, size, chunks inside the size) or byte entries, under string keys."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    for key, item in meta.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad("a key that is not a string")
        if isinstance(item, TensorStorageMetadata):
            if not (isinstance(item.properties, TensorProperties) and isinstance(item.properties.dtype, torch.dtype)
                    and _size(item.size) and isinstance(item.chunks, list)
                    and all(isinstance(c, ChunkStorageMetadata) and _size(c.offsets) and _size(c.sizes)
                            and len(c.offsets) == len(c.sizes) == len(item.size)
                            and all(o + s <= n for o, s, n in zip(c.offsets, c.sizes, item.size, strict=True))
                            for c in item.chunks)):
                raise bad(f"a malformed entry for {key[:100]}")
        elif not isinstance(item, BytesStorageMetadata):
            raise bad(f"an entry of type {type(item).__name__} for {key[:100]}")


def _check_metadata(folder: Path, meta: Any, manifest: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    f = folder / METADATA

    def bad(what: str) -> UserError:
        return UserError(f"{f} is not a distributed checkpoint's metadata: {what}")

    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict) \
            or not isinstance(meta.storage_data, dict):
        raise bad("not a Metadata object")
    _check_entries(meta, bad)
    shards = {n: r["bytes"] for n, r in manifest["files"].items() if n not in (METADATA, MANIFEST)}
    for index, info in meta.storage_data.items():
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)):
            raise bad("a storage entry of the wrong type")
        if not (isinstance(info.relative_path, str) and info.relative_path in shards):
            raise bad(f"storage in a file its manifest does not list ({str(info.relative_path)[:100]})")
        if not (_int(info.offset) and _int(info.length) and info.offset + info.length <= shards[info.relative_path]):
            raise bad(f"storage past the end of {info.relative_path}")
        if info.transform_descriptors:
            raise bad("storage transforms (none are written here)")
    if not (meta.planner_data is None or isinstance(meta.planner_data, dict)):
        raise bad("malformed planner data")
    if tensor_entries(meta) != manifest["tensors"]:
        raise UserError(f"{f} does not list the tensors of its manifest")


def verify(folder: Path, expect: dict[str, Any] | None, checksums: bool = True) -> Any:
    """The checked DCP Metadata of the sharded folder `folder` (see the module docstring). `expect`: the identity
    ({"id", "step"}) the checkpoint's training state records; a folder of another identity is refused. Without
    `checksums` the files' contents are not hashed (the processes of one resume share the folder: one of them
    hashes it, every one checks the rest); `.metadata`'s own checksum is always checked."""
    manifest = read_manifest(folder)
    if not isinstance(expect, dict) or (manifest["id"], manifest["step"]) != (expect.get("id"), expect.get("step")):
        raise UserError(f"{folder} belongs to another checkpoint (its manifest's identity is not the one its training "
                        f"state records): shards of different checkpoints are never mixed")
    _check_files(folder, manifest, checksums)
    if not checksums and _sha256(folder / METADATA) != manifest["files"][METADATA]["sha256"]:
        raise UserError(f"{folder / METADATA} does not match its manifest's checksum")
    meta = _load_metadata(folder)
    _check_metadata(folder, meta, manifest)
    return meta


def safe_reader(folder: Path, meta: Any) -> Any:
    """A DCP FileSystemReader of `folder` that hands out the verified `meta` instead of unpickling the file."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeReader(str(folder))


def safe_planner() -> Any:
    """DCP's default load planner, its non-tensor entries (the optimiser's hyperparameters) loaded with
    `torch.load(weights_only=True)`."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


__all__ = ["FORMAT", "MANIFEST", "read_manifest", "safe_planner", "safe_reader", "tensor_entries", "verify",
           "write_manifest"]
