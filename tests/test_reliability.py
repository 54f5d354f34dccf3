"""Reliability: training state loaded without unpickling code, checkpoint swaps that survive a kill at any instant,
no non-finite weights or losses in checkpoints and metrics, exact metrics after resuming, one line and exit 2 for
bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.model import io as ckpt_io
from loopformer.train.config import load_run_config
from loopformer.train.run import load_for_resume, read_results
from loopformer.train.trainer import train

TINY = ["task.name=lcs", "task.options={length: 3, alphabet_min: 2, alphabet_max: 3}", "task.n_train=96",
        "task.n_test=24", "model.d_model=16", "model.n_heads=2", "model.loops=2", "model.input_injection=true",
        "model.dropout=0.1", "train.batch_size=8", "train.optim.lr=3e-3", "eval.batch_size=64", "eval.max_loops=3",
        "log.tensorboard=false", "log.progress=false"]


class Killed(Exception):
    """Stands for a kill: raised inside training, never caught by the library."""


def tiny(run_dir: Path, *extra: str):
    return load_run_config(None, [*TINY, f"out_dir={run_dir}", *extra])


def strict_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (a bare NaN / Infinity is an error)."""
    def no_constants(name):
        raise AssertionError(f"metrics.jsonl holds a bare {name}")

    return [json.loads(line, parse_constant=no_constants)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def comparable(run_dir: Path) -> list[dict]:
    """The metrics records without the wall-clock fields (speed, time), which no two runs share."""
    drop = {"tokens_per_s", "train_time"}
    return [{k: v for k, v in r.items() if k not in drop} for r in strict_records(run_dir)]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def hidden_leftovers(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".checkpoint."))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loopformer: error: "), err
    assert "Traceback" not in err[0]
    return err[0]


UNALIGNED = ("train.steps=10", "train.eval_every=3", "train.log_every=4")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """An uninterrupted run whose evaluations (every 3 steps) are not aligned with its log steps (every 4)."""
    run = tmp_path_factory.mktemp("full") / "run"
    train(tiny(run, *UNALIGNED))
    return run


# ---------------------------------------------------------------------------------------------- 1. safe loading
class _Payload:
    """Unpickling this object creates a file: proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_never_unpickles_code(tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny(run, "train.steps=2"))
    marker = tmp_path / "code-ran"
    state = torch.load(run / "checkpoint" / "training_state.pt", weights_only=True)
    state["extra"] = _Payload(str(marker))
    torch.save(state, run / "checkpoint" / "training_state.pt")
    assert main(["train", "--resume", str(run), "train.steps=4", "--quiet"]) == 2
    assert not marker.exists()
    assert "refusing to load" in one_error_line(capsys)


def test_training_state_holds_only_plain_values(tmp_path):
    run = tmp_path / "run"
    train(tiny(run, "train.steps=2"))
    state = torch.load(run / "checkpoint" / "training_state.pt", weights_only=True)   # raises if not plain
    assert state["step"] == 2 and state["rng"] and state["window"]


@pytest.mark.parametrize("victim", ["training_state.pt", "model.safetensors"])
def test_truncated_checkpoint_files_are_one_line(tmp_path, capsys, victim):
    run = tmp_path / "run"
    train(tiny(run, "train.steps=2"))
    f = run / "checkpoint" / victim
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert main(["train", "--resume", str(run), "train.steps=4", "--quiet"]) == 2
    one_error_line(capsys)
    if victim == "model.safetensors":
        for argv in (["info", str(run / "checkpoint")], ["eval", str(run)]):
            assert main(argv) == 2
            one_error_line(capsys)


# ---------------------------------------------------------------------------------------------- 2. checkpoint swap
def _kill_inside_swap(monkeypatch, at_call: int, which: str):
    """Make the `at_call`-th checkpoint swap die right before its rename of `which` ("tmp": the new folder into
    place — the checkpoint is gone from its name; "old": the old folder aside)."""
    import shutil

    real, real_rmtree = os.replace, shutil.rmtree
    calls = {"n": 0, "dead": False}

    def replace(src, dst):
        name = Path(src).name
        if name.startswith(".checkpoint.tmp-") and which == "tmp" or (name == "checkpoint" and which == "old"):
            calls["n"] += 1
            if calls["n"] == at_call:
                calls["dead"] = True
                raise Killed
        return real(src, dst)

    def rmtree(path, *a, **k):      # a killed process cleans nothing up
        if not calls["dead"]:
            real_rmtree(path, *a, **k)

    monkeypatch.setattr(ckpt_io.os, "replace", replace)
    monkeypatch.setattr(ckpt_io.shutil, "rmtree", rmtree)


def test_kill_between_the_renames_of_a_checkpoint_swap(tmp_path, monkeypatch, capsys, full_run):
    run = tmp_path / "run"
    cfg = tiny(run, *UNALIGNED)
    with monkeypatch.context() as m:
        _kill_inside_swap(m, at_call=2, which="tmp")    # the second swap (step 6): checkpoint/ already renamed aside
        with pytest.raises(Killed):
            train(cfg)
    assert not (run / "checkpoint").exists()
    assert hidden_leftovers(run)                          # both complete checkpoints sit under hidden names
    metrics_before = (run / "metrics.jsonl").read_bytes()
    # a fresh run into the folder must not start over (and must not delete the metrics)
    with pytest.raises(UserError, match="already holds a run"):
        train(cfg)
    assert (run / "metrics.jsonl").read_bytes() == metrics_before
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert hidden_leftovers(run) == []
    assert comparable(run) == comparable(full_run)
    assert same_weights(run / "checkpoint", full_run / "checkpoint")
    assert read_results(run)["test"] == read_results(full_run)["test"]


def test_kill_before_the_first_rename_keeps_the_old_checkpoint(tmp_path, monkeypatch, full_run):
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _kill_inside_swap(m, at_call=1, which="old")     # second save: the new folder is written, not yet swapped
        with pytest.raises(Killed):
            train(tiny(run, *UNALIGNED))
    assert (run / "checkpoint").is_dir() and hidden_leftovers(run)
    train(load_for_resume(run), resume=True)
    assert hidden_leftovers(run) == []
    assert comparable(run) == comparable(full_run)
    assert same_weights(run / "checkpoint", full_run / "checkpoint")


def test_sweeps_resume_a_run_killed_inside_a_swap(tmp_path, monkeypatch):
    """`loopformer sweep` decides between resuming and starting a run: a run whose checkpoint sits under a hidden
    name is resumed, not started again."""
    from loopformer.train.run import resumable

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _kill_inside_swap(m, at_call=1, which="tmp")
        with pytest.raises(Killed):
            train(tiny(run, "train.steps=4", "train.eval_every=2"))
    assert not (run / "checkpoint").exists()
    assert resumable(run) and ckpt_io.load_training_state(run / "checkpoint")["step"] == 2
    assert not resumable(tmp_path / "never-started")


def test_recover_checkpoint_picks_the_newest_complete_folder(tmp_path):
    from loopformer.model import LoopedTransformer, ModelConfig

    model = LoopedTransformer(ModelConfig(vocab_size=8, d_model=8, n_heads=1, max_len=4))
    state = {"optimizer": {}, "rng": [{"torch": torch.get_rng_state()}]}
    dest = tmp_path / "checkpoint"
    old = ckpt_io.save_checkpoint(dest, model, training_state={**state, "step": 3})
    os.replace(old, tmp_path / ".checkpoint.old-1")
    new = ckpt_io.save_checkpoint(tmp_path / "x", model, training_state={**state, "step": 5})
    os.replace(new, tmp_path / ".checkpoint.tmp-abc")
    broken = ckpt_io.save_checkpoint(tmp_path / "y", model, training_state={**state, "step": 9})
    w = broken / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-4])                   # a folder cut short while being written
    os.replace(broken, tmp_path / ".checkpoint.tmp-def")
    writing = tmp_path / ".checkpoint.tmp-live"            # a running writer's folder: young, incomplete
    writing.mkdir()
    (writing / "model.safetensors").write_bytes(b"\0" * 8)
    for p in [*(tmp_path / ".checkpoint.tmp-def").rglob("*"), tmp_path / ".checkpoint.tmp-def"]:
        os.utime(p, (p.stat().st_atime - 600, p.stat().st_mtime - 600))   # left by a kill ten minutes ago
    assert ckpt_io.recover_checkpoint(dest) == dest
    assert ckpt_io.load_training_state(dest)["step"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.tmp-live", "checkpoint"]


# ---------------------------------------------------------------------------------------------- 3. non-finite
def test_nan_weights_are_never_checkpointed(tmp_path, capsys):
    run = tmp_path / "run"
    cfg = tiny(run, "train.steps=10", "train.eval_every=2", "train.log_every=5", "train.optim.grad_clip=0")
    model_box = {}

    import loopformer.train.trainer as trainer_mod

    real = trainer_mod.LoopedTransformer

    def grab(*a, **k):
        model_box["m"] = real(*a, **k)
        return model_box["m"]

    def poison(step):
        if step == 3:
            with torch.no_grad():
                next(model_box["m"].parameters()).fill_(float("nan"))

    import unittest.mock as mock

    with mock.patch.object(trainer_mod, "LoopedTransformer", grab):
        with pytest.raises(UserError, match="at step 4"):
            train(cfg, on_step=poison)
    assert ckpt_io.load_training_state(run / "checkpoint")["step"] == 2
    weights = load_file(str(run / "checkpoint" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert max(r["step"] for r in strict_records(run)) == 2


def test_diverged_loss_stops_with_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--quiet", *[a for a in TINY if not a.startswith("model.dropout")], f"out_dir={run}",
            "train.steps=6", "train.eval_every=2", "train.log_every=4", "train.optim.lr=1e30",
            "train.optim.grad_clip=0", "train.optim.warmup_steps=0"]
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("seed: 0\n")
    assert main([argv[0], str(cfg_file), *argv[1:]]) == 2
    line = one_error_line(capsys)
    assert "diverged" in line and "step" in line
    strict_records(run)
    if (run / "checkpoint").exists():
        weights = load_file(str(run / "checkpoint" / "model.safetensors"))
        assert all(torch.isfinite(v).all() for v in weights.values())


# ---------------------------------------------------------------------------------------------- 5. exact metrics
def test_resume_metrics_equal_uninterrupted_when_eval_and_log_steps_differ(tmp_path, full_run):
    run = tmp_path / "run"

    def kill(step):
        if step == 5:          # after the checkpoint at step 3, inside the log window 1..4 -> 5..8
            raise Killed

    with pytest.raises(Killed):
        train(tiny(run, *UNALIGNED), on_step=kill)
    train(load_for_resume(run), resume=True)
    assert comparable(run) == comparable(full_run)
    assert same_weights(run / "checkpoint", full_run / "checkpoint")


def test_resuming_a_finished_run_is_a_no_op(tmp_path, full_run):
    run = tmp_path / "run"
    import shutil

    shutil.copytree(full_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    res = train(load_for_resume(run), resume=True)
    assert res == read_results(full_run)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_kill_after_the_final_checkpoint_gives_one_final_record(tmp_path, full_run):
    run = tmp_path / "run"
    import shutil

    shutil.copytree(full_run, run)
    (run / "results.json").unlink()                      # killed after the last checkpoint, before the results
    train(load_for_resume(run), resume=True)
    assert comparable(run) == comparable(full_run)


# ---------------------------------------------------------------------------------------------- kill harness
class _Killer:
    """Kills training (raises Killed) at the `at`-th occurrence of one event, the way a kill -9 would: from then on
    nothing is cleaned up (no temporary folder removed)."""

    EVENTS = ("step", "swap-aside", "swap-into-place", "weights-write", "state-write", "metrics-write")

    def __init__(self, monkeypatch, event: str, at: int):
        import shutil

        import loopformer.train.trainer as trainer_mod

        self.event, self.at, self.n, self.dead = event, at, 0, False
        real_replace, real_rmtree = os.replace, shutil.rmtree
        real_save_model, real_torch_save = ckpt_io.save_model, ckpt_io.torch.save
        real_write = trainer_mod.MetricsLog.write

        def fire(kind: str) -> bool:
            if self.dead or kind != self.event:
                return False
            self.n += 1
            if self.n == self.at:
                self.dead = True
            return self.dead

        def replace(src, dst):
            name = Path(src).name
            if (name == "checkpoint" and fire("swap-aside")) or (
                    name.startswith(".checkpoint.tmp-") and fire("swap-into-place")):
                raise Killed
            return real_replace(src, dst)

        def rmtree(path, *a, **k):
            if not self.dead:
                real_rmtree(path, *a, **k)

        def save_model(model, filename, *a, **k):
            real_save_model(model, filename, *a, **k)
            if fire("weights-write"):
                data = Path(filename).read_bytes()
                Path(filename).write_bytes(data[: len(data) // 3])
                raise Killed

        def torch_save(obj, f, *a, **k):
            real_torch_save(obj, f, *a, **k)
            if str(f).endswith("training_state.pt") and fire("state-write"):
                data = Path(f).read_bytes()
                Path(f).write_bytes(data[: len(data) // 2])
                raise Killed

        def write(log, record):
            if log.enabled and fire("metrics-write"):
                log.fh.write(json.dumps(record)[:20])
                log.fh.flush()
                raise Killed
            return real_write(log, record)

        monkeypatch.setattr(ckpt_io.os, "replace", replace)
        monkeypatch.setattr(ckpt_io.shutil, "rmtree", rmtree)
        monkeypatch.setattr(ckpt_io, "save_model", save_model)
        monkeypatch.setattr(ckpt_io.torch, "save", torch_save)
        monkeypatch.setattr(trainer_mod.MetricsLog, "write", write)
        self.on_step = lambda step: (_ for _ in ()).throw(Killed()) if fire("step") else None


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_kill_harness_resume_gives_the_uninterrupted_run(tmp_path, full_run, seed):
    """Kill training at random moments — between steps, while writing weights, training state or a metrics line,
    and between the two renames of a checkpoint swap — resume until it finishes, and compare with the
    uninterrupted run: same metrics, same final weights and results, no leftovers."""
    import random

    rng = random.Random(seed)
    run = tmp_path / "run"
    kills = 0
    for _ in range(12):
        event = rng.choice(_Killer.EVENTS)
        at = rng.randint(1, 10 if event in ("step", "metrics-write") else 4)
        with pytest.MonkeyPatch.context() as mp:
            killer = _Killer(mp, event, at)
            try:
                try:
                    train(load_for_resume(run), resume=True, on_step=killer.on_step)
                except UserError as exc:       # nothing to resume yet (no run folder or no checkpoint)
                    if "no training state" not in str(exc) and "not a loopformer run" not in str(exc):
                        raise
                    train(tiny(run, *UNALIGNED), on_step=killer.on_step)
                break
            except Killed:
                kills += 1
    else:
        pytest.fail("the run never finished")
    print(f"seed {seed}: {kills} kills")
    assert hidden_leftovers(run) == []
    assert comparable(run) == comparable(full_run)
    assert same_weights(run / "checkpoint", full_run / "checkpoint")
    assert read_results(run)["test"] == read_results(full_run)["test"]
