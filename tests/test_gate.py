"""The gated loop curriculum (`train.loops.gate`, `start_at_steps`, `gate_modulation`; loopformer.train.optim): the
curriculum's clock counts only the log windows whose training accuracy reached the gate, the curriculum starts at
the task's K intermediate steps, the hold's draws follow the clock; in a run the recorded loop counts and clock
agree with a recomputation from the recorded accuracies, a resumed run equals the uninterrupted one, and bad
settings are one line; with gate_modulation a TMLT's modulations train only from the gate's first opening."""

from __future__ import annotations

import pytest
import torch

from loopformer.errors import UserError
from loopformer.train.config import LoopSampling, load_run_config
from loopformer.train.optim import curriculum_end, gate_clock, loops_at, sample_loops
from loopformer.train.run import load_for_resume, read_metrics
from loopformer.train.trainer import train

POINTER = ["task.name=pointer_chase", "task.options={symbols: 6, hops: 3}", "task.loop_targets=true",
           "train.losses.loops=all", "task.n_train=128", "task.n_test=32", "model.d_model=16", "model.n_heads=2",
           "model.loops=6", "model.input_injection=true", "train.batch_size=8", "train.optim.lr=3e-3",
           "train.log_every=2", "eval.batch_size=64", "eval.max_loops=6", "log.tensorboard=false",
           "log.progress=false", "log.dynamics=false", "eval.drift=false", "train.system.compile=false"]


def pointer(tmp_path, *extra: str, name: str = "run"):
    return load_run_config(None, [*POINTER, f"out_dir={tmp_path / name}", *extra])


def test_the_clock_counts_only_windows_at_the_gate():
    assert gate_clock(100, 0.95, 50, 0.9) == 150
    assert gate_clock(100, 0.9, 50, 0.9) == 150           # at the gate: counts
    assert gate_clock(100, 0.5, 50, 0.9) == 100
    assert gate_clock(0, float("nan"), 50, 0.9) == 0      # a NaN accuracy is no progress


def test_the_curriculum_and_the_hold_follow_the_clock():
    cfg = LoopSampling(start=3, every=10, increment=2, gate=0.9, hold=2.0, hold_ramp=20)
    # whatever the step, the count is the clock's: the same step at two clocks, two counts
    assert int(sample_loops(cfg, 500, 9, 0, clock=0)[0]) == loops_at(cfg, 0, 9) == 3
    assert int(sample_loops(cfg, 500, 9, 0, clock=25)[0]) == loops_at(cfg, 25, 9) == 7
    end = curriculum_end(cfg, 9)                          # 30: the clock at which the count reaches r = 9
    assert end == 30 and int(sample_loops(cfg, 5, 9, 0, clock=end - 1)[0]) == 7
    # the hold's draws begin at r and their upper bound ramps with the clock, not the step
    at_end = {int(sample_loops(cfg, s, 9, 0, clock=end)[0]) for s in range(200)}
    assert at_end == {9}                                   # ramp at 0: only r
    half = {int(v) for s in range(400) for v in sample_loops(cfg, s, 9, 0, clock=end + 10)}
    assert half == set(range(9, 9 + (18 - 9) * 10 // 20 + 1))   # r .. r + (2r − r)·10/20
    full = {int(v) for s in range(400) for v in sample_loops(cfg, s, 9, 0, clock=end + 40)}
    assert full == set(range(9, 19))
    # without a clock the step times everything, as before
    plain = LoopSampling(start=3, every=10, increment=2)
    assert [int(sample_loops(plain, s, 9, 0)[0]) for s in (0, 10, 29, 30)] == [3, 5, 7, 9]


def _train_records(run):
    return [r for r in read_metrics(run) if r["split"] == "train"]


def test_start_at_steps_starts_at_k_and_a_shut_gate_holds_it(tmp_path):
    """K = 3 hops: the curriculum starts at 3 loops whatever train.loops.start says; a gate of 1.0 that no window of
    an untrained model reaches keeps it there."""
    train(pointer(tmp_path, "train.steps=8", "train.loops.start=1", "train.loops.start_at_steps=true",
                  "train.loops.every=2", "train.loops.gate=1.0"))
    recs = _train_records(tmp_path / "run")
    assert [r["loops"] for r in recs] == [3] * 4 and [r["curriculum_clock"] for r in recs] == [0] * 4
    assert max(r["accuracy"] for r in recs) < 1.0
    # ungated, the same curriculum rises every 2 steps from 3
    train(pointer(tmp_path, "train.steps=8", "train.loops.start_at_steps=true", "train.loops.every=2",
                  name="open"))
    assert [r["loops"] for r in _train_records(tmp_path / "open")] == [3, 4, 5, 6]


def test_recorded_counts_follow_the_recorded_accuracies(tmp_path):
    """A gate between the windows' accuracies: each window's clock is the last one plus its steps where its
    accuracy reached the gate, and its steps ran loops_at(the clock before it)."""
    train(pointer(tmp_path, "train.steps=40", "train.loops.start_at_steps=true", "train.loops.every=2",
                  "train.loops.gate=0.25", "train.optim.lr=1e-2"))
    recs = _train_records(tmp_path / "run")
    cfg = LoopSampling(start=3, every=2, gate=0.25)
    clock, moved, held = 0, 0, 0
    for r in recs:
        assert r["loops"] == loops_at(cfg, clock, 6)
        new = clock + 2 if r["accuracy"] >= 0.25 else clock
        assert r["curriculum_clock"] == new
        moved, held = moved + (new > clock), held + (new == clock)
        clock = new
    assert moved and held                                 # the gate both opened and shut in this run


def test_a_gated_run_resumes_exactly(tmp_path, train_killed_at):
    over = ("train.steps=24", "train.loops.start_at_steps=true", "train.loops.every=2", "train.loops.gate=0.25",
            "train.loops.gate_modulation=true", "model.timestep=true", "train.optim.lr=1e-2", "train.eval_every=6")
    train(pointer(tmp_path, *over, name="full"))
    train_killed_at(pointer(tmp_path, *over, name="cut"), 10)
    train(load_for_resume(tmp_path / "cut"), resume=True)

    def key(run):
        return [(r["step"], r["loops"], r["loss"], r["lr"], r.get("curriculum_clock"))
                for r in _train_records(tmp_path / run)]

    assert key("full") == key("cut")
    assert len({r[1] for r in key("full")}) > 1           # the count moved: the resumed clock was the saved one


@pytest.mark.parametrize("gate, frozen", [(1.0, True), (0.01, False)])
def test_the_modulations_wait_for_the_gate(tmp_path, monkeypatch, gate, frozen):
    """gate_modulation (a TMLT): with a gate no window reaches, the timestep embedder and the modulations end
    exactly as they started while the block trains; with a gate the first window opens, they train too."""
    from loopformer.model.layers import is_timestep_param
    from loopformer.train.trainer import Trainer

    snaps: dict[str, dict] = {}
    for name, hook in (("start", "open_log"), ("end", "select")):
        original = getattr(Trainer, hook)

        def patched(self, *a, _name=name, _original=original, **k):
            snaps[_name] = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            return _original(self, *a, **k)

        monkeypatch.setattr(Trainer, hook, patched)
    train(pointer(tmp_path, "train.steps=8", "model.timestep=true", "train.loops.start_at_steps=true",
                  f"train.loops.gate={gate}", "train.loops.gate_modulation=true", "train.optim.timestep_lr_mult=1"))
    moved = {n for n in snaps["start"] if not torch.equal(snaps["start"][n], snaps["end"][n])}
    ts = {n for n in snaps["start"] if is_timestep_param(n)}
    assert ts and moved - ts                                       # a TMLT, and its block trained
    assert (moved & ts == set()) == frozen                         # the modulations: frozen until the gate opens


@pytest.mark.parametrize("override, needle", [
    (["train.loops.gate=0.5"], "train.loops.gate gates a loop curriculum"),
    (["train.loops.start=2", "train.loops.gate=1.5"], "train.loops.gate must be 0 (off) or in (0, 1]"),
    (["train.loops.start_at_steps=true", "task.loop_targets=false", "train.losses.loops=last"],
     "train.loops.start_at_steps starts the curriculum at the task's intermediate steps: it needs task.loop_targets"),
    (["train.loops.start=2", "train.loops.gate_modulation=true"], "train.loops.gate_modulation frees the modulations"),
])
def test_bad_settings_are_one_line(override, needle):
    with pytest.raises(UserError) as err:
        load_run_config(None, [*POINTER, *override])
    assert needle in str(err.value) and "\n" not in str(err.value)

