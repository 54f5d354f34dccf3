"""The word problem of a finite group: state tracking (a depth-demanding task).

A sample is a word g_1 g_2 … g_n of elements of a group G drawn uniformly; the target at every position i is the
prefix product p_i = g_1 · g_2 · … · g_i. Knob: n (`length`). For a non-solvable group (S5, A5) the word problem
is NC¹-complete, so no fixed-depth transformer is believed to solve it as n grows, while a looped one can in
O(log n) loops by a parallel prefix scan; a cyclic group (Zk) is the solvable control.

Groups (`group`): Sn and An for n = 3, 4, 5 (permutations of 0..n-1, composed left to right: (a·b)(x) = b(a(x)),
so p_i is "apply g_1, then g_2, …"), and Zk for 2 <= k <= 256 (addition mod k).

Intermediate states (per-loop targets, `task.loop_targets`), option `scan`:
    linear    (default) K = n - 1 steps; after step j position i holds the product of the j + 1 elements ending at
              i (fewer at the start): one combination with the left neighbour per step, and the answer is a fixed
              point of that step, so a loop that does not know its index can run past K and keep the answer
    doubling  the Hillis–Steele scan, K = ⌈log2 n⌉ levels: after level j the product of the 2^j elements ending at
              i; its step combines with the element 2^j to the left, a shift that changes with j (a loop must know
              j: what timestep encoding offers)

Layout (bidirectional, T = n):  inputs g_1 … g_n,  targets p_1 … p_n.  Splits are disjoint by a hash of the
input row. With `bos` (T = n + 1): inputs <bos> g_1 … g_n, targets (none) p_1 … p_n, the intermediate states
shifted alike. A position's attention mixes its keys' values, so without absolute positions (rotary, or none) and
with a window, position i whose left neighbour holds the same token (g_{i-1} = g_i) reads exactly what the first
position reads (itself only): the two cannot be told apart, and a block that learns the first position's rule
answers g_i instead of g_i·g_i on every such pair (the S3 runs without it: 16.7 % of the second positions wrong,
all of them pairs a, a). The <bos> gives the first element a left neighbour of its own.

Variable lengths (length generalisation, `min_length` > 0): every row draws its length m from min_length..length
(`size` [N]) and is padded at the end (pads: target IGNORE, intermediate states IGNORE). The prefix products of a
row of length m are those of its first m elements, and a row's scan reaches its answer by step m − 1 and holds it
(linear) — shorter rows simply finish early. With `causal` the model reads the row under a causal mask (prefix
products need only the past), so no real element ever sees a pad: the setting for training on lengths up to n and
running at 2n; a bidirectional model reads the pads.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from loopformer.errors import UserError
from loopformer.tasks.base import IGNORE, TokenTask, Vocab
from loopformer.tasks.common import (
    check_bool,
    check_range,
    dataclass_options,
    draw_in_split,
    exact_match,
    make_rng,
    token_accuracy,
)


def _parity(p: tuple[int, ...]) -> int:
    return sum(p[i] > p[j] for i in range(len(p)) for j in range(i + 1, len(p))) % 2


def group_elements(group: str) -> tuple[list[str], np.ndarray]:
    """(element names, multiplication table M [G, G] with M[a, b] = a·b); element 0 is the identity."""
    kind, size = group[:1], group[1:]
    if kind in ("S", "A") and size in ("3", "4", "5"):
        perms = [p for p in itertools.permutations(range(int(size))) if kind == "S" or _parity(p) == 0]
        index = {p: i for i, p in enumerate(perms)}
        table = np.array([[index[tuple(b[a[x]] for x in range(len(a)))] for b in perms] for a in perms])
        return ["".join(map(str, p)) for p in perms], table
    if kind == "Z" and size.isdigit() and 2 <= int(size) <= 256:
        k = int(size)
        r = np.arange(k)
        return [f"z{i}" for i in range(k)], (r[:, None] + r[None, :]) % k
    raise UserError(f"option group must be S3, S4, S5, A3, A4, A5 or Zk with 2 <= k <= 256, got {group!r}")


def prefix_products(words: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[N, n] p_i = g_1 · … · g_i for words [N, n] of element indices."""
    out = np.empty_like(words)
    out[:, 0] = words[:, 0]
    for i in range(1, words.shape[1]):
        out[:, i] = table[out[:, i - 1], words[:, i]]
    return out


def linear_scan(words: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[N, K, n] the left-to-right scan, K = n - 1 steps (at least 1): after step j position i holds the product of
    g_{i-j} … g_i (from g_1 when i <= j), i.e. s_j[i] = s_{j-1}[i-1] · g_i — one combination with the left
    neighbour per step, and a fixed point once the window reaches the start: the natural algorithm of a loop that
    does not know its index."""
    n = words.shape[1]
    s = words.copy()
    out = np.empty((words.shape[0], max(1, n - 1), n), dtype=words.dtype)
    if n == 1:
        out[:, 0] = s
    for j in range(n - 1):
        nxt = s.copy()
        nxt[:, 1:] = table[s[:, :-1], words[:, 1:]]
        s = nxt
        out[:, j] = s
    return out


def scan_levels(words: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[N, K, n] the Hillis–Steele scan, K = ⌈log2 n⌉ levels: level j holds at i the product of g_{i-2^j+1} … g_i."""
    n = words.shape[1]
    K = max(1, math.ceil(math.log2(n))) if n > 1 else 1
    s = words.copy()
    out = np.empty((words.shape[0], K, n), dtype=words.dtype)
    for j in range(K):
        shift = 2 ** j
        nxt = s.copy()
        if shift < n:
            nxt[:, shift:] = table[s[:, :-shift], s[:, shift:]]
        s = nxt
        out[:, j] = s
    return out


SCANS = {"linear": linear_scan, "doubling": scan_levels}


@dataclass
class WordProblemTask(TokenTask):
    """Prefix products of a random word over a finite group."""

    group: str = "S5"
    length: int = 16          # n: elements per word (the knob)
    scan: str = "linear"      # intermediate states: "linear" (n - 1 steps, one neighbour each) | "doubling"
                              # (Hillis–Steele, ⌈log2 n⌉ levels: the shift 2^j changes with the step)
    min_length: int = 0       # > 0: every row draws its length from min_length..length (padded at the end)
    causal: bool = False      # read under a causal mask (prefix products need only the past; pads stay unseen)
    bos: bool = False         # a <bos> token before the word (the first element's left neighbour; no target)

    name = "word_problem"

    def __post_init__(self) -> None:
        if not isinstance(self.group, str):
            raise UserError(f"option group must be a group name such as S5, A5 or Z60, got {self.group!r}")
        check_range("length", self.length, 1, 4096)
        check_range("min_length", self.min_length, 0, self.length)
        check_bool("causal", self.causal)
        check_bool("bos", self.bos)
        if self.scan not in SCANS:
            raise UserError(f"option scan must be one of {', '.join(SCANS)}, got {self.scan!r}")
        names, self.table = group_elements(self.group)
        self.order = len(names)
        self.vocab = Vocab(["<pad>"] + names + (["<bos>"] if self.bos else []))
        self.seq_len = self.length + int(self.bos)
        self.states = SCANS[self.scan]
        n = self.length               # K of the scan (`linear_scan`, `scan_levels`), without drawing one
        self.steps = max(1, n - 1) if self.scan == "linear" else (max(1, math.ceil(math.log2(n))) if n > 1 else 1)

    def options(self) -> dict:
        return dataclass_options(self)

    def _draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        words = rng.integers(0, self.order, size=(n, self.length))
        levels = self.states(words, self.table) + 1                                       # [n,K,T] token ids
        inputs, targets = (words + 1).astype(np.int32), levels[:, -1].astype(np.int32)
        size = np.full(n, self.length, dtype=np.int64)
        if self.min_length:   # position i's states depend on g_1 .. g_i only: cut each row after its length
            size = rng.integers(self.min_length, self.length + 1, size=n)
            pad = np.arange(self.length)[None, :] >= size[:, None]                         # [n,T]
            inputs[pad], targets[pad] = self.pad_id, IGNORE
            levels = np.where(pad[:, None, :], IGNORE, levels)
        if self.bos:          # <bos> first: no target, no intermediate state
            inputs = np.concatenate([np.full((n, 1), len(self.vocab) - 1, dtype=np.int32), inputs], axis=1)
            targets = np.concatenate([np.full((n, 1), IGNORE, dtype=np.int32), targets], axis=1)
            levels = np.concatenate([np.full((n, levels.shape[1], 1), IGNORE, dtype=levels.dtype), levels], axis=2)
        return {"inputs": inputs, "targets": targets, "step_targets": levels.astype(np.int32), "size": size}

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        return draw_in_split(self._draw, n, make_rng(seed, split), split)

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: every prefix product right; last_accuracy: the whole word's product right; token_accuracy:
        prefix products right."""
        pred, targets = np.asarray(pred), np.asarray(batch["targets"])
        rows = np.arange(len(pred))
        last = (np.asarray(batch["size"]) if "size" in batch else np.full(len(pred), self.length)) - 1 + int(self.bos)
        return {"accuracy": float(exact_match(pred, targets).mean()) if len(pred) else float("nan"),
                "last_accuracy": float((pred[rows, last] == targets[rows, last]).mean()) if len(pred) else float("nan"),
                "token_accuracy": token_accuracy(pred, targets)}

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        m, b = (int(batch["size"][i]) if "size" in batch else self.length), int(self.bos)
        w = " ".join(self.vocab.decode(batch["inputs"][i][b:b + m]))
        p = " ".join(self.vocab.decode(batch["targets"][i][b:b + m]))
        return f"{self.group} word {w}  -> prefix products {p}"
