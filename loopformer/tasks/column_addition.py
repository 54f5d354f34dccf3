"""Binary addition written in columns: the carry as state tracking (a task of variable size).

Two n-bit numbers a and c, least significant bit first, one token per column (a_i, c_i) — the way addition is
done by hand, the two digits of a column read together — and under every column the sum's bit of that column:

    inputs   <bos> (a_1 c_1) (a_2 c_2) … (a_n c_n) (0 0)       T = length + 2
    targets  —     s_1       s_2       … s_n       s_{n+1}     s = a + c, s_{n+1} the carry out

The extra column (0 0) holds the carry out, so every row of size n has n + 1 answers, each read at its own
column under a causal mask: s_i = a_i xor c_i xor k_{i-1}, where the carry k_i = maj(a_i, c_i, k_{i-1}) (k_0 = 0)
is a two-state automaton run left to right over the columns. Unlike a group's word problem (every element
invertible) a column 0 0 or 1 1 resets the state (kill, generate) and only 0 1 / 1 0 pass it on (propagate). The
sequential layout of the same problem (`addition`: the two numbers one after the other, the sum after "=") asks
a model to align the numbers' bits as well; this one removes the alignment and leaves the carry chain, which needs
up to n sequential steps.

Intermediate states (always present, for `task.loop_targets`; K = length steps): the one-step scan a window of
two positions allows (`model.attn_window=2`, T(n) = n loops). After loop j a column i has seen columns
i − j .. i and no more, so its read-out holds the sum bit of column i with the carry that those columns alone
produce (a carry of 0 into column max(1, i − j)):

    s_i(j) = a_i xor c_i xor k_{i-1}(j - 1),   k_i(j) = maj(a_i, c_i, k_{i-1}(j - 1)),   k_i(0) = a_i and c_i

— the whole sum from loop n on (column i is exact once j >= i − 1), which then holds: the answer is a fixed point
of the step, so a loop that does not know its index can run past T(n) and keep it.

Carry chains (`propagate`): random columns pass the carry on half the time, so the longest chain in a row of n
columns is about log2 n and few rows need many loops; `propagate: p` draws a propagating column (01 or 10) with
probability p and a resetting one (00 or 11) otherwise — rows whose carries travel as far as the evaluation asks
(`loopformer eval RUN --lengths 24 --task-opt propagate=0.95`). At p = 0.5 the draws are the uniform ones.

Variable sizes (`min_length` > 0): every row draws n from min_length..length (`size` [N]) and is padded at the
end (pads: target IGNORE, intermediate states IGNORE). Splits are disjoint by a hash of the input row. Checked
against Python integers, row by row and loop by loop, in `tests/test_lengths.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loopformer.tasks.base import IGNORE, TokenTask, Vocab
from loopformer.tasks.common import (
    check_range,
    dataclass_options,
    draw_in_split,
    draw_sizes,
    exact_match,
    make_rng,
    token_accuracy,
)

MAX_LENGTH = 1024
COLUMNS = ["00", "01", "10", "11"]        # (a_i, c_i)


def column_scan(a: np.ndarray, c: np.ndarray, steps: int) -> np.ndarray:
    """[N, K, W] the sum bits after loops 1..K of the one-step scan over columns a, c [N, W] (0/1): step j gives
    column i the sum bit of columns max(1, i − j)..i added alone (see the module docstring)."""
    carry = a & c                                                          # k(0): each column alone
    out = np.empty((a.shape[0], steps, a.shape[1]), dtype=np.int64)
    for j in range(steps):
        left = np.zeros_like(carry)
        left[:, 1:] = carry[:, :-1]                                        # k_{i-1}(j-1), no carry into column 1
        out[:, j] = a ^ c ^ left
        carry = (a & c) | (a & left) | (c & left)
    return out


@dataclass
class ColumnAdditionTask(TokenTask):
    """a + c for two random n-bit numbers, one token per column, the sum's bit read under each column."""

    length: int = 16          # n: the largest size (bits per number; every row has n + 1 columns)
    min_length: int = 0       # > 0: sizes drawn uniformly from min_length..length
    propagate: float = 0.5    # the chance that a column passes the carry on (01 or 10); 0.5: uniform columns

    name = "column_addition"
    causal = True

    def __post_init__(self) -> None:
        check_range("length", self.length, 1, MAX_LENGTH)
        check_range("min_length", self.min_length, 0, self.length)
        check_range("propagate", self.propagate, 0, 1, integer=False)
        self.vocab = Vocab(["<pad>", "<bos>"] + COLUMNS + ["0", "1"])
        self.seq_len = self.length + 2
        self.steps = self.length

    def options(self) -> dict:
        return dataclass_options(self)

    def _draw(self, rng: np.random.Generator, m: int) -> dict[str, np.ndarray]:
        size = draw_sizes(rng, m, self.min_length, self.length)
        W = self.length + 1                                                # columns, the carry's included
        if self.propagate == 0.5:
            bits = rng.integers(0, 2, size=(m, 2, W))
        else:                                                              # a_i, and c_i = a_i where it resets
            passes = rng.random((m, W)) < self.propagate
            first = rng.integers(0, 2, size=(m, W))
            bits = np.stack([first, np.where(passes, 1 - first, first)], axis=1)
        live = np.arange(W)[None, :] < size[:, None]                       # [m,W] the numbers' own columns
        a, c = bits[:, 0] * live, bits[:, 1] * live                        # zeros from column n + 1 on
        col0, bit0 = self.vocab.index["00"], self.vocab.index["0"]
        steps = column_scan(a, c, self.steps) + bit0                       # [m,K,W] token ids
        pad = np.arange(W)[None, :] > size[:, None]                        # past the carry's column
        inputs = np.where(pad, self.pad_id, col0 + 2 * a + c)
        steps = np.where(pad[:, None, :], IGNORE, steps)
        first = np.full((m, 1), self.vocab.index["<bos>"])
        return {"inputs": np.concatenate([first, inputs], axis=1).astype(np.int32),
                "targets": np.concatenate([np.full((m, 1), IGNORE), steps[:, -1]], axis=1).astype(np.int32),
                "step_targets": np.concatenate([np.full((m, self.steps, 1), IGNORE), steps], axis=2).astype(np.int32),
                "size": size.astype(np.int64)}

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        return draw_in_split(self._draw, n, make_rng(seed, split), split)

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: every bit of the sum right; last_accuracy: the carry out right; token_accuracy: bits right."""
        pred, targets = np.asarray(pred), np.asarray(batch["targets"])
        if not len(pred):
            return {"accuracy": float("nan"), "last_accuracy": float("nan"), "token_accuracy": float("nan")}
        rows, last = np.arange(len(pred)), np.asarray(batch["size"]) + 1
        return {"accuracy": float(exact_match(pred, targets).mean()),
                "last_accuracy": float((pred[rows, last] == targets[rows, last]).mean()),
                "token_accuracy": token_accuracy(pred, targets)}

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        n = int(batch["size"][i])
        cols = self.vocab.decode(batch["inputs"][i][1:n + 2])
        s = "".join(self.vocab.decode(batch["targets"][i][1:n + 2]))
        a, c = "".join(x[0] for x in cols), "".join(x[1] for x in cols)
        return f"n={n}  a={a}  c={c}  (least significant bit first)  -> a+c={s}"
