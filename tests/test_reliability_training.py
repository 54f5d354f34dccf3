"""Reliability of training's own inputs: a staged config is checked whole (every stage's shapes, evaluation
section, data, lengths and memory) before any stage trains; torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK,
the rendezvous variables) is checked before any work; damaged or crafted best-weights files and selection state
stop a resume in one line. Each case: one line, exit status 2, nothing the user owns changed (hashed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import Killed
from safetensors.torch import load_file, save_file
from test_reliability_outside import digest as digest_all
from test_stages import BASE

from loopformer.cli import main
from loopformer.train.config import load_run_config
from loopformer.train.trainer import Trainer, train

STAGE1 = "{name: learn, set: {train.optim.lr: 0.003}}"


def digest(folder: Path) -> str:
    """Every file under `folder`, but the lock's holder (the process id a resume writes into a run's `.lock`)."""
    locks = {p: p.read_bytes() for p in folder.rglob(".lock") if p.is_file()}
    for p in locks:
        p.unlink()
    try:
        return digest_all(folder)
    finally:
        for p, held in locks.items():
            p.write_bytes(held)


def one_line(capsys, needle: str) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("loopformer: error: "), err
    assert needle in err, err
    return err


@pytest.fixture
def no_steps(monkeypatch) -> list[int]:
    """The steps any trainer takes (none, for a refusal)."""
    taken: list[int] = []
    real = Trainer.step

    def spy(self, step):
        taken.append(step)
        return real(self, step)

    monkeypatch.setattr(Trainer, "step", spy)
    return taken


# ------------------------------------------------------------------------------------------------ staged runs
@pytest.mark.parametrize("stage2,needle", [
    ("{name: wide, set: {model.d_model: 32}}", "cannot start from the previous stage's weights"),
    ("{name: votes, set: {eval.votes: 3}}", "votes"),
    ("{name: huge, set: {train.batch_size: 50000000}}", "needs about"),
    ("{name: data, set: {task.data_dir: /nonexistent/data}}", "/nonexistent/data"),
    ("{name: long, set: {eval.lengths: [50]}}", "the model learned 10"),
    ("{name: odd, set: {train.batch_size: 12, train.grad_accum: 8}}", "divisible"),
], ids=["another-width", "votes-on-lcs", "huge-batch", "missing-data-folder", "lengths-past-the-positions",
        "batch-and-accumulation"])
def test_a_staged_config_is_checked_whole_before_any_stage_trains(tmp_path, capsys, no_steps, stage2, needle):
    root = tmp_path / "run"
    (tmp_path / "c.yaml").write_text("name: staged\n")
    before = digest(tmp_path)
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *BASE, f"stages=[{STAGE1}, {stage2}]",
                 f"out_dir={root}"]) == 2
    err = one_line(capsys, needle)
    assert "stage 2" in err
    assert no_steps == [] and not root.exists() and digest(tmp_path) == before


def test_a_staged_run_that_checks_whole_trains_every_stage(tmp_path, capsys, no_steps):
    """The reference: the same stages, valid, train both (3 steps, then 4)."""
    root = tmp_path / "run"
    (tmp_path / "c.yaml").write_text("name: staged\n")
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *BASE,
                 f"stages=[{STAGE1}, {{name: hold, set: {{train.steps: 4, train.loops.hold: 2}}}}]",
                 f"out_dir={root}"]) == 0
    assert no_steps == [0, 1, 2, 0, 1, 2, 3]


# ------------------------------------------------------------------------------------------------ environment
@pytest.mark.parametrize("env,needle", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({"RANK": "x"}, "RANK='x'"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be"),
    ({"WORLD_SIZE": "99999999999999999999"}, "WORLD_SIZE="),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK=2 must be below"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR and MASTER_PORT"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1"}, "needs MASTER_PORT"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({"WORLD_SIZE": "1", "fsdp": "1"}, "MASTER_ADDR and MASTER_PORT"),
], ids=["world-abc", "rank-x", "local-rank-negative", "world-0", "world-huge", "rank-past-world",
        "no-rendezvous", "no-port", "port-not-a-number", "sharded-world-of-one-without-rendezvous"])
def test_a_hostile_launch_environment_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, no_steps, env,
                                                                   needle):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    sharded = env.pop("fsdp", None) is not None
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "c.yaml").write_text("name: env\n")
    before = digest(tmp_path)
    extra = ["train.system.parallel=fsdp"] if sharded else []
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *BASE, *extra, f"out_dir={tmp_path / 'run'}"]) == 2
    one_line(capsys, needle)
    staged = ["stages=[{set: {}}, {set: {train.steps: 2}}]"]
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet", *BASE, *extra, *staged,
                 f"out_dir={tmp_path / 'staged'}"]) == 2
    one_line(capsys, needle)
    assert no_steps == [] and digest(tmp_path) == before


# ------------------------------------------------------------------------------------------------ selection state
SELECT = [*BASE, "task.n_val=24", "train.select.keep_best=true", "train.eval_every=1", "train.steps=4",
          "train.select.ema_decay=0.9", "train.select.skip_spikes=4"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A run keeping its best weights and a weight average, stopped after step 2's checkpoint."""
    out = tmp_path_factory.mktemp("select") / "run"

    def stop(done: int) -> None:
        if done == 2:
            raise Killed

    with pytest.raises(Killed):
        train(load_run_config(None, [*SELECT, f"out_dir={out}"]), on_step=stop, progress=False)
    assert (out / "checkpoint" / "best.safetensors").is_file()
    return out


def _rewrite(f: Path, change) -> None:
    weights = load_file(str(f))
    change(weights)
    save_file(weights, str(f))


def _nan(weights: dict) -> None:
    k = sorted(weights)[0]
    weights[k] = weights[k].clone()
    weights[k].view(-1)[0] = float("nan")


def _other_shape(weights: dict) -> None:
    weights["head.proj.weight"] = torch.zeros(3, 5)


def _state(change) -> callable:
    def damage(ckpt: Path) -> None:
        state = torch.load(ckpt / "training_state.pt", weights_only=True)
        change(state)
        torch.save(state, ckpt / "training_state.pt")
    return damage


DAMAGE = {
    "best-truncated": (lambda c: (c / "best.safetensors").write_bytes((c / "best.safetensors").read_bytes()[:-64]),
                       "best.safetensors is truncated or corrupt"),
    "best-header-garbage": (lambda c: (c / "best.safetensors").write_bytes(b"\xff" * 64), "truncated or corrupt"),
    "best-missing": (lambda c: (c / "best.safetensors").unlink(), "best.safetensors is missing"),
    "best-of-another-shape": (lambda c: _rewrite(c / "best.safetensors", _other_shape),
                              "does not hold this model's weights (head.proj.weight"),
    "best-holding-nan": (lambda c: _rewrite(c / "best.safetensors", _nan), "holds NaN or infinite values"),
    "score-high": (_state(lambda s: s["keep_best"].update(score="high")), "keep_best holds score 'high'"),
    "score-nan": (_state(lambda s: s["keep_best"].update(score=float("nan"))), "keep_best holds score nan"),
    "step-past-the-checkpoint": (_state(lambda s: s["keep_best"].update(step=99)), "step 99"),
    "record-not-a-dict": (_state(lambda s: s.update(keep_best="best")), "keep_best is not a record"),
    "spike-guard-crafted": (_state(lambda s: s.update(spikes={"acc": "x"})), "spike guard"),
    "average-truncated": (lambda c: (c / "ema.safetensors").write_bytes((c / "ema.safetensors").read_bytes()[:-64]),
                          "ema.safetensors is truncated or corrupt"),
    "average-holding-nan": (lambda c: _rewrite(c / "ema.safetensors", _nan), "holds NaN or infinite values"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_or_crafted_selection_state_stops_a_resume_in_one_line(stopped, tmp_path, capsys, no_steps, case):
    damage, needle = DAMAGE[case]
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    damage(run / "checkpoint")
    before = digest(run)
    assert main(["train", "--resume", str(run), "--quiet"]) == 2
    one_line(capsys, needle)
    assert no_steps == [] and digest(run) == before


def test_whole_selection_state_resumes_to_the_end(stopped, tmp_path, capsys, no_steps):
    """The reference: the untouched copy resumes (steps 3 and 4) and selects its best weights."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert no_steps == [2, 3]
