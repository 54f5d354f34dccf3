"""Edit distance and LCS: generators against independent references (memoised recursion, brute force)."""

import hashlib
import heapq
import itertools
from functools import cache

import numpy as np
import pytest

from loopformer.errors import UserError
from loopformer.tasks import IGNORE, get_task
from loopformer.tasks.pairs import LETTERS


# ------------------------------------------------------------------------------------------------ references
def ref_edit_distance(a: str, b: str, ins=2, dele=2, rep=3) -> int:
    @cache
    def d(i, j):
        if i == 0:
            return j * ins
        if j == 0:
            return i * dele
        return min(d(i - 1, j) + dele, d(i, j - 1) + ins, d(i - 1, j - 1) + (0 if a[i - 1] == b[j - 1] else rep))

    return d(len(a), len(b))


def dijkstra_edit_cost(a: str, b: str, ins=2, dele=2, rep=3) -> int:
    """Cheapest sequence of single edits turning a into b, by search over strings (tiny inputs only)."""
    alphabet = sorted(set(a) | set(b))
    limit = max(len(a), len(b)) + 1
    dist = {a: 0}
    heap = [(0, a)]
    while heap:
        c, s = heapq.heappop(heap)
        if s == b:
            return c
        if c > dist[s]:
            continue
        nxt = []
        for p in range(len(s)):
            nxt.append((s[:p] + s[p + 1:], dele))
            for ch in alphabet:
                if ch != s[p]:
                    nxt.append((s[:p] + ch + s[p + 1:], rep))
        if len(s) < limit:
            for p in range(len(s) + 1):
                for ch in alphabet:
                    nxt.append((s[:p] + ch + s[p:], ins))
        for t, w in nxt:
            if c + w < dist.get(t, 1 << 30):
                dist[t] = c + w
                heapq.heappush(heap, (c + w, t))
    raise AssertionError("unreachable")


def brute_lcs(a: str, b: str) -> int:
    def is_subseq(sub, s):
        it = iter(s)
        return all(ch in it for ch in sub)

    for k in range(min(len(a), len(b)), -1, -1):
        for idx in itertools.combinations(range(len(a)), k):
            if is_subseq("".join(a[i] for i in idx), b):
                return k
    return 0


def split_row(task, batch, i):
    toks = task.vocab.decode(batch["inputs"][i][: batch["length"][i]])
    bar = toks.index("|")
    sep = toks.index("<sep>")
    return "".join(toks[:bar]), "".join(toks[bar + 1:sep]), int(toks[sep + 1]), toks[sep + 2]


# ------------------------------------------------------------------------------------------------------- tests
def test_edit_distance_dp_matches_search_on_tiny_pairs():
    task = get_task("edit_distance", length=4)
    rng = np.random.default_rng(0)
    for _ in range(25):
        a = "".join(rng.choice(list("abc"), size=rng.integers(1, 4)))
        b = "".join(rng.choice(list("abc"), size=rng.integers(1, 4)))
        assert task.solve(a, b) == dijkstra_edit_cost(a, b) == ref_edit_distance(a, b)


@pytest.mark.parametrize("length,amax", [(8, 4), (20, 26)])
def test_edit_distance_samples(length, amax):
    task = get_task("edit_distance", length=length, alphabet_max=amax)
    batch = task.generate(300, seed=1)
    assert batch["inputs"].shape == (300, 2 * length + 6) == (300, task.seq_len)
    for i in range(300):
        s1, s2, ans, eos = split_row(task, batch, i)
        assert eos == "<eos>"
        assert ans == ref_edit_distance(s1, s2) == batch["answer"][i]
        assert len(s1) <= len(s2) and s1 != s2
        assert length in (len(s1), len(s2))
        assert all(length - 3 <= len(s) <= length + 2 for s in (s1, s2))
        assert len(set(s1 + s2)) <= amax
        assert ans <= task.max_answer
    # both branches occur: near copies (small distance) and random pairs
    assert (batch["answer"] <= 3 * 2).any() and (batch["answer"] > length).any()


def test_lcs_samples_against_brute_force():
    task = get_task("lcs", length=7, alphabet_max=4)
    batch = task.generate(150, seed=2)
    assert batch["inputs"].shape == (150, 18)
    lens = set()
    for i in range(150):
        s1, s2, ans, eos = split_row(task, batch, i)
        assert eos == "<eos>" and ans == brute_lcs(s1, s2) == batch["answer"][i]
        assert 7 in (len(s1), len(s2)) and min(len(s1), len(s2)) >= 4
        lens.add((len(s1), len(s2)))
    # the swap puts the edited (possibly shorter) string first about half the time
    assert any(a < b for a, b in lens) and any(a > b for a, b in lens)


def test_lcs_paper_setting_two_uniform_strings():
    task = get_task("lcs", length=30, p_random=1.0)
    batch = task.generate(50, seed=0)
    assert (batch["len1"] == 30).all() and (batch["len2"] == 30).all()
    for i in range(5):
        s1, s2, ans, _ = split_row(task, batch, i)
        assert ans == _lcs_table(s1, s2)


def _lcs_table(a, b):
    t = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            t[i + 1][j + 1] = t[i][j] + 1 if x == y else max(t[i][j + 1], t[i + 1][j])
    return t[-1][-1]


@pytest.mark.parametrize("name", ["edit_distance", "lcs"])
def test_causal_layout_and_metrics(name):
    task = get_task(name, length=10)
    b = task.generate(64, seed=5)
    inputs, targets = b["inputs"], b["targets"]
    for i in range(64):
        s, n = b["answer_start"][i], b["length"][i]
        row = targets[i]
        assert (row[: s - 1] == IGNORE).all() and (row[n - 1:] == IGNORE).all()
        assert (row[s - 1:n - 1] == inputs[i, s:n]).all()
        assert (inputs[i, n:] == 0).all() and (inputs[i, :n] != 0).all()
    pred = np.where(targets == IGNORE, 0, targets)
    m = task.metrics(pred, b)
    assert m["accuracy"] == 1.0 and m["answer_mae"] == 0.0
    # break the answer of the first 16 rows by +1, the <eos> of the next 16
    pred2 = pred.copy()
    rows = np.arange(16)
    pred2[rows, b["answer_start"][rows] - 1] += 1
    pred2[rows + 16, b["answer_start"][rows + 16]] = 3
    m2 = task.metrics(pred2, b)
    assert m2["accuracy"] == pytest.approx(32 / 64)
    assert m2["answer_accuracy"] == pytest.approx(48 / 64)
    assert m2["answer_mae"] == pytest.approx(16 / 64)


def test_determinism_and_split_streams():
    task = get_task("edit_distance", length=12)
    a, b = task.generate(50, 3), task.generate(50, 3)
    c = task.generate(50, 3, "test")
    assert all((a[k] == b[k]).all() for k in a)
    assert not (a["inputs"] == c["inputs"]).all()


def test_encode_and_decode():
    task = get_task("edit_distance", length=6)
    b = task.encode("abc", "abd")
    assert b["answer"][0] == 3
    assert task.decode_row(b, 0) == "abc | abd  ->  3"
    lcs = get_task("lcs", length=8)
    assert lcs.encode("abcbdab", "bdcaba")["answer"][0] == 4
    with pytest.raises(UserError, match="not a letter"):
        task.encode("ab1", "abc")
    with pytest.raises(UserError, match="too long"):
        get_task("lcs", length=6).encode("abcbdab", "bdcaba")


@pytest.mark.parametrize("name", ["edit_distance", "lcs"])
def test_alphabet_pool_restricts_the_letters(name):
    task = get_task(name, length=9, alphabet_min=2, alphabet_max=3, alphabet_pool=4)
    batch = task.generate(300, seed=5)
    used = set()
    for i in range(300):
        s1, s2, ans, _ = split_row(task, batch, i)
        assert len(set(s1 + s2)) <= 3
        used |= set(s1 + s2)
        ref = ref_edit_distance(s1, s2) if name == "edit_distance" else brute_lcs(s1, s2)
        assert ans == ref
    assert used == set("abcd")          # every letter of the pool occurs, none outside it
    # the default pool (all 26 letters) draws exactly the bytes the generator drew before the option existed
    full = get_task(name, length=9, alphabet_min=2, alphabet_max=5).generate(50, seed=1)["inputs"]
    digest = hashlib.sha256(np.ascontiguousarray(full).tobytes()).hexdigest()[:16]
    assert digest == {"edit_distance": "50746fac05f35a9d", "lcs": "2d7a9f268a392995"}[name]


def test_options_are_validated():
    with pytest.raises(UserError, match="alphabet_max"):
        get_task("edit_distance", alphabet_max=27)
    with pytest.raises(UserError, match="alphabet_max"):
        get_task("lcs", alphabet_max=5, alphabet_pool=4)
    with pytest.raises(UserError, match="alphabet_pool"):
        get_task("lcs", alphabet_pool=0)
    with pytest.raises(UserError, match="unknown option"):
        get_task("lcs", lenght=5)
    with pytest.raises(UserError, match="unknown task"):
        get_task("knapsack")
    assert set(LETTERS) == set("abcdefghijklmnopqrstuvwxyz")
