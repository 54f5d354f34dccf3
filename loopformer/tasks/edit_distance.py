"""Edit distance (paper Sec. 5.1.1 and App. C.1.1, Algorithm 1; the generator of Feng et al. 2023).

Per sample: draw an alphabet of t letters (t uniform in [alphabet_min, alphabet_max], letters distinct, from a..z,
or from the first `alphabet_pool` letters);
string 1 has exactly `length` (L) letters from it. With probability `p_random` string 2 is random with length
uniform in [L-3, L+2]; otherwise string 2 is string 1 after k random edits (k uniform in 1..L; each edit is a
deletion, a replacement or an insertion, equally likely, at a uniform position — a deletion that would leave
fewer than 3 letters becomes an insertion). A pair whose strings are equal or whose string 2 falls outside
[L-3, L+2] is redrawn (alphabet included, k kept). The shorter string comes first. The answer is the minimum
cost of turning string 1 into string 2 with insertions (cost 2), deletions (2) and replacements (3).

Algorithm 1 in the paper prints t ∈ {3..10} (Feng et al.'s default); the authors' runs at L = 60 use 24 extra
letters, i.e. t ∈ {3..26}, which is our default (`alphabet_max=10` gives Algorithm 1 exactly).

Layout: `s1 | s2 <sep> d <eos>` (see `loopformer.tasks.pairs`); T = 2L + 6; the answer is at most 3L + 6.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from loopformer.tasks.common import check_range, make_rng
from loopformer.tasks.pairs import StringPairTask, draw_alphabet, pair_vocab, write_row


@numba.njit(cache=True)
def edit_distance_dp(a, la, b, lb, c_ins, c_del, c_rep):
    """Weighted Levenshtein distance between a[:la] and b[:lb] (one rolling row; O(la·lb))."""
    row = np.empty(lb + 1, np.int64)
    for j in range(lb + 1):
        row[j] = j * c_ins
    for i in range(1, la + 1):
        diag = row[0]
        row[0] = i * c_del
        ai = a[i - 1]
        for j in range(1, lb + 1):
            up = row[j]
            best = up + c_del
            v = row[j - 1] + c_ins
            if v < best:
                best = v
            v = diag + (0 if ai == b[j - 1] else c_rep)
            if v < best:
                best = v
            diag = up
            row[j] = best
    return row[lb]


@numba.njit(cache=True)
def _random_letters(rng, avail, t, out, m):
    """out[:m] = m letters drawn uniformly (with repetition) from the alphabet avail[:t]."""
    for j in range(m):
        out[j] = avail[rng.integers(0, t)]


@numba.njit(cache=True)
def _edit(rng, s, m, avail, t):
    """One random edit of s[:m] in place: a deletion, a replacement or an insertion, equally likely, at a uniform
    position (a deletion that would leave fewer than 3 letters becomes an insertion). Returns the new length, or -1
    when an insertion finds no room in `s` (s unchanged)."""
    op = rng.integers(0, 3)
    if op == 0 and m > 2:                                   # delete
        p = rng.integers(0, m)
        for j in range(p, m - 1):
            s[j] = s[j + 1]
        return m - 1
    if op == 1:                                             # replace
        p = rng.integers(0, m)
        s[p] = avail[rng.integers(0, t)]
        return m
    p = rng.integers(0, m + 1)                              # insert
    c = avail[rng.integers(0, t)]
    if m + 1 > s.shape[0]:
        return -1
    for j in range(m, p, -1):
        s[j] = s[j - 1]
    s[p] = c
    return m + 1


@numba.njit(cache=True)
def _edited_copy(rng, s1, L, s2, k, avail, t):
    """s2 = s1[:L] after k random edits (`_edit`); returns the length of s2. Stops early when an insertion finds no
    room or s2 grows past 2L + 6 letters (hopelessly long: the pair is redrawn)."""
    for j in range(L):
        s2[j] = s1[j]
    m = L
    for _ in range(k):
        edited = _edit(rng, s2, m, avail, t)
        if edited < 0:
            break
        m = edited
        if m > 2 * L + 6:
            break
    return m


@numba.njit(cache=True)
def _draw_pair(rng, L, k, amin, amax, pool, p_random, perm, avail, s1, s2):
    """One draw of a pair: an alphabet of t letters, s1 (L letters from it), then s2, random with probability
    p_random (length uniform in [L-3, L+2]) or else s1 after k edits. Returns the length of s2."""
    t = rng.integers(amin, amax + 1)
    draw_alphabet(rng, t, pool, perm, avail)
    _random_letters(rng, avail, t, s1, L)
    if rng.random() < p_random:
        m = rng.integers(L - 3, L + 3)
        _random_letters(rng, avail, t, s2, m)
        return m
    return _edited_copy(rng, s1, L, s2, k, avail, t)


@numba.njit(cache=True)
def _kept(s1, L, s2, m):
    """Whether a drawn pair is kept: s2's length m is in [L-3, L+2] and s2[:m] differs from s1[:L]."""
    if m < L - 3 or m > L + 2:
        return False
    if m != L:
        return True
    for j in range(L):
        if s1[j] != s2[j]:
            return True
    return False


@numba.njit(cache=True)
def _generate(rng, n, L, amin, amax, pool, p_random, c_ins, c_del, c_rep, T, rows, start, length, answer, len1, len2):
    perm = np.empty(26, np.int64)
    avail = np.empty(26, np.int64)
    s1 = np.empty(L, np.int64)
    s2 = np.empty(2 * L + 8, np.int64)
    for i in range(n):
        k = rng.integers(1, L + 1)                         # number of edits (drawn once, kept on redraws)
        m = _draw_pair(rng, L, k, amin, amax, pool, p_random, perm, avail, s1, s2)
        while not _kept(s1, L, s2, m):                     # redraw (alphabet included)
            m = _draw_pair(rng, L, k, amin, amax, pool, p_random, perm, avail, s1, s2)
        # shorter string first
        d = edit_distance_dp(s1, L, s2, m, c_ins, c_del, c_rep)
        answer[i] = d
        if m < L:
            write_row(rows, i, s2, m, s1, L, d, start, length, len1, len2)
        else:
            write_row(rows, i, s1, L, s2, m, d, start, length, len1, len2)


@dataclass
class EditDistanceTask(StringPairTask):
    """Edit distance with costs insert 2 / delete 2 / replace 3 (paper App. C.1.1)."""

    insert_cost: int = 2
    delete_cost: int = 2
    replace_cost: int = 3

    name = "edit_distance"

    def __post_init__(self) -> None:
        self.check_pair_options(min_length=4)
        for k in ("insert_cost", "delete_cost", "replace_cost"):
            check_range(k, getattr(self, k), 0, 1000)
        L = self.length
        # one string has exactly L letters, the other L-3..L+2: edit the common prefix of length min <= L
        # letter by letter (replace, or delete + insert) and insert/delete the |difference| <= 3 others
        self.max_answer = int(min(self.replace_cost, self.insert_cost + self.delete_cost) * L
                              + 3 * max(self.insert_cost, self.delete_cost))
        self.vocab = pair_vocab(self.max_answer)
        self.seq_len = 2 * L + 6

    def _dp(self, a: np.ndarray, la: int, b: np.ndarray, lb: int) -> int:
        return edit_distance_dp(a, la, b, lb, self.insert_cost, self.delete_cost, self.replace_cost)

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        rng = make_rng(seed, split)
        n = int(n)
        rows = np.zeros((n, self.seq_len), np.int32)
        start, length, answer, len1, len2 = (np.zeros(n, np.int64) for _ in range(5))
        _generate(rng, n, self.length, self.alphabet_min, self.alphabet_max, self.alphabet_pool,
                  float(self.p_random),
                  self.insert_cost, self.delete_cost, self.replace_cost, self.seq_len,
                  rows, start, length, answer, len1, len2)
        return self._finish(rows, start, length, answer, len1, len2)
