"""Rolling back a collapse (`train.select.rollback`, loopformer.train.rollback): the guard's decisions on given
accuracies; in a run, a collapse (the weights wiped after a good window) is undone the next window with exactly the
good window's weights and optimiser state and half the learning rate; a run interrupted after a snapshot and
resumed rolls back exactly as the uninterrupted one; bad settings and a damaged record are one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_train import tiny

from loopformer.errors import UserError
from loopformer.train.config import load_run_config
from loopformer.train.rollback import RollbackGuard
from loopformer.train.run import load_for_resume, read_metrics
from loopformer.train.trainer import Trainer, train


def _capture(tag):
    return lambda: {"model": {"w": torch.tensor([float(tag)])}}


def test_the_guard_snapshots_good_windows_and_rolls_back_below():
    g = RollbackGuard(below=0.5, learned=0.95, patience=1, lr_factor=0.5, max_rollbacks=2)
    assert not g.update(0.2, 10, _capture(10)) and g.snapshot is None       # nothing learned yet: no rollback
    assert not g.update(0.96, 20, _capture(20)) and g.snapshot["step"] == 20
    assert not g.update(0.97, 30, _capture(30)) and g.snapshot["step"] == 30   # the last good window
    assert not g.update(0.7, 40, _capture(40)) and g.snapshot["step"] == 30    # between: neither
    assert g.update(0.3, 50, _capture(50))                                     # collapse: back to step 30
    assert g.snapshot["step"] == 30 and g.snapshot["model"]["w"].item() == 30 and g.lr_scale == 0.5 and g.count == 1
    assert g.update(math.nan, 60, _capture(60)) and g.lr_scale == 0.25         # NaN counts as 0
    assert not g.update(0.0, 70, _capture(70)) and g.count == 2                # at most max_rollbacks


def test_patience_counts_windows_in_a_row():
    g = RollbackGuard(below=0.5, patience=2)
    g.update(1.0, 1, _capture(1))
    assert not g.update(0.1, 2, _capture(2))
    assert not g.update(0.6, 3, _capture(3))         # the low stretch ends: counting starts again
    assert not g.update(0.1, 4, _capture(4))
    assert g.update(0.1, 5, _capture(5)) and g.count == 1


def test_a_count_rise_from_a_good_window_drops_the_snapshot_and_one_during_a_fall_keeps_it():
    """The curriculum raised the count right after a good window: the fall is the new depth, not a collapse of what
    the snapshot learned. Raised while the accuracy was already falling at the snapshot's count: a collapse."""
    g = RollbackGuard(below=0.5, learned=0.95, max_rollbacks=3)
    assert not g.update(0.96, 10, _capture(10), loops=8) and g.snapshot["loops"] == 8
    assert not g.update(0.4, 20, _capture(20), loops=12) and g.snapshot is None and g.count == 0
    assert not g.update(0.3, 30, _capture(30), loops=12) and g.count == 0      # nothing learned at 12 yet
    assert not g.update(0.97, 40, _capture(40), loops=12) and g.snapshot["loops"] == 12
    assert g.update(0.1, 50, _capture(50), loops=12) and g.snapshot["step"] == 40 and g.count == 1
    assert g.snapshot["model"]["w"].item() == 40 and g.lr_scale == 0.5
    fall = RollbackGuard(below=0.5, learned=0.95)   # the count rises while a fall is under way: the task is lost
    assert not fall.update(1.0, 10, _capture(10), loops=42) and fall.snapshot["step"] == 10
    assert not fall.update(0.73, 20, _capture(20), loops=42)                 # falling at the snapshot's count
    assert fall.update(0.03, 30, _capture(30), loops=46) and fall.snapshot["step"] == 10 and fall.count == 1
    assert fall.snapshot["loops"] == 46                                      # it stands for the new count now
    slow = RollbackGuard(below=0.5, learned=0.95)
    slow.update(1.0, 10, _capture(10), loops=8)
    slow.update(0.8, 20, _capture(20), loops=8)
    assert not slow.update(0.6, 30, _capture(30), loops=12) and slow.snapshot["step"] == 10
    assert slow.update(0.2, 40, _capture(40), loops=12) and slow.count == 1  # still the fall: back to step 10
    old = RollbackGuard(below=0.5)                 # a checkpoint's snapshot from before the count was kept
    old.snapshot = {"step": 5, "model": {"w": torch.zeros(1)}}
    assert old.update(0.1, 6, _capture(6), loops=16) and old.count == 1


def test_the_snapshot_is_a_copy():
    w = torch.ones(3)
    g = RollbackGuard(below=0.5)
    g.update(1.0, 1, lambda: {"model": {"w": w}})
    w.zero_()
    assert torch.equal(g.snapshot["model"]["w"], torch.ones(3))


ROLL = ["train.steps=12", "train.log_every=1", "train.select.rollback=0.001", "train.select.rollback_learned=0.01",
        "log.dynamics=false", "eval.drift=false", "train.system.compile=false"]


@pytest.fixture
def wipe_at(monkeypatch):
    """wipe_at(step): after the "train" record of `step`, every weight is set to 0 (the model answers one token
    everywhere: accuracy 0). Returns the states seen: the weights right before the wipe and right after each
    rollback."""
    seen: dict[str, list] = {"before": [], "after": [], "optim_before": [], "optim_after": []}
    original_log, original_back = Trainer.log_train, Trainer._roll_back

    def setup(step: int):
        def log_train(self, done):
            original_log(self, done)
            if done == step:
                seen["before"].append({k: v.clone() for k, v in self.model.state_dict().items()})
                seen["optim_before"].append(json.dumps(self.optimizer.state_dict()["param_groups"]))
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.zero_()

        def roll_back(self, done):
            rec = original_back(self, done)
            seen["after"].append({k: v.clone() for k, v in self.model.state_dict().items()})
            seen["optim_after"].append(json.dumps(self.optimizer.state_dict()["param_groups"]))
            return rec

        monkeypatch.setattr(Trainer, "log_train", log_train)
        monkeypatch.setattr(Trainer, "_roll_back", roll_back)
        return seen

    return setup


def test_a_wiped_run_gets_the_last_good_weights_back_with_half_the_rate(tmp_path, wipe_at):
    seen = wipe_at(5)
    res = train(tiny(tmp_path, *ROLL))
    recs = read_metrics(tmp_path / "run")
    back = [r for r in recs if r["split"] == "rollback"]
    assert [(r["step"], r["to"], r["lr_scale"], r["rollbacks"]) for r in back] == [(6, 5, 0.5, 1)]
    # the weights right after the rollback are the weights at the end of step 5, before the wipe, exactly
    assert all(torch.equal(seen["before"][0][k], seen["after"][0][k]) for k in seen["before"][0])
    assert seen["optim_before"] == seen["optim_after"]
    train_recs = {r["step"]: r for r in recs if r["split"] == "train"}
    assert train_recs[6]["accuracy"] == 0.0                       # the wiped window
    assert train_recs[7]["accuracy"] > 0.0                        # learning again from the good weights
    from loopformer.train.optim import lr_at
    cfg = tiny(tmp_path, *ROLL)
    assert train_recs[8]["lr"] == pytest.approx(0.5 * lr_at(cfg.train.optim, 7, 12))
    assert train_recs[5]["lr"] == pytest.approx(lr_at(cfg.train.optim, 4, 12))
    assert res["rollbacks"] == 1


def test_a_fall_where_the_loop_curriculum_raises_the_count_is_not_rolled_back(tmp_path, wipe_at):
    """Loop curriculum 1 -> 2 loops at step 6: the window that ends at step 6 is the first at 2 loops, so the wipe
    after step 5 falls in a window at another count than the snapshot's; the guard waits for a good window at 2."""
    wipe_at(5)
    res = train(tiny(tmp_path, *ROLL, "train.loops.start=1", "train.loops.every=5"))
    recs = read_metrics(tmp_path / "run")
    train_recs = {r["step"]: r for r in recs if r["split"] == "train"}
    assert train_recs[5]["loops"] == 1 and train_recs[6]["loops"] == 2 and train_recs[6]["accuracy"] == 0.0
    assert [r for r in recs if r["split"] == "rollback"] == [] and res["rollbacks"] == 0
    from loopformer.train.optim import lr_at
    assert train_recs[8]["lr"] == pytest.approx(lr_at(tiny(tmp_path, *ROLL).train.optim, 7, 12))   # rate not halved


def test_a_resumed_run_rolls_back_like_the_uninterrupted_one(tmp_path, wipe_at, train_killed_at):
    """The checkpoint of step 5 is written after the wipe: it holds the wiped weights and the snapshot of step 5's
    good ones, so the resumed run's first window rolls back from the checkpoint's record, as the full run did."""
    wipe_at(5)
    train(tiny(tmp_path, *ROLL, "train.eval_every=5", name="full"))
    cut = tiny(tmp_path, *ROLL, "train.eval_every=5", name="cut")
    train_killed_at(cut, 5)
    state = torch.load(tmp_path / "cut" / "checkpoint" / "training_state.pt", weights_only=True)
    assert state["rollback"]["snapshot"]["step"] == 5 and state["rollback"]["count"] == 0
    train(load_for_resume(tmp_path / "cut"), resume=True)

    def records(run):
        return [(r["split"], r["step"], r.get("loss"), r.get("lr"), r.get("to")) for r in read_metrics(tmp_path / run)
                if r["split"] in ("train", "rollback")]

    assert records("full") == records("cut")
    assert [r for r in records("cut") if r[0] == "rollback"] == [("rollback", 6, None, None, 5)]


def test_resume_keeps_the_factor_and_the_snapshot(tmp_path, train_killed_at, monkeypatch):
    """Interrupted after a rollback, the resumed run goes on with the halved rate and the same snapshot."""
    original_log = Trainer.log_train

    def log_train(self, done):
        original_log(self, done)
        if done == 3:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.zero_()

    monkeypatch.setattr(Trainer, "log_train", log_train)
    train(tiny(tmp_path, *ROLL, "train.eval_every=6", name="full"))
    cut = tiny(tmp_path, *ROLL, "train.eval_every=6", name="cut")
    train_killed_at(cut, 8)
    train(load_for_resume(tmp_path / "cut"), resume=True)
    a = [(r["step"], r["loss"], r["lr"]) for r in read_metrics(tmp_path / "full") if r["split"] == "train"]
    b = [(r["step"], r["loss"], r["lr"]) for r in read_metrics(tmp_path / "cut") if r["split"] == "train"]
    assert a == b and a[-1][2] < a[2][2]                           # identical, the rate halved after step 4
    assert json.loads((tmp_path / "full" / "results.json").read_text())["rollbacks"] == 1


@pytest.mark.parametrize("override, needle", [
    ("train.select.rollback=1.5", "train.select.rollback must be 0 (off) or in (0, rollback_learned]"),
    ("train.select.rollback=0.99", "train.select.rollback must be 0 (off) or in (0, rollback_learned]"),
    ("train.select.rollback_learned=0", "rollback_learned in (0, 1]"),
])
def test_bad_settings_are_one_line(override, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        load_run_config(None, ["train.select.rollback=0.5", override])


def test_fsdp_and_a_task_without_accuracy_are_refused(tmp_path):
    with pytest.raises(UserError, match="not with train.system.parallel=fsdp"):
        load_run_config(None, ["train.select.rollback=0.5", "train.system.parallel=fsdp"])
    cfg = load_run_config(None, ["task.name=icl", "train.select.rollback=0.5", f"out_dir={tmp_path / 'icl'}",
                                 "train.steps=1", "log.progress=false"])
    with pytest.raises(UserError, match="watches the training accuracy"):
        train(cfg)


def test_a_damaged_record_is_one_line_on_resume(tmp_path):
    train(tiny(tmp_path, *ROLL, "train.steps=3"))
    path = tmp_path / "run" / "checkpoint" / "training_state.pt"
    state = torch.load(path, weights_only=True)
    state["rollback"]["lr_scale"] = 7.0
    torch.save(state, path)
    cfg = load_for_resume(tmp_path / "run", ["train.steps=6"])
    with pytest.raises(UserError, match="rollback record .* is damaged"):
        train(cfg, resume=True)


def test_a_rollback_puts_back_the_spike_guards_record(tmp_path, wipe_at, monkeypatch):
    """With spike skipping on, the snapshot holds the spike guard's record, whose running mean of log g is negative
    once the gradient norms are below 1 (here the guard sees every norm times 1e-3); the rollback loads it back."""
    from loopformer.train.spikes import SpikeGuard

    means, real = [], SpikeGuard.check

    def check(self, norm):
        skip = real(self, norm * 1e-3)
        means.append(self.acc)
        return skip

    monkeypatch.setattr(SpikeGuard, "check", check)
    wipe_at(5)
    res = train(tiny(tmp_path, *ROLL, "train.select.skip_spikes=1000", "train.select.spike_window=10"))
    recs = read_metrics(tmp_path / "run")
    assert [(r["step"], r["to"]) for r in recs if r["split"] == "rollback"] == [(6, 5)]
    assert max(means[:5]) < 0                                      # the record the snapshot holds
    assert res["rollbacks"] == 1 and res["skipped_steps"] == 0
