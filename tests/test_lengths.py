"""Length generalisation: the variable-size tasks against brute force, the word problem with variable lengths, loop
rules T(n) by hand, training with a loop count per row from its size, and `eval --lengths` (table, JSON, plot,
refusals)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.eval.lengths import parse_lengths
from loopformer.model import LoopedTransformer
from loopformer.model.config import ModelConfig
from loopformer.model.io import load, resolve_checkpoint
from loopformer.model.lengths import LoopRule, jitter
from loopformer.model.options import LoopOptions
from loopformer.sources import TaskConfig, make_data
from loopformer.tasks import IGNORE, get_task
from loopformer.tasks.common import causal_targets
from loopformer.tasks.word_problem import group_elements
from loopformer.train.config import load_run_config
from loopformer.train.distributed import setup, teardown
from loopformer.train.trainer import Trainer, train


# ----------------------------------------------------------------------------------------------- brute force
def _bits_value(bits: list[str]) -> int:
    """A binary number written least significant bit first."""
    return sum(int(b) << i for i, b in enumerate(bits))


def _reference(name: str, options: dict, problem: list[str], n: int) -> list[str]:
    """The answer of one row from its problem tokens, with Python integers and lists."""
    if name == "parity":
        assert len(problem) == n
        return [str(sum(map(int, problem)) % 2)]
    if name == "copy":
        assert len(problem) == n
        return problem[::-1] if options.get("reverse") else list(problem)
    if name == "addition":
        assert len(problem) == 2 * n + 1 and problem[n] == "+"
        s = _bits_value(problem[:n]) + _bits_value(problem[n + 1:])
        return [str((s >> i) & 1) for i in range(n + 1)]
    if name == "binary_sum":
        count = sum(map(int, problem))
        return [str((count >> i) & 1) for i in range(n.bit_length())]
    raise AssertionError(name)


CASES = [("parity", {}), ("copy", {}), ("copy", {"reverse": True, "alphabet": 5}), ("addition", {}),
         ("binary_sum", {})]


@pytest.mark.parametrize("name,options", CASES)
def test_answers_match_brute_force_at_every_size(name, options):
    task = get_task(name, length=9, min_length=1, **options)
    b = task.generate(600, seed=3, split="train")
    assert set(np.unique(b["size"])) == set(range(1, 10))           # every size drawn
    for i in range(len(b["inputs"])):
        n, start, end = int(b["size"][i]), int(b["answer_start"][i]), int(b["length"][i])
        toks = task.vocab.decode(b["inputs"][i])
        assert toks[start - 1] == "=" and toks[end - 1] == "<eos>"
        assert all(t == "<pad>" for t in toks[end:])                 # padded at the end only
        assert toks[0] == "<bos>" and toks[start:end - 1] == _reference(name, options, toks[1:start - 1], n)
    assert np.array_equal(b["targets"], causal_targets(b["inputs"], b["answer_start"], b["length"]))
    assert b["inputs"].shape[1] == task.seq_len


@pytest.mark.parametrize("name,options", CASES)
def test_fixed_size_rows_and_disjoint_deterministic_splits(name, options):
    task = get_task(name, length=7, **options)
    train, test = task.generate(400, 0, "train"), task.generate(200, 0, "test")
    assert (train["size"] == 7).all() and (test["size"] == 7).all()
    seen = {r.tobytes() for r in train["inputs"]}
    assert not any(r.tobytes() in seen for r in test["inputs"])
    again = task.generate(400, 0, "train")
    assert all(np.array_equal(train[k], again[k]) for k in train)
    assert task.metrics(train["targets"], train) == {"accuracy": 1.0, "token_accuracy": 1.0}
    wrong = train["targets"].copy()
    wrong[0, train["answer_start"][0] - 1] = 0
    assert task.metrics(wrong, train)["accuracy"] == pytest.approx(1 - 1 / 400)


def _scan_reference(name: str, toks: list[str], n: int, K: int, every: bool = False) -> list[list[str | None]]:
    """The read-out's targets after loops 1..K of a one-step scan, simulated token by token: each loop every
    position takes its left neighbour's content (copy: a shift register) or XORs its own bit into it (parity:
    the parity of the window p − j .. p); a position is supervised where the final answer is read and the scan
    has brought a symbol (copy) or any bits (parity) there; from loop n on, the final targets. None: IGNORE."""
    T = len(toks)
    final = [toks[p + 1] if p + 1 < T and toks[p] != "<pad>" and "=" in toks[:p + 1] and toks[p + 1] != "<pad>"
             else None for p in range(T)]
    out = []
    if name == "copy":
        state = [t if p <= n else None for p, t in enumerate(toks)]    # the problem; the answer is blank
        for j in range(1, K + 1):
            state = [None] + state[:-1]                               # one position to the right
            if j >= n:
                out.append(final)
                continue
            out.append([state[p] if final[p] is not None and final[p] != "<eos>" and state[p] not in
                        (None, "=", "<bos>", "<pad>") else None for p in range(T)])
        return out
    state = [0] * T
    bit = [int(t) if t in ("0", "1") and p <= n else 0 for p, t in enumerate(toks)]
    state = bit                                                        # loop 0: each position its own bit
    for j in range(1, K + 1):
        state = [bit[p] ^ (state[p - 1] if p else 0) for p in range(T)]  # the XOR of bits p − j .. p
        row = list(final)
        row[n + 1] = str(state[n + 1]) if j < n else final[n + 1]
        if every:                                                      # every bit holds its window's parity too
            row[1:n + 1] = [str(state[p]) for p in range(1, n + 1)]
        out.append(row)
    return out


@pytest.mark.parametrize("name", ["parity", "copy"])
def test_scan_targets_match_a_simulated_one_step_scan(name):
    task = get_task(name, length=7, min_length=1, scan=True)
    b = task.generate(200, seed=1)
    assert task.steps == 7 and b["step_targets"].shape == (200, 7, task.seq_len)
    assert np.array_equal(b["step_targets"][:, -1], b["targets"])           # the last step is the answer
    plain = get_task(name, length=7, min_length=1).generate(200, seed=1)
    assert "step_targets" not in plain and all(np.array_equal(plain[k], b[k]) for k in plain)
    for i in range(len(b["inputs"])):
        toks, n = task.vocab.decode(b["inputs"][i]), int(b["size"][i])
        want = _scan_reference(name, toks, n, task.steps)
        got = [[None if t == IGNORE else task.vocab.decode([t])[0] for t in step] for step in b["step_targets"][i]]
        assert got == want, (toks, n)


def test_parity_scan_every_supervises_every_bit_with_its_window_parity():
    task = get_task("parity", length=7, min_length=1, scan=True, scan_every=True)
    b = task.generate(200, seed=4)
    only = get_task("parity", length=7, min_length=1, scan=True).generate(200, seed=4)
    assert np.array_equal(b["inputs"], only["inputs"]) and np.array_equal(b["targets"], only["targets"])
    for i in range(len(b["inputs"])):
        toks, n = task.vocab.decode(b["inputs"][i]), int(b["size"][i])
        want = _scan_reference("parity", toks, n, task.steps, every=True)
        got = [[None if t == IGNORE else task.vocab.decode([t])[0] for t in step] for step in b["step_targets"][i]]
        assert got == want, (toks, n)
        bits = [int(t) for t in toks[1:n + 1]]
        assert got[-1][1:n + 1] == [str(sum(bits[:p]) % 2) for p in range(1, n + 1)]   # prefix parities by loop K
    with pytest.raises(UserError, match="needs scan: true"):
        get_task("parity", length=5, scan_every=True)


@pytest.mark.parametrize("name,options,needle", [("addition", {}, "has no one-step scan"),
                                                 ("copy", {"reverse": True}, "reversed copy"),
                                                 ("parity", {"scan": "yes"}, "scan")])
def test_scan_refusals(name, options, needle):
    with pytest.raises(UserError, match=needle):
        get_task(name, length=5, **{"scan": True, **options})


@pytest.mark.parametrize("bad,needle", [({"length": 0}, "length must be >= 1"),
                                        ({"length": 4, "min_length": 5}, "min_length must be <= 4"),
                                        ({"length": 4, "min_length": -1}, "min_length must be >= 0")])
def test_bad_size_options(bad, needle):
    with pytest.raises(UserError, match=needle):
        get_task("parity", **bad)


def test_word_problem_with_variable_lengths_is_the_prefix_products_of_each_prefix():
    task = get_task("word_problem", group="S3", length=8, min_length=2, causal=True)
    names, table = group_elements("S3")
    b = task.generate(300, seed=1, split="test")
    sizes = set(np.unique(b["size"]).tolist())     # (the 36 rows of size 2 may all hash into other splits)
    assert task.causal and set(range(3, 9)) <= sizes <= set(range(2, 9))
    for i in range(len(b["inputs"])):
        m = int(b["size"][i])
        assert (b["inputs"][i, m:] == task.pad_id).all() and (b["targets"][i, m:] == IGNORE).all()
        p = None
        for j in range(m):                                            # prefix products by hand
            g = int(b["inputs"][i, j]) - 1
            p = g if p is None else int(table[p, g])
            assert b["targets"][i, j] == p + 1
        steps = b["step_targets"][i]                                  # the linear scan reaches its answer by m - 1
        assert (steps[:, m:] == IGNORE).all() and (steps[m - 2:, :m] == b["targets"][i, :m]).all()
    assert task.metrics(b["targets"], b)["last_accuracy"] == 1.0
    fixed = get_task("word_problem", group="S3", length=8)
    assert not fixed.causal and (fixed.generate(10, 0)["size"] == 8).all()


def test_column_addition_against_python_integers_row_by_row_and_loop_by_loop():
    """Every row's sum bits are a + c; after loop j column i holds the sum bit of columns max(1, i − j)..i added
    alone (integers of those columns only); pads carry no target; the answer holds from loop n on."""
    task = get_task("column_addition", length=8, min_length=1)
    b = task.generate(500, seed=2, split="train")
    assert task.causal and set(np.unique(b["size"])) == set(range(1, 9))
    assert b["step_targets"].shape == (500, 8, 10) and task.seq_len == 10
    for i in range(len(b["inputs"])):
        n = int(b["size"][i])
        toks = task.vocab.decode(b["inputs"][i])
        assert toks[0] == "<bos>" and toks[n + 1] == "00" and all(t == "<pad>" for t in toks[n + 2:])
        a = [int(t[0]) for t in toks[1:n + 2]]
        c = [int(t[1]) for t in toks[1:n + 2]]
        s = _bits_value(a) + _bits_value(c)
        got = task.vocab.decode(b["targets"][i][1:n + 2])
        assert got == [str((s >> k) & 1) for k in range(n + 1)]
        assert b["targets"][i][0] == IGNORE and (b["targets"][i][n + 2:] == IGNORE).all()
        for j in range(1, task.steps + 1):
            step = b["step_targets"][i][j - 1]
            assert step[0] == IGNORE and (step[n + 2:] == IGNORE).all()
            for col in range(1, n + 2):                                  # 1-based column
                lo = max(1, col - j)
                seg = _bits_value(a[lo - 1:col]) + _bits_value(c[lo - 1:col])
                assert task.vocab.decode([step[col]]) == [str((seg >> (col - lo)) & 1)], (i, j, col)
            if j >= n:
                assert np.array_equal(step, b["targets"][i])
    assert task.metrics(b["targets"], b) == {"accuracy": 1.0, "last_accuracy": 1.0, "token_accuracy": 1.0}
    wrong = b["targets"].copy()
    rows = np.arange(3)
    wrong[rows, b["size"][:3] + 1] = np.where(wrong[rows, b["size"][:3] + 1] == task.vocab.index["0"],
                                               task.vocab.index["1"], task.vocab.index["0"])   # three carries
    m = task.metrics(wrong, b)
    assert m["accuracy"] == m["last_accuracy"] == pytest.approx(1 - 3 / 500)
    assert "a+c=" in task.decode_row(b, 0)


def _longest_chain(row: list[str]) -> int:
    """The most columns in a row that pass a carry on (01 or 10)."""
    best = run = 0
    for col in row:
        run = run + 1 if col in ("01", "10") else 0
        best = max(best, run)
    return best


def test_column_addition_propagate_sets_the_carry_chains():
    """propagate p: each column passes the carry on with probability p; the answers stay a + c."""
    uniform = get_task("column_addition", length=24).generate(400, 0, "test")
    same = get_task("column_addition", length=24, propagate=0.5).generate(400, 0, "test")
    assert all(np.array_equal(uniform[k], same[k]) for k in uniform)
    task = get_task("column_addition", length=24, propagate=0.95)
    b = task.generate(400, 0, "test")
    cols = [task.vocab.decode(r[1:25]) for r in b["inputs"]]
    share = np.mean([c in ("01", "10") for row in cols for c in row])
    assert 0.92 < share < 0.98
    plain = get_task("column_addition", length=24)
    assert np.median([_longest_chain(r) for r in cols]) > 3 * np.median(
        [_longest_chain(plain.vocab.decode(r[1:25])) for r in uniform["inputs"]])
    for i in range(50):
        a = [int(c[0]) for c in cols[i]]
        c = [int(x[1]) for x in cols[i]]
        s = _bits_value(a) + _bits_value(c)
        assert task.vocab.decode(b["targets"][i][1:26]) == [str((s >> k) & 1) for k in range(25)]
    none = get_task("column_addition", length=6, propagate=0.0).generate(50, 0, "test")
    assert all(t in ("00", "11") for r in none["inputs"] for t in task.vocab.decode(r[1:7]))


def test_column_addition_splits_sizes_and_refusals():
    task = get_task("column_addition", length=6)
    train, test = task.generate(400, 0, "train"), task.generate(200, 0, "test")
    assert (train["size"] == 6).all() and (test["size"] == 6).all()
    seen = {r.tobytes() for r in train["inputs"]}
    assert not any(r.tobytes() in seen for r in test["inputs"])
    again = task.generate(400, 0, "train")
    assert all(np.array_equal(train[k], again[k]) for k in train)
    for bad, needle in [({"length": 0}, "length must be >= 1"), ({"length": 4, "min_length": 5}, "min_length"),
                        ({"length": "8"}, "length must be an integer"), ({"propagate": 1.5}, "propagate")]:
        with pytest.raises(UserError, match=needle):
            get_task("column_addition", **bad)


# ------------------------------------------------------------------------------------------------ loop rules
@pytest.mark.parametrize("text,sizes,want", [
    ("linear:1,0", [1, 2, 8, 33], [1, 2, 8, 33]),
    ("linear:2,1", [1, 5], [3, 11]),
    ("linear:0.5,0", [1, 3, 4], [1, 2, 2]),       # ⌈n/2⌉, at least one loop
    ("log:1,1", [1, 2, 3, 8, 9], [1, 2, 3, 4, 5]),  # ⌈log2 n⌉ + 1
    ("log:2,0", [1, 16, 17], [1, 8, 10]),
    ("fixed", [1, 100], [7, 7]),
])
def test_loop_rules_by_hand(text, sizes, want):
    rule = LoopRule.parse(text)
    assert rule.loops(sizes, 7).tolist() == want
    assert str(LoopRule.parse(str(rule))) == str(rule)


@pytest.mark.parametrize("text", ["linear", "linear:1", "linear:0,1", "linear:-1,0", "log:a,b", "quadratic:1,0",
                                  "fixed:3", "linear:inf,0"])
def test_bad_loop_rules_name_the_field(text):
    with pytest.raises(ValueError, match="loop_rule"):
        ModelConfig(vocab_size=4, loop_rule=text)


def test_jitter_is_a_function_of_seed_and_step():
    a, b = jitter(0, 5, 64, 3), jitter(0, 5, 64, 3)
    assert np.array_equal(a, b) and a.min() >= 0 and a.max() <= 3 and len(set(a.tolist())) == 4
    assert not np.array_equal(a, jitter(0, 6, 64, 3)) and (jitter(0, 5, 8, 0) == 0).all()


# ------------------------------------------------------------------------------------------------- training
LG = ["task.name=parity", "task.options={length: 6, min_length: 1}", "task.n_train=256", "task.n_test=32",
      "model.d_model=16", "model.n_heads=2", "model.pos=none", "model.input_injection=true", "model.loops=6",
      "model.loop_rule=linear:1,0", "train.steps=3", "train.batch_size=8", "train.log_every=1",
      "log.tensorboard=false", "log.progress=false", "log.dynamics=false", "eval.max_loops=8", "eval.drift=false"]


def _train(folder, *extra, base=tuple(LG)) -> int:
    """`loopformer train` of the tiny length config (`base`) with `extra` overrides into folder/r."""
    (folder / "lg.yaml").write_text("name: lg\n")
    return main(["train", str(folder / "lg.yaml"), "--quiet", *base, f"out_dir={folder / 'r'}", *extra])


def test_each_row_runs_the_loops_of_its_size(tmp_path):
    cfg = load_run_config(None, [*LG, f"out_dir={tmp_path / 'r'}", "train.loops.jitter=2", "train.grad_accum=2"])
    d = setup("cpu")
    try:
        tr = Trainer(cfg, d, resume=False, overwrite=True)
        micro, _ = tr._micro_batches(4)
    finally:
        teardown()
    extra = np.array_split(jitter(cfg.seed, 4, 8, 2), 2)
    for m, j in zip(micro, extra):
        assert m["row_loops"].tolist() == (m["size"].numpy() + j).tolist()
    assert tr.loops == max(int(m["row_loops"].max()) for m in micro)


def test_loop_rule_rows_are_scored_on_their_own_step_t_in_a_length_curriculum(tmp_path, monkeypatch):
    """The word problem (K = 7 steps at length 8) under a length curriculum that starts at 3 elements: a batch runs
    at most 3 loops, and loop t of every row is scored against step t of the scan (the products of t + 1
    elements), not against steps spread over the 3 loops."""
    over = ["task.name=word_problem", "task.options={group: S3, length: 8, min_length: 1, causal: true}",
            "task.loop_targets=true", "task.length_start=3", "task.length_every=100", "task.n_train=256",
            "task.n_test=16", "model.d_model=16", "model.n_heads=2", "model.pos=rope", "model.attn_window=2",
            "model.input_injection=true", "model.loops=8", "model.loop_rule=linear:1,0", "train.steps=2",
            "train.batch_size=8", "train.losses.loops=all", "train.system.compile=false", "log.tensorboard=false",
            "log.progress=false", "log.dynamics=false", "eval.drift=false", f"out_dir={tmp_path / 'r'}"]
    seen = []
    orig = Trainer.forward_loss

    def spy(self, mb, state, offset):
        seen.append((mb.inputs.clone(), mb.targets.clone()))
        return orig(self, mb, state, offset)

    monkeypatch.setattr(Trainer, "forward_loss", spy)
    train(load_run_config(None, over))
    assert seen
    _, table = group_elements("S3")
    for x, targets in seen:                                          # targets [R,B,T], R <= 3 loops
        assert 1 <= targets.shape[0] <= 3
        words = x.numpy() - 1                                        # element ids; pads -1
        for t in range(targets.shape[0]):
            for b in range(words.shape[0]):
                for i in range(words.shape[1]):
                    if words[b, i] < 0:
                        assert targets[t, b, i] == IGNORE
                        continue
                    g = words[b, i]                                  # the product of elements i - t .. i
                    for j in range(i - 1, max(-1, i - t - 2), -1):
                        g = table[words[b, j], g]
                    assert targets[t, b, i] == g + 1


def test_a_row_with_its_own_loops_equals_a_run_of_that_many():
    cfg = load_run_config(None, LG)
    model = LoopedTransformer(cfg.model).eval()
    task = get_task("parity", length=6, min_length=1)
    b = task.generate(16, 0, "test")
    x = torch.as_tensor(b["inputs"], dtype=torch.long)
    rows = torch.as_tensor(b["size"])
    with torch.no_grad():
        out = model(x, loops=int(rows.max()), opts=LoopOptions(row_loops=rows)).logits
        for i in range(len(x)):
            alone = model(x[i:i + 1], loops=int(rows[i])).logits
            assert torch.allclose(out[i], alone[0], atol=1e-5)


def test_training_with_a_loop_rule_end_to_end_and_eval_lengths(tmp_path, capsys):
    run = tmp_path / "r"
    assert _train(tmp_path, "eval.lengths=[8,12]") == 0
    res = json.loads((run / "results.json").read_text())
    assert res["loop_rule"] == "linear:1,0" and [p["length"] for p in res["lengths"]["lengths"]] == [8, 12]
    assert [p["loops"] for p in res["lengths"]["lengths"]] == [8, 12] and res["lengths"]["trained_size"] == 6
    capsys.readouterr()
    out_json = tmp_path / "l.json"
    plot = tmp_path / "l.png"
    assert main(["eval", str(run), "--lengths", "24,5,10", "--json", str(out_json), "--plot", str(plot),
                 "--quiet", "-n", "20"]) == 0
    text = capsys.readouterr().out
    assert "| 24 ×4 | 24 |" in text and "⌈1·n + 0⌉" in text
    got = json.loads(out_json.read_text())["lengths"]["lengths"]
    assert [p["loops"] for p in got] == [5, 10, 24] and [p["max_loops"] for p in got] == [10, 20, 48]
    assert all(len(p["loopwise"]) == p["max_loops"] and p["metric"] == p["loopwise"][p["loops"] - 1] for p in got)
    assert plot.stat().st_size > 0
    # the same length's metric by hand: every row of size 10 run 10 loops
    model = load(resolve_checkpoint(str(run)), device=torch.device("cpu")).eval()
    task = get_task("parity", length=10)
    b = task.generate(20, 0, "test")
    with torch.no_grad():
        pred = model(torch.as_tensor(b["inputs"], dtype=torch.long), loops=10).logits.argmax(-1).numpy()
    assert got[1]["metric"] == pytest.approx(task.metrics(pred, b)["accuracy"])
    # --loops: that many at every length
    assert main(["eval", str(run), "--lengths", "9,8", "--loops", "5", "--json", str(out_json), "--quiet",
                 "-n", "10", "--no-loopwise"]) == 0
    assert [p["loops"] for p in json.loads(out_json.read_text())["lengths"]["lengths"]] == [5, 5]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lg")
    assert _train(base) == 0
    (base / "r").rename(base / "rule")
    assert _train(base, "model.pos=learned", "model.loop_rule=fixed", "train.steps=1") == 0
    (base / "r").rename(base / "learned")
    return base


def test_confident_stop_reads_each_row_at_its_most_confident_loop(tiny_runs):
    """The stop against a hand computation: every row of size 10 run 20 loops, the loop whose greedy answer has the
    largest summed log-probability over the answer positions (the first of equals), scored by the task."""
    from loopformer.eval.lengths import confident_stop, length_curve
    run = tiny_runs / "rule"
    model = load(resolve_checkpoint(str(run)), device=torch.device("cpu")).eval()
    cfg = load_run_config(str(run / "config.yaml"))
    data = make_data(cfg.task)
    d10, _ = data.at_length(10, 30)
    metrics, mean_loop = confident_stop(model, d10, 20, batch_size=7)
    task = get_task("parity", length=10)
    b = task.generate(30, cfg.task.seed, "test")
    assert np.array_equal(d10.test_rows(30)["inputs"], b["inputs"])                        # the same rows
    x = torch.as_tensor(b["inputs"], dtype=torch.long)
    with torch.no_grad():
        logits = model(x, loops=20, return_all=True).all_logits.float()                     # [20,30,T,C]
    scored = torch.as_tensor(b["targets"]) != IGNORE
    conf = [[float(sum(logits[t, i, j].log_softmax(-1).max() for j in range(x.shape[1]) if scored[i, j]))
             for t in range(20)] for i in range(30)]
    stop = [max(range(20), key=lambda t: (c[t], -t)) for c in conf]                        # the first best loop
    pred = torch.stack([logits[stop[i], i] for i in range(30)]).argmax(-1).numpy()
    assert metrics["accuracy"] == pytest.approx(task.metrics(pred, b)["accuracy"])
    assert mean_loop == pytest.approx(1 + np.mean(stop))
    res = length_curve(model, data, [10], limit=30)["lengths"][0]
    assert res["confident"] == pytest.approx(metrics["accuracy"]) and res["confident_loops"] == mean_loop


def test_loop_vote_reads_each_row_with_the_answer_most_of_its_window_gives(tiny_runs):
    """The vote against a hand computation: every row of size 10 run 20 loops, the greedy answer (the scored
    positions' tokens) after each loop 10..20, the row read at the loop whose answer the most loops of the window
    share (the latest of equals), scored by the task; the share is that count over the window's 11 loops."""
    from loopformer.eval.lengths import length_curve, loop_vote
    run = tiny_runs / "rule"
    model = load(resolve_checkpoint(str(run)), device=torch.device("cpu")).eval()
    cfg = load_run_config(str(run / "config.yaml"))
    data = make_data(cfg.task)
    d10, _ = data.at_length(10, 30)
    metrics, share = loop_vote(model, d10, 10, 20, batch_size=7)
    task = get_task("parity", length=10)
    b = task.generate(30, cfg.task.seed, "test")
    x = torch.as_tensor(b["inputs"], dtype=torch.long)
    with torch.no_grad():
        logits = model(x, loops=20, return_all=True).all_logits.float()                     # [20,30,T,C]
    scored = np.asarray(b["targets"]) != IGNORE
    picks, shares = [], []
    for i in range(30):
        answers = [tuple(logits[t, i].argmax(-1).numpy()[scored[i]]) for t in range(9, 20)]
        counts = [answers.count(a) for a in answers]
        t = max(range(11), key=lambda k: (counts[k], k))                                    # the latest best
        picks.append(logits[9 + t, i])
        shares.append(counts[t] / 11)
    pred = torch.stack(picks).argmax(-1).numpy()
    assert metrics["accuracy"] == pytest.approx(task.metrics(pred, b)["accuracy"])
    assert share == pytest.approx(np.mean(shares))
    res = length_curve(model, data, [10], limit=30)["lengths"][0]
    assert res["vote"] == pytest.approx(metrics["accuracy"]) and res["vote_share"] == pytest.approx(share)
    # a model whose answer never changes: the vote is the answer at every loop, held by the whole window
    m1, s1 = loop_vote(model, d10, 20, 20, batch_size=7)
    at20 = logits[19].argmax(-1).numpy()
    assert m1["accuracy"] == pytest.approx(task.metrics(at20, b)["accuracy"]) and s1 == 1.0
    with pytest.raises(UserError, match="window"):
        loop_vote(model, d10, 5, 4)


@pytest.mark.parametrize("args,needle", [
    (["--lengths", "0"], "every length must be >= 1"),
    (["--lengths", "4,-2"], "every length must be >= 1"),
    (["--lengths", "4,x"], "not a whole number"),
    (["--lengths", ","], "not a whole number"),
    (["--lengths", "2000"], "length must be <= 1024"),
    (["--lengths", "4", "--loops", "5000"], "loops"),
])
def test_eval_lengths_bad_values(tiny_runs, capsys, args, needle):
    before = sorted(p.name for p in (tiny_runs / "rule").iterdir())
    assert main(["eval", str(tiny_runs / "rule"), *args, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in (tiny_runs / "rule").iterdir()) == before


def test_eval_lengths_past_learned_positions(tiny_runs, capsys):
    assert main(["eval", str(tiny_runs / "learned"), "--lengths", "6,7", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "positions" in err and len(err.splitlines()) == 1


def test_a_rule_must_cover_the_training_sizes(tmp_path, capsys):
    assert _train(tmp_path, "model.loops=4") == 2
    assert "model.loops=4 must be at least 6" in capsys.readouterr().err
    assert _train(tmp_path, "task.name=lcs", "task.options={length: 3}",
                  base=[a for a in LG if not a.startswith("task.options")]) == 2
    assert "reads every row's size" in capsys.readouterr().err
    assert _train(tmp_path, "train.loops.sample=uniform") == 2
    assert "excludes train.loops.sample" in capsys.readouterr().err
    assert _train(tmp_path, "model.pos=learned", "model.loop_rule=fixed", "eval.lengths=[8,30]") == 2   # at start
    assert "positions" in capsys.readouterr().err
    assert not (tmp_path / "r" / "checkpoint").exists()


@given(st.lists(st.integers(min_value=-5, max_value=3000), min_size=1, max_size=8))
def test_parse_lengths_property(values):
    text = ",".join(map(str, values))
    if min(values) < 1:
        with pytest.raises(UserError, match=">= 1"):
            parse_lengths(text)
    else:
        assert parse_lengths(text) == sorted(set(values))


def test_length_curriculum_admits_larger_sizes_over_steps():
    cfg = TaskConfig(name="parity", options={"length": 8, "min_length": 1}, n_train=400, n_test=8, length_start=2,
                     length_every=10, length_increment=2)
    data = make_data(cfg)
    for step, largest in ((0, 2), (9, 2), (10, 4), (25, 6)):
        sizes = data.train["size"][data.plan(step, 32)]
        assert sizes.max() <= largest and data.curriculum_size(step) == largest
        assert np.array_equal(data.plan(step, 32), make_data(cfg).plan(step, 32))     # a function of the step
    assert data.curriculum_size(30) is None and data.train["size"][data.plan(30, 400)].max() == 8
    with pytest.raises(UserError, match="record no size"):
        make_data(TaskConfig(name="lcs", options={"length": 3}, n_train=8, n_test=8, length_start=2))
    with pytest.raises(UserError, match="below the smallest"):
        make_data(dataclasses.replace(cfg, options={"length": 8, "min_length": 4}))


def test_sweep_report_tabulates_lengths():
    from loopformer.experiments.report import lengths_table

    def run(seed, metrics, name="model.loop_rule=linear:1,0"):
        return {"_dir": f"/x/runs/{name}_seed={seed}", "seed": seed, "metric": "accuracy",
                "task": {"name": "parity", "options": {"length": 12}},
                "lengths": {"formula": "⌈1·n + 0⌉", "trained_size": 12,
                            "lengths": [{"length": n, "loops": n, "metric": v} for n, v in zip((12, 24), metrics)]}}

    text = lengths_table([run(0, (1.0, 0.5)), run(1, (0.9, 0.7)), run(2, (1.0, 0.6)), {"_dir": "/x/runs/other"}])
    assert "| n = 12 | n = 24 |" in text
    assert "| 3 | 100.0 [90.0–100.0] | 60.0 [50.0–70.0] |" in text          # median [min–max] over seeds
    assert "| 1 | 90.0 (12) | 70.0 (24) |" in text                           # each run: metric (loops)
    assert "vote" not in text                                                 # runs without the vote: no table
    voted = [run(s, (1.0, 0.5)) for s in range(2)]
    for r, v in zip(voted, (0.96, 0.98)):
        r["lengths"]["lengths"][1]["vote"] = v
    text = lengths_table(voted)
    assert "read by the vote" in text and "| 2 |  | 97.0 [96.0–98.0] |" in text
    assert lengths_table([{"_dir": "/x/runs/a"}]) is None


def test_at_length_refuses_tasks_without_a_length():
    data = make_data(TaskConfig(name="pointer_chase", options={"symbols": 8, "hops": 3}, n_train=8, n_test=8))
    with pytest.raises(UserError, match="has no length option"):
        data.at_length(8, 10)
    parity = make_data(TaskConfig(name="parity", options={"length": 8, "min_length": 1}, n_train=8, n_test=8,
                                  n_val=4, length_start=2))
    other, cfg = parity.at_length(20, 10)
    assert (other.test["size"] == 20).all() and cfg.options == {"length": 20, "min_length": 0, "scan": False,
                                                                       "scan_every": False}
    assert cfg.n_val == 0 and cfg.length_start == 0 and len(other.test["inputs"]) == 10
    scanned = make_data(TaskConfig(name="copy", options={"length": 6, "min_length": 1, "scan": True}, n_train=8,
                                   n_test=8, loop_targets=True))
    other, cfg = scanned.at_length(12, 4)
    assert cfg.options["scan"] is False and "step_targets" not in other.test and not cfg.loop_targets
    every = make_data(TaskConfig(name="parity", options={"length": 6, "min_length": 1, "scan": True,
                                                         "scan_every": True}, n_train=8, n_test=8, loop_targets=True))
    other, cfg = every.at_length(12, 4)                 # scan_every goes with the scan
    assert cfg.options["scan"] is False and cfg.options["scan_every"] is False and "step_targets" not in other.test
    word = make_data(TaskConfig(name="word_problem", options={"group": "S3", "length": 6, "min_length": 1,
                                                              "causal": True, "scan": "linear"},
                                n_train=8, n_test=8, loop_targets=True))
    other, cfg = word.at_length(12, 4)                  # the word problem's scan is a kind, not a switch: kept
    assert cfg.options["scan"] == "linear" and (other.test["size"] == 12).all() and not cfg.loop_targets


# ------------------------------------------------------------------------------------------------- full output
COPY = [*LG, "task.name=copy", "task.full_output=true"]      # later overrides win


def test_full_output_hides_every_answer_token_and_keeps_the_causal_mask(tmp_path):
    """Fan et al.'s full-output prediction: the answer's tokens are blanks in the inputs of training, test and
    evaluation-at-length rows; targets, and the mask, are the task's own."""
    cfg = load_run_config(None, [*COPY, f"out_dir={tmp_path / 'r'}"])
    assert cfg.model.causal is True and cfg.task.full_output
    data = make_data(cfg.task)
    plain = get_task("copy", length=6, min_length=1).generate(32, 0, "test")
    x, st = data.test["inputs"], data.test["answer_start"]
    pos = np.arange(x.shape[1])[None, :]
    assert np.array_equal(np.where(pos >= st[:, None], 0, plain["inputs"]), x)      # blanks from the answer on
    assert np.array_equal(data.test["targets"], plain["targets"])
    assert (x[pos >= st[:, None]] == 0).all() and (plain["inputs"][pos == st[:, None]] >= 4).all()
    keys = data.plan(2, 8)
    b = data.fetch(keys, 2)
    for i, k in enumerate(keys):
        s0 = data.train["answer_start"][k]
        assert (b["inputs"][i, s0:].numpy() == 0).all()
        assert np.array_equal(b["inputs"][i, :s0].numpy(), data.train["inputs"][k, :s0])
        assert np.array_equal(b["targets"][i].numpy(), data.train["targets"][k])
    longer, _ = data.at_length(9, 10)
    s9 = longer.test["answer_start"]
    assert (longer.test["inputs"][np.arange(longer.test["inputs"].shape[1])[None, :] >= s9[:, None]] == 0).all()


def test_full_output_trains_and_evaluates_at_other_lengths_on_blank_answers(tmp_path, capsys):
    """A trained run's metric at another length equals the model's greedy answer read from rows whose answers are
    blanks, computed by hand."""
    assert _train(tmp_path, "task.name=copy", "task.full_output=true", "train.steps=4") == 0
    run = tmp_path / "r"
    out_json = tmp_path / "l.json"
    assert main(["eval", str(run), "--lengths", "8", "--json", str(out_json), "--quiet", "-n", "16",
                 "--no-loopwise"]) == 0
    got = json.loads(out_json.read_text())["lengths"]["lengths"][0]
    model = load(resolve_checkpoint(str(run)), device=torch.device("cpu")).eval()
    task = get_task("copy", length=8)
    b = task.generate(16, 0, "test")
    x = np.where(np.arange(b["inputs"].shape[1])[None, :] >= b["answer_start"][:, None], 0, b["inputs"])
    with torch.no_grad():
        pred = model(torch.as_tensor(x, dtype=torch.long), loops=8).logits.argmax(-1).numpy()
    assert got["metric"] == pytest.approx(task.metrics(pred, b)["accuracy"])
    with torch.no_grad():                                  # the blanks matter: the visible answer reads differently
        seen = model(torch.as_tensor(b["inputs"], dtype=torch.long), loops=8).logits
    assert not torch.allclose(seen, model(torch.as_tensor(x, dtype=torch.long), loops=8).logits)


@pytest.mark.parametrize("extra, needle", [
    (["task.answer_only=true"], "exclude each other"),
    (["task.name=word_problem"], "not causal"),                # prefix products, read bidirectionally
])
def test_full_output_bad_combinations(tmp_path, capsys, extra, needle):
    assert _train(tmp_path, "task.name=copy", "task.full_output=true", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_a_windowed_rotary_block_trains_and_runs_at_any_length(tmp_path):
    """attn_window with rotary positions: trained at sizes 1..6, evaluated at 20 (no learned positions to run out)."""
    assert _train(tmp_path, "task.name=copy", "task.full_output=true", "model.pos=rope", "model.attn_window=2") == 0
    out_json = tmp_path / "l.json"
    assert main(["eval", str(tmp_path / "r"), "--lengths", "20", "--json", str(out_json), "--quiet", "-n", "8",
                 "--no-loopwise"]) == 0
    got = json.loads(out_json.read_text())["lengths"]["lengths"][0]
    assert got["length"] == 20 and got["loops"] == 20 and 0.0 <= got["metric"] <= 1.0
    assert load(resolve_checkpoint(str(tmp_path / "r"))).config.attn_window == 2


def test_copy_trains_on_its_scan_and_is_evaluated_at_other_lengths(tmp_path, monkeypatch):
    """task.options.scan with per-loop targets: every loop of every row is scored against the scan's step t (the
    symbol t positions back at the answer's read positions), and the run is evaluated at a longer length."""
    seen = []
    orig = Trainer.forward_loss

    def spy(self, mb, state, offset):
        seen.append(mb.targets.clone())
        return orig(self, mb, state, offset)

    monkeypatch.setattr(Trainer, "forward_loss", spy)
    assert _train(tmp_path, "task.name=copy", "task.options={length: 6, min_length: 1, scan: true}",
                  "task.full_output=true", "task.loop_targets=true", "train.losses.loops=all", "model.pos=rope",
                  "model.attn_window=2", "train.system.compile=false", "eval.lengths=[12]") == 0
    assert seen and all(t.dim() == 3 and 1 <= t.shape[0] <= 6 for t in seen)     # [R,B,T], R <= T(6) = 6 loops
    assert any((t[0] != IGNORE).any() and (t[0] == IGNORE).sum() > (t[-1] == IGNORE).sum() for t in seen)
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert [p["length"] for p in res["lengths"]["lengths"]] == [12]
