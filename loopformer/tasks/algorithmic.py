"""Algorithmic tasks of variable size for length generalisation: parity, copy / reverse, binary addition, binary sum.

In the spirit of the set of Fan et al. (ICLR 2025, "Looped Transformers for Length Generalization"): small
problems whose natural algorithm takes a number of steps that grows with the input, so a model that loops T(n)
times can be trained on sizes up to n and run at 2n and 4n (`model.loop_rule`, `loopformer eval --lengths`).

Every row has a size n — the number of bits or symbols of its problem — drawn uniformly from min_length..length
(`min_length` 0: every row has n = length) and recorded in `size` [N]. Rows are causal (teacher-forced exact match
over the answer equals greedy decoding, `loopformer.tasks.common`) and padded at the end, so under the causal mask
no real token ever sees a pad and a row of size n is the same computation whatever the padding. Every row starts
with <bos>, a token a causal model without position encodings (`model.pos=none`) can count positions from:

    parity      <bos> b_1 … b_n = p <eos>                  p = b_1 xor … xor b_n              T = length + 4
    copy        <bos> x_1 … x_n = x_1 … x_n <eos>          (reverse: x_n … x_1)               T = 2·length + 3
    addition    <bos> a_1 … a_n + c_1 … c_n = s_1 … s_{n+1} <eos>                             T = 3·length + 5
                binary, least significant bit first (a = Σ a_i·2^(i-1)), s = a + c
    binary_sum  <bos> b_1 … b_n = s_1 … s_w <eos>          s = b_1 + … + b_n in binary, least significant bit
                                                           first, w = bit_length(n) bits      T = length + w + 3

Arrays: inputs / targets [N, T] (targets IGNORE outside the answer and its <eos>), answer_start [N] (the index of
the first answer token), length [N] (non-pad tokens), size [N] (n). Splits are disjoint by a hash of the whole
row (`loopformer.tasks.common.draw_in_split`).

Intermediate states (option `scan`, parity and copy; for `task.loop_targets` with T(n) = n loops and a window of
two positions, `model.attn_window=2`): also step_targets [N, K, T], K = length, the read-out's targets after each
loop j of the one-step scan. After j loops a read position p has seen positions p − j .. p only, so:

    parity  the read-out before p holds the parity of the last min(j, n) bits (the whole parity from loop n on);
            with `scan_every`, every bit position b_p too holds the parity of the bits it has seen, b_(p−j) .. b_p
            (the prefix parity from loop p − 1 on): the scan's state supervised wherever it is, as the word
            problem's and column addition's are
    copy    the read-out before y_i holds the symbol j positions back, x_(n+i−j), once that is a symbol (j >= i;
            IGNORE before); <eos> from loop n on — for copy the only way a window of two can move x_i to y_i

Past step n a row of size n holds its state at step n: its final targets and, with parity's `scan_every`, the
prefix parity at every bit (positions its final targets do not supervise).

Every answer is checked against a brute-force reference in the tests (Python integers, one row at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from loopformer.errors import UserError
from loopformer.tasks.base import IGNORE, TokenTask, Vocab
from loopformer.tasks.common import (
    causal_targets,
    check_bool,
    check_range,
    dataclass_options,
    draw_in_split,
    draw_sizes,
    exact_match,
    make_rng,
    token_accuracy,
)

MAX_LENGTH = 1024
SPECIALS = ["<pad>", "=", "<eos>", "<bos>"]
EQ, EOS, BOS = 1, 2, 3


@dataclass
class LengthTask(TokenTask):
    """The common part of the variable-size tasks: sizes, the causal layout, metrics. A subclass sets `symbols`
    (its token strings after the specials), `width` (random draws per row) and `max_row` and writes `solve`."""

    length: int = 16          # n: the largest size (every size with min_length = 0)
    min_length: int = 0       # > 0: sizes drawn uniformly from min_length..length
    scan: bool = False        # also the one-step scan's intermediate states (step_targets; parity and copy)

    causal = True
    symbols: ClassVar[list[str]] = []

    def __post_init__(self) -> None:
        check_range("length", self.length, 1, MAX_LENGTH)
        check_range("min_length", self.min_length, 0, self.length)
        check_bool("scan", self.scan)
        self.check_options()
        self.vocab = Vocab(SPECIALS + self.symbols)
        self.seq_len = self.max_row(self.length)
        if self.scan:
            if type(self).scan_targets is LengthTask.scan_targets:
                raise UserError(f"option scan: the {self.name} task has no one-step scan (parity and copy have)")
            self.steps = self.length

    # ---------------------------------------------------------------- what a task defines
    def check_options(self) -> None:
        """One-line UserErrors for the task's own options."""

    def max_row(self, n: int) -> int:
        """Tokens of a row of size n, <bos> and <eos> included."""
        raise NotImplementedError

    def width(self) -> int:
        """Random draws per row (each in 0..draw_range - 1)."""
        return self.length

    draw_range = 2

    def solve(self, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(problem tokens [m, P], answer tokens [m, A]) as token ids, for rows of size n from their random draws
        x [m, width]."""
        raise NotImplementedError

    def scan_targets(self, rows: np.ndarray, targets: np.ndarray, n: int) -> np.ndarray:
        """[m, K, T] the targets after loops 1..K of the one-step scan for rows of size n (`scan`), from their
        tokens and final targets [m, T]; steps past n repeat step n."""
        raise NotImplementedError

    # ---------------------------------------------------------------- the contract
    def options(self) -> dict:
        return dataclass_options(self)

    def _draw(self, rng: np.random.Generator, m: int) -> dict[str, np.ndarray]:
        size = draw_sizes(rng, m, self.min_length, self.length)
        x = rng.integers(0, self.draw_range, size=(m, self.width()))
        rows = np.zeros((m, self.seq_len), dtype=np.int32)
        start, length = np.zeros(m, np.int64), np.zeros(m, np.int64)
        for n in np.unique(size):
            sel = np.flatnonzero(size == n)
            prob, ans = self.solve(x[sel], int(n))
            P, A = prob.shape[1] + 1, ans.shape[1]                       # P: <bos> and the problem
            rows[sel, 0] = BOS
            rows[sel, 1:P] = prob
            rows[sel, P] = EQ
            rows[sel, P + 1:P + 1 + A] = ans
            rows[sel, P + 1 + A] = EOS
            start[sel], length[sel] = P + 1, P + A + 2
        targets = causal_targets(rows, start, length)
        out = {"inputs": rows, "targets": targets, "answer_start": start, "length": length,
               "size": size.astype(np.int64)}
        if self.scan:
            steps = np.empty((m, self.steps, self.seq_len), dtype=np.int32)
            for n in np.unique(size):
                sel = np.flatnonzero(size == n)
                steps[sel] = self.scan_targets(rows[sel], targets[sel], int(n))
            out["step_targets"] = steps
        return out

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        return draw_in_split(self._draw, n, make_rng(seed, split), split)

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: the whole answer (and its <eos>) right; token_accuracy: answer tokens right."""
        pred, targets = np.asarray(pred), np.asarray(batch["targets"])
        if not len(pred):
            return {"accuracy": float("nan"), "token_accuracy": float("nan")}
        return {"accuracy": float(exact_match(pred, targets).mean()), "token_accuracy": token_accuracy(pred, targets)}

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        row = batch["inputs"][i][:int(batch["length"][i])]
        return f"n={int(batch['size'][i])}  " + " ".join(self.vocab.decode(row))



def _bits(task: LengthTask, bits: np.ndarray) -> np.ndarray:
    """Bits 0/1 as the token ids of "0" / "1"."""
    return bits.astype(np.int32) + task.vocab.index["0"]


@dataclass
class ParityTask(LengthTask):
    """The parity of n random bits."""

    scan_every: bool = False  # with scan: the scan's state at every bit position too, not only where p is read

    name = "parity"
    symbols: ClassVar[list[str]] = ["0", "1"]

    def check_options(self) -> None:
        check_bool("scan_every", self.scan_every)
        if self.scan_every and not self.scan:
            raise UserError("option scan_every supervises the scan's states at every position: it needs scan: true")

    def max_row(self, n: int) -> int:
        return n + 4

    def solve(self, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        b = x[:, :n]
        return _bits(self, b), _bits(self, b.sum(axis=1, keepdims=True) % 2)

    def scan_targets(self, rows: np.ndarray, targets: np.ndarray, n: int) -> np.ndarray:
        """Loop j: at the read position of the parity (the "=" at n + 1) the parity of bits n − j + 1 .. n; <eos>
        (read one position later, next to the "=") at every loop. With `scan_every`, bit b_p (at position p) holds
        the parity of bits max(1, p − j) .. p."""
        steps = np.repeat(targets[:, None, :], self.steps, axis=1)           # [m,K,T]
        bits = rows[:, 1:n + 1] - self.vocab.index["0"]                     # [m,n]
        suffix = np.cumsum(bits[:, ::-1], axis=1) % 2                        # [m,n] parity of the last j bits
        j = np.minimum(np.arange(1, self.steps + 1), n)                     # [K]
        steps[:, :, n + 1] = _bits(self, suffix[:, j - 1])
        if self.scan_every:                                                  # window parities: prefix differences
            prefix = np.concatenate([np.zeros((len(rows), 1), np.int64), np.cumsum(bits, axis=1)], axis=1)  # [m,n+1]
            p = np.arange(1, n + 1)                                           # [n] bit positions
            lo = np.maximum(p[None, :] - np.arange(1, self.steps + 1)[:, None], 1)  # [K,n] first bit seen
            steps[:, :, 1:n + 1] = _bits(self, (prefix[:, None, p] - prefix[:, lo - 1]) % 2)
        return steps


@dataclass
class CopyTask(LengthTask):
    """n random symbols, written again (or reversed)."""

    alphabet: int = 2         # symbols a, b, … (2..26)
    reverse: bool = False     # the answer is the input reversed

    name = "copy"

    def max_row(self, n: int) -> int:
        return 2 * n + 3

    def check_options(self) -> None:
        check_range("alphabet", self.alphabet, 2, 26)
        check_bool("reverse", self.reverse)
        if self.scan and self.reverse:
            raise UserError("option scan: a reversed copy has no one-step scan (each symbol moves its own distance)")
        self.symbols = [chr(ord("a") + i) for i in range(self.alphabet)]
        self.draw_range = self.alphabet

    def solve(self, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        s = x[:, :n].astype(np.int32) + len(SPECIALS)
        return s, (s[:, ::-1] if self.reverse else s)

    def scan_targets(self, rows: np.ndarray, targets: np.ndarray, n: int) -> np.ndarray:
        """Loop j: the read position of y_i (n + i) holds the symbol j positions back, x_(n+i−j), for j >= i
        (IGNORE before: "=" or a blank); <eos> (read at 2n + 1) from loop n on."""
        K, T = self.steps, self.seq_len
        steps = np.full((len(rows), K, T), IGNORE, dtype=np.int32)
        for j in range(1, K + 1):
            if j >= n:
                steps[:, j - 1] = targets
                continue
            i = np.arange(1, j + 1)                                          # answer tokens reached by loop j
            steps[:, j - 1, n + i] = rows[:, n + i - j]
        return steps


@dataclass
class AdditionTask(LengthTask):
    """The sum of two random n-bit numbers, least significant bit first."""

    name = "addition"
    symbols: ClassVar[list[str]] = ["0", "1", "+"]

    def max_row(self, n: int) -> int:
        return 3 * n + 5

    def width(self) -> int:
        return 2 * self.length

    def solve(self, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        a, c = x[:, :n], x[:, self.length:self.length + n]
        s = np.zeros((len(x), n + 1), dtype=np.int64)
        carry = np.zeros(len(x), dtype=np.int64)
        for i in range(n):                                   # ripple carry, one column at a time
            t = a[:, i] + c[:, i] + carry
            s[:, i], carry = t % 2, t // 2
        s[:, n] = carry
        plus = np.full((len(x), 1), self.vocab.index["+"], dtype=np.int32)
        return np.concatenate([_bits(self, a), plus, _bits(self, c)], axis=1), _bits(self, s)


@dataclass
class BinarySumTask(LengthTask):
    """The number of ones among n random bits, in binary, least significant bit first."""

    name = "binary_sum"
    symbols: ClassVar[list[str]] = ["0", "1"]

    def max_row(self, n: int) -> int:
        return n + int(n).bit_length() + 3

    def solve(self, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        b = x[:, :n]
        count = b.sum(axis=1)
        w = int(n).bit_length()
        return _bits(self, b), _bits(self, (count[:, None] >> np.arange(w)[None, :]) & 1)

