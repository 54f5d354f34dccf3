"""Reliability, second round: run-folder locks, signals to sweeps, sizes checked before allocating, damaged dataset
arrays, non-finite weights, strict JSON and config hygiene — each case a one-line error with exit status 2 and
nothing already on disk lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from safetensors.torch import load_file, save_file
from test_cli_errors import TINY_YAML as TINY_CLI_YAML
from test_cli_errors import error_line

from loopformer.checksums import sha256_file
from loopformer.cli import main
from loopformer.fileio import write_json
from loopformer.model import memory
from loopformer.model.halting import HaltRule
from loopformer.train.run import RunLock

TINY_YAML = TINY_CLI_YAML.replace("steps: 2", "steps: 4").replace("eval_every: 1", "eval_every: 2")


@pytest.fixture()
def cfg(tmp_path) -> Path:
    (tmp_path / "tiny.yaml").write_text(TINY_YAML)
    return tmp_path / "tiny.yaml"


@pytest.fixture()
def run(cfg, tmp_path, capsys) -> Path:
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'run'}", "--quiet"]) == 0
    capsys.readouterr()
    return tmp_path / "run"


# ------------------------------------------------------------------------------------------------ locks
def test_a_second_writer_is_refused_while_a_run_holds_its_folder(cfg, tmp_path, capsys):
    out = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from loopformer.train.run import RunLock; "
                               f"RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["train", str(cfg), f"out_dir={out}", "--quiet"]) == 2
        error_line(capsys, f"in use by process {holder.pid}")
        assert not (out / "results.json").exists() and not (out / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", str(cfg), f"out_dir={out}", "--quiet"]) == 0          # the OS dropped the dead holder's lock
    lock = RunLock(out).acquire()                                                # ... and train released its own
    lock.release()


def test_a_fresh_run_keeps_off_a_folder_of_the_user_s_files(cfg, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.yaml").write_text("# my notes\nkeep: me\n")
    assert main(["train", str(cfg), f"out_dir={out}", "--quiet"]) == 2
    error_line(capsys, "notes.yaml")
    assert sorted(p.name for p in out.iterdir()) == [".lock", "notes.yaml"]
    assert main(["train", str(cfg), f"out_dir={out}", "--quiet", "--overwrite"]) == 0
    assert (out / "notes.yaml").read_text() == "# my notes\nkeep: me\n" and (out / "results.json").is_file()
    assert main(["train", str(cfg), f"out_dir={out}", "--quiet"]) == 2           # a finished run is not replaced
    error_line(capsys, "already holds a run")
    first = (out / "results.json").read_bytes()
    assert main(["train", str(cfg), f"out_dir={out}", "--quiet", "--overwrite", "seed=1"]) == 0   # ... unless asked
    assert (out / "results.json").read_bytes() != first and (out / "notes.yaml").exists()


def test_the_yaml_being_trained_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "exp"
    out.mkdir()
    mine = "# my experiment: keep this comment\n" + TINY_YAML
    (out / "config.yaml").write_text(mine)
    assert main(["train", str(out / "config.yaml"), f"out_dir={out}", "--quiet"]) == 2
    error_line(capsys, "config.yaml")
    assert (out / "config.yaml").read_text() == mine


# ------------------------------------------------------------------------------------------------ signals
SWEEP_YAML = TINY_YAML.replace("steps: 4", "steps: 60").replace("eval_every: 2", "eval_every: 10")


def _sweep(yaml: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "loopformer.cli", "sweep", str(yaml), "--grid", "model.loops=2,3", "--out",
            str(out), "--jobs", "2", "--threads", "1", "--quiet"]


def test_sigterm_stops_a_sweep_and_its_workers_and_a_rerun_gives_the_same_weights(tmp_path):
    yaml = tmp_path / "sweep.yaml"
    yaml.write_text(SWEEP_YAML)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = tmp_path / "ref"
    subprocess.run(_sweep(yaml, ref), check=True, env=env, capture_output=True)
    out = tmp_path / "killed"
    sweep = subprocess.Popen(_sweep(yaml, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parent = psutil.Process(sweep.pid)
    deadline = time.time() + 120
    while time.time() < deadline:          # both workers started and past their first checkpoint
        ckpts = list(out.glob("runs/*/checkpoint/model.safetensors"))
        if len(parent.children()) == 2 and len(ckpts) == 2:
            break
        time.sleep(0.05)
    workers = parent.children()
    assert len(workers) == 2
    sweep.send_signal(signal.SIGTERM)
    assert sweep.wait(timeout=60) == 128 + signal.SIGTERM
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive, "workers outlived the sweep"
    assert len(list(out.glob("runs/*/results.json"))) < 2                      # interrupted indeed
    subprocess.run(_sweep(yaml, out), check=True, env=env, capture_output=True)  # the immediate re-run completes it
    for name in ("loops=2", "loops=3"):
        a = (ref / "runs" / name / "checkpoint" / "model.safetensors").read_bytes()
        b = (out / "runs" / name / "checkpoint" / "model.safetensors").read_bytes()
        assert a == b, name


# ------------------------------------------------------------------------------------------------ sizes
@pytest.mark.parametrize("over,needle", [
    (["model.d_model=1000000000"], "d_model=1000000000 exceeds"),
    (["model.n_layers=1000000"], "n_layers=1000000 exceeds"),
    (["model.max_len=1000000000000"], "max_len=1000000000000 exceeds"),
    (["model.loops=10000000"], "loops=10000000 exceeds"),
    (["train.batch_size=1000000000"], "training needs about"),
    (["model.d_model=60000", "model.n_heads=1", "model.n_layers=500"], "training needs about"),
])
def test_absurd_sizes_are_refused_before_anything_is_built(cfg, tmp_path, capsys, monkeypatch, over, needle):
    def no_build(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr("loopformer.train.trainer.LoopedTransformer", no_build)
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'r'}", "--quiet", *over]) == 2
    error_line(capsys, needle)
    assert not (tmp_path / "r" / "config.yaml").exists()


def test_the_size_check_can_be_turned_off(cfg, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1000)       # a machine with 1 kB free
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'a'}", "--quiet"]) == 2
    error_line(capsys, "memory_check=false")
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'b'}", "--quiet", "memory_check=false"]) == 0


def test_the_estimate_counts_parameters_exactly_and_grows_with_batch_and_loops():
    from loopformer.model import LoopedTransformer, ModelConfig

    for kw in ({}, {"timestep": True, "loops": 3}, {"bias": True, "exit_gate": True}, {"tie_embeddings": True},
               {"compat": "authors", "n_layers": 2}, {"timestep": True, "timestep_embed": "learned", "loops": 4}):
        c = ModelConfig(vocab_size=13, d_model=16, n_heads=2, max_len=9, **kw)
        assert memory.param_count(c) == LoopedTransformer(c).num_params(), kw
    c = ModelConfig(vocab_size=13, d_model=16, n_heads=2, max_len=9, loops=4)
    a = memory.estimate(c, batch=8, training=True)
    assert memory.estimate(c, batch=16, training=True)["activations"] == 2 * a["activations"]
    assert memory.estimate(c.replace(loops=8), batch=8, training=True)["activations"] == 2 * a["activations"]
    assert memory.estimate(c.replace(checkpoint=True), batch=8, training=True)["activations"] < a["activations"]
    assert memory.estimate(c, batch=2, cache_len=9)["cache"] == 4 * 2 * 4 * 1 * 2 * 2 * 9 * 8


def test_checkpoint_configs_are_checked_against_the_weights_before_building(run, capsys, monkeypatch):
    cj = run / "checkpoint" / "config.json"
    data = json.loads(cj.read_text())
    data["d_model"] = 32                                     # config.json no longer matches model.safetensors
    cj.write_text(json.dumps(data))
    assert main(["eval", str(run), "--no-loopwise"]) == 2
    error_line(capsys, "does not match its config")
    data["d_model"], data["n_layers"] = 16, 10 ** 7          # absurd: refused by the config's bounds
    cj.write_text(json.dumps(data))
    assert main(["eval", str(run), "--no-loopwise"]) == 2
    error_line(capsys, "n_layers=10000000 exceeds")


def test_eval_loops_are_capped(run, capsys):
    assert main(["eval", str(run), "--loops", "100000"]) == 2
    error_line(capsys, "loops must be in 1..1024")


# ------------------------------------------------------------------------------------------------ dataset arrays
@pytest.mark.parametrize("damage", ["short", "object"])
def test_damaged_arrays_with_a_consistent_manifest_are_one_line_errors(cfg, tmp_path, capsys, damage):
    data = tmp_path / "data"
    assert main(["data", "gen", "lcs", "--out", str(data), "--train", "32", "--test", "8", "--opt", "length=3",
                 "alphabet_max=3"]) == 0
    f = data / "train" / "inputs.npy"
    arr = np.load(f)
    if damage == "short":           # the header claims 32 rows, the file holds 10
        raw = f.read_bytes()
        f.write_bytes(raw[:len(raw) - arr.itemsize * arr.shape[1] * 22])
    else:                           # an object array (a pickle inside)
        np.save(f, arr.astype(object), allow_pickle=True)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["checksums"]["train/inputs.npy"] = sha256_file(str(f))
    if damage == "object":
        manifest["arrays"]["train"]["inputs"]["dtype"] = "|O"
    (data / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["train", str(cfg), f"task.data_dir={data}", f"out_dir={tmp_path / 'r'}", "--quiet"]) == 2
    error_line(capsys, "train/inputs.npy")


# ------------------------------------------------------------------------------------------------ non-finite weights
def test_weights_holding_nan_are_refused(run, capsys):
    f = run / "checkpoint" / "model.safetensors"
    weights = load_file(f)
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, f)
    assert main(["eval", str(run), "--json", str(run.parent / "r.json")]) == 2
    error_line(capsys, "NaN or infinite")
    assert not (run.parent / "r.json").exists()


def test_json_files_are_strict(tmp_path):
    write_json(tmp_path / "r.json", {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf")}})
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": None}}


def test_norm_eps_must_be_positive(cfg, tmp_path, capsys):
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'r'}", "--quiet", "model.norm_eps=-1"]) == 2
    error_line(capsys, "norm_eps")


# ------------------------------------------------------------------------------------------------ config hygiene
def test_environment_interpolations_never_reach_the_run_folder(cfg, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOOPFORMER_SECRET", "hunter2")
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'a'}", "--quiet", "name=${oc.env:LOOPFORMER_SECRET}"]) == 2
    error_line(capsys, "resolver interpolation")
    y = tmp_path / "env.yaml"
    y.write_text(TINY_YAML + "name: run-${oc.env:LOOPFORMER_SECRET}\n")
    assert main(["train", str(y), f"out_dir={tmp_path / 'b'}", "--quiet"]) == 2
    error_line(capsys, "resolver interpolation")
    for d in (tmp_path / "a", tmp_path / "b"):
        assert not any("hunter2" in p.read_text(errors="ignore") for p in d.rglob("*") if p.is_file())
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'c'}", "--quiet", "eval.max_loops=${model.loops}"]) == 0


def test_huge_strings_are_refused(cfg, tmp_path, capsys):
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'r'}", "--quiet", "name=" + "x" * 100_000]) == 2
    error_line(capsys, "100,000 characters")
    assert not (tmp_path / "r").exists()


def test_halting_rules_with_min_above_max_are_refused(cfg, tmp_path, capsys):
    with pytest.raises(Exception, match="exceeds max_loops"):
        HaltRule.parse("kl:1e-3,min=5,max=2")
    assert main(["train", str(cfg), f"out_dir={tmp_path / 'r'}", "--quiet", "eval.halt=['kl:0.1,min=4,max=3']"]) == 2
    error_line(capsys, "exceeds max_loops")
