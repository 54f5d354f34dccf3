"""The shared layout of the two string-pair dynamic-programming tasks (edit distance and LCS; paper Sec. 5.1.1,
App. C.1.1), which follow the causal format of Feng et al. (2023):

    s1 | s2 <sep> answer <eos>

Vocabulary (ids are positions):

    0 <pad>   1 <sep>   2 <eos>   3 |   4..29 a..z   30.. the numbers 0..max_answer (one token per number)

The answer is a single number token, so exact match on the answer (number and <eos>) is the task's accuracy.
Shapes: N samples, T = seq_len (the longest possible row for the task's options).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numba
import numpy as np

from loopformer.errors import UserError
from loopformer.tasks.base import IGNORE, TokenTask, Vocab
from loopformer.tasks.common import causal_targets, check_range, dataclass_options, exact_match, token_accuracy

PAD, SEP, EOS, BAR = 0, 1, 2, 3
LETTER0 = 4          # id of 'a'
NUM0 = 30            # id of the number 0
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def pair_vocab(max_answer: int) -> Vocab:
    return Vocab(["<pad>", "<sep>", "<eos>", "|"] + list(LETTERS) + [str(i) for i in range(max_answer + 1)])


def encode_pair(s1: str, s2: str, answer: int | None = None) -> list[int]:
    """Token ids of `s1 | s2 <sep> [answer <eos>]` (letters a..z only)."""
    for s in (s1, s2):
        bad = [c for c in s if c not in LETTERS]
        if bad:
            raise UserError(f"character {bad[0]!r} is not a letter a..z")
    ids = [LETTER0 + LETTERS.index(c) for c in s1] + [BAR] + [LETTER0 + LETTERS.index(c) for c in s2] + [SEP]
    if answer is not None:
        ids += [NUM0 + int(answer), EOS]
    return ids


@numba.njit(cache=True)
def draw_alphabet(rng, t, pool, perm, avail):
    """avail[:t] = t distinct letters (0-based) drawn from the first `pool` letters (partial Fisher-Yates)."""
    for j in range(26):
        perm[j] = j
    for j in range(t):
        r = j + rng.integers(0, pool - j)
        tmp = perm[j]
        perm[j] = perm[r]
        perm[r] = tmp
        avail[j] = perm[j]


@numba.njit(cache=True)
def write_row(rows, i, a, la, b, lb, value, start, length, len1, len2):
    """Write `a | b <sep> value <eos>` into rows[i] and record where the answer starts and the lengths."""
    pos = 0
    for j in range(la):
        rows[i, pos] = LETTER0 + a[j]
        pos += 1
    rows[i, pos] = BAR
    pos += 1
    for j in range(lb):
        rows[i, pos] = LETTER0 + b[j]
        pos += 1
    rows[i, pos] = SEP
    pos += 1
    start[i] = pos
    rows[i, pos] = NUM0 + value
    rows[i, pos + 1] = EOS
    length[i] = pos + 2
    len1[i] = la
    len2[i] = lb


@dataclass
class StringPairTask(TokenTask):
    """Common options and behaviour of edit distance and LCS: string length, alphabet sizes, the share of random
    pairs; batch assembly, metrics, decoding."""

    length: int = 60
    alphabet_min: int = 3
    alphabet_max: int = 26
    p_random: float = 0.4
    alphabet_pool: int = 26

    causal = True
    max_answer: ClassVar[int]

    def check_pair_options(self, min_length: int) -> None:
        """One-line errors for the shared options."""
        check_range("length", self.length, min_length, 1000)
        check_range("alphabet_min", self.alphabet_min, 1, 26)
        check_range("alphabet_pool", self.alphabet_pool, 1, 26)
        check_range("alphabet_max", self.alphabet_max, self.alphabet_min, self.alphabet_pool)
        check_range("p_random", self.p_random, 0.0, 1.0, integer=False)

    def _dp(self, a: np.ndarray, la: int, b: np.ndarray, lb: int) -> int:
        """The task's answer for two strings given as integer arrays."""
        raise NotImplementedError

    def solve(self, s1: str, s2: str) -> int:
        a = np.array([ord(c) for c in s1], np.int64)
        b = np.array([ord(c) for c in s2], np.int64)
        return int(self._dp(a, len(a), b, len(b)))

    def options(self) -> dict:
        return dataclass_options(self)

    def _finish(self, rows: np.ndarray, start: np.ndarray, length: np.ndarray, answer: np.ndarray,
                len1: np.ndarray, len2: np.ndarray) -> dict[str, np.ndarray]:
        return {
            "inputs": rows,
            "targets": causal_targets(rows, start, length),
            "answer_start": start.astype(np.int32),
            "length": length.astype(np.int32),
            "answer": answer.astype(np.int32),
            "len1": len1.astype(np.int32),
            "len2": len2.astype(np.int32),
        }

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: exact match of the answer number and <eos>; answer_mae: mean |predicted − true| over rows
        whose predicted answer token is a number (answer_numeric: their fraction)."""
        pred = np.asarray(pred)
        targets = np.asarray(batch["targets"])
        n = len(pred)
        rows = np.arange(n)
        q = np.asarray(batch["answer_start"]) - 1           # position whose output is the answer number
        got = pred[rows, q].astype(np.int64) - NUM0
        true = np.asarray(batch["answer"]).astype(np.int64)
        numeric = (got >= 0) & (got <= self.max_answer)
        out = {
            "accuracy": float(exact_match(pred, targets).mean()) if n else float("nan"),
            "answer_accuracy": float((got == true).mean()) if n else float("nan"),
            "token_accuracy": token_accuracy(pred, targets),
            "answer_numeric": float(numeric.mean()) if n else float("nan"),
            "answer_mae": float(np.abs(got - true)[numeric].mean()) if numeric.any() else float("nan"),
        }
        return out

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        row = np.asarray(batch["inputs"][i])
        row = row[: int(batch["length"][i])] if "length" in batch else row[row != PAD]
        toks = self.vocab.decode(row)
        k = toks.index("|") if "|" in toks else len(toks)
        s1 = "".join(toks[:k])
        rest = toks[k + 1:]
        j = rest.index("<sep>") if "<sep>" in rest else len(rest)
        s2 = "".join(rest[:j])
        ans = " ".join(t for t in rest[j + 1:] if t != "<eos>")
        return f"{s1} | {s2}  ->  {ans}"

    def encode(self, s1: str, s2: str) -> dict[str, np.ndarray]:
        """A one-row batch for a user-given pair (answer computed by the task's reference DP)."""
        ans = self.solve(s1, s2)
        ids = encode_pair(s1, s2, ans)
        if len(ids) > self.seq_len:
            raise UserError(f"pair is too long for this task: {len(ids)} tokens > seq_len {self.seq_len}")
        rows = np.zeros((1, self.seq_len), dtype=np.int32)
        rows[0, : len(ids)] = ids
        start = np.array([len(ids) - 2])
        return self._finish(rows, start, np.array([len(ids)]), np.array([ans]), np.array([len(s1)]),
                            np.array([len(s2)]))


__all__ = ["StringPairTask", "pair_vocab", "encode_pair", "PAD", "SEP", "EOS", "BAR", "LETTER0", "NUM0",
           "IGNORE"]
