"""Training: end-to-end runs, exact resume after an interruption, per-loop losses, schedules, curricula, data
order and config errors — each checked against an independent computation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.model import LoopedTransformer
from loopformer.sources import TokenData, stream_indices
from loopformer.train.config import LoopSampling, OptimConfig, load_run_config
from loopformer.train.losses import summed_loss
from loopformer.train.optim import curriculum_end, loops_at, lr_at
from loopformer.train.run import read_metrics, read_results
from loopformer.train.trainer import train

TINY = ["task.name=lcs", "task.options={length: 3, alphabet_min: 2, alphabet_max: 3}", "task.n_train=96",
        "task.n_test=40", "model.d_model=16", "model.n_heads=2", "model.loops=2", "model.input_injection=true",
        "train.batch_size=8", "train.optim.lr=3e-3", "train.log_every=1", "eval.batch_size=64", "eval.max_loops=4",
        "log.tensorboard=false", "log.progress=false"]


def tiny(tmp_path: Path, *extra: str, name: str = "run"):
    return load_run_config(None, [*TINY, f"out_dir={tmp_path / name}", *extra])


def _train_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if r["split"] == "train"]


def test_end_to_end_run_folder(tmp_path):
    cfg = tiny(tmp_path, "train.steps=6", "train.eval_every=3")
    res = train(cfg)
    run = tmp_path / "run"
    for f in ("config.yaml", "run.json", "metrics.jsonl", "results.json", "checkpoint/model.safetensors",
              "checkpoint/config.json", "checkpoint/training_state.pt"):
        assert (run / f).is_file(), f
    info = json.loads((run / "run.json").read_text())
    assert info["seed"] == 0 and "torch" in info["versions"] and info["config"]["model"]["loops"] == 2
    assert res["steps"] == 6 and len(res["loopwise"]) == 4
    assert [r["step"] for r in read_metrics(run) if r["split"] == "test"] == [3, 6]
    assert read_results(run)["test"] == res["test"]
    # the recorded metric at the trained r is the loop-wise value at t = r
    assert res["loopwise"][1]["accuracy"] == res["test"]["accuracy"]


def test_resume_after_interruption_equals_uninterrupted(tmp_path, train_killed_at):
    full = tiny(tmp_path, "train.steps=10", "train.eval_every=4", "model.dropout=0.1", name="full")
    train(full)

    cut = tiny(tmp_path, "train.steps=10", "train.eval_every=4", "model.dropout=0.1", name="cut")

    train_killed_at(cut, 7)     # after the checkpoint at step 4 and three more steps that will be lost
    assert json.loads((tmp_path / "cut" / "checkpoint" / "config.json").read_text())["loops"] == 2
    assert max(s for s, _ in _train_losses(tmp_path / "cut")) == 7
    from loopformer.train.run import load_for_resume

    train(load_for_resume(tmp_path / "cut"), resume=True)
    a, b = _train_losses(tmp_path / "full"), _train_losses(tmp_path / "cut")
    assert [s for s, _ in b] == list(range(1, 11))
    assert a == b                                   # bit-identical losses, same data order and dropout masks
    ra, rb = read_results(tmp_path / "full"), read_results(tmp_path / "cut")
    assert ra["test"] == rb["test"] and ra["loopwise"] == rb["loopwise"]
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "full" / "checkpoint" / "model.safetensors"))
    wb = load_file(str(tmp_path / "cut" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_refuses_to_overwrite_a_run(tmp_path):
    cfg = tiny(tmp_path, "train.steps=2")
    train(cfg)
    with pytest.raises(UserError, match="already holds a run"):
        train(cfg)


@pytest.mark.parametrize("mode,window", [("last", 1), ("all", 1), ("window", 2)])
def test_per_loop_loss_matches_manual(mode, window):
    torch.manual_seed(0)
    cfg = load_run_config(None, [*TINY, "model.loops=3", f"train.losses.loops={mode}", f"train.losses.window={window}"])
    model = LoopedTransformer(cfg.model)
    data = TokenData(cfg.task)
    b = data.fetch(data.plan(0, 8), 0)
    from loopformer.train.losses import loss_loops

    n = loss_loops(cfg.train.losses, 3)
    out = model(b["inputs"], return_all=n is not None)
    logits = out.logits if n is None else out.all_logits[-n:]
    s, count = summed_loss(logits, b["targets"])
    got = s / (count * (n or 1))
    # reference: run the model separately with t loops for each loop in the loss, mean cross-entropy
    loops = {"last": [3], "all": [1, 2, 3], "window": [2, 3]}[mode]
    ref = torch.stack([F.cross_entropy(model(b["inputs"], loops=t).logits.flatten(0, 1), b["targets"].flatten(),
                                       ignore_index=-100) for t in loops]).mean()
    assert torch.allclose(got, ref, atol=1e-5)


def test_regression_loss_uses_weights():
    out = torch.tensor([[[1.0], [2.0], [3.0]]])                    # [B=1,T=3,1]
    y = torch.tensor([[0.0, 0.0, 1.0]])
    w = torch.tensor([[1.0, 0.0, 1.0]])
    s, c = summed_loss(out, y, w)
    assert c == 2 and math.isclose(float(s), 1.0 + 4.0)


def test_schedules():
    lin = OptimConfig(lr=1.0, min_lr=0.0, schedule="linear", warmup_steps=5)
    assert lr_at(lin, 0, 100) == pytest.approx(0.2) and lr_at(lin, 4, 100) == pytest.approx(1.0)
    assert lr_at(lin, 5, 100) == pytest.approx(1.0)
    assert lr_at(lin, 52, 100) == pytest.approx(1 - 47 / 95)
    assert lr_at(lin, 100, 100) == pytest.approx(0.0)
    cos = OptimConfig(lr=2e-4, min_lr=6e-5, schedule="cosine", warmup_steps=100)
    assert lr_at(cos, 49, 1000) == pytest.approx(2e-4 * 50 / 100)
    mid = 100 + 450
    assert lr_at(cos, mid, 1000) == pytest.approx(6e-5 + (2e-4 - 6e-5) * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(cos, 1000, 1000) == pytest.approx(6e-5)
    one = OptimConfig(lr=1.0, schedule="onecycle", warmup_fraction=0.1)
    assert lr_at(one, 9, 100) == pytest.approx(1.0) and lr_at(one, 99, 100) < 0.01
    const = OptimConfig(lr=0.5, schedule="constant", warmup_steps=0)
    assert {lr_at(const, s, 10) for s in range(10)} == {0.5}


def test_loop_curriculum():
    cfg = LoopSampling(start=2, every=10, increment=3)
    assert [loops_at(cfg, s, 9) for s in (0, 9, 10, 25, 99)] == [2, 2, 5, 8, 9]
    assert loops_at(LoopSampling(), 5, 7) == 7


def test_curriculum_end_is_the_first_step_at_r():
    cfg = LoopSampling(start=2, every=10, increment=3)
    end = curriculum_end(cfg, 9)
    assert end == 30 and loops_at(cfg, end, 9) == 9 and loops_at(cfg, end - 1, 9) < 9
    assert all(curriculum_end(cfg, r) == min(s for s in range(1000) if loops_at(cfg, s, r) == r) for r in range(1, 40))
    assert curriculum_end(LoopSampling(), 7) is None


def test_loop_curriculum_in_training(tmp_path, capsys):
    cfg = tiny(tmp_path, "train.steps=6", "model.loops=4", "train.loops.start=1", "train.loops.every=2",
               "train.loops.increment=1")
    train(cfg)
    loops = [r["loops"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert loops == [1, 1, 2, 2, 3, 3]
    # the curriculum reaches 4 loops at step 6, after the run's 6 steps: said once, and recorded
    err = capsys.readouterr().err
    assert err.count("warning: the loop curriculum reaches model.loops = 4 at step 6, after this run's 6 steps") == 1
    assert json.loads((tmp_path / "run" / "run.json").read_text())["curriculum_reaches_loops_at"] == 6
    train(tiny(tmp_path, "train.steps=7", "model.loops=4", "train.loops.start=1", "train.loops.every=2",
               name="reached"))
    assert "warning" not in capsys.readouterr().err


def test_icl_curriculum_and_training(tmp_path):
    cfg = load_run_config(None, [
        "task.name=icl", "task.options={function_class: linear, n_dims: 4}", "task.n_test=16",
        "task.curriculum={dims_start: 2, dims_end: 4, dims_inc: 1, dims_interval: 2, points_start: 3, "
        "points_end: 5, points_inc: 1, points_interval: 2}",
        "model.d_model=16", "model.n_heads=2", "model.loops=2", "train.steps=5", "train.batch_size=4",
        "train.losses.loops=all", "log.progress=false", "log.tensorboard=false", f"out_dir={tmp_path / 'icl'}"])
    assert cfg.model.input_dim == 5 and cfg.model.head == "regression" and cfg.model.max_len == 10
    from loopformer.sources import make_data

    data = make_data(cfg.task)
    for step, (dims, points) in [(0, (2, 3)), (2, (3, 4)), (5, (4, 5))]:
        b = data.fetch(data.plan(step, 4), step)
        assert b["inputs"].shape == (4, 2 * points, 5)
        xs = b["inputs"][:, 0::2, :4]
        assert torch.all(xs[..., dims:] == 0) and torch.all(xs[..., :dims] != 0)
        assert torch.equal(b["targets"][:, 0::2], b["inputs"][:, 1::2, 4])   # y_i supervised at x_i's position
    res = train(cfg)
    assert res["metric"] == "mse" and math.isfinite(res["test"]["mse"]) and len(res["loopwise"]) == 4


def test_data_order_epochs_and_determinism():
    n = 10
    rows = stream_indices(3, n, 0, 35)
    for e in range(3):
        assert sorted(rows[e * n:(e + 1) * n]) == list(range(n))      # every epoch visits every row once
    assert not np.array_equal(rows[:n], rows[n:2 * n])                 # ... in a fresh order
    assert np.array_equal(stream_indices(3, n, 7, 9), rows[7:16])       # any window of the stream is the same


def test_answer_only_hides_the_answer(tmp_path):
    cfg = tiny(tmp_path, "task.answer_only=true")
    assert cfg.model.causal is False
    data = TokenData(cfg.task)
    x, st = data.test["inputs"], data.test["answer_start"]
    for i in range(5):
        assert np.all(x[i, st[i]:] == 0) and np.all(x[i, :st[i]] != 0)
    assert np.all(data.test["targets"][np.arange(len(st)), st - 1] >= 30)   # the answer number is a target
    keys = data.plan(2, 8)
    b = data.fetch(keys, 2)
    for i, k in enumerate(keys):                                           # training rows are hidden the same way
        s0 = data.train["answer_start"][k]
        assert np.all(b["inputs"][i, s0:].numpy() == 0)
        assert np.array_equal(b["inputs"][i, :s0].numpy(), data.train["inputs"][k, :s0])
        assert np.array_equal(b["targets"][i].numpy(), data.train["targets"][k])


def test_epochs_give_steps(tmp_path):
    cfg = tiny(tmp_path, "train.steps=0", "train.epochs=0.5")
    res = train(cfg)
    assert res["steps"] == math.ceil(0.5 * 96 / 8)


def _cli_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loopformer: error: ")
    return err[0]


def test_cli_config_errors(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task:\n  name: lcs\n  options: {length: 3}\ntrain:\n  steps: 2\n")
    assert "lr_typo" in _cli_error(capsys, ["train", str(cfg), "train.lr_typo=3"])
    assert "steps" in _cli_error(capsys, ["train", str(cfg), "train.steps=many"])
    assert "data directory not found" in _cli_error(capsys, ["train", str(cfg), f"task.data_dir={tmp_path}/none"])
    assert "not found" in _cli_error(capsys, ["train", str(tmp_path / "missing.yaml")])
    assert "train.losses.loops" in _cli_error(capsys, ["train", str(cfg), "train.losses.loops=some"])
    assert "resume" in _cli_error(capsys, ["train", "--resume", str(tmp_path)])
    assert not (tmp_path / "runs").exists()


def test_cli_train_and_resume_extends(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("\n".join(["task:", "  name: lcs", "  options: {length: 3, alphabet_max: 3}", "  n_train: 64",
                              "  n_test: 16", "model: {d_model: 16, n_heads: 2, loops: 2}",
                              "train: {steps: 3, batch_size: 8, log_every: 1}", "log: {tensorboard: false}"]))
    out = tmp_path / "r"
    assert main(["train", str(cfg), f"out_dir={out}", "--quiet", "--device", "cpu"]) == 0
    assert main(["train", "--resume", str(out), "train.steps=5", "--quiet"]) == 0
    assert [r["step"] for r in read_metrics(out) if r["split"] == "train"] == [1, 2, 3, 4, 5]


def test_language_model_training_on_a_token_folder(tmp_path):
    from loopformer.sources import TextData
    from loopformer.text.corpus import PrepareOptions, prepare_corpus

    rng = np.random.default_rng(0)
    (tmp_path / "t.txt").write_text("\n".join(" ".join(rng.choice(["to", "be", "or", "not"], 10)) for _ in range(200)))
    prepare_corpus(str(tmp_path / "t.txt"), tmp_path / "c", PrepareOptions(tokenizer="bpe", vocab_size=280),
                   progress=False)
    cfg = load_run_config(None, ["task.name=text", f"task.data_dir={tmp_path / 'c'}", "task.block_size=16",
                                 "task.eval_windows=4", "model.d_model=16", "model.n_heads=2", "model.loops=2",
                                 "train.steps=4", "train.batch_size=4", "train.log_every=1", "log.progress=false",
                                 "log.tensorboard=false", f"out_dir={tmp_path / 'lm'}"])
    data = TextData(cfg.task)
    V = data.corpus.vocab_size
    assert cfg.model.vocab_size == V and cfg.model.causal and cfg.model.max_len == 16
    keys = data.plan(3, 4)
    b = data.fetch(keys, 3)
    toks = np.asarray(data.train_tokens)
    for i, o in enumerate(keys):   # targets are the inputs shifted by one token of the training split
        assert np.array_equal(b["inputs"][i].numpy(), toks[o:o + 16]) and np.array_equal(b["targets"][i].numpy(),
                                                                                         toks[o + 1:o + 17])
    res = train(cfg)
    assert res["metric"] == "ppl" and res["test"]["ppl"] == pytest.approx(math.exp(res["test"]["loss"]))
    first = read_metrics(tmp_path / "lm")[0]
    assert abs(first["loss"] - math.log(V)) < 1.0      # an untrained model is near the uniform guess


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    """A real `kill -9` of `loopformer train` between checkpoints, then `--resume`: same losses and weights."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = [*TINY, "train.steps=300", "train.eval_every=40", "eval.max_loops=2"]
    train(load_run_config(None, [*args, f"out_dir={tmp_path / 'full'}"]))
    cut = tmp_path / "cut"
    (tmp_path / "tiny.yaml").write_text("seed: 0\n")         # the run is the overrides
    proc = subprocess.Popen([sys.executable, "-m", "loopformer.cli", "train", str(tmp_path / "tiny.yaml"), *args,
                             f"out_dir={cut}", "--quiet"],
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        steps = [r["step"] for r in read_metrics(cut) if r["split"] == "train"]
        if (cut / "checkpoint" / "training_state.pt").is_file() and steps and max(steps) >= 100:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (cut / "results.json").exists()
    assert main(["train", "--resume", str(cut), "--quiet"]) == 0
    assert _train_losses(cut) == _train_losses(tmp_path / "full")
    assert read_results(cut)["test"] == read_results(tmp_path / "full")["test"]
