"""The tasks whose continuity is set by a dial: label sequences of dialled variation (Lemma 4.1's setting) and the
dial map (token and contextual moduli dialled apart, Theorem 3.6), against brute-force references; their dials'
measured variation and moduli; the circuit's period as a dial of distinct layers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from loopformer.cli import main
from loopformer.data.dataset import open_dataset, write_dataset
from loopformer.errors import UserError
from loopformer.tasks import get_task
from loopformer.tasks.common import in_split
from loopformer.tasks.dial_map import target
from loopformer.tasks.label_sequence import draw_table, table_variation
from loopformer.tasks.schedule import draw_circuit
from loopformer.theory.moduli import estimate_modulus
from loopformer.theory.targets import load_target
from loopformer.train.config import load_run_config
from loopformer.train.trainer import train


# ------------------------------------------------------------------------------------------------ references
def pursuit_reference(z: list[int], jump: int) -> list[int]:
    """A sequence pursuing the draws z with steps of at most `jump`, one label at a time."""
    y = [z[0]]
    for v in z[1:]:
        step = v - y[-1]
        y.append(y[-1] + (max(-jump, min(jump, step))))
    return y


def variation_reference(table: list[list[int]]) -> tuple[int, float]:
    steps = [[abs(b - a) for a, b in zip(row, row[1:])] for row in table]
    return max((max(s) for s in steps if s), default=0), sum(sum(s) for s in steps) / len(table)


def tri_reference(z: float) -> float:
    r = math.fmod(z, 2.0)
    return 1.0 - abs((r + 2.0 if r < 0 else r) - 1.0)


def dial_reference(x: list[int], levels: int, bins: int, alpha: float, beta: float) -> list[int]:
    """The bins of one row, one position at a time in Python floats."""
    u = [v / (levels - 1) for v in x]
    out = []
    for i in range(len(u)):
        s = math.fsum(u[j] for j in range(len(u)) if j != i) / math.sqrt(len(u) - 1)
        out.append(min(bins - 1, math.floor(bins * tri_reference(alpha * u[i] + beta * s) + 1e-9)))
    return out


# ------------------------------------------------------------------------------------------------ label_sequence
def test_label_sequence_against_the_pursuit_one_label_at_a_time():
    task = get_task("label_sequence", keys=7, length=6, labels=9, jump=2, width=5, table_seed=3)
    assert task.seq_len == 5 and task.steps == 6 and not task.causal and task.vocab_size == 1 + 7 + 9
    draws = np.random.default_rng([3, 0x1AB5E9]).integers(0, 9, size=(7, 6))
    table = [pursuit_reference([int(v) for v in row], 2) for row in draws]
    assert task.table.tolist() == table
    b = task.generate(200, seed=1, split="test")
    for i in range(200):
        keys = [int(v) - 1 for v in b["inputs"][i]]
        assert [int(v) - task.first_label for v in b["targets"][i]] == [table[k][-1] for k in keys]
        for t in range(6):                                   # loop t + 1 reads label t of each key's sequence
            assert [int(v) - task.first_label for v in b["step_targets"][i, t]] == [table[k][t] for k in keys]
    assert np.array_equal(b["step_targets"][:, -1], b["targets"])
    assert (np.abs(np.diff(b["step_targets"].astype(int), axis=1)) <= 2).all()   # per-loop targets move ≤ J
    assert "y(k" in task.decode_row(b, 0) and "jump <= 2" in task.decode_row(b, 0)


def test_label_sequence_dial_ends():
    """J = 0: constant sequences; J = L - 1: the independent uniform draws themselves."""
    flat = get_task("label_sequence", keys=40, length=9, labels=6, jump=0)
    assert (flat.table == flat.table[:, :1]).all() and flat.variation() == {"max_jump": 0, "total_variation": 0.0,
                                                                            "mean_jump": 0.0}
    rough = get_task("label_sequence", keys=40, length=9, labels=6, jump=5)
    assert np.array_equal(rough.table, np.random.default_rng([0, 0x1AB5E9]).integers(0, 6, size=(40, 9)))


def test_label_sequence_variation_against_brute_force():
    for jump in (0, 1, 3, 7):
        task = get_task("label_sequence", keys=12, length=10, labels=8, jump=jump, table_seed=5)
        mj, tv = variation_reference(task.table.tolist())
        v = task.variation()
        assert v["max_jump"] == mj <= jump and v["total_variation"] == pytest.approx(tv)
        assert v["mean_jump"] == pytest.approx(tv / 9)
        assert f"max jump {mj}" in task.describe()
    assert table_variation(np.zeros((3, 1), int)) == {"max_jump": 0, "total_variation": 0.0, "mean_jump": 0.0}


def test_label_sequence_variation_rises_with_the_dial_for_every_sequence():
    """Every sequence's largest step and total variation are non-decreasing in J: exhaustively for all draws of 6
    labels over 6 values, and on drawn tables of several seeds (the same draws at every J)."""
    for z in itertools.product(range(6), repeat=6):
        prev = (-1, -1)
        for jump in range(6):
            y = pursuit_reference(list(z), jump)
            steps = [abs(b - a) for a, b in zip(y, y[1:])]
            now = (max(steps), sum(steps))
            assert now[0] >= prev[0] and now[1] >= prev[1] and now[0] <= jump
            prev = now
    for seed in range(4):
        v = [table_variation(draw_table(seed, 16, 8, 16, j)) for j in range(16)]
        mj, tv = [x["max_jump"] for x in v], [x["total_variation"] for x in v]
        assert mj[:13] == list(range(13)) and all(a <= b <= j for j, (a, b) in enumerate(zip(mj, mj[1:]), 1))
        assert all(b > a for a, b in zip(tv[:13], tv[1:13])) and all(b >= a for a, b in zip(tv, tv[1:]))


def test_label_sequence_metrics():
    task = get_task("label_sequence", keys=5, length=3, labels=10, jump=3, width=4)
    b = task.generate(50, seed=0)
    pred = b["targets"].copy()
    assert task.metrics(pred, b) == {"accuracy": 1.0, "token_accuracy": 1.0, "label_error": 0.0,
                                     "max_label_error": 0.0}
    y = pred[:10, 0] - task.first_label
    pred[:10, 0] = np.where(y >= 2, pred[:10, 0] - 2, pred[:10, 0] + 2)        # 2 labels off at one position
    pred[10:15, 1] = 1                                                         # a key token: not a label (L - 1)
    m = task.metrics(pred, b)
    assert m["accuracy"] == 0.7 and m["max_label_error"] == 9.0
    assert m["label_error"] == pytest.approx((10 * 2 + 5 * 9) / 200)


# ------------------------------------------------------------------------------------------------ dial_map
@pytest.mark.parametrize("alpha,beta,width", [(1.0, 1.0, 6), (3.5, 0.0, 4), (0.0, 2.0, 5), (7, 3, 3)])
def test_dial_map_against_the_formula_one_position_at_a_time(alpha, beta, width):
    task = get_task("dial_map", width=width, levels=11, bins=7, token_lipschitz=alpha, context_lipschitz=beta)
    assert task.seq_len == width and task.vocab_size == 1 + 11 + 7 and not task.causal
    b = task.generate(300, seed=2, split="test")
    for i in range(300):
        x = [int(v) - 1 for v in b["inputs"][i]]
        assert [int(v) - task.first_bin for v in b["targets"][i]] == dial_reference(x, 11, 7, alpha, beta)
    assert "-> bins" in task.decode_row(b, 0)


def test_dial_map_by_hand():
    """α = 1, β = 0: f(u)_i = u_i, so bin = ⌊B·x/(Q-1)⌋ (the top level in the top bin); α = 0: the context only."""
    task = get_task("dial_map", width=3, levels=5, bins=4, token_lipschitz=1, context_lipschitz=0)
    assert task.solve(np.array([[0, 1, 2], [3, 4, 4]])).tolist() == [[0, 1, 2], [3, 3, 3]]
    ctx = get_task("dial_map", width=3, levels=5, bins=4, token_lipschitz=0, context_lipschitz=math.sqrt(2))
    # s_i·√2 = the others' sum: (0.25 + 0.5), (0 + 0.5), (0 + 0.25) -> tri = 0.75, 0.5, 0.25
    assert ctx.solve(np.array([[0, 1, 2]])).tolist() == [[3, 2, 1]]
    assert ctx.function(np.array([[[0.0, 0.0, 0.0]]])).tolist() == [[[0.0, 0.0, 0.0]]]
    assert task.function(np.array([0.25, 1.0, 1.5, 2.5, -0.5])[None, :]).tolist() == [[0.25, 1.0, 0.5, 0.5, 0.5]]


def test_dial_map_metrics():
    task = get_task("dial_map", width=4, levels=6, bins=5)
    b = task.generate(40, seed=0)
    pred = b["targets"].copy()
    bins = pred[:8, 2] - task.first_bin
    pred[:8, 2] = np.where(bins >= 1, pred[:8, 2] - 1, pred[:8, 2] + 1)
    m = task.metrics(pred, b)
    assert m["accuracy"] == 0.8 and m["bin_error"] == pytest.approx(8 / 160) and m["token_accuracy"] == 1 - 8 / 160


def _moduli(alpha, beta, quantised=False, **kw):
    f = target(token_lipschitz=alpha, context_lipschitz=beta, quantised=quantised)
    kw = {"samples": 512, "steps": 40, "restarts": 4, "seed": 0, **kw}
    return {k: estimate_modulus(f, 0.1, k, 1, 6, **kw).value for k in ("tok", "cont")}


def test_dial_map_moduli_follow_their_dials():
    """Measured (certified lower bounds, sampling plus gradient ascent): ω^tok(0.1) = 0.1·α whatever β, ω^cont(0.1)
    = 0.1·β whatever α — never above the exact value, and within 2 % of it."""
    dials = (0.5, 1, 2, 4)
    tok = [_moduli(a, 1.0) for a in dials]
    cont = [_moduli(1.0, b) for b in dials]
    for d, m in zip(dials, tok):
        assert 0.098 * d <= m["tok"] <= 0.1 * d + 1e-12 and 0.098 <= m["cont"] <= 0.1 + 1e-12
    for d, m in zip(dials, cont):
        assert 0.098 * d <= m["cont"] <= 0.1 * d + 1e-12 and 0.098 <= m["tok"] <= 0.1 + 1e-12
    assert all(b["tok"] > a["tok"] for a, b in zip(tok, tok[1:]))
    assert all(b["cont"] > a["cont"] for a, b in zip(cont, cont[1:]))
    # the token task's own (quantised) map: its moduli rise with the dials too (sampling only: no gradients)
    qt = [_moduli(a, 1.0, quantised=True, samples=2048) for a in (0.5, 2, 8)]
    qc = [_moduli(1.0, b, quantised=True, samples=2048) for b in (0.5, 2, 8)]
    assert qt[0]["tok"] < qt[1]["tok"] < qt[2]["tok"] and qc[0]["cont"] < qc[1]["cont"] < qc[2]["cont"]


def test_dial_map_target_from_the_command_line(capsys):
    spec = "loopformer.tasks.dial_map:target(token_lipschitz=2, context_lipschitz=0.5)"
    assert main(["theory", "modulus", "--target", spec, "--N", "4", "--delta", "0.1", "--samples", "256",
                 "--steps", "20", "--restarts", "2"]) == 0
    rows = {line.split("|")[1].strip(): float(line.split("|")[3]) for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in ("tok", "cont", "seq")}
    assert rows["tok"] == pytest.approx(0.2, abs=0.004) and rows["cont"] == pytest.approx(0.05, abs=0.001)
    assert rows["seq"] <= (2 + 0.5 * math.sqrt(3)) * 0.1 + 1e-12
    assert load_target("loopformer.tasks.dial_map:target()")(np.zeros((1, 3))).shape == (1, 3)


@pytest.mark.parametrize("spec,needle", [
    ("loopformer.tasks.dial_map:target(width=1)", "option width"),
    ("loopformer.tasks.dial_map:target(alpha=1)", "unknown option 'alpha'"),
    ("loopformer.tasks.dial_map:target(quantised=1)", "option quantised"),
    ("loopformer.tasks.dial_map:target(token_lipschitz=x)", "key=value pairs of literals"),
    ("loopformer.tasks.dial_map:target(4)", "key=value pairs of literals"),
    ("loopformer.tasks.dial_map:EDGE()", "not callable"),
])
def test_bad_target_factories_are_one_line_errors(spec, needle, capsys):
    with pytest.raises(UserError, match=needle):
        load_target(spec)
    assert main(["theory", "modulus", "--target", spec, "--delta", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("loopformer: error:") == 1


# ------------------------------------------------------------------------------------------------ both tasks
OPTS = [("label_sequence", {"keys": 8, "length": 5, "labels": 7, "jump": 2, "width": 5}),
        ("dial_map", {"width": 5, "levels": 6, "bins": 5, "token_lipschitz": 2.0})]


@pytest.mark.parametrize("name,opts", OPTS)
def test_same_seed_same_bytes_and_disjoint_splits(tmp_path, name, opts):
    task = get_task(name, **opts)
    for w in (1, 2):
        write_dataset(tmp_path / f"w{w}", task, 600, 100, seed=5, workers=w, chunk_size=150, progress=False)
    parts = ["train/inputs.npy", "train/targets.npy", "test/inputs.npy", "test/targets.npy"]
    parts += ["train/step_targets.npy"] if task.steps else []
    for part in parts:
        assert (tmp_path / "w1" / part).read_bytes() == (tmp_path / "w2" / part).read_bytes()
    again, splits = open_dataset(tmp_path / "w1", verify=True)
    assert again.options() == task.options()
    assert not {r.tobytes() for r in splits["test"]["inputs"]} & {r.tobytes() for r in splits["train"]["inputs"]}
    a, b = task.generate(50, 7), task.generate(50, 7)
    assert all(np.array_equal(a[k], b[k]) for k in a) and in_split(a["inputs"], "train").all()
    assert not np.array_equal(a["inputs"], task.generate(50, 8)["inputs"])


def test_the_table_depends_on_its_seed_only():
    a = get_task("label_sequence", table_seed=1, jump=4)
    assert np.array_equal(a.table, get_task("label_sequence", table_seed=1, jump=4, width=3).table)
    assert not np.array_equal(a.table, get_task("label_sequence", table_seed=2, jump=4).table)
    b = a.generate(30, seed=0, split="train")                  # the same table for every split and data seed
    c = a.generate(30, seed=9, split="test")
    for batch in (b, c):
        assert np.array_equal(batch["step_targets"] - a.first_label, a.table[batch["inputs"] - 1].transpose(0, 2, 1))


@pytest.mark.parametrize("name,opts,needle", [
    ("label_sequence", {"keys": 1}, "option keys"),
    ("label_sequence", {"labels": 5, "jump": 5}, "option jump"),
    ("label_sequence", {"jump": -1}, "option jump"),
    ("label_sequence", {"jump": 1.5}, "option jump"),
    ("label_sequence", {"length": 0}, "option length"),
    ("label_sequence", {"width": 1}, "option width"),
    ("label_sequence", {"table_seed": -3}, "option table_seed"),
    ("label_sequence", {"n_keys": 4}, "unknown option 'n_keys'"),
    ("dial_map", {"width": 1}, "option width"),
    ("dial_map", {"levels": 1}, "option levels"),
    ("dial_map", {"bins": 1}, "option bins"),
    ("dial_map", {"token_lipschitz": -1}, "option token_lipschitz"),
    ("dial_map", {"context_lipschitz": "big"}, "option context_lipschitz"),
    ("dial_map", {"token_lipschitz": True}, "option token_lipschitz"),
])
def test_bad_options_are_one_line_errors(name, opts, needle):
    with pytest.raises(UserError, match=needle):
        get_task(name, **opts)


def test_data_gen_and_show_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["data", "gen", "label_sequence", "--out", str(out), "--train", "40", "--test", "10",
                 "--opt", "jump=4", "--opt", "length=5", "--opt", "table_seed=2"]) == 0
    capsys.readouterr()
    assert main(["data", "show", str(out), "-n", "2"]) == 0
    shown = capsys.readouterr().out
    assert "task label_sequence" in shown and "(jump <= 4: max " in shown and "test 10" in shown
    _, splits = open_dataset(out)
    assert splits["train"]["step_targets"].shape == (40, 5, 8)
    bad = tmp_path / "bad"
    assert main(["data", "gen", "dial_map", "--out", str(bad), "--train", "10", "--test", "5",
                 "--opt", "bins=1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("loopformer: error:") == 1 and "option bins" in err
    assert not bad.exists()


TINY = ["task.n_train=64", "task.n_test=32", "model.d_model=16", "model.n_heads=2", "model.loops=2",
        "train.steps=2", "train.batch_size=16"]


@pytest.mark.parametrize("name,opts", [("label_sequence", "{keys: 6, length: 3, labels: 5, jump: 2, width: 4}"),
                                       ("dial_map", "{width: 4, levels: 6, bins: 4, context_lipschitz: 2.5}")])
def test_two_training_steps(tmp_path, name, opts):
    res = train(load_run_config(None, [*TINY, f"task.name={name}", f"task.options={opts}", f"out_dir={tmp_path}"]))
    assert res["task"]["name"] == name and 0 <= res["test"]["accuracy"] <= 1
    assert ("label_error" if name == "label_sequence" else "bin_error") in res["test"]


def test_per_loop_targets_reach_the_source():
    """task.loop_targets: the training batches carry each key's labels, loop t against label t - 1."""
    from loopformer.sources import TaskConfig, make_data

    data = make_data(TaskConfig(name="label_sequence", options={"keys": 6, "length": 4, "labels": 5, "width": 3},
                                n_train=20, n_test=10, loop_targets=True))
    steps = np.asarray(data.train["step_targets"])
    assert steps.shape == (20, 4, 3)
    assert np.array_equal(steps - data.task.first_label,
                          data.task.table[np.asarray(data.train["inputs"]) - 1].transpose(0, 2, 1))


# ------------------------------------------------------------------------------------------------ the circuit's period
@pytest.mark.parametrize("period", [1, 2, 4, 8, 16])
def test_circuit_period_gives_exactly_that_many_distinct_layers_in_turn(period):
    """period = p: layer t is distinct layer t mod p, and the p layers are pairwise distinct maps (their
    partners or tables differ, and a layer's map determines both: a Latin square is a bijection in each argument);
    p = K is the circuit with all K layers distinct (period 0)."""
    K = 16
    c = get_task("schedule", layers=K, width=12, alphabet=4, circuit_seed=3, period=period).circuit
    layers = [(c.partners[t].tobytes(), c.tables[t].tobytes()) for t in range(K)]
    assert len(set(layers)) == period
    assert all(layers[t] == layers[t % period] for t in range(K))
    x = np.random.default_rng(0).integers(0, 4, size=(64, 12))    # the maps differ on inputs, not only in parameters
    single = [type(c)(c.partners[t:t + 1], c.tables[t:t + 1]).run(x)[:, 0].tobytes() for t in range(period)]
    assert len(set(single)) == period
    full = draw_circuit(3, K, 12, 4, 0)
    if period == K:
        assert np.array_equal(c.partners, full.partners) and np.array_equal(c.tables, full.tables)
    assert np.array_equal(c.partners[:period], full.partners[:period])   # the p layers are the first p drawn
