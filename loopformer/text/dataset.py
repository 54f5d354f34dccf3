"""Memory-mapped token corpora for training and evaluation (the nanoGPT-style `.bin` files of `corpus.py`).

    TokenCorpus(DIR)       the manifest, the tokeniser and each split as a read-only `np.memmap` (no copy); each
                           file is checked against the manifest's SHA-256 and the vocabulary when first opened
                           (once per file and modification: `loopformer.checksums`)
    RandomWindows          training batches: B random windows of T+1 tokens -> (x [B,T], y [B,T]) int64, the offsets
                           drawn from `default_rng([seed, step, rank])`, so batch `step` on rank `rank` is the same
                           whatever happened before (resume is exact, no sampler state to save)
    SequentialWindows      evaluation: the non-overlapping windows x = s[i·T : i·T+T], y = s[i·T+1 : i·T+T+1],
                           in order, sharded round-robin over ranks; the last partial window is kept (shorter)

Memory: nothing here holds a split. The maps are read where a window lies (a training step reads its B windows,
and each rank of a distributed run only the windows of its own rows: the file pages those touch count in the
process's resident size, shared with the page cache and reclaimable); the checks read the files in blocks;
evaluation windows are computed batch by batch, not listed for the whole split.

Shapes: B batch, T block size (context length).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from loopformer.checksums import verify_file
from loopformer.errors import UserError
from loopformer.text.corpus import corpus_tokenizer, read_manifest


class TokenCorpus:
    """A prepared corpus folder: `manifest.json`, `{train,val,test}.bin`, maybe `tokenizer.json`."""

    def __init__(self, folder: str | os.PathLike, verify: bool = True):
        self.folder = os.fspath(folder)
        self.verify = verify
        self.manifest = read_manifest(self.folder)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.vocab_size = int(self.manifest["vocab_size"])
        self.eot_id = int(self.manifest["eot_id"])
        self._maps: dict[str, np.memmap] = {}

    @property
    def splits(self) -> list[str]:
        return list(self.manifest["splits"])

    def tokens(self, split: str) -> np.ndarray:
        """The split's token ids [N] as a read-only memory map."""
        if split not in self.manifest["splits"]:
            raise UserError(f"{self.folder} has no {split!r} split (has {', '.join(self.splits)})")
        if split not in self._maps:
            info = self.manifest["splits"][split]
            path = os.path.join(self.folder, info["file"])
            if not os.path.isfile(path):
                raise UserError(f"{path} is missing")
            size = os.path.getsize(path)
            if size != info["tokens"] * self.dtype.itemsize:
                raise UserError(f"{path} has {size} bytes, the manifest says {info['tokens']} {self.dtype.name} tokens")
            if self.verify:
                rec = verify_file(path, info.get("sha256"), f"corpus {self.folder}", shown=info["file"],
                                  extra=lambda: {"max": _max_id(path, self.dtype)})
                top = rec["extra"].get("max") if isinstance(rec.get("extra"), dict) else None
                if top is not None and top >= self.vocab_size:
                    raise UserError(f"corpus {self.folder}: {info['file']} holds token id {top}, outside the "
                                    f"vocabulary 0..{self.vocab_size - 1}")
            self._maps[split] = np.memmap(path, dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype)
        return self._maps[split]

    def tokenizer(self):
        tok = self.manifest["tokenizer"]
        if self.verify and tok.get("kind") == "bpe":
            name = tok.get("file", "tokenizer.json")
            verify_file(os.path.join(self.folder, name), tok.get("sha256"), f"corpus {self.folder}", shown=name)
        return corpus_tokenizer(self.folder, self.manifest)


def _max_id(path: str, dtype: np.dtype, block: int = 1 << 22) -> int | None:
    """The largest token id of a flat token file, read in blocks (plain reads: the pages do not stay mapped)."""
    top: int | None = None
    with open(path, "rb") as f:
        while raw := f.read(block * dtype.itemsize):
            m = int(np.frombuffer(raw, dtype=dtype).max())
            top = m if top is None else max(top, m)
    return top


def _as_long(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.int64))


@dataclass
class RandomWindows:
    """Random training windows; `batch(step)` is a pure function of (seed, step, rank)."""

    tokens: np.ndarray
    block_size: int
    batch_size: int
    seed: int = 0
    rank: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.batch_size < 1:
            raise UserError("block_size and batch_size must be positive")
        if len(self.tokens) < self.block_size + 1:
            raise UserError(f"the split has {len(self.tokens)} tokens, fewer than block_size + 1 = "
                            f"{self.block_size + 1}")

    def offsets(self, step: int) -> np.ndarray:
        """Window starts [B] for this step."""
        rng = np.random.default_rng([self.seed, step, self.rank])
        return rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)

    def batch(self, step: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) [B,T] int64 with y the next tokens of x."""
        T = self.block_size
        win = np.stack([np.asarray(self.tokens[o:o + T + 1]) for o in self.offsets(step)])   # [B,T+1]
        w = _as_long(win)
        x, y = w[:, :-1], w[:, 1:]
        if device is not None and torch.device(device).type != "cpu":
            x = x.pin_memory().to(device, non_blocking=True)
            y = y.pin_memory().to(device, non_blocking=True)
        return x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1


@dataclass
class SequentialWindows:
    """Non-overlapping evaluation windows covering the split once, batched; shard `rank` of `world_size`."""

    tokens: np.ndarray
    block_size: int
    batch_size: int = 8
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False   # drop the final window when it is shorter than block_size

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.batch_size < 1:
            raise UserError("block_size and batch_size must be positive")
        if not 0 <= self.rank < self.world_size:
            raise UserError(f"rank {self.rank} is not in [0, {self.world_size})")

    def _counts(self) -> tuple[int, int]:
        """(windows of the split, of which full-length), over all ranks."""
        n_targets = len(self.tokens) - 1
        if n_targets < 1:
            return 0, 0
        full = n_targets // self.block_size
        n = full if (self.drop_last or n_targets % self.block_size == 0) else full + 1
        return n, full

    def _mine(self, lo: int, hi: int) -> np.ndarray:
        """Indices of this rank's windows among windows lo..hi-1."""
        first = lo + (self.rank - lo) % self.world_size
        return np.arange(first, hi, self.world_size, dtype=np.int64)

    def starts(self) -> np.ndarray:
        """Start offsets of this rank's windows."""
        n, _ = self._counts()
        return self._mine(0, n) * self.block_size

    def __len__(self) -> int:
        """Number of batches on this rank (a shorter final window is a batch of its own)."""
        n, full = self._counts()
        mine_full = len(range(self.rank, full, self.world_size))
        mine_short = len(range(self.rank, n, self.world_size)) - mine_full
        return -(-mine_full // self.batch_size) + mine_short

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        T = self.block_size
        n, full = self._counts()
        step = self.batch_size * self.world_size      # this rank's next batch_size windows lie within `step`
        for lo in range(0, full, step):
            mine = self._mine(lo, min(lo + step, full))
            if mine.size:
                w = _as_long(np.stack([np.asarray(self.tokens[s * T:s * T + T + 1]) for s in mine]))
                yield w[:, :-1], w[:, 1:]                                               # [B,T], [B,T]
        for s in self._mine(full, n) * T:
            w = _as_long(np.asarray(self.tokens[s:len(self.tokens)]))[None]
            yield w[:, :-1], w[:, 1:]                                                   # [1,n], [1,n]
