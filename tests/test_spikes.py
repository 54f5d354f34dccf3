"""Skipping gradient spikes (`train.select.skip_spikes`): the guard's running mean and decisions against a hand
computation; a skipped step leaves weights, AdamW moments and the weight average untouched; a run with skips resumes
exactly; bad values are one line."""

from __future__ import annotations

import math

import pytest
import torch
from test_train import _train_losses, tiny

from loopformer.errors import UserError
from loopformer.train.distributed import Dist
from loopformer.train.run import load_for_resume, read_metrics, read_results
from loopformer.train.spikes import SpikeGuard
from loopformer.train.trainer import Trainer, train


def test_the_guard_follows_the_hand_computation():
    g = SpikeGuard(factor=10.0, window=4)                      # beta = 0.75, warm-up max(10, 0) = 10 steps
    norms = [1.0, 2.0, 0.5, 1.0, 4.0, 1.0, 1.0, 2.0, 1.0, 1.0]  # the warm-up: never skipped, all folded in
    assert not any(g.check(n) for n in norms)
    acc = 0.0
    for n in norms:
        acc = 0.75 * acc + 0.25 * math.log(n)
    mean = acc / (1 - 0.75 ** 10)
    assert g.mean_log == pytest.approx(mean)
    assert g.threshold() == pytest.approx(10 * math.exp(mean))
    limit = g.threshold()
    assert g.check(limit * 0.99) is False                      # below the threshold: taken
    acc = 0.75 * acc + 0.25 * math.log(limit * 0.99)
    limit = g.threshold()
    assert g.check(limit * 1000) is True                       # a spike: skipped, folded in at the threshold
    acc = 0.75 * acc + 0.25 * math.log(limit)
    assert g.mean_log == pytest.approx(acc / (1 - 0.75 ** 12))
    assert g.check(float("nan")) is True and g.check(float("inf")) is True and g.skipped == 3
    assert g.seen == 12                                        # non-finite norms are not folded in
    state = g.state_dict()
    h = SpikeGuard(10.0, 4)
    h.load_state_dict(state)
    assert h.state_dict() == state and h.threshold() == g.threshold()


def test_a_guard_of_small_norms_round_trips():
    """Norms below 1 (the common case late in training) make the running mean of log g negative; the checkpointed
    record loads back as it was (a resume, and a rollback of the collapse guard, which puts it back too)."""
    g = SpikeGuard(factor=20.0, window=100)
    for n in [0.1, 0.2, 0.05] * 10:
        g.check(n)
    state = g.state_dict()
    assert state["acc"] < 0
    h = SpikeGuard(20.0, 100)
    h.load_state_dict(state)
    assert h.state_dict() == state and h.threshold() == g.threshold()
    for bad in ({**state, "seen": -1}, {**state, "skipped": 1.5}, {**state, "acc": float("nan")}):
        with pytest.raises(UserError, match="spike guard"):
            SpikeGuard(20.0, 100).load_state_dict(bad)


def test_a_lasting_rise_is_absorbed_not_skipped_forever():
    g = SpikeGuard(factor=4.0, window=20)
    for _ in range(50):
        g.check(1.0)
    skipped = [g.check(100.0) for _ in range(200)]            # the gradient scale rises 100x for good
    assert skipped[0] and not any(skipped[-50:])
    assert 0 < g.skipped < 200


def test_a_skipped_step_changes_nothing(tmp_path):
    cfg = tiny(tmp_path, "train.steps=4", "train.select.skip_spikes=5", "train.select.spike_window=20",
               "train.select.ema_decay=0.9")
    t = Trainer(cfg, Dist(), resume=False)
    t.open_log(False)
    t.wrap()
    t.step(0)                                                   # AdamW has moments to keep
    t.spikes.acc, t.spikes.seen = 0.0, 100                      # warmed up at a mean norm of 1: threshold 5
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in st.items()} for p, st in t.optimizer.state.items()}
    ema = {k: v.clone() for k, v in t.ema.module.state_dict().items()}
    for p in t.trunk_params:
        p.grad = torch.full_like(p, 1e3)                        # a norm far above 5
    t._update(1)
    assert t.spikes.skipped == 1 and all(p.grad is None for p in t.trunk_params)
    assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())
    assert all(torch.equal(v, moments[id(p)][k]) for p, st in t.optimizer.state.items() for k, v in st.items())
    assert all(torch.equal(v, ema[k]) for k, v in t.ema.module.state_dict().items())
    for p in t.trunk_params:
        p.grad = torch.full_like(p, 1e-4)                       # an ordinary gradient: the step is taken
    t._update(2)
    assert t.spikes.skipped == 1
    assert any(not torch.equal(v, before[k]) for k, v in t.model.state_dict().items())


def test_a_run_that_skips_resumes_exactly(tmp_path, train_killed_at):
    # a factor just above 1 after a 10-step warm-up: later steps whose norm exceeds the mean are skipped
    extra = ("train.steps=16", "train.eval_every=12", "train.select.skip_spikes=1.05", "train.select.spike_window=12",
             "train.optim.lr=1e-2")
    train(tiny(tmp_path, *extra, name="full"))
    skipped = read_results(tmp_path / "full")["skipped_steps"]
    assert 0 < skipped < 6
    records = [r for r in read_metrics(tmp_path / "full") if r["split"] == "train"]
    assert records[-1]["skipped_steps"] == skipped and records[9]["skipped_steps"] == 0
    train_killed_at(tiny(tmp_path, *extra, name="cut"), 14)
    train(load_for_resume(tmp_path / "cut"), resume=True)
    assert _train_losses(tmp_path / "full") == _train_losses(tmp_path / "cut")
    assert read_results(tmp_path / "cut")["skipped_steps"] == skipped


@pytest.mark.parametrize("bad", ["train.select.skip_spikes=1", "train.select.skip_spikes=-2",
                                 "train.select.skip_spikes=nan", "train.select.spike_window=1"])
def test_bad_values_are_refused(tmp_path, bad):
    with pytest.raises(UserError, match="train.s"):
        tiny(tmp_path, bad)
