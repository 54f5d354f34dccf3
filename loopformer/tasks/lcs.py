"""Longest common subsequence (paper Sec. 5.1.1, App. C.1.1; L = 60 and 100 in Table 2).

Per sample: draw an alphabet of t letters (t uniform in [alphabet_min, alphabet_max], distinct letters of a..z, or
of the first `alphabet_pool` letters: with a small pool every sample reuses the same few letters, which a small
model learns to compare much sooner);
string 1 has exactly `length` (L) letters from it. With probability `p_random` string 2 is L random letters from
the same alphabet (the paper's "two sequences sampled uniformly from the alphabet"; `p_random=1` gives exactly
that); otherwise string 2 is string 1 after k random edits (k uniform in 1..L, each a replacement by a random
letter or a deletion, equally likely, at a uniform position; a deletion that would leave fewer than ⌈L/2⌉ letters
becomes a replacement), which gives long common subsequences too. The two strings are swapped with probability
1/2. The answer is the LCS length (0..L).

Layout: `s1 | s2 <sep> n <eos>` (see `loopformer.tasks.pairs`); T = 2L + 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from loopformer.tasks.common import make_rng
from loopformer.tasks.pairs import StringPairTask, draw_alphabet, pair_vocab, write_row


@numba.njit(cache=True)
def lcs_dp(a, la, b, lb):
    """Length of the longest common subsequence of a[:la] and b[:lb] (one rolling row; O(la·lb))."""
    row = np.zeros(lb + 1, np.int64)
    for i in range(1, la + 1):
        diag = 0
        ai = a[i - 1]
        for j in range(1, lb + 1):
            up = row[j]
            if ai == b[j - 1]:
                v = diag + 1
            else:
                v = up if up > row[j - 1] else row[j - 1]
            diag = up
            row[j] = v
    return row[lb]


@numba.njit(cache=True)
def _generate(rng, n, L, amin, amax, pool, p_random, rows, start, length, answer, len1, len2):
    perm = np.empty(26, np.int64)
    avail = np.empty(26, np.int64)
    s1 = np.empty(L, np.int64)
    s2 = np.empty(L, np.int64)
    min_len = (L + 1) // 2
    for i in range(n):
        t = rng.integers(amin, amax + 1)
        draw_alphabet(rng, t, pool, perm, avail)
        for j in range(L):
            s1[j] = avail[rng.integers(0, t)]
        if rng.random() < p_random:
            m = L
            for j in range(L):
                s2[j] = avail[rng.integers(0, t)]
        else:
            m = L
            for j in range(L):
                s2[j] = s1[j]
            k = rng.integers(1, L + 1)
            for _ in range(k):
                op = rng.integers(0, 2)
                p = rng.integers(0, m)
                if op == 0 and m > min_len:                 # delete
                    for j in range(p, m - 1):
                        s2[j] = s2[j + 1]
                    m -= 1
                else:                                       # replace
                    s2[p] = avail[rng.integers(0, t)]
        swap = rng.random() < 0.5
        d = lcs_dp(s1, L, s2, m)
        answer[i] = d
        if swap:
            write_row(rows, i, s2, m, s1, L, d, start, length, len1, len2)
        else:
            write_row(rows, i, s1, L, s2, m, d, start, length, len1, len2)


@dataclass
class LCSTask(StringPairTask):
    """Length of the longest common subsequence of two strings."""

    alphabet_max: int = 25

    name = "lcs"

    def __post_init__(self) -> None:
        self.check_pair_options(min_length=1)
        self.max_answer = int(self.length)
        self.vocab = pair_vocab(self.max_answer)
        self.seq_len = 2 * self.length + 4

    def _dp(self, a: np.ndarray, la: int, b: np.ndarray, lb: int) -> int:
        return lcs_dp(a, la, b, lb)

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        rng = make_rng(seed, split)
        n = int(n)
        rows = np.zeros((n, self.seq_len), np.int32)
        start, length, answer, len1, len2 = (np.zeros(n, np.int64) for _ in range(5))
        _generate(rng, n, self.length, self.alphabet_min, self.alphabet_max, self.alphabet_pool,
                  float(self.p_random),
                  rows, start, length, answer, len1, len2)
        return self._finish(rows, start, length, answer, len1, len2)
