"""The depth-demanding tasks (word problem, pointer chasing, a fixed hidden circuit) against brute-force references,
their splits, determinism, options and per-loop targets in training."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import torch

from loopformer.cli import main
from loopformer.data.dataset import open_dataset, write_dataset
from loopformer.errors import UserError
from loopformer.tasks import IGNORE, get_task
from loopformer.tasks.common import in_split, loop_steps, row_buckets
from loopformer.tasks.schedule import draw_circuit
from loopformer.train.config import load_run_config
from loopformer.train.losses import loop_targets, summed_loss
from loopformer.train.trainer import train


# ------------------------------------------------------------------------------------------------ references
def compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """a then b: x -> b[a[x]]."""
    return tuple(b[a[x]] for x in range(len(a)))


def word_reference(group: str, word: list[int], names: list[str]) -> list[int]:
    """Prefix products by composing the elements one by one from their names."""
    if group.startswith("Z"):
        k = int(group[1:])
        vals = [int(names[g][1:]) for g in word]
        return [names.index(f"z{sum(vals[:i + 1]) % k}") for i in range(len(vals))]
    perms = [tuple(int(c) for c in names[g]) for g in word]
    acc, out = perms[0], [perms[0]]
    for p in perms[1:]:
        acc = compose(acc, p)
        out.append(acc)
    return [names.index("".join(map(str, p))) for p in out]


@pytest.mark.parametrize("group,order", [("S3", 6), ("S4", 24), ("A4", 12), ("S5", 120), ("A5", 60), ("Z7", 7)])
def test_word_problem_against_composition(group, order):
    task = get_task("word_problem", group=group, length=11)
    assert task.order == order and task.vocab_size == order + 1 and task.seq_len == 11
    names = task.vocab.tokens[1:]
    if group[0] in "SA":           # closed under composition, identity first, A5 even permutations only
        perms = [tuple(int(c) for c in n) for n in names]
        assert perms[0] == tuple(range(len(perms[0])))
        assert set(compose(a, b) for a in perms for b in perms) == set(perms)
    batch = task.generate(200, seed=3, split="test")
    for i in range(200):
        word = [int(g) - 1 for g in batch["inputs"][i]]
        assert [int(p) - 1 for p in batch["targets"][i]] == word_reference(group, word, names)


@pytest.mark.parametrize("scan,steps,window", [("doubling", 4, lambda j: 2 ** (j + 1)),
                                               ("linear", 12, lambda j: j + 2)])
def test_word_problem_scan_states_are_window_products(scan, steps, window):
    task = get_task("word_problem", group="S4", length=13, scan=scan)
    assert task.steps == steps
    b = task.generate(50, seed=0)
    names = task.vocab.tokens[1:]
    for i in range(50):
        word = [int(g) - 1 for g in b["inputs"][i]]
        for j in range(task.steps):
            for pos in range(13):
                lo = max(0, pos - window(j) + 1)
                want = word_reference("S4", word[lo:pos + 1], names)[-1]
                assert int(b["step_targets"][i, j, pos]) - 1 == want
    assert np.array_equal(b["step_targets"][:, -1], b["targets"])


def test_word_problem_linear_scan_holds_its_answer():
    """The linear step applied to the answer gives the answer again (why a loop can run past K)."""
    from loopformer.tasks.word_problem import linear_scan

    task = get_task("word_problem", group="A5", length=6)
    b = task.generate(30, seed=2)
    words, answer = b["inputs"].astype(np.int64) - 1, b["targets"].astype(np.int64) - 1
    again = answer.copy()
    again[:, 1:] = task.table[answer[:, :-1], words[:, 1:]]
    assert np.array_equal(again, answer) and linear_scan(words[:, :1], task.table).shape == (30, 1, 1)


def test_word_problem_with_bos_is_the_word_shifted_by_one():
    """bos: a <bos> first (no target, no states), the rest exactly the word without it, variable lengths too."""
    for extra in ({}, {"min_length": 2, "causal": True}):
        plain = get_task("word_problem", group="S3", length=9, **extra)
        task = get_task("word_problem", group="S3", length=9, bos=True, **extra)
        assert task.seq_len == 10 and task.vocab.tokens[-1] == "<bos>" and task.vocab_size == plain.vocab_size + 1
        a, b = plain._draw(np.random.default_rng(5), 40), task._draw(np.random.default_rng(5), 40)  # same words
        assert (b["inputs"][:, 0] == task.vocab_size - 1).all() and (b["targets"][:, 0] < 0).all()
        assert (b["step_targets"][:, :, 0] < 0).all()
        assert np.array_equal(b["inputs"][:, 1:], a["inputs"]) and np.array_equal(b["targets"][:, 1:], a["targets"])
        assert np.array_equal(b["step_targets"][:, :, 1:], a["step_targets"]) and np.array_equal(b["size"], a["size"])
        pred = b["targets"].copy()
        rows = np.arange(40)
        pred[rows, b["size"]] = pred[rows, b["size"]] % task.order + 1          # each word's last product wrong
        m = task.metrics(np.where(pred < 0, 0, pred), b)
        assert m["accuracy"] == 0.0 and m["last_accuracy"] == 0.0
        assert task.decode_row(b, 0) == plain.decode_row(a, 0)
        test, train = task.generate(60, seed=1, split="test"), task.generate(60, seed=1, split="train")
        assert not {r.tobytes() for r in test["inputs"]} & {r.tobytes() for r in train["inputs"]}


def test_word_problem_metrics_and_non_solvable_flag():
    task = get_task("word_problem", group="A5", length=8)
    b = task.generate(100, seed=1)
    pred = b["targets"].copy()
    pred[:50, 3] = (pred[:50, 3] % task.order) + 1            # a wrong product at one inner position
    m = task.metrics(pred, b)
    assert m["accuracy"] == 0.5 and m["last_accuracy"] == 1.0 and m["token_accuracy"] == pytest.approx(1 - 50 / 800)


def chase_reference(table: list[int], start: int, hops: int) -> list[int]:
    out, x = [], start
    for _ in range(hops):
        x = table[x]
        out.append(x)
    return out


def test_pointer_chase_against_following_pointers():
    task = get_task("pointer_chase", symbols=9, hops=5)
    assert task.seq_len == 10 and task.steps == 5 and not task.causal
    b = task.generate(300, seed=2, split="test")
    for i in range(300):
        table = [int(v) - 1 for v in b["inputs"][i, :9]]
        start = int(b["inputs"][i, 9]) - 1
        # one cycle through all symbols
        x, seen = 0, set()
        for _ in range(9):
            seen.add(x)
            x = table[x]
        assert x == 0 and len(seen) == 9
        hops = chase_reference(table, start, 5)
        assert int(b["targets"][i, 9]) - 1 == hops[-1] and (b["targets"][i, :9] == IGNORE).all()
        assert [int(b["step_targets"][i, j, 9]) - 1 for j in range(5)] == hops
        assert (b["step_targets"][i, :, :9] == IGNORE).all()
    # the answer is uniform over the other symbols: never the start, no symbol preferred
    ans = b["targets"][:, 9]
    assert not (ans == b["inputs"][:, 9]).any()
    assert "hops 5" in task.decode_row(b, 0)


def test_pointer_chase_metrics():
    task = get_task("pointer_chase", symbols=6, hops=3)
    b = task.generate(40, seed=0)
    pred = b["targets"].copy()
    pred[:10, -1] = np.where(pred[:10, -1] == 1, 2, 1)
    pred[:, 0] = 5                                             # positions outside the answer do not count
    assert task.metrics(pred, b)["accuracy"] == 0.75


def test_schedule_against_running_the_circuit_by_hand():
    task = get_task("schedule", layers=6, width=7, alphabet=3, circuit_seed=4)
    c = task.circuit
    assert c.partners.shape == (6, 7) and c.tables.shape == (6, 3, 3)
    for t in range(6):
        x, seen = 0, set()                                     # π_t: one cycle through all positions
        for _ in range(7):
            seen.add(x)
            x = int(c.partners[t][x])
        assert x == 0 and len(seen) == 7
        for row in c.tables[t]:                                # a Latin square: a bijection in each argument
            assert sorted(row) == [0, 1, 2]
        for col in c.tables[t].T:
            assert sorted(col) == [0, 1, 2]
    b = task.generate(100, seed=0, split="test")
    for i in range(100):
        states = c.run_reference([int(v) - 1 for v in b["inputs"][i]])
        assert (b["step_targets"][i] - 1).tolist() == states
        assert (b["targets"][i] - 1).tolist() == states[-1]


def test_schedule_circuit_depends_on_its_seed_only_and_period_repeats_layers():
    a = draw_circuit(1, 5, 6, 4)
    assert np.array_equal(a.partners, draw_circuit(1, 5, 6, 4).partners)
    assert not np.array_equal(a.partners, draw_circuit(2, 5, 6, 4).partners)
    p = draw_circuit(1, 5, 6, 4, period=2)
    assert np.array_equal(p.partners[[0, 2, 4]], np.repeat(a.partners[:1], 3, 0))
    assert np.array_equal(p.tables[[1, 3]], np.repeat(a.tables[1:2], 2, 0))
    one = get_task("schedule", layers=4, width=5, alphabet=3, period=1)
    assert (one.circuit.partners == one.circuit.partners[0]).all()
    # the same circuit for every split and data seed: the rows of all of them follow it
    for split, seed in (("train", 0), ("test", 9)):
        b = one.generate(20, seed, split)
        assert np.array_equal(b["step_targets"] - 1, one.circuit.run(b["inputs"] - 1))


def test_schedule_layers_mix_positions():
    """After enough layers an output position depends on inputs other than its own (no position-wise shortcut)."""
    task = get_task("schedule", layers=3, width=8, alphabet=4)
    x = np.zeros((1, 8), np.int64)
    base = task.circuit.run(x)[0, -1]
    moved = set()
    for pos in range(8):
        y = x.copy()
        y[0, pos] = 1
        moved |= {int(i) for i in np.nonzero(task.circuit.run(y)[0, -1] != base)[0] if i != pos}
    assert moved                                               # changing one input changes other outputs


@pytest.mark.parametrize("name,opts", [("word_problem", {"group": "Z3", "length": 6}),
                                       ("pointer_chase", {"symbols": 4, "hops": 2}),
                                       ("schedule", {"layers": 2, "width": 6, "alphabet": 2})])
def test_splits_are_disjoint_even_in_small_spaces(name, opts):
    task = get_task(name, **opts)
    train_, test_ = task.generate(3000, 0, "train"), task.generate(300, 0, "test")
    tr = {r.tobytes() for r in train_["inputs"]}
    assert not any(r.tobytes() in tr for r in test_["inputs"])
    assert in_split(train_["inputs"], "train").all() and in_split(test_["inputs"], "test").all()
    assert not in_split(test_["inputs"], "val").any()


def test_row_buckets_spread_rows_evenly():
    rows = np.random.default_rng(0).integers(0, 5, size=(32000, 7))
    counts = np.bincount(row_buckets(rows), minlength=16)
    assert counts.min() > 1700 and counts.max() < 2300


@pytest.mark.parametrize("name,opts", [("word_problem", {"group": "A5", "length": 9}),
                                       ("pointer_chase", {"symbols": 8, "hops": 5}),
                                       ("schedule", {"layers": 4, "width": 6})])
def test_same_bytes_for_any_worker_count(tmp_path, name, opts):
    task = get_task(name, **opts)
    for w in (1, 2):
        write_dataset(tmp_path / f"w{w}", task, 900, 200, seed=5, workers=w, chunk_size=250, progress=False)
    for part in ("train/inputs.npy", "train/targets.npy", "train/step_targets.npy", "test/step_targets.npy"):
        assert (tmp_path / "w1" / part).read_bytes() == (tmp_path / "w2" / part).read_bytes()
    again, splits = open_dataset(tmp_path / "w1", verify=True)
    assert again.options() == task.options() and splits["train"]["step_targets"].shape == (900, task.steps,
                                                                                            task.seq_len)
    a, b = task.generate(50, 7), task.generate(50, 7)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["inputs"], task.generate(50, 8)["inputs"])


@pytest.mark.parametrize("name,opts,needle", [
    ("word_problem", {"group": "Q8"}, "option group"),
    ("word_problem", {"scan": "tree"}, "option scan"),
    ("word_problem", {"group": 5}, "option group"),
    ("word_problem", {"length": 0}, "option length"),
    ("pointer_chase", {"symbols": 8, "hops": 8}, "option hops"),
    ("pointer_chase", {"symbols": 1}, "option symbols"),
    ("schedule", {"alphabet": 1}, "option alphabet"),
    ("schedule", {"layers": 3, "period": 4}, "option period"),
    ("schedule", {"width": 2.5}, "option width"),
])
def test_bad_options_are_one_line_errors(name, opts, needle):
    with pytest.raises(UserError, match=needle):
        get_task(name, **opts)


def test_bad_options_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["data", "gen", "pointer_chase", "--out", str(out), "--train", "10", "--test", "5",
                 "--opt", "hops=40"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("loopformer: error:") == 1 and "option hops" in err
    assert not out.exists()
    assert main(["data", "gen", "schedule", "--out", str(out), "--train", "30", "--test", "10",
                 "--opt", "layers=3", "--opt", "width=5"]) == 0
    capsys.readouterr()
    assert main(["data", "show", str(out), "-n", "2"]) == 0
    assert "(3 layers)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ per-loop targets
def test_loop_steps():
    assert loop_steps(4, 4).tolist() == [1, 2, 3, 4]
    assert loop_steps(6, 3).tolist() == [1, 2, 3, 3, 3, 3]             # one step per loop, then the answer held
    assert loop_steps(4, 8).tolist() == [2, 4, 6, 8]                   # several steps per loop
    assert loop_steps(3, 8).tolist() == [3, 6, 8]
    for R, K in itertools.product(range(1, 12), range(1, 12)):
        j = loop_steps(R, K)
        assert j[-1] == K and (np.diff(j) >= 0).all() and j[0] >= 1


def test_per_loop_loss_equals_the_loss_of_each_loop_on_its_own_targets():
    g = torch.Generator().manual_seed(0)
    R, B, T, C, K = 5, 3, 4, 6, 3
    logits = torch.randn(R, B, T, C, generator=g)
    steps = torch.randint(0, C, (B, K, T), generator=g)
    steps[:, :, 0] = IGNORE
    tg = loop_targets(steps, R, 4)                                     # the last 4 loops: steps 2, 3, 3, 3
    assert tg.shape == (4, B, T)
    assert torch.equal(tg[0], steps[:, 1]) and all(torch.equal(tg[i], steps[:, 2]) for i in (1, 2, 3))
    s, count = summed_loss(logits[-4:], tg)
    want = sum(torch.nn.functional.cross_entropy(logits[1 + i].reshape(-1, C), tg[i].reshape(-1),
                                                 ignore_index=IGNORE, reduction="sum") for i in range(4))
    assert torch.allclose(s, want) and count == B * (T - 1)


def test_prefix_targets_keep_each_loop_on_its_step_in_a_curriculum():
    """A curriculum's shorter step of R loops spreads the K steps over the R loops."""
    K, B, T = 8, 2, 3
    steps = torch.arange(K)[None, :, None].expand(B, K, T)            # step j's state is the number j - 1
    assert loop_targets(steps, 4, 4)[:, 0, 0].tolist() == [1, 3, 5, 7]            # spread: steps 2, 4, 6, 8
    assert loop_targets(steps, 8, 8)[:, 0, 0].tolist() == list(range(8))           # R = K: one step per loop
    # a loop rule's batch of short rows (R = 4 < K = 8): loop t is step t, never spread
    assert loop_targets(steps, 4, 4, per_row=True)[:, 0, 0].tolist() == [0, 1, 2, 3]
    assert loop_targets(steps, 10, 3, per_row=True)[:, 0, 0].tolist() == [7, 7, 7]   # past K: the final state


TINY = ["task.n_train=256", "task.n_test=64", "model.d_model=16", "model.n_heads=2", "model.loops=3",
        "model.input_injection=true", "train.steps=6", "train.batch_size=16", "train.optim.lr=3e-3",
        "train.log_every=3", "eval.batch_size=64", "eval.max_loops=4", "log.tensorboard=false", "log.progress=false",
        "train.losses.loops=all"]


def test_training_with_per_loop_targets(tmp_path):
    over = [*TINY, "task.name=schedule", "task.options={layers: 3, width: 5, alphabet: 3}"]
    a = train(load_run_config(None, [*over, "task.loop_targets=true", f"out_dir={tmp_path / 'a'}"]))
    b = train(load_run_config(None, [*over, f"out_dir={tmp_path / 'b'}"]))
    assert a["task"]["loop_targets"] and not b["task"]["loop_targets"]
    la = [r for r in map(json.loads, open(tmp_path / "a" / "metrics.jsonl")) if r.get("split") == "train"]
    lb = [r for r in map(json.loads, open(tmp_path / "b" / "metrics.jsonl")) if r.get("split") == "train"]
    assert la[0]["loss"] != lb[0]["loss"]                              # the early loops see other targets
    assert [p["loop"] for p in a["loopwise"]] == [1, 2, 3, 4]


@pytest.mark.parametrize("over,needle", [
    (["task.name=lcs", "task.options={length: 3, alphabet_max: 3}", "task.answer_only=true",
      "task.loop_targets=true"], "no intermediate states"),
    (["task.name=schedule", "task.options={layers: 2, width: 4}", "task.loop_targets=true",
      "train.losses.loops=last"], "train.losses.loops"),
])
def test_per_loop_targets_refused_where_they_cannot_apply(tmp_path, capsys, over, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("log: {tensorboard: false}\n")
    assert main(["train", str(cfg), *TINY, *over, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and needle in err
    assert not os.path.exists(tmp_path / "r" / "results.json")


def test_loopwise_step_accuracy_scores_each_loop_against_its_state(tmp_path):
    """A model whose read-out after loop t is exactly layer t's state scores step_accuracy 1 at every loop (and
    accuracy 1 only from the last layer on): checked with a stand-in model that returns the reference states."""
    from loopformer.eval.evaluate import loop_metrics
    from loopformer.model.looped import LoopOutput
    from loopformer.sources import TaskConfig, make_data

    data = make_data(TaskConfig(name="schedule", options={"layers": 3, "width": 5, "alphabet": 3}, n_train=10,
                                n_test=40))
    states = torch.as_tensor(np.asarray(data.test["step_targets"], dtype=np.int64))           # [N,K,T]

    class Oracle(torch.nn.Module):
        config = type("C", (), {"loops": 3, "out_dim": 4})()

        def forward(self, x, loops, return_all=False):
            rows = [int(np.nonzero((data.test["inputs"] == r).all(1))[0][0]) for r in x.numpy()]
            seq = [states[rows, min(t, 2)] for t in range(loops)]                               # [b,T] each
            logits = torch.stack([torch.nn.functional.one_hot(s, 4).float() for s in seq])      # [R,b,T,C]
            return LoopOutput(logits=logits[-1], hidden=logits[-1], all_logits=logits)

    out = loop_metrics(Oracle(), data, 4, True, 16, 0, torch.device("cpu"), torch.no_grad, False)
    assert [m["step_accuracy"] for m in out] == [1.0, 1.0, 1.0, 1.0]
    assert [m["accuracy"] for m in out][:2] != [1.0, 1.0] and out[2]["accuracy"] == out[3]["accuracy"] == 1.0
