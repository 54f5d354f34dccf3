"""Sudoku (paper Sec. 5.1.1, App. C.1.1; Table 2): puzzles with exactly one solution, loaders for the public CSV
files, metrics, a validator and validity-preserving augmentation.

Format (non-causal, T = 81): the grid is flattened row by row; `inputs` holds the puzzle (blank cells are the
token '0', as in the paper's `1005037006...`), `targets` the solution digit at every cell. Vocabulary:

    0 <pad>   1 '0' (blank)   2..10 the digits '1'..'9'        (digit d has id d + 1)

The metrics are board exact match (all 81 cells; the headline 'accuracy') and cell accuracy on the blanks.

Generator: a random complete grid (randomised depth-first search), then clues are removed in random order while
the puzzle keeps exactly one solution (checked by a compiled solver: "is there a solution whose removed cell
differs?"), until `blanks` cells are empty (or, with `blanks=None`, until no clue can be removed: a minimal
puzzle, typically 22–26 clues). Each puzzle gets a difficulty rating: the mean number of guesses over `rating_runs`
randomised solves by a solver that fills naked and hidden singles and guesses (at a cell with fewest candidates)
only when stuck — 0 means solvable by singles alone. `min_difficulty` redraws easier puzzles. The public sets use
their own ratings (Radcliffe's `difficulty`, Sudoku-Extreme's `rating`); the loaders keep them in `difficulty`.

Public layouts (`read_sudoku_csv`):
    radcliffe  `id,puzzle,solution,clues,difficulty`   '.' blanks (sudoku-3m.csv; the paper keeps difficulty ≥ 3.0)
    extreme    `source,question,answer,rating`          '.' blanks (Sudoku-Extreme)
    kaggle     `quizzes,solutions`                       '0' blanks (the Kaggle 1M set)
`import_csv` turns such a file into de-duplicated train/test splits (`loopformer data import` writes them).
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass

import numba
import numpy as np

from loopformer.errors import UserError
from loopformer.tasks.base import TokenTask, Vocab
from loopformer.tasks.common import check_range, dataclass_options, make_rng, token_accuracy

BLANK_ID = 1          # token id of an empty cell; digit d in 1..9 has id d + 1

_CELLS = np.arange(81)
ROW = (_CELLS // 9).astype(np.int64)
COL = (_CELLS % 9).astype(np.int64)
BOX = ((ROW // 3) * 3 + COL // 3).astype(np.int64)
UNITS = np.array([[r * 9 + c for c in range(9)] for r in range(9)]
                 + [[r * 9 + c for r in range(9)] for c in range(9)]
                 + [[(b // 3 * 3 + k // 3) * 9 + b % 3 * 3 + k % 3 for k in range(9)] for b in range(9)],
                 dtype=np.int64)   # [27, 9]: rows, columns, boxes
POPCOUNT = np.array([bin(i).count("1") for i in range(512)], dtype=np.int64)


# ----------------------------------------------------------------------------------------------- compiled solver
@numba.njit(cache=True)
def _nth_bit(m, j):
    """The j-th (0-based) set bit of m, as a one-bit mask."""
    while True:
        b = m & -m
        if j == 0:
            return b
        m &= ~b
        j -= 1


@numba.njit(cache=True)
def _bit_digit(b):
    d = 1
    while b > 1:
        b >>= 1
        d += 1
    return d


@numba.njit(cache=True)
def _most_constrained(g, rm, cm, bm, fcell, fbit, stop_at):
    """(cell, candidate count, candidate mask) of the empty cell with the fewest candidates, scanning in order and
    stopping early at a count <= stop_at (-1: never). `fbit` is struck from cell `fcell`'s candidates (-1: none);
    cell -1 when the grid is full."""
    best = -1
    bc = 10
    bmask = 0
    for c in range(81):
        if g[c] == 0:
            m = ~(rm[ROW[c]] | cm[COL[c]] | bm[BOX[c]]) & 511
            if c == fcell:
                m &= ~fbit
            k = POPCOUNT[m]
            if k < bc:
                bc = k
                best = c
                bmask = m
                if k <= stop_at:
                    break
    return best, bc, bmask


@numba.njit(cache=True)
def count_solutions_nb(grid, limit, sol, fcell, fbit):
    """Number of solutions of `grid` (int [81], 0 = blank), stopping at `limit`; the first one goes to `sol`.

    Depth-first search on the cell with fewest candidates. If fcell >= 0, digit mask `fbit` is forbidden there.
    """
    g = np.empty(81, np.int64)
    for c in range(81):
        g[c] = grid[c]
    rm = np.zeros(9, np.int64)
    cm = np.zeros(9, np.int64)
    bm = np.zeros(9, np.int64)
    for c in range(81):
        d = g[c]
        if d != 0:
            bit = 1 << (d - 1)
            if (rm[ROW[c]] | cm[COL[c]] | bm[BOX[c]]) & bit:
                return 0
            if c == fcell and (bit & fbit):
                return 0
            rm[ROW[c]] |= bit
            cm[COL[c]] |= bit
            bm[BOX[c]] |= bit
    st_cell = np.empty(81, np.int64)
    st_mask = np.empty(81, np.int64)
    depth = 0
    count = 0
    while True:
        best, bc, bmask = _most_constrained(g, rm, cm, bm, fcell, fbit, 1)
        if best >= 0 and bc > 0:
            bit = bmask & -bmask
            g[best] = _bit_digit(bit)
            rm[ROW[best]] |= bit
            cm[COL[best]] |= bit
            bm[BOX[best]] |= bit
            st_cell[depth] = best
            st_mask[depth] = bmask & ~bit
            depth += 1
            continue
        if best == -1:
            count += 1
            if count == 1:
                for c in range(81):
                    sol[c] = g[c]
            if count >= limit:
                return count
        # backtrack to the deepest cell with an untried candidate
        resumed = False
        while depth > 0:
            depth -= 1
            c = st_cell[depth]
            bit = 1 << (g[c] - 1)
            rm[ROW[c]] &= ~bit
            cm[COL[c]] &= ~bit
            bm[BOX[c]] &= ~bit
            g[c] = 0
            m = st_mask[depth]
            if m != 0:
                bit = m & -m
                g[c] = _bit_digit(bit)
                rm[ROW[c]] |= bit
                cm[COL[c]] |= bit
                bm[BOX[c]] |= bit
                st_mask[depth] = m & ~bit
                depth += 1
                resumed = True
                break
        if not resumed:
            return count


@numba.njit(cache=True)
def _random_full_grid(rng, out):
    """A uniformly-seeded random complete grid: depth-first search trying candidates in random order."""
    g = np.zeros(81, np.int64)
    rm = np.zeros(9, np.int64)
    cm = np.zeros(9, np.int64)
    bm = np.zeros(9, np.int64)
    st_cell = np.empty(81, np.int64)
    st_mask = np.empty(81, np.int64)
    depth = 0
    while True:
        best, bc, bmask = _most_constrained(g, rm, cm, bm, -1, 0, 1)
        if best == -1:
            for c in range(81):
                out[c] = g[c]
            return
        if bc > 0:
            bit = _nth_bit(bmask, rng.integers(0, bc))
            g[best] = _bit_digit(bit)
            rm[ROW[best]] |= bit
            cm[COL[best]] |= bit
            bm[BOX[best]] |= bit
            st_cell[depth] = best
            st_mask[depth] = bmask & ~bit
            depth += 1
            continue
        while depth > 0:
            depth -= 1
            c = st_cell[depth]
            bit = 1 << (g[c] - 1)
            rm[ROW[c]] &= ~bit
            cm[COL[c]] &= ~bit
            bm[BOX[c]] &= ~bit
            g[c] = 0
            m = st_mask[depth]
            if m != 0:
                bit = _nth_bit(m, rng.integers(0, POPCOUNT[m]))
                g[c] = _bit_digit(bit)
                rm[ROW[c]] |= bit
                cm[COL[c]] |= bit
                bm[BOX[c]] |= bit
                st_mask[depth] = m & ~bit
                depth += 1
                break


@numba.njit(cache=True)
def _place(g, rm, cm, bm, c, bit):
    g[c] = _bit_digit(bit)
    rm[ROW[c]] |= bit
    cm[COL[c]] |= bit
    bm[BOX[c]] |= bit


@numba.njit(cache=True)
def _propagate(g, rm, cm, bm):
    """Fill naked and hidden singles to a fixed point. False on a contradiction."""
    changed = True
    while changed:
        changed = False
        for c in range(81):
            if g[c] == 0:
                m = ~(rm[ROW[c]] | cm[COL[c]] | bm[BOX[c]]) & 511
                if m == 0:
                    return False
                if POPCOUNT[m] == 1:
                    _place(g, rm, cm, bm, c, m)
                    changed = True
        for u in range(27):
            once = 0
            twice = 0
            placed = 0
            for k in range(9):
                c = UNITS[u, k]
                if g[c] == 0:
                    m = ~(rm[ROW[c]] | cm[COL[c]] | bm[BOX[c]]) & 511
                    twice |= once & m
                    once |= m
                else:
                    placed |= 1 << (g[c] - 1)
            need = 511 & ~placed
            if need & ~once:
                return False
            singles = once & ~twice & need
            while singles:
                bit = singles & -singles
                singles &= ~bit
                for k in range(9):
                    c = UNITS[u, k]
                    if g[c] == 0 and (~(rm[ROW[c]] | cm[COL[c]] | bm[BOX[c]]) & bit):
                        _place(g, rm, cm, bm, c, bit)
                        changed = True
                        break
                else:
                    return False
    return True


@numba.njit(cache=True)
def _given_masks(g, ms):
    """ms[0:9], ms[9:18], ms[18:27] = the digits (bit d-1 for digit d) placed in each row, column and box of grid g.
    False if a given repeats a digit within its row, column or box."""
    ok = True
    for c in range(81):
        d = g[c]
        if d != 0:
            bit = 1 << (d - 1)
            if (ms[ROW[c]] | ms[9 + COL[c]] | ms[18 + BOX[c]]) & bit:
                ok = False
            ms[ROW[c]] |= bit
            ms[9 + COL[c]] |= bit
            ms[18 + BOX[c]] |= bit
    return ok


@numba.njit(cache=True)
def _save_state(gs, ms, level, cur, rm, cm, bm):
    """gs[level], ms[level] = the grid cur and its row/column/box masks."""
    for c in range(81):
        gs[level, c] = cur[c]
    for k in range(9):
        ms[level, k] = rm[k]
        ms[level, 9 + k] = cm[k]
        ms[level, 18 + k] = bm[k]


@numba.njit(cache=True)
def _load_state(gs, ms, level, cur, rm, cm, bm):
    """cur, rm, cm, bm = the grid and masks saved at gs[level], ms[level]."""
    for c in range(81):
        cur[c] = gs[level, c]
    for k in range(9):
        rm[k] = ms[level, k]
        cm[k] = ms[level, 9 + k]
        bm[k] = ms[level, 18 + k]


@numba.njit(cache=True)
def _guesses_to_solve(grid, rng):
    """Guesses one run of the singles-propagating solver with random guesses makes before it finds a solution of
    `grid`; -1 if the givens clash or the grid has no solution."""
    gs = np.zeros((82, 81), np.int64)
    ms = np.zeros((82, 27), np.int64)
    st_cell = np.empty(82, np.int64)
    st_mask = np.empty(82, np.int64)
    for c in range(81):
        gs[0, c] = grid[c]
    if not _given_masks(gs[0], ms[0]):
        return -1
    guesses = 0
    depth = 0          # gs[depth] is the state before the guess at level depth
    # state of the current node lives in cur, rm, cm, bm (saved to gs[depth+1] before a guess); propagate, branch
    cur = np.empty(81, np.int64)
    rm = np.empty(9, np.int64)
    cm = np.empty(9, np.int64)
    bm = np.empty(9, np.int64)
    _load_state(gs, ms, 0, cur, rm, cm, bm)
    while True:
        if _propagate(cur, rm, cm, bm):
            best, bc, bmask = _most_constrained(cur, rm, cm, bm, -1, 0, -1)
            if best == -1:
                return guesses
            # save the state, then guess a random candidate
            _save_state(gs, ms, depth + 1, cur, rm, cm, bm)
            bit = _nth_bit(bmask, rng.integers(0, bc))
            st_cell[depth + 1] = best
            st_mask[depth + 1] = bmask & ~bit
            depth += 1
            guesses += 1
            _place(cur, rm, cm, bm, best, bit)
            continue
        # contradiction: resume the deepest saved state with an untried candidate
        while depth > 0 and st_mask[depth] == 0:
            depth -= 1
        if depth == 0:
            return -1
        m = st_mask[depth]
        bit = _nth_bit(m, rng.integers(0, POPCOUNT[m]))
        st_mask[depth] = m & ~bit
        _load_state(gs, ms, depth, cur, rm, cm, bm)
        guesses += 1
        _place(cur, rm, cm, bm, st_cell[depth], bit)


@numba.njit(cache=True)
def rate_nb(grid, rng, runs):
    """Mean number of guesses a singles-propagating solver with random guesses makes before it finds a solution
    (over `runs` runs); -1 if the grid has no solution."""
    total = 0.0
    for _ in range(runs):
        guesses = _guesses_to_solve(grid, rng)
        if guesses < 0:
            return -1.0
        total += guesses
    return total / runs


@numba.njit(cache=True)
def _generate(rng, n, blanks, min_difficulty, runs, puzzles, solutions, difficulty, attempts):
    full = np.empty(81, np.int64)
    puz = np.empty(81, np.int64)
    sol = np.empty(81, np.int64)
    order = np.empty(81, np.int64)
    for i in range(n):
        tries = 0
        while True:
            tries += 1
            _random_full_grid(rng, full)
            for c in range(81):
                puz[c] = full[c]
                order[c] = c
            for c in range(80, 0, -1):
                r = rng.integers(0, c + 1)
                tmp = order[c]
                order[c] = order[r]
                order[r] = tmp
            removed = 0
            for k in range(81):
                if blanks >= 0 and removed == blanks:
                    break
                c = order[k]
                v = puz[c]
                puz[c] = 0
                # unique iff no solution has another digit at c (the full grid is one solution)
                if count_solutions_nb(puz, 1, sol, c, 1 << (v - 1)) == 0:
                    removed += 1
                else:
                    puz[c] = v
            if blanks >= 0 and removed < blanks:
                continue
            d = rate_nb(puz, rng, runs)
            if d < min_difficulty:
                continue
            break
        attempts[i] = tries
        difficulty[i] = d
        for c in range(81):
            puzzles[i, c] = puz[c]
            solutions[i, c] = full[c]


# -------------------------------------------------------------------------------------------- python helpers
def count_solutions(grid, limit: int = 2) -> int:
    """Number of solutions of a puzzle (digits 0..9, 0 blank; any shape with 81 cells), counted up to `limit`."""
    g = np.asarray(grid, dtype=np.int64).reshape(81)
    return int(count_solutions_nb(g, int(limit), np.zeros(81, np.int64), -1, 0))


def solve(grid) -> np.ndarray | None:
    """The first solution (int8 [81]) of a puzzle, or None if it has none."""
    g = np.asarray(grid, dtype=np.int64).reshape(81)
    sol = np.zeros(81, np.int64)
    if count_solutions_nb(g, 1, sol, -1, 0) == 0:
        return None
    return sol.astype(np.int8)


def rate(grid, runs: int = 8, seed: int = 0) -> float:
    """Difficulty rating of a puzzle: mean guesses of the singles-propagating random-guess solver."""
    g = np.asarray(grid, dtype=np.int64).reshape(81)
    return float(rate_nb(g, np.random.default_rng(seed), int(runs)))


def is_valid_solution(puzzles: np.ndarray, boards: np.ndarray) -> np.ndarray:
    """[N] bool: `boards` (digits [N, 81]) is a complete valid grid (every row, column and box holds 1..9) that
    keeps every given of `puzzles` (digits, 0 blank)."""
    p = np.asarray(puzzles).reshape(-1, 81).astype(np.int64)
    b = np.asarray(boards).reshape(-1, 81).astype(np.int64)
    in_range = np.all((b >= 1) & (b <= 9), axis=1)
    keeps = np.all((p == 0) | (p == b), axis=1)
    onehot = np.zeros((len(b), 81, 10), dtype=bool)
    np.put_along_axis(onehot, np.clip(b, 0, 9)[:, :, None], True, axis=2)
    per_unit = onehot[:, UNITS, :].sum(axis=2)           # [N, 27, 10] digit counts per unit
    units_ok = np.all(per_unit[:, :, 1:] == 1, axis=(1, 2))
    return in_range & keeps & units_ok


def digits_to_ids(digits: np.ndarray) -> np.ndarray:
    """Cell digits (0 blank, 1..9) to token ids (blank 1, digit d -> d + 1)."""
    return np.asarray(digits).astype(np.int32) + 1


def ids_to_digits(ids: np.ndarray) -> np.ndarray:
    """Token ids back to digits; pad and blank become 0."""
    return np.clip(np.asarray(ids).astype(np.int64) - 1, 0, 9)


def render(digits, blank: str = ".") -> str:
    """A 9×9 grid as text with box separators."""
    d = np.asarray(digits).reshape(9, 9)
    lines = []
    for r in range(9):
        if r in (3, 6):
            lines.append("------+-------+------")
        cells = [str(int(v)) if v else blank for v in d[r]]
        lines.append(" | ".join(" ".join(cells[k:k + 3]) for k in (0, 3, 6)))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- augmentation
def draw_symmetries(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`n` random validity-preserving symmetries of the grid: row shuffles within bands, band shuffles, column
    shuffles within stacks, stack shuffles, a transposition with probability 1/2, and a digit relabelling.

    Returns (cells [n, 81]: new cell j reads old cell cells[j]; relabel [n, 10]: old digit d becomes relabel[d],
    relabel[0] = 0 keeps blanks). Apply with `apply_symmetries`, undo with `invert_symmetries`.
    """
    def line_maps() -> np.ndarray:          # [n, 9]: new line -> old line
        bands = rng.permuted(np.tile(np.arange(3), (n, 1)), axis=1)
        inner = rng.permuted(np.tile(np.arange(3), (n * 3, 1)), axis=1).reshape(n, 3, 3)
        return (bands[:, :, None] * 3 + inner).reshape(n, 9)

    rows, cols = line_maps(), line_maps()
    idx = rows[:, :, None] * 9 + cols[:, None, :]                # [n, 9, 9]
    flip = rng.random(n) < 0.5
    idx[flip] = idx[flip].transpose(0, 2, 1)
    idx = idx.reshape(n, 81)
    lut = np.zeros((n, 10), dtype=np.int64)
    lut[:, 1:] = rng.permuted(np.tile(np.arange(1, 10), (n, 1)), axis=1)
    return idx, lut


def apply_symmetries(digits: np.ndarray, cells: np.ndarray, relabel: np.ndarray) -> np.ndarray:
    """Grids digits [n, 81] (0 blank) under the symmetries (cells, relabel) of `draw_symmetries` (same dtype)."""
    d = np.asarray(digits).reshape(-1, 81)
    out = np.take_along_axis(relabel, np.take_along_axis(d.astype(np.int64), cells, axis=1), axis=1)
    return out.astype(d.dtype)


def invert_symmetries(digits: np.ndarray, cells: np.ndarray, relabel: np.ndarray) -> np.ndarray:
    """The inverse of `apply_symmetries`: grids seen under (cells, relabel) mapped back to the original frame."""
    d = np.asarray(digits).reshape(-1, 81).astype(np.int64)
    n = len(d)
    inv = np.zeros_like(relabel)
    np.put_along_axis(inv, relabel, np.tile(np.arange(10), (n, 1)), axis=1)     # inv[relabel[d]] = d
    out = np.empty_like(d)
    np.put_along_axis(out, cells, np.take_along_axis(inv, d, axis=1), axis=1)   # out[cells[j]] = inv[d[j]]
    return out.astype(np.asarray(digits).dtype)


def augment(puzzles: np.ndarray, solutions: np.ndarray, rng: np.random.Generator):
    """Random validity-preserving symmetries (`draw_symmetries`), one per row, applied to puzzles and solutions.

    puzzles, solutions: digits [N, 81] (0 blank in puzzles). Returns transformed copies (same dtype).
    """
    p = np.asarray(puzzles).reshape(-1, 81)
    s = np.asarray(solutions).reshape(-1, 81)
    cells, relabel = draw_symmetries(len(p), rng)
    return apply_symmetries(p, cells, relabel), apply_symmetries(s, cells, relabel)


def vote(preds: np.ndarray, scores: np.ndarray | None = None) -> np.ndarray:
    """Per-cell majority vote over K predictions of the same grids: preds [K, N, 81] digits -> [N, 81].

    Ties go to the digit with the larger summed `scores` [K, N, 81] (e.g. each prediction's probability), then to
    the first copy's digit (the plain prediction when copy 0 is the identity)."""
    P = np.asarray(preds).astype(np.int64)
    onehot = np.zeros(P.shape + (10,), np.float64)
    np.put_along_axis(onehot, P[..., None], 1.0, axis=-1)
    tally = onehot.sum(0)                                                        # [N, 81, 10] votes
    if scores is not None:
        tally += 1e-3 * (onehot * np.asarray(scores, np.float64)[..., None]).sum(0) / len(P)
    tally += 1e-6 * onehot[0]                                                    # last resort: copy 0
    return tally.argmax(-1)


# ------------------------------------------------------------------------------------------------------ loaders
LAYOUTS = {
    # name: (header columns, puzzle column, solution column, rating column or None, blank character)
    "radcliffe": (("id", "puzzle", "solution", "clues", "difficulty"), "puzzle", "solution", "difficulty", "."),
    "extreme": (("source", "question", "answer", "rating"), "question", "answer", "rating", "."),
    "kaggle": (("quizzes", "solutions"), "quizzes", "solutions", None, "0"),
}


def _read_rows(path, layout, header, pcol, scol, rcol, limit, puzzles, solutions, ratings, lines) -> None:
    """Append the CSV's fields to the lists (see `read_sudoku_csv`)."""
    with open(path, newline="", encoding="utf-8") as fh:
        first = fh.readline()
        names = [h.strip().lower() for h in next(csv.reader(io.StringIO(first)))] if first.strip() else []
        missing = [h for h in (pcol, scol) + ((rcol,) if rcol else ()) if h not in names]
        if missing:
            raise UserError(f"{path}:1: header {first.strip()!r} lacks column(s) {', '.join(missing)} of the "
                            f"{layout} layout ({','.join(header)})")
        ip, is_, ir = names.index(pcol), names.index(scol), (names.index(rcol) if rcol else -1)
        reader = csv.reader(fh)
        for lineno, rec in enumerate(reader, start=2):
            if not rec or (len(rec) == 1 and not rec[0].strip()):
                continue
            if len(rec) != len(names):
                raise UserError(f"{path}:{lineno}: expected {len(names)} fields, got {len(rec)}")
            puzzles.append(rec[ip].strip())
            solutions.append(rec[is_].strip())
            if ir >= 0:
                try:
                    ratings.append(float(rec[ir]))
                except ValueError:
                    raise UserError(f"{path}:{lineno}: {rcol} {rec[ir]!r} is not a number") from None
            lines.append(lineno)
            if limit is not None and len(lines) >= limit:
                break


def read_sudoku_csv(path: str | os.PathLike, layout: str, min_difficulty: float | None = None,
                    limit: int | None = None) -> dict[str, np.ndarray]:
    """Read one of the public Sudoku CSV layouts into digit arrays.

    Returns {'puzzles': int8 [N, 81] (0 blank), 'solutions': int8 [N, 81], 'difficulty': float32 [N] (NaN when the
    layout has no rating), 'line': int64 [N] (1-based line numbers in the file)}. Every row is checked (field
    count, 81 cells, allowed characters, the solution is a valid grid that keeps the givens); the first bad row
    raises a UserError naming its line. `min_difficulty` keeps rows rated at least that much.
    """
    if layout not in LAYOUTS:
        raise UserError(f"unknown Sudoku layout {layout!r} (expected one of: {', '.join(LAYOUTS)})")
    header, pcol, scol, rcol, blank = LAYOUTS[layout]
    if min_difficulty is not None and rcol is None:
        raise UserError(f"the {layout} layout has no difficulty column; leave min_difficulty unset")
    if not os.path.isfile(path):
        raise UserError(f"file not found: {path}")
    puzzles: list[str] = []
    solutions: list[str] = []
    ratings: list[float] = []
    lines: list[int] = []
    try:
        _read_rows(path, layout, header, pcol, scol, rcol, limit, puzzles, solutions, ratings, lines)
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text (after line {lines[-1] if lines else 1})") from None
    except csv.Error as exc:
        after = lines[-1] if lines else 1
        raise UserError(f"{path}: after line {after}: malformed CSV ({exc})") from None
    n = len(lines)
    line_arr = np.asarray(lines, dtype=np.int64)

    def to_digits(strings: list[str], what: str, allow_blank: bool) -> np.ndarray:
        lens = np.fromiter((len(s) for s in strings), dtype=np.int64, count=n)
        bad = np.flatnonzero(lens != 81)
        if len(bad):
            i = bad[0]
            raise UserError(f"{path}:{line_arr[i]}: {what} has {lens[i]} cells, expected 81")
        raw = np.frombuffer("".join(strings).encode("latin-1", errors="replace"), dtype=np.uint8).reshape(n, 81)
        digits = raw.astype(np.int64) - ord("0")
        is_blank = raw == ord(blank)
        ok = ((digits >= 1) & (digits <= 9)) | (is_blank if allow_blank else False)
        digits[is_blank] = 0
        bad_rows = np.flatnonzero(~ok.all(axis=1))
        if len(bad_rows):
            i = bad_rows[0]
            j = int(np.flatnonzero(~ok[i])[0])
            raise UserError(f"{path}:{line_arr[i]}: {what} has invalid character {chr(raw[i, j])!r} "
                            f"at cell {j + 1}")
        return digits.astype(np.int8)

    p = to_digits(puzzles, "puzzle", allow_blank=True) if n else np.zeros((0, 81), np.int8)
    s = to_digits(solutions, "solution", allow_blank=False) if n else np.zeros((0, 81), np.int8)
    valid = is_valid_solution(p, s) if n else np.zeros(0, bool)
    if n and not valid.all():
        i = int(np.flatnonzero(~valid)[0])
        raise UserError(f"{path}:{line_arr[i]}: the solution is not a valid grid for the puzzle")
    r = np.asarray(ratings, dtype=np.float32) if rcol else np.full(n, np.nan, np.float32)
    if min_difficulty is not None:
        keep = r >= min_difficulty
        p, s, r, line_arr = p[keep], s[keep], r[keep], line_arr[keep]
    return {"puzzles": p, "solutions": s, "difficulty": r, "line": line_arr}


# --------------------------------------------------------------------------------------------------------- task
@dataclass
class SudokuTask(TokenTask):
    """9×9 Sudoku as an 81-token non-causal task; puzzles with exactly one solution.

    Options: `blanks` (empty cells per puzzle; None = minimal puzzles), `min_difficulty` (redraw puzzles rated
    below it), `rating_runs` (randomised solves averaged by the rating).
    """

    blanks: int | None = None
    min_difficulty: float = 0.0
    rating_runs: int = 4

    name = "sudoku"
    causal = False

    def __post_init__(self) -> None:
        if self.blanks is not None:
            check_range("blanks", self.blanks, 0, 64)
        check_range("min_difficulty", self.min_difficulty, 0.0, None, integer=False)
        check_range("rating_runs", self.rating_runs, 1, 1000)
        self.vocab = Vocab(["<pad>"] + [str(d) for d in range(10)])
        self.seq_len = 81

    def options(self) -> dict:
        return dataclass_options(self)

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        rng = make_rng(seed, split)
        n = int(n)
        puzzles = np.zeros((n, 81), np.int64)
        solutions = np.zeros((n, 81), np.int64)
        difficulty = np.zeros(n, np.float64)
        attempts = np.zeros(n, np.int64)
        _generate(rng, n, -1 if self.blanks is None else int(self.blanks), float(self.min_difficulty),
                  int(self.rating_runs), puzzles, solutions, difficulty, attempts)
        return self.from_digits(puzzles, solutions, difficulty)

    @staticmethod
    def from_digits(puzzles: np.ndarray, solutions: np.ndarray, difficulty: np.ndarray | None = None):
        """A batch from digit grids (puzzles [N, 81] with 0 blanks, solutions [N, 81])."""
        p = np.asarray(puzzles).reshape(-1, 81)
        s = np.asarray(solutions).reshape(-1, 81)
        batch = {
            "inputs": digits_to_ids(p),
            "targets": digits_to_ids(s),
            "clues": (p != 0).sum(axis=1).astype(np.int32),
        }
        if difficulty is not None:
            batch["difficulty"] = np.asarray(difficulty, dtype=np.float32)
        return batch

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: whole-board exact match; cell_accuracy_blanks: right digits on the empty cells; valid: the
        predicted board is a valid grid keeping the givens (equals exact match for unique-solution puzzles)."""
        pred = np.asarray(pred)
        targets = np.asarray(batch["targets"])
        inputs = np.asarray(batch["inputs"])
        if pred.shape != targets.shape:
            raise ValueError(f"pred has shape {pred.shape} but targets have shape {targets.shape}")
        blank = inputs == BLANK_ID
        right = pred == targets
        nb = int(blank.sum())
        return {
            "accuracy": float(right.all(axis=1).mean()) if len(pred) else float("nan"),
            "cell_accuracy_blanks": float((right & blank).sum() / nb) if nb else float("nan"),
            "cell_accuracy": token_accuracy(pred, targets),
            "valid": float(is_valid_solution(ids_to_digits(inputs), ids_to_digits(pred)).mean())
            if len(pred) else float("nan"),
        }

    def position_factors(self) -> list[list[int]]:
        """Each cell's row, column and 3×3 box (cells numbered row by row): the three groups whose digits must
        differ."""
        cells = np.arange(81)
        rows, cols = cells // 9, cells % 9
        return [rows.tolist(), cols.tolist(), ((rows // 3) * 3 + cols // 3).tolist()]

    def augment(self, batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """The batch under random validity-preserving symmetries (see `augment`); other arrays are copied."""
        p, s = augment(ids_to_digits(batch["inputs"]), ids_to_digits(batch["targets"]), rng)
        out = dict(batch)
        out["inputs"] = digits_to_ids(p).astype(np.asarray(batch["inputs"]).dtype)
        out["targets"] = digits_to_ids(s).astype(np.asarray(batch["targets"]).dtype)
        return out

    def views(self, inputs: np.ndarray, copies: int, seed: int = 0) -> tuple[np.ndarray, tuple]:
        """Test-time augmentation: the puzzles `inputs` (ids [N, 81]) and `copies` random symmetric copies of each,
        [1 + copies, N, 81] ids (copy 0 the puzzle itself), and the symmetries to map predictions back (`unview`).
        Deterministic in (seed, N)."""
        x = np.asarray(inputs)
        n = len(x)
        rng = np.random.default_rng([seed, n, 0x5D])
        cells, relabel = draw_symmetries(n * copies, rng)
        ident = (np.tile(np.arange(81), (n, 1)), np.tile(np.arange(10), (n, 1)))
        cells = np.concatenate([ident[0], cells])                                  # [(1+K)·N, 81]
        relabel = np.concatenate([ident[1], relabel])                              # [(1+K)·N, 10]
        d = np.tile(ids_to_digits(x), (1 + copies, 1))
        out = digits_to_ids(apply_symmetries(d, cells, relabel)).astype(x.dtype)
        return out.reshape(1 + copies, n, 81), (cells, relabel)

    def unview(self, preds: np.ndarray, symmetries: tuple, scores: np.ndarray | None = None) -> np.ndarray:
        """Predictions on the `views` (ids [1+K, N, 81]) mapped back to the puzzles' frame and voted per cell
        (`vote`; `scores` [1+K, N, 81] break ties): ids [N, 81]."""
        P = np.asarray(preds)
        K1, n = P.shape[:2]
        cells, relabel = symmetries
        back = invert_symmetries(ids_to_digits(P.reshape(K1 * n, 81)), cells, relabel).reshape(K1, n, 81)
        sc = None
        if scores is not None:
            sc = np.empty((K1 * n, 81), np.float64)
            np.put_along_axis(sc, cells, np.asarray(scores, np.float64).reshape(K1 * n, 81), axis=1)
            sc = sc.reshape(K1, n, 81)
        return digits_to_ids(vote(back, sc)).astype(P.dtype)

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        p = ids_to_digits(batch["inputs"][i])
        s = ids_to_digits(batch["targets"][i])
        head = f"clues {int((p != 0).sum())}"
        if "difficulty" in batch and np.isfinite(batch["difficulty"][i]):
            head += f", difficulty {float(batch['difficulty'][i]):.2f}"
        left, right = render(p).splitlines(), render(s).splitlines()
        return head + "\n" + "\n".join(f"{a}    {b}" for a, b in zip(left, right))


# ------------------------------------------------------------------------------------------------------ import
def import_csv(csv_path: str | os.PathLike, layout: str, n_test: int = 1000, n_train: int | None = None,
               seed: int = 0, min_difficulty: float | None = None, test_csv: str | os.PathLike | None = None
               ) -> tuple[SudokuTask, dict[str, dict[str, np.ndarray]], dict]:
    """A public Sudoku CSV (see `LAYOUTS`) as dataset splits: (task, {"train", "test"} batches, provenance).

    Rows are validated by `read_sudoku_csv` (a malformed row is a UserError naming its line), optionally filtered
    by difficulty, de-duplicated by puzzle, shuffled with `seed`, and split into `n_test` test rows and `n_train`
    (default: all the rest) train rows; each batch keeps the file's line numbers. `loopformer.data.write_splits`
    writes the result as a dataset folder.

    test_csv: the test split is that file instead (same layout, every distinct row, e.g. Sudoku-Extreme's test.csv;
    `n_test` is then ignored), and all of `csv_path` is left for training; test puzzles also found in the
    training file are dropped from the training split.
    """
    if min_difficulty is not None and layout in LAYOUTS and LAYOUTS[layout][3] is None:
        raise UserError(f"the {layout} layout has no difficulty column; leave min_difficulty unset")
    data = read_sudoku_csv(csv_path, layout)
    rows_read = int(len(data["line"]))
    if min_difficulty is not None:
        keep = data["difficulty"] >= min_difficulty
        data = {k: v[keep] for k, v in data.items()}
    p, s, r = data["puzzles"], data["solutions"], data["difficulty"]
    _, first = np.unique(p, axis=0, return_index=True)
    first = np.sort(first)
    order = first[np.random.default_rng(seed).permutation(len(first))]
    if test_csv is not None:
        return _import_with_test_file(p, s, r, data["line"], order, test_csv, layout, n_train, min_difficulty,
                                      csv_path, rows_read)
    if n_test > len(order):
        raise UserError(f"{csv_path}: only {len(order)} distinct puzzles, fewer than the {n_test} test puzzles "
                        f"asked for")
    test_idx = order[:n_test]
    rest = order[n_test:]
    if n_train is not None:
        if n_train > len(rest):
            raise UserError(f"{csv_path}: only {len(rest)} puzzles left for training, fewer than the {n_train} "
                            f"asked for")
        rest = rest[:n_train]
    splits = {}
    for split, idx in (("train", rest), ("test", test_idx)):
        batch = SudokuTask.from_digits(p[idx], s[idx], r[idx])
        batch["line"] = data["line"][idx]
        splits[split] = batch
    provenance = {"source": f"import:{layout}", "source_file": os.path.basename(os.fspath(csv_path)),
                  "min_difficulty": min_difficulty, "rows_read": rows_read, "rows_kept": int(len(p))}
    return SudokuTask(), splits, provenance


def _import_with_test_file(p, s, r, lines, order, test_csv, layout, n_train, min_difficulty, csv_path,
                           rows_read) -> tuple[SudokuTask, dict[str, dict[str, np.ndarray]], dict]:
    """`import_csv` with the test split read from its own file (see there)."""
    test = read_sudoku_csv(test_csv, layout, min_difficulty=min_difficulty)
    _, first = np.unique(test["puzzles"], axis=0, return_index=True)
    first = np.sort(first)
    seen = {row.tobytes() for row in test["puzzles"][first]}
    rest = np.array([i for i in order if p[i].tobytes() not in seen], dtype=np.int64)
    if n_train is not None:
        if n_train > len(rest):
            raise UserError(f"{csv_path}: only {len(rest)} puzzles for training, fewer than the {n_train} asked for")
        rest = rest[:n_train]
    train = SudokuTask.from_digits(p[rest], s[rest], r[rest])
    train["line"] = lines[rest]
    tst = SudokuTask.from_digits(test["puzzles"][first], test["solutions"][first], test["difficulty"][first])
    tst["line"] = test["line"][first]
    provenance = {"source": f"import:{layout}", "source_file": os.path.basename(os.fspath(csv_path)),
                  "test_file": os.path.basename(os.fspath(test_csv)), "min_difficulty": min_difficulty,
                  "rows_read": rows_read, "rows_kept": int(len(p))}
    return SudokuTask(), {"train": train, "test": tst}, provenance
