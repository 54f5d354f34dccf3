"""Sudoku: generator against an independent pure-Python solution counter, validator, augmentation, loaders."""

import hashlib
import os

import numpy as np
import pytest

from loopformer.errors import UserError
from loopformer.tasks import get_task
from loopformer.tasks.sudoku import (
    SudokuTask,
    augment,
    count_solutions,
    ids_to_digits,
    is_valid_solution,
    rate,
    read_sudoku_csv,
    solve,
)

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
HARD = "8..........36......7..9.2...5...7.......457.....1...3...1....68..85...1..9....4.."
CLASSIC = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"


def ref_count(grid, limit=2):
    """Count solutions with plain Python sets (fewest-candidates-first backtracking), up to `limit`."""
    g = [int(v) for v in np.asarray(grid).reshape(81)]

    def cands(c):
        r, k = divmod(c, 9)
        used = {g[r * 9 + j] for j in range(9)} | {g[i * 9 + k] for i in range(9)}
        br, bk = r // 3 * 3, k // 3 * 3
        used |= {g[(br + i) * 9 + bk + j] for i in range(3) for j in range(3)}
        return [d for d in range(1, 10) if d not in used]

    for c in range(81):           # givens must not clash
        if g[c]:
            v, g[c] = g[c], 0
            if v not in cands(c):
                return 0
            g[c] = v

    def rec(budget):
        empties = [c for c in range(81) if g[c] == 0]
        if not empties:
            return 1
        best = min(empties, key=lambda c: len(cands(c)))
        total = 0
        for d in cands(best):
            g[best] = d
            total += rec(budget - total)
            g[best] = 0
            if total >= budget:
                break
        return total

    return rec(limit)


def parse(s):
    return np.array([0 if ch == "." else int(ch) for ch in s])


def test_solver_matches_reference_on_known_puzzles():
    classic = parse(CLASSIC)
    assert count_solutions(classic) == 1 == ref_count(classic)
    sol = solve(classic)
    assert is_valid_solution(classic[None], sol[None])[0]
    assert sol[:9].tolist() == [5, 3, 4, 6, 7, 8, 9, 1, 2]
    loose = classic.copy()
    loose[[0, 1, 4, 9, 12, 13]] = 0             # several clues gone: more solutions, counted alike
    assert count_solutions(loose, 50) == ref_count(loose, 50) >= 2
    bad = classic.copy()
    bad[2] = 5                                  # clash in row 0
    assert count_solutions(bad) == 0 == ref_count(bad)
    assert count_solutions(np.zeros(81), 3) == 3
    hard = parse(HARD)                          # a famously hard 21-clue puzzle (too slow for the reference)
    assert count_solutions(hard) == 1
    assert is_valid_solution(hard[None], solve(hard)[None])[0]


def test_generated_puzzles_are_unique_and_consistent():
    task = get_task("sudoku", blanks=40)
    b = task.generate(6, seed=0)
    assert b["inputs"].shape == (6, 81) and b["targets"].shape == (6, 81)
    p, s = ids_to_digits(b["inputs"]), ids_to_digits(b["targets"])
    assert ((p == 0).sum(axis=1) == 40).all() and (b["clues"] == 41).all()
    assert is_valid_solution(p, s).all()
    for i in range(6):
        assert ref_count(p[i]) == 1


def test_minimal_puzzles_are_minimal():
    task = get_task("sudoku")                   # blanks=None: remove clues until none can go
    b = task.generate(2, seed=3)
    p = ids_to_digits(b["inputs"])
    for i in range(2):
        assert 17 <= b["clues"][i] <= 32
        for c in np.flatnonzero(p[i]):
            q = p[i].copy()
            q[c] = 0
            assert count_solutions(q) == 2


def test_difficulty_rating():
    full = solve(parse(HARD))
    assert rate(full) == 0.0
    easy = full.copy()
    easy[[0, 10, 20, 30]] = 0                   # four holes: naked singles finish it
    assert rate(easy) == 0.0
    assert rate(parse(HARD), runs=16) > 3.0
    task = get_task("sudoku", min_difficulty=2.0)
    b = task.generate(3, seed=1)
    assert (b["difficulty"] >= 2.0).all()


def test_validator_hand_made():
    hard = parse(HARD)
    sol = solve(hard).astype(np.int64)
    assert is_valid_solution(hard[None], sol[None])[0]
    swapped = sol.copy()
    blanks_row0 = [c for c in range(9) if hard[c] == 0][:2]
    swapped[blanks_row0] = swapped[blanks_row0[::-1]]      # same row, so columns break
    assert not is_valid_solution(hard[None], swapped[None])[0]
    other = sol.copy()
    other[0] = 0
    assert not is_valid_solution(hard[None], other[None])[0]
    changed_given = sol.copy()
    puzzle = hard.copy()
    puzzle[0] = (sol[0] % 9) + 1                            # a "given" the solution does not keep
    assert not is_valid_solution(puzzle[None], changed_given[None])[0]


def test_augmentation_keeps_validity_and_solution():
    b = get_task("sudoku", blanks=45).generate(8, seed=4)
    p, s = ids_to_digits(b["inputs"]), ids_to_digits(b["targets"])
    p2, s2 = augment(p, s, np.random.default_rng(0))
    assert is_valid_solution(p2, s2).all()
    assert ((p2 != 0).sum(1) == (p != 0).sum(1)).all()
    assert (p2 != p).any(axis=1).sum() >= 7
    for i in range(3):
        assert count_solutions(p2[i]) == 1 and (solve(p2[i]) == s2[i]).all()
    task = SudokuTask()
    aug = task.augment(b, np.random.default_rng(1))
    assert aug["inputs"].dtype == b["inputs"].dtype
    assert is_valid_solution(ids_to_digits(aug["inputs"]), ids_to_digits(aug["targets"])).all()


def test_metrics_hand_made():
    task = SudokuTask()
    b = task.generate(4, seed=2)
    pred = b["targets"].copy()
    blank_cells = np.flatnonzero(b["inputs"][0] == 1)
    pred[0, blank_cells[0]] = (pred[0, blank_cells[0]] - 1) % 9 + 2     # one wrong digit in board 0
    m = task.metrics(pred, b)
    nb = int((b["inputs"] == 1).sum())
    assert m["accuracy"] == pytest.approx(3 / 4)
    assert m["cell_accuracy_blanks"] == pytest.approx((nb - 1) / nb)
    assert m["cell_accuracy"] == pytest.approx(1 - 1 / (4 * 81))
    assert m["valid"] == pytest.approx(3 / 4)
    assert "clues" in task.decode_row(b, 0)


@pytest.mark.parametrize("layout,n", [("radcliffe", 12), ("extreme", 10), ("kaggle", 8)])
def test_loaders_read_fixtures(layout, n):
    data = read_sudoku_csv(os.path.join(FIX, f"sudoku_{layout}.csv"), layout)
    assert data["puzzles"].shape == (n, 81) and data["solutions"].shape == (n, 81)
    assert is_valid_solution(data["puzzles"], data["solutions"]).all()
    assert data["line"][0] == 2
    for i in range(2):
        assert count_solutions(data["puzzles"][i]) == 1


def test_loader_difficulty_filter():
    path = os.path.join(FIX, "sudoku_radcliffe.csv")
    allrows = read_sudoku_csv(path, "radcliffe")
    hard = read_sudoku_csv(path, "radcliffe", min_difficulty=1.5)
    assert len(hard["puzzles"]) == int((allrows["difficulty"] >= 1.5).sum()) < len(allrows["puzzles"])
    with pytest.raises(UserError, match="no difficulty"):
        read_sudoku_csv(os.path.join(FIX, "sudoku_kaggle.csv"), "kaggle", min_difficulty=1.0)


def _corrupt(tmp_path, lineno, fn):
    lines = open(os.path.join(FIX, "sudoku_radcliffe.csv")).read().splitlines()
    lines[lineno - 1] = fn(lines[lineno - 1])
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("fn,msg", [
    (lambda l: l + ",extra", "expected 5 fields"),
    (lambda l: l.replace(l.split(",")[1], l.split(",")[1][:-1]), "80 cells"),
    (lambda l: l.replace(l.split(",")[1], "x" + l.split(",")[1][1:]), "invalid character 'x'"),
    (lambda l: ",".join([*l.split(",")[:2], l.split(",")[2][::-1], *l.split(",")[3:]]), "not a valid grid"),
    (lambda l: ",".join([*l.split(",")[:4], "hard"]), "not a number"),
])
def test_loader_reports_malformed_line(tmp_path, fn, msg):
    path = _corrupt(tmp_path, 5, fn)
    with pytest.raises(UserError, match=rf"bad.csv:5: .*{msg}"):
        read_sudoku_csv(path, "radcliffe")


def test_loader_header_and_missing(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_sudoku_csv(tmp_path / "nope.csv", "kaggle")
    with pytest.raises(UserError, match="lacks column"):
        read_sudoku_csv(os.path.join(FIX, "sudoku_kaggle.csv"), "radcliffe")

def _digest(batch: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(np.ascontiguousarray(batch[k]).tobytes())
    return h.hexdigest()[:16]


def test_sudoku_generation_and_rating_are_pinned():
    """A seed gives the same puzzles and ratings from one version to the next (the rating's random guesses draw
    from the generator's stream, so a change in the order of its draws changes the data, not only the ratings)."""
    b = SudokuTask(blanks=40, min_difficulty=0.5, rating_runs=3).generate(4, 0)
    assert _digest(b) == "8daaa120203e4edc"
    assert np.allclose(b["difficulty"], [5 / 3, 5 / 3, 4 / 3, 1.0])
    first = ids_to_digits(b["inputs"][0])
    assert [rate(first, runs, seed) for runs, seed in ((1, 0), (8, 0), (8, 5))] == [2.0, 1.375, 1.625]
    assert [rate(ids_to_digits(p), 8, 1) for p in b["inputs"]] == [1.625, 1.625, 1.375, 1.625]
    assert rate(np.zeros(81), runs=4, seed=0) == 46.75                   # the blank grid: guesses all the way
