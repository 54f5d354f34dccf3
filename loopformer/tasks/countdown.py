"""Countdown (paper Sec. 5.1.1, App. C.1.1; the game of Gandhi et al. 2024 with 4 input numbers).

A puzzle is 4 numbers (uniform in 1..`max_number`, paper 99) and a target (uniform in `min_target`..`max_target`,
paper 10..100); target and numbers are redrawn together until a solution exists. A solution is three steps; each
step takes two of the numbers still available and replaces them by their result:

    larger + smaller,   larger − smaller,   larger × smaller,   larger / smaller (only when exact)

every intermediate result must lie in 0..`max_value` (one vocabulary token per number), and the last result must
be the target. A seeded `test_fraction` (10 %) of the targets is held out: the 'train' split only uses the other
targets and the 'test' split only the held-out ones, so no test target is ever seen in training.

Layout (causal, T = 21), as in the paper's example:

    58 84 48 62 96 | 62 - 58 = 4 48 / 4 = 12 84 + 12 = 96 .
    ----prompt----   ----------------answer (16 tokens)-----------

(`|` only marks the boundary here; it is not a token). The reference answer is the first solution in a fixed
search order (pairs of input positions in order, then + − × /), so it is a function of the prompt. Metrics: exact
match against the reference (teacher forced; 'accuracy') and `validity` — any correct three-step solution using
each input number once — for model-generated answers (greedy decoding), since puzzles often have several
solutions. Vocabulary: 0 <pad>, 1 '.', 2 '+', 3 '-', 4 '*', 5 '/', 6 '=', then the numbers 0..max_value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from loopformer.errors import UserError
from loopformer.tasks.base import TokenTask, Vocab
from loopformer.tasks.common import (
    answer_region,
    causal_targets,
    check_range,
    dataclass_options,
    exact_match,
    make_rng,
    split_id,
    token_accuracy,
)

PAD, EOS, PLUS, MINUS, TIMES, DIV, EQ = 0, 1, 2, 3, 4, 5, 6
NUM0 = 7
OP_IDS = np.array([PLUS, MINUS, TIMES, DIV], dtype=np.int64)
OP_SYMBOLS = "+-*/"
PROMPT_LEN = 5
ANSWER_LEN = 16        # 3 × (a op b = c) + '.'
SEQ_LEN = PROMPT_LEN + ANSWER_LEN


@numba.njit(cache=True)
def _apply(a, b, op):
    """Result of `larger op smaller` (op 0..3 = + - * /), or -1 when the step is not allowed."""
    hi = a if a >= b else b
    lo = b if a >= b else a
    if op == 0:
        return hi + lo
    if op == 1:
        return hi - lo
    if op == 2:
        return hi * lo
    if lo != 0 and hi % lo == 0:
        return hi // lo
    return -1


@numba.njit(cache=True)
def _combine(src, m, i, j, r, out):
    """out <- the m-2 entries of src[:m] other than i and j, then r (the pool after one step)."""
    k = 0
    for q in range(m):
        if q != i and q != j:
            out[k] = src[q]
            k += 1
    out[k] = r


@numba.njit(cache=True)
def _record(steps, row, x, y, op, r):
    steps[row, 0] = max(x, y)
    steps[row, 1] = op
    steps[row, 2] = min(x, y)
    steps[row, 3] = r


@numba.njit(cache=True)
def solve_nb(nums, target, max_value, steps):
    """Count the three-step solutions of (nums[4], target); the first (in search order) goes to steps [3, 4]
    as rows (larger, op, smaller, result)."""
    count = 0
    cur3 = np.empty(3, np.int64)
    cur2 = np.empty(2, np.int64)
    for i in range(4):
        for j in range(i + 1, 4):
            for op1 in range(4):
                r1 = _apply(nums[i], nums[j], op1)
                if r1 < 0 or r1 > max_value:
                    continue
                _combine(nums, 4, i, j, r1, cur3)
                for a in range(3):
                    for b in range(a + 1, 3):
                        for op2 in range(4):
                            r2 = _apply(cur3[a], cur3[b], op2)
                            if r2 < 0 or r2 > max_value:
                                continue
                            _combine(cur3, 3, a, b, r2, cur2)
                            for op3 in range(4):
                                r3 = _apply(cur2[0], cur2[1], op3)
                                if r3 != target:
                                    continue
                                count += 1
                                if count == 1:
                                    _record(steps, 0, nums[i], nums[j], op1, r1)
                                    _record(steps, 1, cur3[a], cur3[b], op2, r2)
                                    _record(steps, 2, cur2[0], cur2[1], op3, r3)
    return count


@numba.njit(cache=True)
def _generate(rng, n, targets_pool, max_number, max_value, rows, numbers, target, n_solutions):
    nums = np.empty(4, np.int64)
    steps = np.empty((3, 4), np.int64)
    for i in range(n):
        while True:
            tg = targets_pool[rng.integers(0, targets_pool.shape[0])]
            for k in range(4):
                nums[k] = rng.integers(1, max_number + 1)
            c = solve_nb(nums, tg, max_value, steps)
            if c > 0:
                break
        n_solutions[i] = c
        target[i] = tg
        for k in range(4):
            numbers[i, k] = nums[k]
            rows[i, k] = NUM0 + nums[k]
        rows[i, 4] = NUM0 + tg
        p = 5
        for s in range(3):
            rows[i, p] = NUM0 + steps[s, 0]
            rows[i, p + 1] = OP_IDS[steps[s, 1]]
            rows[i, p + 2] = NUM0 + steps[s, 2]
            rows[i, p + 3] = EQ
            rows[i, p + 4] = NUM0 + steps[s, 3]
            p += 5
        rows[i, p] = EOS


@numba.njit(cache=True)
def _check(answers, numbers, target, max_value):
    """[N] bool: answers [N, 16] token ids form a valid three-step solution for (numbers[N, 4], target[N])."""
    n = answers.shape[0]
    ok = np.zeros(n, np.bool_)
    pool = np.empty(5, np.int64)
    for i in range(n):
        for k in range(4):
            pool[k] = numbers[i, k]
        size = 4
        good = True
        last = -1
        for s in range(3):
            ta = answers[i, 5 * s]
            to = answers[i, 5 * s + 1]
            tb = answers[i, 5 * s + 2]
            te = answers[i, 5 * s + 3]
            tc = answers[i, 5 * s + 4]
            if ta < NUM0 or tb < NUM0 or tc < NUM0 or te != EQ or to < PLUS or to > DIV:
                good = False
                break
            a, b, c = ta - NUM0, tb - NUM0, tc - NUM0
            op = to - PLUS
            if op == 1 or op == 3:                   # − and / are written larger first
                if a < b:
                    good = False
                    break
            if _apply(a, b, op) != c or c > max_value:
                good = False
                break
            # remove a and b from the pool (a multiset), add c
            ia = -1
            for k in range(size):
                if pool[k] == a:
                    ia = k
                    break
            if ia < 0:
                good = False
                break
            pool[ia] = pool[size - 1]
            size -= 1
            ib = -1
            for k in range(size):
                if pool[k] == b:
                    ib = k
                    break
            if ib < 0:
                good = False
                break
            pool[ib] = pool[size - 1]
            size -= 1
            pool[size] = c
            size += 1
            last = c
        if good and size == 1 and last == target[i] and answers[i, 15] == EOS:
            ok[i] = True
    return ok


@dataclass
class CountdownTask(TokenTask):
    """Countdown with 4 numbers: reach the target with three arithmetic steps."""

    max_number: int = 99
    min_target: int = 10
    max_target: int = 100
    max_value: int = 10000
    test_fraction: float = 0.1
    holdout_seed: int = 0

    name = "countdown"
    causal = True

    def __post_init__(self) -> None:
        check_range("max_number", self.max_number, 1, 100000)
        check_range("min_target", self.min_target, 0, None)
        check_range("max_target", self.max_target, self.min_target, None)
        check_range("max_value", self.max_value, max(self.max_number, self.max_target), 1_000_000)
        check_range("test_fraction", self.test_fraction, 0.0, 0.9, integer=False)
        check_range("holdout_seed", self.holdout_seed, 0, None)
        self.vocab = Vocab(["<pad>", ".", "+", "-", "*", "/", "="] + [str(i) for i in range(self.max_value + 1)])
        self.seq_len = SEQ_LEN
        all_targets = np.arange(self.min_target, self.max_target + 1)
        n_test = int(round(self.test_fraction * len(all_targets)))
        if self.test_fraction > 0:
            n_test = max(1, n_test)
        if n_test >= len(all_targets):
            raise UserError("test_fraction leaves no training targets; widen min_target..max_target")
        held = np.random.default_rng(self.holdout_seed).choice(all_targets, size=n_test, replace=False)
        self.test_targets = np.sort(held).astype(np.int64)
        self.train_targets = np.setdiff1d(all_targets, self.test_targets).astype(np.int64)

    def options(self) -> dict:
        return dataclass_options(self)

    def targets_for(self, split: str) -> np.ndarray:
        """The targets a split draws from: held-out ones for 'test', the others otherwise."""
        if split_id(split) == 1:
            if len(self.test_targets) == 0:
                raise UserError("test_fraction=0 holds out no targets, so there is no test split")
            return self.test_targets
        return self.train_targets

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        rng = make_rng(seed, split)
        n = int(n)
        rows = np.zeros((n, SEQ_LEN), np.int32)
        numbers = np.zeros((n, 4), np.int64)
        target = np.zeros(n, np.int64)
        n_solutions = np.zeros(n, np.int64)
        _generate(rng, n, self.targets_for(split), self.max_number, self.max_value, rows, numbers, target,
                  n_solutions)
        start = np.full(n, PROMPT_LEN, np.int64)
        length = np.full(n, SEQ_LEN, np.int64)
        return {
            "inputs": rows,
            "targets": causal_targets(rows, start, length),
            "answer_start": start.astype(np.int32),
            "length": length.astype(np.int32),
            "numbers": numbers.astype(np.int32),
            "target": target.astype(np.int32),
            "n_solutions": n_solutions.astype(np.int32),
        }

    def solve(self, numbers, target: int) -> tuple[int, list[tuple[int, str, int, int]]]:
        """(number of solutions, the reference solution as [(larger, op, smaller, result)] or [] if none)."""
        nums = np.asarray(numbers, dtype=np.int64)
        if nums.shape != (4,):
            raise UserError("countdown needs exactly 4 numbers")
        steps = np.zeros((3, 4), np.int64)
        c = int(solve_nb(nums, int(target), self.max_value, steps))
        return c, ([(int(a), OP_SYMBOLS[int(o)], int(b), int(r)) for a, o, b, r in steps] if c else [])

    def valid_rows(self, generated: np.ndarray, batch: dict[str, np.ndarray]) -> np.ndarray:
        """[N] bool: the answer in `generated` is a correct three-step solution (each input number used once,
        every step exact, the last result the target, then '.'). `generated` [N, T'] holds whole sequences —
        the prompt followed by the model's tokens — as greedy decoding returns them; the answer is read from
        `batch['answer_start']`. Commutative steps (+, ×) may be written in either order."""
        gen = np.asarray(generated).astype(np.int64)
        ans = answer_region(gen, np.asarray(batch["answer_start"]).astype(np.int64), ANSWER_LEN)
        return _check(ans, np.asarray(batch["numbers"]).astype(np.int64),
                      np.asarray(batch["target"]).astype(np.int64), self.max_value)

    def validity(self, generated: np.ndarray, batch: dict[str, np.ndarray]) -> float:
        """Fraction of rows whose generated answer is a valid solution (see `valid_rows`)."""
        ok = self.valid_rows(generated, batch)
        return float(ok.mean()) if len(ok) else float("nan")

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: teacher-forced exact match with the reference solution; first_step_accuracy: the first step
        right; token_accuracy over the answer tokens."""
        pred = np.asarray(pred)
        targets = np.asarray(batch["targets"])
        first = exact_match(pred[:, : PROMPT_LEN + 4], targets[:, : PROMPT_LEN + 4])
        return {
            "accuracy": float(exact_match(pred, targets).mean()) if len(pred) else float("nan"),
            "first_step_accuracy": float(first.mean()) if len(pred) else float("nan"),
            "token_accuracy": token_accuracy(pred, targets),
        }

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        row = np.asarray(batch["inputs"][i])
        toks = [t for t in self.vocab.decode(row) if t != "<pad>"]
        prompt, answer = toks[:PROMPT_LEN], toks[PROMPT_LEN:]
        steps = [" ".join(answer[k:k + 5]) for k in range(0, 15, 5)]
        text = f"{' '.join(prompt[:4])} -> {prompt[4]}:  " + ",  ".join(steps)
        if "n_solutions" in batch:
            text += f"   ({int(batch['n_solutions'][i])} solutions)"
        return text
