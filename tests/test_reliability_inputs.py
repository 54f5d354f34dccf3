"""Reliability, third round: hostile checkpoints and config files, empty splits, odd option values, sizes checked
before work, folders that hold the user's files, symbolic links, kills while a checkpoint is written — each a
correct result or one line with exit status 2, with nothing the user owns changed."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli_errors import TINY_YAML, error_line, train_tiny
from test_convert import ckpt

import loopformer.model.io as ckpt_io
from loopformer.analysis.continuity import ContinuityConfig
from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.tasks.common import draw_in_split
from loopformer.text.generate import sample_next
from loopformer.train.run import RunLock


def digest(folder: Path) -> str:
    """A hash of every name, link target and file content under `folder`."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def dead_pid() -> int:
    """The id of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("inputs"))




@pytest.fixture()
def cfg(tmp_path) -> Path:
    (tmp_path / "tiny.yaml").write_text(TINY_YAML)
    return tmp_path / "tiny.yaml"


# ------------------------------------------------------------------------------------------------ convert
def _hostile(kind: str) -> dict:
    c = ckpt("lt")
    if kind == "string":
        c["model_args"]["n_loop"] = "four"
    elif kind == "list":
        c["model_args"]["vocab_size"] = [1, 2]
    elif kind == "huge":
        c["model_args"]["n_embd"] = 10 ** 12
    elif kind == "huge_block":
        c["model_args"]["block_size"] = 2 ** 40
    elif kind == "misshaped":
        c["model_args"]["n_embd"] = 64
    elif kind == "heads":
        c["model_args"]["n_head"] = 3
    elif kind == "tensor":
        c["model"] = torch.zeros(3)
    elif kind == "nan":
        c["model"]["transformer.mlp.c_fc.weight"][0, 0] = float("nan")
    return c


@pytest.mark.parametrize("flags,needle", [
    (["--batch", "-1"], "--batch must lie in"), (["--batch", "0"], "--batch must lie in"),
    (["--length", "-5"], "--length must lie in"), (["--length", "100000"], "--length must lie in"),
    (["debug", "--length", "100"], "exceeds preset debug's max_len")])
def test_presets_refuses_input_it_cannot_time_in_one_line(capsys, flags, needle):
    assert main(["presets", *flags]) == 2
    error_line(capsys, needle)


@pytest.mark.parametrize("kind,needle", [
    ("string", "n_loop must be an integer"), ("list", "vocab_size must be an integer"), ("huge", "d_model"),
    ("huge_block", "max_len"), ("misshaped", "shape"), ("heads", "n_heads"), ("tensor", "'model' entry"),
    ("nan", "NaN")])
def test_convert_refuses_hostile_checkpoints_in_one_line(tmp_path, capsys, kind, needle):
    torch.save(_hostile(kind), tmp_path / "ckpt.pt")
    assert main(["convert", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "out")]) == 2
    error_line(capsys, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["convert", "info", "train"])
def test_a_memory_refusal_names_only_switches_the_command_has(run, cfg, tmp_path, capsys, monkeypatch, command):
    """A refusal for memory names the way to skip the check only where the command has one: `convert` and `info`
    have none (no --no-memory-check, no config), `train` takes `memory_check=false`, `generate` --no-memory-check."""
    import argparse
    import re

    import loopformer.model.memory as memory
    from loopformer.cli import build_parser, memory_check_switch

    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1000)
    torch.save(ckpt("lt"), tmp_path / "ckpt.pt")
    argv = {"convert": ["convert", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "out")],
            "info": ["info", str(run)],
            "train": ["train", str(cfg), f"out_dir={tmp_path / 'r'}", "--quiet"]}[command]
    assert main(argv) == 2
    line = error_line(capsys, "GiB are available")
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    named = re.findall(r"--[a-z][a-z-]+", line)
    assert all(flag in sub._option_string_actions for flag in named), line
    assert ("memory_check=false" in line) == (command == "train"), line
    assert not (tmp_path / "out").exists()
    assert memory_check_switch(parser.parse_args(["generate", "x", "--prompt", "p"])) == "--no-memory-check"


def test_convert_never_replaces_a_folder_it_did_not_write(run, tmp_path, capsys):
    torch.save(ckpt("lt"), tmp_path / "ckpt.pt")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for dest in (run, run / "checkpoint", mine):
        before = digest(dest)
        assert main(["convert", str(tmp_path / "ckpt.pt"), "--out", str(dest)]) == 2
        error_line(capsys, str(dest))
        assert digest(dest) == before
    out = tmp_path / "conv"
    assert main(["convert", str(tmp_path / "ckpt.pt"), "--out", str(out)]) == 0
    assert main(["convert", str(tmp_path / "ckpt.pt"), "--out", str(out)]) == 0     # its own folder: replaced


# ------------------------------------------------------------------------------------------------ data
@pytest.mark.parametrize("task", ["word_problem", "pointer_chase", "schedule"])
def test_data_gen_with_no_test_rows_and_training_on_it(task, tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["data", "gen", task, "--out", str(out), "--train", "8", "--test", "0"]) == 0
    capsys.readouterr()
    (tmp_path / "c.yaml").write_text(TINY_YAML.replace("task: {name: lcs, options: {length: 3, alphabet_min: 2, "
                                                       "alphabet_max: 3}, n_train: 64, n_test: 16}",
                                                       f"task: {{name: {task}, data_dir: {out}}}"))
    assert main(["train", str(tmp_path / "c.yaml"), f"out_dir={tmp_path / 'r'}", "--quiet"]) == 2
    error_line(capsys, "no test rows")
    assert not (tmp_path / "r" / "run.json").exists()


def test_eval_data_with_no_test_rows(tmp_path, capsys):
    (tmp_path / "pc.yaml").write_text(TINY_YAML.replace(
        "task: {name: lcs, options: {length: 3, alphabet_min: 2, alphabet_max: 3}, n_train: 64, n_test: 16}",
        "task: {name: pointer_chase, options: {symbols: 4, hops: 2}, n_train: 32, n_test: 8}"))
    assert main(["train", str(tmp_path / "pc.yaml"), f"out_dir={tmp_path / 'r'}", "--quiet"]) == 0
    assert main(["data", "gen", "pointer_chase", "--out", str(tmp_path / "d"), "--train", "4", "--test", "0",
                 "--opt", "symbols=4", "hops=2"]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "r"), "--data", str(tmp_path / "d")]) == 2
    error_line(capsys, "no test rows")


def test_a_space_too_small_for_the_split_ends_with_one_line(tmp_path, capsys):
    def one_row(rng, m):
        return {"inputs": np.zeros((m, 3), dtype=np.int64)}

    from loopformer.tasks.common import in_split
    split = "test" if in_split(np.zeros((1, 3), dtype=np.int64), "train")[0] else "train"
    with pytest.raises(UserError, match="too few distinct samples"):
        draw_in_split(one_row, 1, np.random.default_rng(0), split)
    t0 = time.perf_counter()
    code = main(["data", "gen", "pointer_chase", "--out", str(tmp_path / "d"), "--train", "1", "--test", "1",
                 "--opt", "symbols=2", "hops=1"])
    assert code in (0, 2) and time.perf_counter() - t0 < 30
    if code == 2:
        error_line(capsys, "too few distinct samples")


# ------------------------------------------------------------------------------------------------ run configs
@pytest.mark.parametrize("override,needle", [
    ("train.optim.eps=nan", "train.optim.eps"), ("train.optim.eps=-1", "train.optim.eps"),
    ("train.losses.fixed_point_loops=100000", "fixed_point_loops"),
    ("task.loop_targets=true", "no intermediate states")])
def test_bad_training_values_are_one_line_before_any_step(cfg, tmp_path, capsys, override, needle):
    extra = ["task.name=icl", "train.losses.loops=all"] if "loop_targets" in override else []
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'r'}", override, *extra, "--quiet"]) == 2
    error_line(capsys, needle)
    assert not (tmp_path / "r").exists()


def test_the_evaluation_section_is_checked_before_the_first_step(cfg, tmp_path, capsys):
    steps = []
    import loopformer.train.trainer as trainer

    real = trainer.Trainer.step
    trainer.Trainer.step = lambda self, step: steps.append(step) or real(self, step)
    try:
        assert main(["train", str(cfg), f"out_dir={tmp_path / 'r'}", "eval.votes=3", "--quiet"]) == 2
    finally:
        trainer.Trainer.step = real
    error_line(capsys, "defines no symmetries")
    assert steps == [] and not (tmp_path / "r" / "run.json").exists()


def _doctor(run: Path, tmp_path: Path, edit) -> Path:
    import shutil

    copy = tmp_path / "doctored"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".lock"))
    f = copy / "checkpoint" / "config.json"
    f.write_text(edit(f.read_text()))
    return copy


@pytest.mark.parametrize("edit,needle", [
    (lambda t: json.dumps({**json.loads(t), "run": "lcs"}), "run must be a JSON object"),
    (lambda t: json.dumps({**json.loads(t), "task": ["lcs"]}), "task must be a JSON object"),
    (lambda t: t.rstrip()[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}", "nested too deeply")])
def test_crafted_checkpoint_configs_are_one_line(run, tmp_path, capsys, edit, needle):
    copy = _doctor(run, tmp_path, edit)
    assert main(["eval", str(copy), "--no-loopwise"]) == 2
    error_line(capsys, needle)


# ---------------------------------------------------------------------------------------- eval, generate, analyze
def test_eval_plot_that_is_no_image_is_refused_before_evaluating(run, tmp_path, capsys, monkeypatch):
    import loopformer.eval.commands as ec

    monkeypatch.setattr(ec, "evaluate_all", lambda *a, **k: pytest.fail("evaluated"))
    assert main(["eval", str(run), "--budgets", "1,2", "--plot", str(tmp_path / "x.txt")]) == 2
    error_line(capsys, "no image format")
    assert list(tmp_path.iterdir()) == []


def test_sampling_at_extreme_settings(capsys, run):
    logits = torch.tensor([[0.0, 1.0, 0.5], [2.0, 2.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=1e-300, generator=g).tolist()[0] == 1
    assert sample_next(logits, temperature=1.0, top_p=1e-300, generator=g).tolist()[0] == 1
    assert main(["generate", str(run), "--prompt", "x", "--seed", str(10 ** 23)]) == 2
    error_line(capsys, "seed")


def test_dynamics_below_the_trained_loops_and_continuity_scales(run, tmp_path):
    from loopformer.analysis.dynamics import analyze_dynamics

    with pytest.raises(UserError, match="below the model's trained loops"):
        analyze_dynamics(str(run), str(tmp_path / "dyn"), max_loops=1)
    for bad in (float("nan"), math.inf, 0.0):
        with pytest.raises(UserError, match="positive finite"):
            ContinuityConfig(scales=(bad,))


# ------------------------------------------------------------------------------------------------ sweeps, reproduce
def test_sweep_grids_given_twice_or_too_large_are_refused(cfg, tmp_path, capsys):
    assert main(["sweep", str(cfg), "--grid", "model.loops=2,3", "model.loops=4", "--out", str(tmp_path / "s")]) == 2
    error_line(capsys, "given twice")
    t0 = time.perf_counter()
    big = ",".join(str(i) for i in range(1, 1001))
    assert main(["sweep", str(cfg), "--grid", f"seed={big}", f"task.seed={big}", f"train.optim.lr={big}",
                 "--out", str(tmp_path / "s")]) == 2
    error_line(capsys, "1,000,000,000 runs")
    assert time.perf_counter() - t0 < 5 and not (tmp_path / "s").exists()


def test_reproduce_seeds_and_export_folders(tmp_path, capsys):
    assert main(["reproduce", "--seeds", "1000000000", "--dry-run", "--out", str(tmp_path / "rep")]) == 2
    error_line(capsys, "--seeds")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my own report")
    before = digest(mine)
    assert main(["reproduce", "--dry-run", "--export", str(mine), "--out", str(tmp_path / "rep")]) == 2
    error_line(capsys, "report.md")
    assert digest(mine) == before
    from loopformer.experiments.reproduce import export

    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "report.json").write_text("{}")
    export(tmp_path / "rep", tmp_path / "exp")
    export(tmp_path / "rep", tmp_path / "exp")      # an earlier export: refreshed


# ------------------------------------------------------------------------------------------------ text prepare
def test_text_prepare_keeps_the_user_s_files(tmp_path, capsys):
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is"]
    (tmp_path / "t.txt").write_text("".join(" ".join(rng.choice(words, 7)) + "\n" for _ in range(80)))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "val.bin").write_bytes(b"my own bytes")
    (mine / "notes.md").write_text("mine")
    before = digest(mine)
    args = ["text", "prepare", str(tmp_path / "t.txt"), "--vocab-size", "270", "--quiet"]
    for extra in ([], ["--force"], ["--val-fraction", "0"]):
        assert main([*args, "--out", str(mine), *extra]) == 2
        error_line(capsys, "notes.md")
        assert digest(mine) == before
    out = tmp_path / "corpus"
    out.mkdir()
    stale = out / f".prepare-{dead_pid()}-abc"
    stale.mkdir()
    assert main([*args, "--out", str(out)]) == 0
    assert not stale.exists() and (out / "manifest.json").is_file()


# ------------------------------------------------------------------------------------------------ files
def test_a_lock_that_is_a_symbolic_link_is_not_followed(tmp_path, cfg, capsys):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    out = tmp_path / "r"
    out.mkdir()
    (out / ".lock").symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        RunLock(out).acquire()
    assert main(["train", str(cfg), f"out_dir={out}", "--quiet"]) == 2
    error_line(capsys, "symbolic link")
    assert target.read_text() == "keep me"


def test_sweep_logs_that_are_symbolic_links_are_not_followed(tmp_path):
    from loopformer.fileio import open_nofollow

    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "run.log").symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        open_nofollow(tmp_path / "run.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("failure", ["safetensors", "torch.save"])
def test_a_full_disk_inside_the_weight_writers_keeps_the_last_checkpoint(cfg, tmp_path, capsys, monkeypatch,
                                                                         failure):
    from safetensors import SafetensorError

    calls = {"n": 0}
    real = ckpt_io.save_model if failure == "safetensors" else torch.save

    def fail_second(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise SafetensorError("Error while serializing: IoError(No space left on device)") \
                if failure == "safetensors" else RuntimeError("[enforce fail] PytorchStreamWriter failed writing file")
        return real(*a, **k)

    if failure == "safetensors":
        monkeypatch.setattr(ckpt_io, "save_model", fail_second)
    else:
        monkeypatch.setattr(ckpt_io.torch, "save", fail_second)
    out = tmp_path / "r"
    assert main(["train", str(cfg), f"out_dir={out}", "--quiet"]) == 2
    error_line(capsys, "cannot write the checkpoint")
    monkeypatch.undo()
    assert ckpt_io.load_training_state(out / "checkpoint")["step"] == 1
    assert [p.name for p in out.iterdir() if p.name.startswith(".checkpoint")] == []


def test_a_kill_while_the_first_training_state_is_written(cfg, tmp_path, capsys, monkeypatch):
    """A kill -9 inside the first checkpoint's write leaves its temporary folder (weights written, training state
    cut short): the next run does not take it for a checkpoint, removes it and trains afresh."""
    import shutil

    class Killed(BaseException):
        pass

    real = torch.save
    out = tmp_path / "r"

    def killed_save(obj, f, *a, **k):
        real(obj, f, *a, **k)
        Path(f).write_bytes(Path(f).read_bytes()[:100])            # cut short
        shutil.copytree(Path(f).parent, out / f".checkpoint.tmp-{dead_pid()}-x")   # what a kill -9 leaves
        raise Killed

    monkeypatch.setattr(ckpt_io.torch, "save", killed_save)
    with pytest.raises(Killed):
        main(["train", str(cfg), f"out_dir={out}", "--quiet"])
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["train", str(cfg), f"out_dir={out}", "--quiet"]) == 0
    assert (out / "results.json").is_file()
    assert [p.name for p in out.iterdir() if p.name.startswith(".checkpoint")] == []


@pytest.mark.parametrize("args,needle", [(["--N", "100000", "--d", "100000"], "GiB"),
                                         (["--samples", str(10 ** 12)], "lower --samples")])
def test_theory_modulus_sizes_are_checked_before_drawing(capsys, args, needle):
    t0 = time.perf_counter()
    assert main(["theory", "modulus", "--delta", "0.1", *args]) == 2
    error_line(capsys, needle)
    assert time.perf_counter() - t0 < 5
