"""Data parallelism: `torchrun --nproc_per_node=2` on CPU (gloo), each process with half the batch, follows the loss
curve of one process with the whole batch; only rank 0 writes the run folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import TINY

from loopformer.train.run import read_metrics, read_results

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


def _run(cmd: list[str], tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[:2000] + "\n…\n" + proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found")
def test_two_processes_follow_the_single_process_curve(tmp_path):
    (tmp_path / "tiny.yaml").write_text("seed: 0\n")         # the run is the overrides below
    common = [str(tmp_path / "tiny.yaml"), *TINY, "train.steps=8", "train.batch_size=16", "train.optim.grad_clip=0.5",
              "train.eval_every=4", "task.n_train=64", "--quiet"]
    _run([sys.executable, "-m", "loopformer.cli", "train", *common, f"out_dir={tmp_path / 'one'}"], tmp_path)
    _run([TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "loopformer.cli", "train", *common,
          f"out_dir={tmp_path / 'two'}"], tmp_path)
    one = [r for r in read_metrics(tmp_path / "one") if r["split"] == "train"]
    two = [r for r in read_metrics(tmp_path / "two") if r["split"] == "train"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 9))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
        assert b["accuracy"] == pytest.approx(a["accuracy"], abs=1e-9)
    ra, rb = read_results(tmp_path / "one"), read_results(tmp_path / "two")
    assert rb["world_size"] == 2 and ra["world_size"] == 1
    assert rb["test"]["accuracy"] == pytest.approx(ra["test"]["accuracy"], abs=0.03)
    # only rank 0 wrote: one metrics file, one checkpoint, no stray temporary folders
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
