"""Staged runs (`stages:`): each stage is the run's config with its `set` on top, starts from the previous stage's
weights, trains in its own folder (the last in out_dir); an interrupted staged run resumes where it stopped; sweeps
run staged configs as any other; bad stages are refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import Killed
from safetensors.torch import load_file
from test_train import TINY

from loopformer.cli import main
from loopformer.experiments.report import find_runs
from loopformer.experiments.sweep import RunSpec, parse_grid, run_progress, run_size, run_sweep
from loopformer.train.config import load_run_config
from loopformer.train.stages import run_stages, stage_configs, train_run
from loopformer.train.trainer import Trainer, train

BASE = [*TINY, "train.steps=3", "log.dynamics=false", "eval.drift=false"]
STAGES = ("stages=[{name: learn, set: {train.optim.lr: 0.003}}, "
          "{name: hold, set: {train.optim.lr: 0.001, train.steps: 4, train.loops.hold: 2}}]")


def _weights(run) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint" / "model.safetensors"))


def _staged(tmp_path, *extra):
    return load_run_config(None, [*BASE, STAGES, f"out_dir={tmp_path / 'run'}", *extra])


def _stop_in_second_stage(cfg) -> None:
    """Run `_staged`'s stages and stop them after the second stage's 2nd step (the first runs 3)."""
    calls = []

    def kill(done):
        calls.append(done)
        if len(calls) == 5:
            raise Killed

    with pytest.raises(Killed):
        run_stages(cfg, on_step=kill)


def test_stage_configs_apply_each_stage_and_chain_the_folders(tmp_path):
    cfg = _staged(tmp_path)
    first, last = stage_configs(cfg)
    root = tmp_path / "run"
    assert (first.out_dir, last.out_dir) == (str(root / "stages" / "1-learn"), str(root))
    assert (first.train.optim.lr, first.train.steps, first.train.loops.hold, first.train.init_from) == \
        (0.003, 3, 0.0, "")
    assert (last.train.optim.lr, last.train.steps, last.train.loops.hold) == (0.001, 4, 2.0)
    assert last.train.init_from == first.out_dir and not first.stages and not last.stages
    assert (first.model, first.task) == (cfg.model, cfg.task)            # what no stage sets stays the run's


def test_a_staged_run_trains_each_stage_from_the_last_ones_weights(tmp_path, monkeypatch, capsys):
    starts = []
    orig = Trainer.step

    def spy(self, step):
        if step == 0:
            starts.append({k: v.clone() for k, v in self.model.state_dict().items()})
        return orig(self, step)

    monkeypatch.setattr(Trainer, "step", spy)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"stages": [{"name": "learn", "set": {"train.optim.lr": 0.003}},
                                                                {"name": "hold", "set": {"train.steps": 4,
                                                                                         "train.loops.hold": 2}}]}))
    root = tmp_path / "run"
    assert main(["train", str(tmp_path / "c.yaml"), *BASE, f"out_dir={root}", "--quiet"]) == 0
    learn = root / "stages" / "1-learn"
    assert len(starts) == 2
    want = _weights(learn)
    assert all(torch.equal(starts[1][k], want[k]) for k in want)      # stage 2 starts at stage 1's final weights
    assert any(not torch.equal(starts[0][k], want[k]) for k in want)  # ... which stage 1 trained
    res = json.loads((root / "results.json").read_text())
    assert [s["name"] for s in res["stages"]] == ["learn", "hold"] and [s["steps"] for s in res["stages"]] == [3, 4]
    assert res["stages"][0]["test"] == json.loads((learn / "results.json").read_text())["test"]
    assert res["steps"] == 4 and res["loops_sample"]["range"] == [2, 4]       # the root holds the last stage
    info = json.loads((root / "run.json").read_text())
    assert info["init_from"] == str((learn / "checkpoint").resolve())
    assert yaml.safe_load((root / "config.yaml").read_text())["stages"] == []
    assert len(yaml.safe_load((root / "stages.yaml").read_text())["stages"]) == 2
    # a staged run's folder is a run folder: eval reads it
    capsys.readouterr()
    assert main(["eval", str(root), "--quiet"]) == 0


def test_an_interrupted_staged_run_resumes_where_it_stopped(tmp_path):
    whole = _staged(tmp_path, "train.eval_every=1")
    whole.out_dir = str(tmp_path / "whole")
    run_stages(whole)
    cut = _staged(tmp_path, "train.eval_every=1")
    _stop_in_second_stage(cut)
    root = tmp_path / "run"
    stamp = (root / "stages" / "1-learn" / "results.json").stat().st_mtime_ns
    assert not (root / "results.json").exists()
    assert main(["train", "--resume", str(root), "--quiet"]) == 0
    assert (root / "stages" / "1-learn" / "results.json").stat().st_mtime_ns == stamp       # not trained again
    a, b = _weights(tmp_path / "whole"), _weights(root)
    assert all(torch.equal(a[k], b[k]) for k in a)                    # exactly the uninterrupted run's weights
    again = train_run(load_run_config(root / "stages.yaml", [f"out_dir={root}"]), resume=True)
    assert again["stages"] == json.loads((root / "results.json").read_text())["stages"]   # finished: nothing new


def test_sweeps_run_and_skip_staged_configs(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"stages": [{"set": {"train.steps": 2}}, {"set": {"train.optim.lr": 0.001}}]}))
    out = tmp_path / "sw"
    specs = run_sweep(str(cfg), parse_grid(["seed=0,1"]), [], out, BASE, progress=False)
    assert all(json.loads((s.out_dir / "results.json").read_text())["stages"][0]["steps"] == 2 for s in specs)
    assert all((s.out_dir / "stages" / "1").is_dir() for s in specs)
    runs = find_runs(out)                               # each staged run once, by its last stage
    assert sorted(r["_dir"] for r in runs) == sorted(str(s.out_dir) for s in specs)
    stamps = [(s.out_dir / "results.json").stat().st_mtime_ns for s in specs]
    run_sweep(str(cfg), parse_grid(["seed=0,1"]), [], out, BASE, progress=False)     # finished: skipped
    assert stamps == [(s.out_dir / "results.json").stat().st_mtime_ns for s in specs]


def test_a_sweep_sizes_and_follows_a_staged_run_over_its_stages(tmp_path):
    cfg = _staged(tmp_path)
    # stage 1: 3 steps at r = 2 loops; stage 2: 4 steps drawing 2..4 loops (loops_hold 2), 3 on average; one layer
    assert run_size(cfg) == (3 + 4, 3 * 2 + 4 * 3.0)
    assert run_size(stage_configs(cfg)[0]) == (3, 6.0)        # an unstaged config: its steps at r
    _stop_in_second_stage(cfg)
    spec = RunSpec("run", [], tmp_path / "run", steps=7)
    assert run_progress(spec) == (3 + 2, False)         # the finished first stage's steps and the second's so far
    assert main(["train", "--resume", str(tmp_path / "run"), "--quiet"]) == 0
    assert run_progress(spec) == (7, False)


@pytest.mark.parametrize("stages,needle", [
    ("[{set: {train.nope: 1}}, {set: {}}]", "stage 1"),
    ("[{set: {}}, {name: b, set: {train.optim.lr: fast}}]", "stage 2 (b)"),
    ("[{set: {}}, {set: {train.init_from: x}}]", "train.init_from is the previous stage"),
    ("[{set: {out_dir: x}}]", "set by the staged run itself"),
    ("[{name: a/b, set: {}}]", "stages[1].name"),
    ("[{name: a, set: {}}, {name: a, set: {}}]", "names must differ"),
    ("[{set: {'train lr': 1}}]", "not a dotted config key"),
])
def test_bad_stages_are_refused_before_anything_is_written(tmp_path, capsys, stages, needle):
    root = tmp_path / "run"
    (tmp_path / "c.yaml").write_text("name: staged\n")
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *BASE, f"stages={stages}", f"out_dir={root}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not root.exists()


def test_a_staged_run_does_not_write_over_a_folder_in_use(tmp_path, capsys):
    root = tmp_path / "run"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    (tmp_path / "c.yaml").write_text("name: staged\n")
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *BASE, STAGES, f"out_dir={root}"]) == 2
    assert "already holds" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]
    with pytest.raises(Exception, match="staged config"):
        train(_staged(tmp_path))                     # the one-run trainer does not run stages silently as one


def test_overwrite_replaces_an_earlier_run_in_out_dir(tmp_path):
    root = tmp_path / "run"
    train(load_run_config(None, [*BASE, "train.steps=5", f"out_dir={root}"]))          # an earlier one-stage run
    res = run_stages(_staged(tmp_path), overwrite=True)
    assert res["steps"] == 4 and [s["steps"] for s in res["stages"]] == [3, 4]        # not the old run resumed
    assert json.loads((root / "run.json").read_text())["init_from"].endswith("1-learn/checkpoint")
