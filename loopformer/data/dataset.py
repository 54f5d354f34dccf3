"""Datasets on disk: generation in parallel chunks, train/test de-duplication, manifest, memory-mapped loading and
sharding for data-parallel ranks.

A dataset folder:

    manifest.json          task name and options, seed, counts, chunk size, format version, array dtypes/shapes,
                           SHA-256 of every array file
    train/inputs.npy       [N_train, T] token ids (int16 when the vocabulary fits, else int32)
    train/targets.npy      [N_train, T] (IGNORE = -100 where no loss is taken)
    train/<extra>.npy      the task's extra arrays (answer_start, difficulty, ...)
    test/...               the same for the test split

Determinism: split s is produced as a stream of chunks of `chunk_size` rows; chunk k is
`task.generate(chunk_size, seed_k, s)` with seed_k drawn from `SeedSequence([seed, s, k])`. Chunks are consumed
in order and duplicates dropped in order, so the bytes do not depend on the number of worker processes.
De-duplication: a row is identified by a 128-bit hash of its `inputs`; train keeps the first occurrence of each,
test drops rows already in train or earlier in test — train and test are disjoint across the whole split.
Everything is written to a temporary folder that is renamed into place, so a failed run leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os
import signal
import threading
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from loopformer.checksums import verify_file
from loopformer.errors import UserError
from loopformer.fileio import new_folder
from loopformer.fileio import read_manifest as read_json_manifest
from loopformer.tasks import IGNORE, get_task
from loopformer.tasks.common import split_id
from loopformer.version import __version__

FORMAT_VERSION = 1
SPLITS = ("train", "test")
_HASH_COEF = (np.random.default_rng(0x5EED).integers(1, 2**63 - 1, size=(2, 4096), dtype=np.int64)
              .astype(np.uint64) * np.uint64(2) + np.uint64(1))   # odd 64-bit multipliers


# ------------------------------------------------------------------------------------------------------ hashing
def row_hashes(rows: np.ndarray) -> list[int]:
    """A 128-bit hash (as Python ints) of every row of an integer array [N, T] (two random linear hashes mod 2^64)."""
    rows = np.ascontiguousarray(rows)
    n, t = rows.shape
    if t > _HASH_COEF.shape[1]:
        raise ValueError("rows longer than 4096 tokens are not supported by the row hash")
    v = rows.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        h1 = (v * _HASH_COEF[0, :t]).sum(axis=1, dtype=np.uint64) ^ np.uint64(t)
        h2 = (v * _HASH_COEF[1, :t]).sum(axis=1, dtype=np.uint64)
    return [(a << 64) | b for a, b in zip(h1.tolist(), h2.tolist())]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------- generation
def chunk_seed(seed: int, split: str, k: int) -> int:
    return int(np.random.SeedSequence([int(seed), split_id(split), int(k)]).generate_state(1, np.uint32)[0])


def default_chunk_size(task) -> int:
    """Rows per chunk: about a tenth of a second of work per chunk."""
    return 256 if task.name == "sudoku" else 4096


def _gen_chunk(args):
    name, options, chunk, seed, split, k = args
    task = get_task(name, **options)
    return task.generate(chunk, chunk_seed(seed, split, k), split)


def _quiet_worker() -> None:
    """A generator worker leaves interrupts to the main process: a Ctrl-C at a terminal reaches the whole process
    group, and the main process ends the pool and cleans up (a worker's own traceback would only add noise); the
    pool's SIGTERM ends a worker at once (not through the handler a forked worker inherits from the command)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)


def _pool(workers: int):
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else "spawn")
    if threading.current_thread() is not threading.main_thread():
        return ctx.Pool(workers, initializer=_quiet_worker)
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)   # forked workers ignore Ctrl-C from their first instant
    try:
        return ctx.Pool(workers, initializer=_quiet_worker)
    finally:
        signal.signal(signal.SIGINT, old)


def _collect(task, n: int, seed: int, split: str, chunk: int, pool, seen: set, exclude: set, bar) -> dict:
    """n distinct rows of `split` (not in `exclude`), consuming the chunk stream in order."""
    parts: list[dict[str, np.ndarray]] = []
    have = 0
    generated = 0
    k = 0
    workers = pool._processes if pool is not None else 1
    while have < n:
        left = n - have
        todo = max(1, min(math.ceil(left / chunk) + (1 if k else 0), 4 * workers))
        args = [(task.name, task.options(), chunk, seed, split, k + j) for j in range(todo)]
        k += todo
        results = pool.map(_gen_chunk, args) if pool is not None else [_gen_chunk(a) for a in args]
        for batch in results:
            generated += chunk
            keep = []
            for i, h in enumerate(row_hashes(batch["inputs"])):
                if h in seen or h in exclude:
                    continue
                seen.add(h)
                keep.append(i)
                if have + len(keep) == n:
                    break
            if keep:
                idx = np.asarray(keep)
                parts.append({key: np.asarray(v)[idx] for key, v in batch.items()})
                have += len(keep)
                if bar is not None:
                    bar.update(len(keep))
            if have == n:
                break
        if have < n and generated >= 20 * n + 10 * chunk:
            raise UserError(f"only {have} distinct {split} samples found among {generated} generated: the task "
                            f"options {task.options()} allow too few distinct samples for {n} {split} samples")
    if not parts:
        empty = task.generate(0, seed, split)
        return {key: v[:0] for key, v in empty.items()}
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def _token_dtype(task) -> np.dtype:
    return np.dtype(np.int16) if task.vocab_size < 2**15 else np.dtype(np.int32)


def write_splits(out_dir: str | os.PathLike, task, splits: dict[str, dict[str, np.ndarray]], seed: int | None,
                 extra: dict[str, Any] | None = None, overwrite: bool = False) -> dict:
    """Write arrays + manifest.json atomically (temporary folder, then rename). Returns the manifest."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"output path exists and is not a folder: {out_dir}")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise UserError(f"output folder is not empty: {out_dir} (overwrite replaces it)")
    tok = _token_dtype(task)
    with new_folder(out_dir) as tmp:
        arrays: dict[str, dict] = {}
        checksums: dict[str, str] = {}
        counts: dict[str, int] = {}
        for split, batch in splits.items():
            os.makedirs(os.path.join(tmp, split))
            counts[split] = int(len(batch["inputs"]))
            arrays[split] = {}
            for key, value in batch.items():
                value = np.asarray(value)
                if key in ("inputs", "targets"):
                    value = value.astype(tok)
                rel = f"{split}/{key}.npy"
                np.save(os.path.join(tmp, rel), np.ascontiguousarray(value), allow_pickle=False)
                arrays[split][key] = {"dtype": value.dtype.str, "shape": list(value.shape)}
                checksums[rel] = _sha256(os.path.join(tmp, rel))
        manifest = {
            "format_version": FORMAT_VERSION,
            "task": task.name,
            "options": task.options(),
            "seed": seed,
            "counts": counts,
            "seq_len": task.seq_len,
            "vocab_size": task.vocab_size,
            "causal": bool(task.causal),
            "arrays": arrays,
            "checksums": checksums,
            "loopformer_version": __version__,
        }
        if extra:
            manifest.update(extra)
        with open(os.path.join(tmp, "manifest.json"), "w") as fh:
            json.dump(manifest, fh, indent=2, sort_keys=True)
            fh.write("\n")
    return manifest


def write_dataset(out_dir: str | os.PathLike, task, n_train: int, n_test: int, seed: int = 0, workers: int = 1,
                  chunk_size: int | None = None, overwrite: bool = False, progress: bool = True) -> dict:
    """Generate `n_train` + `n_test` distinct samples of `task` and write them to `out_dir` (see module doc).

    The result is identical for any `workers`; it depends on (task options, seed, chunk_size). Returns the
    manifest.
    """
    for name, v in (("n_train", n_train), ("n_test", n_test), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise UserError(f"{name} must be a non-negative integer, got {v!r}")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise UserError(f"workers must be a positive integer, got {workers!r}")
    chunk = int(chunk_size or default_chunk_size(task))
    if chunk < 1:
        raise UserError(f"chunk_size must be >= 1, got {chunk}")
    task.generate(1, 0, "train")          # compile / load the compiled kernels once before forking workers
    pool = _pool(workers) if workers > 1 else None
    try:
        splits = {}
        train_seen: set = set()
        for split, n in (("train", int(n_train)), ("test", int(n_test))):
            bar = tqdm(total=n, desc=f"{task.name} {split}", unit="samples", disable=not progress, leave=True,
                       dynamic_ncols=True)
            try:
                if split == "train":
                    splits[split] = _collect(task, n, seed, split, chunk, pool, train_seen, set(), bar)
                else:
                    splits[split] = _collect(task, n, seed, split, chunk, pool, set(), train_seen, bar)
            finally:
                bar.close()
    except BaseException:                    # an error or a signal: stop the workers now, not after their queue
        if pool is not None:
            pool.terminate()
        raise
    finally:
        if pool is not None:
            pool.close()                         # (after terminate: a no-op)
            pool.join()
    return write_splits(out_dir, task, splits, seed, {"chunk_size": chunk, "source": "generator"}, overwrite)


# ------------------------------------------------------------------------------------------------------ loading
def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a dataset folder; UserError if the folder or manifest is missing or malformed."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise UserError(f"dataset folder not found: {path}")
    mpath = os.path.join(path, "manifest.json")
    manifest = read_json_manifest(path, f"not a dataset folder (no manifest.json): {path}")
    for key in ("format_version", "task", "options", "counts", "arrays", "checksums"):
        if key not in manifest:
            raise UserError(f"malformed manifest {mpath}: missing key {key!r}")
    if manifest["format_version"] != FORMAT_VERSION:
        raise UserError(f"dataset {path} has format version {manifest['format_version']!r}; this loopformer "
                        f"reads version {FORMAT_VERSION}")
    if not isinstance(manifest["options"], dict) or not isinstance(manifest["arrays"], dict):
        raise UserError(f"malformed manifest {mpath}: 'options' and 'arrays' must be objects")
    _check_manifest_fields(manifest, mpath)
    return manifest


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_manifest_fields(m: dict, mpath: str) -> None:
    """Types of every field the loaders read; a malformed one is a UserError naming it."""
    def bad(field: str, want: str):
        raise UserError(f"malformed manifest {mpath}: {field} must be {want}")

    if not isinstance(m["task"], str):
        bad("'task'", "a task name")
    if not isinstance(m["counts"], dict) or not all(_is_int(v) and v >= 0 for v in m["counts"].values()):
        bad("'counts'", "an object of row counts")
    if not isinstance(m["checksums"], dict) or not all(isinstance(v, str) for v in m["checksums"].values()):
        bad("'checksums'", "an object of SHA-256 strings")
    for key in ("seq_len", "vocab_size"):
        if key in m and m[key] is not None and not (_is_int(m[key]) and m[key] >= 0):
            bad(f"'{key}'", "a non-negative integer")
    for split, arrays in m["arrays"].items():
        if split not in SPLITS:
            bad(f"arrays.{split}", f"one of the splits {SPLITS}")
        if not isinstance(arrays, dict):
            bad(f"arrays.{split}", "an object")
        for key, meta in arrays.items():
            field = f"arrays.{split}.{key}"
            if not isinstance(key, str) or not key.isidentifier():
                bad(field, "named by a plain identifier")
            if not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str):
                bad(field, "an object with a dtype string and a shape list")
            shape = meta.get("shape")
            if not isinstance(shape, list) or not all(_is_int(x) and x >= 0 for x in shape):
                bad(f"{field}.shape", "a list of non-negative integers")
            try:
                np.dtype(meta["dtype"])
            except TypeError:
                bad(f"{field}.dtype", "a numpy dtype")


def _id_range(fpath: str, targets: bool) -> dict:
    """The smallest and largest token id of an id array (for targets IGNORE excluded), read in blocks of rows."""
    arr = load_array(fpath, os.path.basename(os.path.dirname(fpath)) + "/" + os.path.basename(fpath))
    if not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"{fpath} holds {arr.dtype} values, not token ids (integers)")
    lo, hi, ignored = None, None, False
    step = max(1, (1 << 24) // max(1, arr.itemsize * int(np.prod(arr.shape[1:]) or 1)))
    for i in range(0, len(arr), step):
        block = np.asarray(arr[i:i + step])
        keep = block != IGNORE if targets else np.ones(block.shape, bool)
        ignored = ignored or not bool(keep.all())
        vals = block[keep]
        if vals.size:
            lo = int(vals.min()) if lo is None else min(lo, int(vals.min()))
            hi = int(vals.max()) if hi is None else max(hi, int(vals.max()))
    return {"min": lo, "max": hi, "ignore": ignored}


def _ids_fit(rng: Any, vocab_size: int) -> bool:
    if not isinstance(rng, dict):
        return False
    lo, hi = rng.get("min"), rng.get("max")
    return lo is None or (0 <= lo and hi < vocab_size)


def load_array(fpath: str, shown: str, mmap: bool = True) -> np.ndarray:
    """A .npy file memory-mapped read-only (or read), refusing pickled objects; a header that claims more data than
    the file holds, an object dtype or a damaged header is a one-line UserError."""
    try:
        return np.load(fpath, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise UserError(f"cannot read {shown}: {str(exc).splitlines()[0] if str(exc) else exc!r}") from None


def open_dataset(path: str | os.PathLike, verify: bool = False, mmap: bool = True):
    """(task, {'train': {name: array}, 'test': {...}}) from a dataset folder; arrays are memory-mapped read-only.

    The task is rebuilt from the manifest's name and options. `verify=True` also checks every SHA-256 (once per
    file, remembered by size and modification time: `loopformer.checksums`) and that the token ids of `inputs`
    and `targets` lie in the task's vocabulary; training and evaluation open datasets with it.
    Raises UserError with one clear line when the folder, manifest or an array is missing or inconsistent.
    """
    path = os.fspath(path)
    manifest = read_manifest(path)
    try:
        task = get_task(manifest["task"], **manifest["options"])
    except UserError as exc:
        raise UserError(f"dataset {path}: {exc}") from None
    except TypeError as exc:
        raise UserError(f"dataset {path}: bad task options in manifest: {exc}") from None
    splits: dict[str, dict[str, np.ndarray]] = {}
    for split, arrays in manifest["arrays"].items():
        if not isinstance(arrays, dict) or "inputs" not in arrays or "targets" not in arrays:
            raise UserError(f"dataset {path}: split {split!r} lacks inputs/targets in the manifest")
        splits[split] = {}
        for key, meta in arrays.items():
            rel = f"{split}/{key}.npy"
            fpath = os.path.join(path, rel)
            if not os.path.isfile(fpath):
                raise UserError(f"dataset {path}: missing array file {rel}")
            ids = key in ("inputs", "targets")
            if verify:
                rec = verify_file(fpath, manifest["checksums"].get(rel), f"dataset {path}", shown=rel,
                                  extra=(lambda f=fpath, k=key: _id_range(f, k == "targets")) if ids else None)
            arr = load_array(fpath, f"dataset {path}: {rel}", mmap)
            if verify and ids and not _ids_fit(rec["extra"], task.vocab_size):
                lo, hi = rec["extra"]["min"], rec["extra"]["max"]
                raise UserError(f"dataset {path}: {rel} holds token ids in [{lo}, {hi}], outside the task's "
                                f"vocabulary 0..{task.vocab_size - 1}"
                                + (f" (and {IGNORE} for targets without loss)" if key == "targets" else ""))
            if list(arr.shape) != list(meta.get("shape", [])) or arr.dtype.str != meta.get("dtype"):
                raise UserError(f"dataset {path}: {rel} has shape {list(arr.shape)} / dtype {arr.dtype.str}, "
                                f"manifest says {meta.get('shape')} / {meta.get('dtype')}")
            splits[split][key] = arr
        n = manifest["counts"].get(split)
        if n is not None and len(splits[split]["inputs"]) != n:
            raise UserError(f"dataset {path}: split {split} has {len(splits[split]['inputs'])} rows, manifest "
                            f"says {n}")
        if splits[split]["inputs"].shape[1:] != (task.seq_len,):
            raise UserError(f"dataset {path}: rows have length {splits[split]['inputs'].shape[1:]}, the task "
                            f"expects {task.seq_len}")
    return task, splits


def shard_indices(n: int, rank: int, world_size: int, drop_last: bool = False) -> np.ndarray:
    """Row indices of rank `rank` out of `world_size`: strided (rank, rank + W, ...), every rank the same count.

    With drop_last=False the tail is padded by wrapping around to the first rows (as torch's DistributedSampler
    does), so each rank gets ceil(n / W) rows; with drop_last=True each gets floor(n / W).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if drop_last:
        total = (n // world_size) * world_size
        idx = np.arange(total)
    else:
        total = math.ceil(n / world_size) * world_size if n else 0
        idx = np.arange(total) % max(n, 1)
    return idx[rank::world_size].astype(np.int64)
