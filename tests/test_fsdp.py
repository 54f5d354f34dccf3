"""Sharded data parallelism (`train.system.parallel=fsdp`) with `torchrun` on CPU (gloo): two processes follow the loss
curve of one process with the whole batch; a distributed checkpoint written by 2 processes resumes on 1 (and one written
by 1 on 2) with the losses of an uninterrupted run; the full weights written beside the shards, and the export rebuilt
from the shards alone, load with `loopformer.load` and evaluate to the run's metrics; bad launches and damaged
checkpoints are one line with exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loopformer import cli
from loopformer.model.io import load
from loopformer.train.config import load_run_config
from loopformer.train.run import read_metrics, read_results
from loopformer.train.sharding import SHARDED, read_sharded
from loopformer.train.trainer import train

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found")

BASE = """seed: 0
task: {name: lcs, options: {length: 3, alphabet_min: 2, alphabet_max: 3}, n_train: 64, n_test: 40}
model: {d_model: 16, n_heads: 2, loops: 3, input_injection: true}
train: {batch_size: 16, log_every: 1, steps: 8, eval_every: 4, optim: {lr: 3.0e-3, grad_clip: 0.5}}
eval: {batch_size: 64, max_loops: 6}
log: {tensorboard: false, progress: false}
"""
# a launch that stops after step K, as a crash right after that step's checkpoint would
STOP = """import sys
from loopformer.train.config import load_run_config
from loopformer.train.trainer import train

class Stop(Exception):
    pass

def stop(step):
    if step == int(sys.argv[1]):
        raise Stop

try:
    train(load_run_config(sys.argv[2], sys.argv[3:]), on_step=stop, progress=False)
except Stop:
    pass
"""


def torchrun(cwd: Path, n: int, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([TORCHRUN, "--standalone", f"--nproc_per_node={n}", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stderr[:2000] + "\n…\n" + proc.stderr[-2000:]
    return proc


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["split"] == "train"]


def one_process(folder: Path, name: str, *overrides: str) -> Path:
    """The reference: one plain process with the whole batch."""
    out = folder / name
    train(load_run_config(str(folder / "base.yaml"), [*overrides, f"out_dir={out}"]), progress=False)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One process, uninterrupted; two sharded processes stopped after step 4 and resumed on one."""
    d = tmp_path_factory.mktemp("fsdp")
    (d / "base.yaml").write_text(BASE)
    (d / "stop.py").write_text(STOP)
    one = one_process(d, "one")
    torchrun(d, 2, "stop.py", "4", "base.yaml", "train.system.parallel=fsdp", f"out_dir={d / 'sharded'}")
    stopped = d / "stopped"                        # the checkpoint two processes wrote, kept for the error tests
    shutil.copytree(d / "sharded", stopped)
    torchrun(d, 1, "-m", "loopformer.cli", "train", "--resume", str(d / "sharded"), "--quiet")
    return {"dir": d, "one": one, "sharded": d / "sharded", "stopped": stopped}


@needs_torchrun
def test_two_sharded_processes_resumed_on_one_follow_one_process(runs):
    one, sharded = runs["one"], runs["sharded"]
    assert len(losses(one)) == 8
    assert losses(sharded) == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
    assert read_results(sharded)["test"] == pytest.approx(read_results(one)["test"], abs=1e-6)
    ckpt = runs["stopped"] / "checkpoint"
    assert sorted(p.name for p in (ckpt / SHARDED).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                      "manifest.json"]
    state = torch.load(ckpt / "training_state.pt", weights_only=True)
    assert state["sharded"] is True and state["step"] == 4 and len(state["rng"]) == 2


@needs_torchrun
def test_the_full_weights_and_the_export_load_and_evaluate_as_the_run(runs, tmp_path, capsys):
    """model.safetensors beside the shards equals the single process's weights; `export` rebuilds the same tensors
    from the shards alone; both evaluate to the run's final metrics."""
    sharded, one = runs["sharded"], runs["one"]
    a, b = load(sharded).state_dict(), load(one).state_dict()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert cli.main(["export", str(sharded), "--out", str(tmp_path / "exported")]) == 0
    e = load(tmp_path / "exported").state_dict()
    assert set(e) == set(a) and all(torch.equal(e[k], a[k]) for k in a)
    assert cli.main(["eval", str(tmp_path / "exported"), "--no-loopwise", "--json", str(tmp_path / "e.json")]) == 0
    got = json.loads((tmp_path / "e.json").read_text())
    assert got["metrics"] == pytest.approx(read_results(sharded)["test"], abs=1e-9)
    # the shards alone: the optimiser state is left out, every weight is there
    assert set(read_sharded(sharded / "checkpoint" / SHARDED)["model"]) == set(a)


def one_line_exit_2(capsys, argv: list[str], needle: str) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_fsdp_without_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "base.yaml").write_text(BASE)
    one_line_exit_2(capsys, ["train", str(tmp_path / "base.yaml"), "train.system.parallel=fsdp",
                             f"out_dir={tmp_path / 'r'}", "--quiet"], "launch with torchrun")
    assert not (tmp_path / "r").exists()
    one_line_exit_2(capsys, ["train", str(tmp_path / "base.yaml"), "train.system.parallel=zero"],
                    "train.system.parallel must be")


@needs_torchrun
def test_a_sharded_checkpoint_resumed_without_sharding_is_one_line(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["stopped"], run)
    before = sorted(p.name for p in (run / "checkpoint").rglob("*"))
    one_line_exit_2(capsys, ["train", "--resume", str(run), "train.system.parallel=ddp", "--quiet"],
                    "written with train.system.parallel=fsdp")
    assert sorted(p.name for p in (run / "checkpoint").rglob("*")) == before


@needs_torchrun
def test_export_refuses_damaged_shards_and_user_folders(runs, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["stopped"] / "checkpoint", ckpt)
    (ckpt / SHARDED / "__1_0.distcp").unlink()                       # a shard lost
    one_line_exit_2(capsys, ["export", str(ckpt), "--out", str(tmp_path / "x")], "lacks __1_0.distcp")
    assert not (tmp_path / "x").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    one_line_exit_2(capsys, ["export", str(runs["sharded"]), "--out", str(mine)], "export does not write")
    assert (mine / "notes.txt").read_text() == "keep"
    one_line_exit_2(capsys, ["export", str(runs["one"]), "--out", str(tmp_path / "y")], "holds no sharded checkpoint")


@pytest.mark.slow
@needs_torchrun
def test_a_checkpoint_of_one_sharded_process_resumes_on_two(runs, tmp_path):
    d = runs["dir"]
    torchrun(d, 1, "stop.py", "4", "base.yaml", "train.system.parallel=fsdp", f"out_dir={tmp_path / 'r'}")
    torchrun(d, 2, "-m", "loopformer.cli", "train", "--resume", str(tmp_path / "r"), "--quiet")
    assert losses(tmp_path / "r") == pytest.approx(losses(runs["one"]), rel=1e-5, abs=1e-6)


@pytest.mark.slow
@needs_torchrun
def test_a_missing_shard_stops_the_resume_in_one_line(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["stopped"], run)
    (run / "checkpoint" / SHARDED / "__0_0.distcp").unlink()
    proc = torchrun(runs["dir"], 1, "-m", "loopformer.cli", "train", "--resume", str(run), "--quiet", ok=False)
    assert proc.returncode != 0
    assert "loopformer: error: cannot resume" in proc.stderr and "Traceback" not in proc.stderr.split(
        "loopformer: error:")[0][-2000:]


@pytest.mark.slow
@needs_torchrun
@pytest.mark.parametrize("variant", [
    ["model.timestep=true", "train.losses.loops=all", "train.select.ema_decay=0.9", "train.grad_accum=2",
     "model.exit_gate=true"],
    ["model.checkpoint=true", "model.n_layers=2"],
    ["train.system.compile=true", "train.system.compile_scope=block"],
], ids=["tmlt-perloop-ema-gate-accum", "activation-checkpointing-two-layers", "compiled-block"])
def test_variants_follow_one_process(runs, tmp_path, variant):
    d = runs["dir"]
    one = one_process(d, f"one-{'-'.join(v.split('=')[0] for v in variant)}", *variant)
    torchrun(d, 2, "-m", "loopformer.cli", "train", "base.yaml", "train.system.parallel=fsdp", *variant,
             f"out_dir={tmp_path / 'two'}", "--quiet")
    assert losses(tmp_path / "two") == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
    ra, rb = read_results(one), read_results(tmp_path / "two")
    assert rb["test"] == pytest.approx(ra["test"], abs=1e-6)
    if "train.select.ema_decay=0.9" in variant:
        assert rb["test_ema"] == pytest.approx(ra["test_ema"], abs=1e-6)


@pytest.mark.slow
@needs_torchrun
def test_a_language_model_follows_one_process(runs, tmp_path):
    """The language-model path (a prepared corpus, causal loss over every token, tied embeddings, TMLT with the
    paper's gates) sharded over two processes."""
    import numpy as np

    from loopformer.text.corpus import PrepareOptions, prepare_corpus

    words = ["alpha", "beta", "gamma", "delta", "omega"]
    rng = np.random.default_rng(0)
    (tmp_path / "t.txt").write_text("".join(" ".join(rng.choice(words, 6)) + "\n" for _ in range(200)))
    prepare_corpus(str(tmp_path / "t.txt"), tmp_path / "data", PrepareOptions(vocab_size=270), progress=False,
                   log=lambda s: None)
    (tmp_path / "lm.yaml").write_text(f"""seed: 0
task: {{name: text, data_dir: {tmp_path / 'data'}, block_size: 16, eval_windows: 8}}
model: {{d_model: 16, n_heads: 2, loops: 3, tie_embeddings: true, timestep: true, timestep_gate_init: 0.0}}
train: {{batch_size: 8, log_every: 1, steps: 6, eval_every: 3, optim: {{lr: 3.0e-3}}}}
eval: {{batch_size: 8, max_loops: 4}}
log: {{tensorboard: false, progress: false}}
""")
    one = tmp_path / "one"
    train(load_run_config(str(tmp_path / "lm.yaml"), [f"out_dir={one}"]), progress=False)
    torchrun(tmp_path, 2, "-m", "loopformer.cli", "train", "lm.yaml", "train.system.parallel=fsdp",
             f"out_dir={tmp_path / 'two'}", "--quiet")
    assert len(losses(one)) == 6
    assert losses(tmp_path / "two") == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
    a, b = read_results(one)["test"], read_results(tmp_path / "two")["test"]
    numeric = [k for k, v in a.items() if isinstance(v, (int, float))]
    assert numeric and {k: b[k] for k in numeric} == pytest.approx({k: a[k] for k in numeric}, rel=1e-5)
