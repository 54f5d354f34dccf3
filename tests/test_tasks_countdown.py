"""Countdown: solvability against an exhaustive Python search, reference solutions, validity, held-out targets."""

import numpy as np
import pytest

from loopformer.errors import UserError
from loopformer.tasks import IGNORE, get_task
from loopformer.tasks.countdown import ANSWER_LEN, PROMPT_LEN


def ref_solvable(nums, target, max_value):
    """Exhaustive search over every way to combine two remaining numbers (any order, any of + - * /)."""
    nums = list(nums)
    if len(nums) == 1:
        return nums[0] == target
    for i in range(len(nums)):
        for j in range(len(nums)):
            if i == j:
                continue
            a, b = nums[i], nums[j]
            rest = [nums[k] for k in range(len(nums)) if k not in (i, j)]
            results = [a + b, a * b]
            if a >= b:
                results.append(a - b)
            if b != 0 and a % b == 0:
                results.append(a // b)
            for r in results:
                if 0 <= r <= max_value and ref_solvable(rest + [r], target, max_value):
                    return True
    return False


def ref_check(tokens, nums, target):
    """Independent check of a written solution 'a op b = c' ×3 '.' (list of strings)."""
    if len(tokens) != 16 or tokens[15] != ".":
        return False
    pool = list(nums)
    last = None
    for s in range(3):
        a, op, b, eq, c = tokens[5 * s:5 * s + 5]
        if eq != "=" or op not in "+-*/":
            return False
        a, b, c = int(a), int(b), int(c)
        ok = {"+": a + b == c, "-": a - b == c and a >= b, "*": a * b == c,
              "/": b != 0 and a % b == 0 and a // b == c}[op]
        if not ok or a not in pool:
            return False
        pool.remove(a)
        if b not in pool:
            return False
        pool.remove(b)
        pool.append(c)
        last = c
    return len(pool) == 1 and last == target


def test_paper_example():
    task = get_task("countdown")
    count, steps = task.solve([58, 84, 48, 62], 96)
    assert count >= 1
    assert steps == [(62, "-", 58, 4), (48, "/", 4, 12), (84, "+", 12, 96)]


def test_solvability_matches_exhaustive_search():
    task = get_task("countdown", max_number=20, min_target=10, max_target=40, max_value=400)
    rng = np.random.default_rng(0)
    seen = {True: 0, False: 0}
    for _ in range(120):
        nums = rng.integers(1, 21, size=4)
        target = int(rng.integers(10, 41))
        count, steps = task.solve(nums, target)
        want = ref_solvable(nums.tolist(), target, 400)
        assert (count > 0) == want
        seen[want] += 1
        if count:
            toks = [str(x) for a, o, b, r in steps for x in (a, o, b, "=", r)] + ["."]
            assert ref_check(toks, nums.tolist(), target)
    assert seen[True] > 10 and seen[False] > 10


def test_generated_rows_and_layout():
    task = get_task("countdown")
    b = task.generate(200, seed=1)
    assert b["inputs"].shape == (200, PROMPT_LEN + ANSWER_LEN) == (200, task.seq_len)
    assert (b["answer_start"] == PROMPT_LEN).all()
    for i in range(200):
        toks = task.vocab.decode(b["inputs"][i])
        nums = [int(t) for t in toks[:4]]
        assert nums == b["numbers"][i].tolist() and int(toks[4]) == b["target"][i]
        assert all(1 <= x <= 99 for x in nums) and 10 <= b["target"][i] <= 100
        assert ref_check(toks[5:], nums, int(toks[4]))
        count, steps = task.solve(nums, int(toks[4]))        # the reference is the first solution found
        assert toks[5:8] == [str(steps[0][0]), steps[0][1], str(steps[0][2])]
        assert count == b["n_solutions"][i]
    t = b["targets"]
    assert (t[:, : PROMPT_LEN - 1] == IGNORE).all() and (t[:, -1] == IGNORE).all()
    assert (t[:, PROMPT_LEN - 1:-1] == b["inputs"][:, PROMPT_LEN:]).all()


def test_held_out_targets():
    task = get_task("countdown")
    assert len(task.test_targets) == 9 and len(task.train_targets) == 82
    assert not set(task.test_targets) & set(task.train_targets)
    train = task.generate(2000, seed=0, split="train")
    test = task.generate(300, seed=0, split="test")
    assert not np.isin(train["target"], task.test_targets).any()
    assert np.isin(test["target"], task.test_targets).all()
    assert len(np.unique(test["target"])) == 9
    other = get_task("countdown", holdout_seed=1)
    assert set(other.test_targets) != set(task.test_targets)
    with pytest.raises(UserError, match="no test split"):
        get_task("countdown", test_fraction=0.0).generate(1, 0, "test")


def _row(task, prompt, answer):
    ids = task.vocab.encode(prompt.split() + answer.split())
    return np.array(ids + [0] * (task.seq_len - len(ids)))[None]


@pytest.mark.parametrize("answer,valid", [
    ("62 - 58 = 4 48 / 4 = 12 84 + 12 = 96 .", True),          # the reference
    ("62 - 58 = 4 48 / 4 = 12 12 + 84 = 96 .", True),          # + written smaller first: still correct
    ("84 - 62 = 22 58 - 48 = 10 22 * 10 = 220 .", False),      # wrong target
    ("62 - 58 = 4 48 / 4 = 12 84 + 12 = 96 =", False),         # no end token
    ("58 - 62 = 4 48 / 4 = 12 84 + 12 = 96 .", False),         # negative step written backwards
    ("62 - 58 = 5 48 / 5 = 12 84 + 12 = 96 .", False),         # wrong arithmetic
    ("62 - 58 = 4 62 / 4 = 12 84 + 12 = 96 .", False),         # 62 used twice
])
def test_validity_hand_made(answer, valid):
    task = get_task("countdown")
    gen = _row(task, "58 84 48 62 96", answer)
    batch = {"answer_start": np.array([5]), "numbers": np.array([[58, 84, 48, 62]]), "target": np.array([96])}
    assert task.validity(gen, batch) == float(valid)
    assert ref_check(answer.split(), [58, 84, 48, 62], 96) == valid


def test_validity_of_alternative_solutions_and_metrics():
    task = get_task("countdown")
    b = task.generate(300, seed=7)
    assert task.validity(b["inputs"], b) == 1.0
    pred = np.where(b["targets"] == IGNORE, 0, b["targets"])
    assert task.metrics(pred, b)["accuracy"] == 1.0
    # an alternative valid solution is not an exact match but is valid
    rows = np.flatnonzero(b["n_solutions"] > 1)
    i = int(rows[0])
    nums, target = b["numbers"][i].tolist(), int(b["target"][i])
    alt = _find_other_solution(nums, target, task.vocab.decode(b["inputs"][i][5:]))
    gen = _row(task, " ".join(map(str, nums + [target])), " ".join(alt))
    one = {k: v[i:i + 1] for k, v in b.items()}
    assert task.validity(gen, one) == 1.0
    pred_alt = np.zeros_like(b["inputs"][i:i + 1])
    pred_alt[0, :-1] = gen[0, 1:]
    assert task.metrics(pred_alt, one)["accuracy"] == 0.0
    # a truncated answer (greedy decoding hit the end) is invalid, not an error
    assert task.validity(b["inputs"][:, :10], b) == 0.0


def _find_other_solution(nums, target, reference):
    import itertools

    for (i, j) in itertools.permutations(range(4), 2):
        a, b = nums[i], nums[j]
        rest = [nums[k] for k in range(4) if k not in (i, j)]
        for op in "+-*/":
            for r1 in _apply(a, b, op):
                for (p, q) in itertools.permutations(range(3), 2):
                    pool = rest + [r1]
                    x, y = pool[p], pool[q]
                    last = [pool[k] for k in range(3) if k not in (p, q)][0]
                    for op2 in "+-*/":
                        for r2 in _apply(x, y, op2):
                            for op3 in "+-*/":
                                for r3 in _apply(max(last, r2), min(last, r2), op3):
                                    if r3 == target:
                                        toks = [str(a), op, str(b), "=", str(r1), str(x), op2, str(y), "=",
                                                str(r2), str(max(last, r2)), op3, str(min(last, r2)), "=",
                                                str(r3), "."]
                                        if toks != reference[:16] and ref_check(toks, nums, target):
                                            return toks
    raise AssertionError("no alternative solution")


def _apply(a, b, op):
    if op == "+":
        return [a + b]
    if op == "*":
        return [a * b] if a * b <= 10000 else []
    if op == "-":
        return [a - b] if a >= b else []
    return [a // b] if b and a % b == 0 else []


def test_small_options_for_cpu_demo():
    task = get_task("countdown", max_number=9, min_target=5, max_target=20, max_value=100)
    assert task.vocab_size == 7 + 101
    b = task.generate(1000, seed=0)
    assert b["numbers"].max() <= 9 and task.validity(b["inputs"], b) == 1.0
    assert "->" in task.decode_row(b, 0)
