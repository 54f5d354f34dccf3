"""The dials study's pieces: the η(t) arm (`loopformer.lab.loop_scales`) against the loop written out, the label
sequences' per-loop label error against a brute-force count, and the study's summary on made-up runs."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.tasks.label_sequence import LabelSequenceTask

ROOT = Path(__file__).resolve().parents[1]


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=16, n_heads=2, loops=4, max_len=16, input_injection=True, causal=False)
    return ModelConfig(**{**base, **kw})


# ------------------------------------------------------------------ η(t): Theorem 4.2's model
def test_loop_scales_against_the_loop_written_out():
    torch.manual_seed(0)
    m = LoopedTransformer(_cfg(extensions={"loop_scales": {}})).eval()
    ext = m.extensions[0]
    assert len(ext.eta) == 4 and all(torch.equal(p, torch.ones(16)) for p in ext.eta)
    assert m.num_params() == LoopedTransformer(_cfg()).num_params() + 4 * 16      # r·D parameters more
    x = torch.randint(0, 11, (2, 6))
    # at init (η = 1) it is the looped model of the same weights, loop for loop
    plain = LoopedTransformer(_cfg()).eval()
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("extensions.")})
    torch.testing.assert_close(m(x, return_all=True).all_hidden, plain(x, return_all=True).all_hidden)
    with torch.no_grad():
        for p in ext.eta:
            p.uniform_(-1.0, 2.0)
    eta = [p.detach().clone() for p in ext.eta]
    e = m.embed(x)
    h, states = e, []
    for t in range(6):                                    # two loops past r: η(r-1) again
        z = m.blocks[0](h + e if t > 0 else h)
        h = h + eta[min(t, 3)] * (z - h)
        states.append(h)
    out = m(x, loops=6, return_all=True)
    torch.testing.assert_close(out.all_hidden, torch.stack(states))
    # a loop per row: row b's η(t_b), past r the last
    t = torch.tensor([0, 2, 9])
    torch.testing.assert_close(ext.scales(t), torch.stack([eta[0], eta[2], eta[3]])[:, None])
    # every η(t) a loop reads is trained, and nothing else changes where η(t) is not read
    m.train()
    m(x, loops=2).logits.square().mean().backward()
    assert [p.grad is not None and p.grad.abs().sum() > 0 for p in ext.eta] == [True, True, False, False]


def test_loop_scales_options_are_checked():
    m = LoopedTransformer(_cfg(extensions={"loop_scales": {"init": 0.5}}))
    assert all(torch.equal(p, torch.full((16,), 0.5)) for p in m.extensions[0].eta)
    for bad in (math.nan, 1e6, "1", True):
        with pytest.raises(ValueError, match="loop_scales.init must be a number"):
            _cfg(extensions={"loop_scales": {"init": bad}})


# ------------------------------------------------------------------ the per-loop label error
def test_step_label_error_against_a_brute_force_count():
    task = LabelSequenceTask(keys=4, length=3, labels=5, jump=2, width=3)
    rng = np.random.default_rng(0)
    state = rng.integers(task.first_label, task.first_label + 5, size=(7, 3))          # [N,T] label tokens
    pred = state.copy()
    pred[0, 1] = task.first_label + (state[0, 1] - task.first_label + 2) % 5           # a label off by 2 or 3
    pred[3, 2] = 0                                                                      # not a label: L - 1
    errs = [abs(int(p) - int(s)) if task.first_label <= p < task.first_label + 5 else 4
            for p, s in zip(pred.ravel(), state.ravel())]
    got = task.step_metrics(pred, state)
    assert got == {"step_label_error": pytest.approx(sum(errs) / len(errs)), "step_max_label_error": max(errs)}


def test_loop_wise_evaluation_reads_every_loop_against_its_label():
    """The token source's summary: loop t's step metrics against label t-1, their mean over loops 1..r at r."""
    from loopformer.sources import TokenData
    from loopformer.sources.base import TaskConfig

    cfg = TaskConfig(name="label_sequence", options={"keys": 4, "length": 3, "labels": 6, "jump": 5, "width": 4},
                     n_train=64, n_test=40, loop_targets=True)
    data = TokenData(cfg)
    rows = data.test_rows(0)
    steps = rows["step_targets"]                                                        # [N,K,T]
    # predictions: loop 1 right, loop 2 every label +1 (or L-1 for the last label), loop 3 the first label
    pred = np.stack([steps[:, 0], np.where(steps[:, 1] < data.task.first_label + 5, steps[:, 1] + 1, 0),
                     steps[:, 0]])
    out = data.summarize([(pred, rows)], 0, 3)
    want = [float(data.task.label_errors(pred[t], steps[:, t]).mean()) for t in range(3)]
    assert [m["step_label_error"] for m in out] == pytest.approx(want)
    assert out[0]["step_label_error"] == 0 and out[0]["step_accuracy"] == 1
    assert out[2]["loops_step_label_error"] == pytest.approx(sum(want) / 3)
    assert out[2]["loops_step_max_label_error"] == pytest.approx(np.mean([m["step_max_label_error"] for m in out]))
    assert "loops_step_label_error" not in out[1]


# ------------------------------------------------------------------ the study's summary
def _summary():
    spec = importlib.util.spec_from_file_location("dial_summary", ROOT / "studies" / "dials" / "dial_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_least_squares_fit_against_numpy():
    fit = _summary().fit
    rng = np.random.default_rng(1)
    x1, x2 = rng.uniform(1, 16, 12), rng.uniform(0, 8, 12)
    y = 0.3 + 0.1 * np.log2(x1) - 0.05 * x2 + rng.normal(0, 0.01, 12)
    got = fit(list(np.log2(x1)), list(x2), list(y))
    ref, *_ = np.linalg.lstsq(np.column_stack([np.ones(12), np.log2(x1), x2]), y, rcond=None)
    assert [got["intercept"], got["slope_log2_r"], got["slope_dial"]] == pytest.approx(list(ref))
    assert 0.9 < got["r2"] <= 1 and got["n"] == 12
    assert fit([1.0], [2.0], [0.5]) is None                                             # too few points


def test_summary_of_made_up_runs(tmp_path):
    mod = _summary()
    sweeps, out = tmp_path / "sweeps", tmp_path / "out"
    for setting, jump in (("j1", 1), ("j15", 15)):
        for r in (2, 4):
            for arm in ("looped", "tmlt"):
                for seed in (0, 1):
                    run = sweeps / "labels" / f"{setting}-r{r}" / arm / "runs" / f"seed={seed}"
                    run.mkdir(parents=True)
                    err = 0.1 * r * jump / 15 * (arm == "looped") + 0.01 * seed
                    res = {"task": {"name": "label_sequence", "options": {"jump": jump, "length": r}},
                           "variant": "looped", "seed": seed, "loops": r, "steps": 200, "params": 1000,
                           "test": {"accuracy": 0.5, "token_accuracy": 0.9, "label_error": err,
                                    "loops_step_label_error": err}}
                    (run / "results.json").write_text(json.dumps(res))
    rows = mod.main([str(sweeps), str(out)])
    assert len(rows) == 16
    back = json.loads((out / "results.json").read_text())
    cells = back["cells"]
    c = next(c for c in cells if c["setting"] == "j15" and c["r"] == 4 and c["arm"] == "looped")
    assert c["error"]["median"] == pytest.approx(0.4 + 0.005) and c["error"]["range"] == pytest.approx([0.4, 0.41])
    fits = {f["arm"]: f for f in back["fits"] if f["family"] == "labels" and f["setting"] == "all"}
    assert fits["looped"]["slope_dial"] > 0 and abs(fits["tmlt"]["slope_dial"]) < 1e-9
    j1 = next(f for f in back["fits"] if f["setting"] == "j1" and f["arm"] == "looped")      # 0.1·r/15 + seed
    assert j1["slope_dial"] is None and j1["slope_log2_r"] == pytest.approx(0.2 / 15)
    md = (out / "summary.md").read_text()
    assert "| labels | j15 | 4 | looped |" in md and "per doubling of r" in md
    assert (out / "labels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"                # the family's plot
    vs = {v["id"]: v for v in back["predictions"]}                  # looped grows with J at r = 2 and 4, TMLT flat
    assert vs["1"]["verdict"] == "met" and vs["1"]["held"] == "2/2"
    assert vs["2c"]["verdict"] == "met" and vs["2a"]["verdict"] == "not run" and vs["3a"]["verdict"] == "not run"
    assert "| 1 | labels |" in md and "| met |" in md
    with pytest.raises(SystemExit) as exc:                                               # bad input: exit status 2
        mod.main([str(tmp_path / "none"), str(out)])
    assert exc.value.code == 2


@pytest.mark.parametrize("env,args,line", [
    ({}, ["run", "nope"], "unknown family: nope"),
    ({"ARMS": "looped bogus"}, ["run", "labels"], "unknown arm: bogus"),
    ({"RS": "2 x"}, ["run", "labels"], "RS: loop counts are positive integers (got x)"),
    ({"ONLY": "j1 zz"}, ["run", "labels"], "ONLY: no setting named zz"),
])
def test_the_study_stage_refuses_bad_input_in_one_line(tmp_path, env, args, line):
    import os
    import subprocess

    out = subprocess.run(["bash", str(ROOT / "studies" / "dials" / "dial_study.sh"), *args], capture_output=True,
                         text=True, env={**os.environ, "STUDY": str(tmp_path / "s"), **env}, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().startswith(line) and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()                                                # nothing started


def test_predictions_judged_against_hand_made_slopes():
    mod = _summary()

    def rows(slopes: dict[str, float]) -> list[dict]:       # error = slope · J (+ seed noise), J = 1, 15, r = 4
        return [{"family": "labels", "setting": f"j{j}", "r": 4, "arm": arm, "dial": float(j), "seed": seed,
                 "error": k * j + 0.001 * seed, "read": "per loop"}
                for arm, k in slopes.items() for j in (1, 15) for seed in (0, 1)]

    got = rows({"looped": 0.05, "tmlt": 0.08, "eta": -0.01, "standard": 0.02})
    vs = {p[0]: mod.judge(got, mod.cells(got), p) for p in mod.PREDICTIONS}
    assert vs["1"]["verdict"] == "met"                                       # looped slope +0.05 > 0
    assert vs["2c"]["verdict"] == "not met"                                  # the TMLT's +0.08 is not below +0.05
    assert vs["2a"]["verdict"] == "met" and vs["2b"]["verdict"] == "met"     # η(t): -0.01 < 0.05; 0 < 0.75 at J=15
    assert vs["5"]["verdict"] == "not met"                                   # |0.02| is above 0.05 / 4
    assert vs["2a"]["numbers"] == ["eta r=4: -0.01 vs +0.05 (2/2 seeds)"]
    split = [c for c in got if c["arm"] == "looped"] + [                 # TMLT slopes 0 and 0.06 on seeds 0 and 1
        dict(c, arm="tmlt", error=(0.0 if c["seed"] == 0 else 0.06) * c["dial"]) for c in got if c["arm"] == "looped"]
    v = mod.judge(split, mod.cells(split), next(p for p in mod.PREDICTIONS if p[0] == "2c"))
    assert mod.dial_slope(split, "labels", "tmlt", 4) == pytest.approx(0.03)          # below 0.05 over both seeds,
    assert v["verdict"] == "not met" and v["numbers"] == ["tmlt r=4: +0.03 vs +0.05 (1/2 seeds)"]  # not on seed 1
    exact = [dict(c, error=0.0) for c in rows({"looped": 0.0, "standard": 0.0})]    # every arm exact at every J
    vs = {p[0]: mod.judge(exact, mod.cells(exact), p) for p in mod.PREDICTIONS}
    assert vs["5"]["verdict"] == "met" and vs["1"]["verdict"] == "not met"        # no move with J; no growth
    flat = [{"family": "map-token", "setting": "a2", "r": r, "arm": "looped", "dial": 2.0, "seed": seed,
             "error": 0.01 * math.log2(r) + 0.001 * seed, "read": "at r"} for r in (8, 16) for seed in (0, 1)]
    rule = next(p for p in mod.PREDICTIONS if p[0] == "3e")
    for sign, verdict in ((-1, "met"), (1, "not met")):                      # falls with r / rises with r
        flat = [dict(c, error=sign * abs(c["error"])) for c in flat]
        assert mod.judge(flat, mod.cells(flat), rule)["verdict"] == verdict


def test_predicted_shapes_are_the_theorems():
    predicted = _summary().predicted
    lemma, exact = predicted("labels", 4.0, [2, 4, 8], {})
    assert lemma[1:] == ([2, 4, 8], [4.0] * 3) and exact[1:] == ([2, 4, 8], [0.0] * 3)   # ε = J; Theorem 4.2: 0
    (label, rs, ys), = predicted("map-token", 2.0, [2, 4, 8, 16], {8: 0.5, 16: 0.3})
    # Theorem 3.6 at N = 6, d = 1: ((r - 6)/2)^(-1/8), defined for r > N, through the looped median at r = 16
    assert rs == [8, 16] and ys == pytest.approx([0.3 * 5 ** (1 / 8), 0.3])
    assert predicted("period", 2.0, [2, 4], {2: 0.1}) == []


def _moduli():
    spec = importlib.util.spec_from_file_location("dial_moduli", ROOT / "studies" / "dials" / "dial_moduli.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trained_models_moduli_against_a_direct_count(tmp_path):
    from loopformer.eval.evaluate import read_outs
    from loopformer.sources import make_data
    from loopformer.train.config import load_run_config
    from loopformer.train.trainer import train

    run = tmp_path / "sweeps" / "labels" / "j4-r3" / "looped" / "runs" / "seed=0"
    cfg = load_run_config(ROOT / "configs" / "cpu" / "dial-labels.yaml", [
        "task.options.length=3", "task.options.jump=4", "task.options.keys=16", "model.loops=3", "model.d_model=16",
        "model.n_heads=2", "task.n_train=256", "task.n_test=64", "train.steps=30", "train.log_every=10",
        "threads=1", f"out_dir={run}"])
    train(cfg)
    mod = _moduli()
    mod.main([str(tmp_path / "sweeps"), str(tmp_path / "out"), "--seeds", "0"])
    rec, = json.loads((tmp_path / "out" / "moduli.json").read_text())["records"]
    # the same quantities counted directly from the evaluation's read-outs and the task's table
    data = make_data(cfg.task)
    task, rows = data.task, data.test_rows(0)
    from loopformer import load
    model = load(run / "checkpoint").eval()
    with torch.no_grad():
        pred = read_outs(model, torch.as_tensor(rows["inputs"]).long(), 3, True, torch.no_grad).argmax(-1).numpy()
    pred = np.clip(pred - task.first_label, 0, task.labels - 1)                           # [3,N,w]
    keys = rows["inputs"] - 1                                                             # [N,w]
    want_model = np.mean([abs(int(pred[t, i, j]) - int(pred[t - 1, i, j]))
                          for t in (1, 2) for i in range(len(keys)) for j in range(keys.shape[1])])
    want_target = np.mean([abs(int(task.table[k, t]) - int(task.table[k, t - 1]))
                           for t in (1, 2) for k in keys.reshape(-1)])
    assert rec["model_jump"] == pytest.approx(want_model) and rec["target_jump"] == pytest.approx(want_target)
    assert rec["tracking"] == pytest.approx(want_model / want_target)
    assert 0 <= rec["target_max_jump"] <= 4 and rec["dial"] == 4 and rec["r"] == 3
    assert rec["omega_tok"] > 0 and rec["omega_cont"] >= 0 and rec["update"] > 0
    assert rec["error"] == json.loads((run / "results.json").read_text())["test"]["loops_step_label_error"]
    assert "| 4 | 3 | looped | 1 |" in (tmp_path / "out" / "moduli.md").read_text()
    mod.main([str(tmp_path / "sweeps"), str(tmp_path / "out"), "--seeds", "0"])       # measured once: kept
    assert json.loads((tmp_path / "out" / "moduli.json").read_text())["records"] == [rec]
    with pytest.raises(SystemExit) as exc:
        mod.main([str(tmp_path / "sweeps"), str(tmp_path / "out"), "--delta", "0"])
    assert exc.value.code == 2
