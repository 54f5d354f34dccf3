"""Keeping the best weights (`train.select.keep_best`): the keeper's choice by hand, the run finishing with the weights
of the step whose validation score was best (checked against copies taken during training), exact resume, refusals."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from test_train import TINY

from loopformer.cli import main
from loopformer.eval.run import evaluate_all
from loopformer.model.io import load
from loopformer.sources import make_data
from loopformer.train.config import load_run_config
from loopformer.train.selection import BestKeeper, held_score
from loopformer.train.trainer import Trainer, train

KEEP = [*TINY, "task.n_val=24", "train.select.keep_best=true", "train.eval_every=1", "train.steps=5",
        "log.dynamics=false", "eval.drift=false"]


def test_the_keeper_keeps_the_first_best_score():
    m = torch.nn.Linear(2, 2)
    k = BestKeeper(higher_is_better=True)
    for step, score in enumerate([0.5, math.nan, 0.7, 0.7, 0.2], start=1):
        with torch.no_grad():
            m.weight.fill_(step)
        k.offer(m, score, step)
    assert (k.step, k.score) == (3, 0.7) and bool((k.weights["weight"] == 3).all())
    low = BestKeeper(higher_is_better=False)
    for step, score in enumerate([3.0, 1.0, 2.0], start=1):
        low.offer(m, score, step)
    assert (low.step, low.score) == (2, 1.0)
    assert k.restore(m) and bool((m.weight == 3).all()) and not BestKeeper().restore(m)
    held = BestKeeper(higher_is_better=True)                         # equal scores: the tie-break decides
    for step, (score, tie) in enumerate([(0.0, 0.2), (0.0, 0.9), (0.0, 0.9), (0.0, 0.5), (0.1, 0.0)], start=1):
        held.offer(m, score, step, tie=tie)
        if step == 4:
            assert (held.step, held.tie) == (2, 0.9)
    assert (held.step, held.score, held.tie) == (5, 0.1, 0.0)
    again = BestKeeper()
    again.score, again.step, again.tie = held.state_dict()["score"], 0, held.state_dict()["tie"]
    assert not again.better(0.1, 0.0) and again.better(0.1, 0.5)


def test_the_run_finishes_with_the_best_validation_weights(tmp_path, monkeypatch):
    """Validation scores forced to peak at step 2: the final checkpoint holds step 2's weights, results.json says
    so, and the final test metrics are those weights' (the last step's are kept beside them)."""
    scores = {1: 0.4, 2: 0.9, 3: 0.1, 4: 0.9, 5: 0.2}
    copies = {}

    def forced(self, model, step):
        self.keeper.offer(model, scores[step], step)

    monkeypatch.setattr(Trainer, "score_validation", forced)
    cfg = load_run_config(None, [*KEEP, f"out_dir={tmp_path / 'r'}"])
    holder = {}
    orig_init = Trainer.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        holder["t"] = self

    monkeypatch.setattr(Trainer, "__init__", init)
    res = train(cfg, on_step=lambda s: copies.__setitem__(s, {k: v.clone() for k, v in
                                                               holder["t"].model.state_dict().items()}))
    assert res["keep_best"]["step"] == 2 and res["keep_best"]["val"] == 0.9 and res["keep_best"]["last_test"]
    saved = load_file(str(tmp_path / "r" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(saved[k], copies[2][k]) for k in saved)
    assert any(not torch.equal(saved[k], copies[5][k]) for k in saved)
    assert main(["eval", str(tmp_path / "r"), "--json", str(tmp_path / "e.json"), "--quiet", "--no-loopwise"]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["metrics"] == pytest.approx(res["test"])


def test_real_validation_scores_choose_and_resume_is_exact(tmp_path, train_killed_at):
    full = train(load_run_config(None, [*KEEP, f"out_dir={tmp_path / 'full'}"]))
    recs = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in recs if r.get("split") == "val"]
    assert [r["step"] for r in val] == [1, 2, 3, 4, 5]
    best = max(val, key=lambda r: (r["accuracy"], -r["step"]))            # the first of the best
    assert full["keep_best"]["step"] == best["step"] and full["keep_best"]["val"] == best["accuracy"]
    assert sum(r["kept"] for r in val) >= 1
    cut = load_run_config(None, [*KEEP, f"out_dir={tmp_path / 'cut'}"])
    train_killed_at(cut, 3)
    again = train(cut, resume=True)
    assert again["keep_best"] == full["keep_best"] and again["test"] == full["test"]
    a = load_file(str(tmp_path / "full" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("drop,add,needle", [
    ("task.n_val=24", [], "set task.n_val"),
    ("train.eval_every=1", [], "set train.eval_every"),
])
def test_keep_best_refusals(tmp_path, capsys, drop, add, needle):
    (tmp_path / "c.yaml").write_text("name: keep\n")
    args = [a for a in KEEP if a != drop]
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *args, *add, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r" / "checkpoint").exists()


def test_held_score_is_the_worst_metric_from_r_to_the_deepest_drawn_loop():
    curve = [{"loop": t, "accuracy": a, "loss": 1 - a} for t, a in enumerate([0.1, 0.9, 0.8, 0.95, 0.7], start=1)]
    res = {"metric": "accuracy", "loops": 2, "max_loops": 5, "higher_is_better": True, "loopwise": curve,
           "metrics": {"accuracy": 0.9}}
    assert held_score(res) == 0.7                                     # loops 2..5; loop 1 (0.1) is before r
    assert held_score({**res, "loopwise": curve[:4]}) == 0.8
    assert held_score({**res, "metric": "loss", "higher_is_better": False}) == pytest.approx(0.3)
    assert held_score({**res, "loopwise": [], "metrics": {"accuracy": 0.6}}) == 0.6   # no curve: the metric at r


def test_keep_best_depth_trained_scores_the_held_loops(tmp_path):
    """Draws 2..4 loops (loops_hold=2): every validation record's score is the worst accuracy over loops 2..4, the
    kept step is the first best of them, and the final weights evaluated afresh on the validation split give the
    kept score."""
    over = [*KEEP, "train.loops.hold=2", "train.select.keep_best_depth=trained", f"out_dir={tmp_path / 'r'}"]
    cfg = load_run_config(None, over)
    res = train(cfg)
    val = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in val if r.get("split") == "val"]
    assert [r["held_to"] for r in val] == [4] * 5 and all(r["held"] <= r["accuracy"] for r in val)
    best = max(val, key=lambda r: (r["held"], r["accuracy"], -r["step"]))   # ties: the metric at r, then the first
    assert res["keep_best"]["step"] == best["step"] and res["keep_best"]["val"] == best["held"]
    again = evaluate_all(load(tmp_path / "r"), make_data(cfg.task).validation(),
                         replace(cfg.eval, max_loops=4), extras=False)
    worst = min(p["accuracy"] for p in again["loopwise"] if p["loop"] >= 2)
    assert worst == pytest.approx(best["held"])


@pytest.mark.parametrize("add,needle", [
    (["train.select.keep_best_depth=trained"], "loop counts past r that the run draws"),
    (["train.select.keep_best_depth=deep"], "keep_best_depth must be r or trained"),
])
def test_keep_best_depth_refusals(tmp_path, capsys, add, needle):
    (tmp_path / "c.yaml").write_text("name: keep\n")
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *KEEP, *add, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r" / "checkpoint").exists()


def test_a_fine_tuning_run_scores_its_starting_weights(tmp_path):
    """With train.init_from the starting weights are scored as step 0: a fine-tuning run that never does better (here
    a learning rate of 1e-12: every score equal, the first kept) finishes with exactly the weights it started from."""
    src = tmp_path / "src"
    train(load_run_config(None, [*TINY, "train.steps=4", "log.dynamics=false", "eval.drift=false",
                                 f"out_dir={src}"]))
    res = train(load_run_config(None, [*KEEP, f"train.init_from={src}", "train.optim.lr=1e-12",
                                       "train.optim.warmup_steps=0", f"out_dir={tmp_path / 'ft'}"]))
    val = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in val if r.get("split") == "val"]
    assert [r["step"] for r in val] == [0, 1, 2, 3, 4, 5] and res["keep_best"]["step"] == 0
    a, b = load_file(str(src / "checkpoint" / "model.safetensors")), \
        load_file(str(tmp_path / "ft" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    scratch = train(load_run_config(None, [*KEEP, f"out_dir={tmp_path / 'new'}"]))   # no source: no step 0
    assert scratch["keep_best"]["step"] >= 1
