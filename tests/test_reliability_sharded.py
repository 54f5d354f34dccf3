"""Reliability of distributed (sharded) checkpoints: a planted pickle in `.metadata` or in a shard runs nothing on
`export` or `train --resume`; a truncated, foreign (another run's or another checkpoint's), extra or NaN-holding shard
and a missing manifest are one line with exit status 2; config.json's sizes are checked before a model is built.
Nothing under the run folder changes (hashed before and after).

The resumes run in this process as a world of one (the environment torchrun sets: WORLD_SIZE, RANK, MASTER_ADDR,
MASTER_PORT), the sharded checkpoints are written by two processes under torchrun."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shlex
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cli_errors import error_line
from test_fsdp import BASE, STOP, needs_torchrun, torchrun
from test_reliability_outside import digest as digest_all

from loopformer.cli import main
from loopformer.train.config import load_run_config
from loopformer.train.shard_manifest import MANIFEST, write_manifest
from loopformer.train.trainer import train

pytestmark = needs_torchrun


class Planted:
    """What a crafted file holds: unpickling it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Two sharded runs (seeds 0 and 1, two processes, with a weight average) stopped after step 4's checkpoint,
    and a plain run."""
    d = tmp_path_factory.mktemp("shards")
    (d / "base.yaml").write_text(BASE)
    (d / "stop.py").write_text(STOP)
    for name, seed in (("a", 0), ("b", 1)):
        torchrun(d, 2, "stop.py", "4", "base.yaml", "train.system.parallel=fsdp", "train.select.ema_decay=0.9",
                 f"seed={seed}", f"out_dir={d / name}")
    train(load_run_config(str(d / "base.yaml"), [f"out_dir={d / 'plain'}", "train.steps=4"]), progress=False)
    return d


def digest(run: Path) -> str:
    """Every file under the run folder, but the lock's holder (the process id a resume writes into `.lock`)."""
    lock = run / ".lock"
    held = lock.read_bytes() if lock.is_file() else None
    lock.unlink(missing_ok=True)
    try:
        return digest_all(run)
    finally:
        if held is not None:
            lock.write_bytes(held)


def copy_run(shards: Path, tmp_path: Path, name: str = "a") -> Path:
    run = tmp_path / "run"
    shutil.copytree(shards / name, run)
    return run


def rewrite_manifest(sharded: Path) -> None:
    """The manifest of a folder rewritten to match its files, as whoever planted a file there could."""
    m = json.loads((sharded / MANIFEST).read_text())
    meta = pickle.loads((sharded / ".metadata").read_bytes())       # the test's own, untampered metadata
    (sharded / MANIFEST).unlink()
    write_manifest(sharded, meta, {"id": m["id"], "step": m["step"]})


def replace_item(sharded: Path, fqn: str, payload: bytes) -> None:
    """Store `payload` as the bytes of the entry `fqn` (appended to its shard, the metadata pointed at it) and
    rewrite the manifest to match."""
    meta = pickle.loads((sharded / ".metadata").read_bytes())
    index = next(i for i in meta.storage_data if i.fqn == fqn)
    info = meta.storage_data[index]
    f = sharded / info.relative_path
    info.offset, info.length = f.stat().st_size, len(payload)
    with open(f, "ab") as fh:
        fh.write(payload)
    (sharded / ".metadata").write_bytes(pickle.dumps(meta))
    rewrite_manifest(sharded)


def tensor_item(sharded: Path, fqn: str) -> torch.Tensor:
    meta = pickle.loads((sharded / ".metadata").read_bytes())
    info = meta.storage_data[next(i for i in meta.storage_data if i.fqn == fqn)]
    raw = (sharded / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    return torch.load(io.BytesIO(raw), weights_only=True)


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def resume(run: Path, monkeypatch) -> int:
    """`train --resume RUN` in this process as torchrun's world of one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    return main(["train", "--resume", str(run), "--quiet"])


def refused(capsys, monkeypatch, run: Path, tmp_path: Path, needle: str, export: bool = True,
            resumed: bool = True) -> None:
    """`export` and `train --resume` of `run` are one line with `needle`, exit 2; nothing under `run` changes and no
    export folder is made."""
    before = digest(run)
    if export:
        assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 2
        error_line(capsys, needle)
        assert not (tmp_path / "exported").exists()
    if resumed:
        assert resume(run, monkeypatch) == 2
        error_line(capsys, needle)
    assert digest(run) == before


@pytest.mark.parametrize("manifest_too", [False, True], ids=["metadata", "metadata-and-manifest"])
def test_a_planted_metadata_pickle_runs_nothing(shards, tmp_path, capsys, monkeypatch, manifest_too):
    """A `.metadata` whose unpickling would create a marker file: refused by its checksum, or — with the manifest
    rewritten to match — by the metadata reader, which builds DCP's own classes only. The marker never exists."""
    run = copy_run(shards, tmp_path)
    marker = tmp_path / "ran"
    sharded = run / "checkpoint" / "sharded"
    (sharded / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    if manifest_too:
        m = json.loads((sharded / MANIFEST).read_text())
        raw = (sharded / ".metadata").read_bytes()
        m["files"][".metadata"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        (sharded / MANIFEST).write_text(json.dumps(m))
    refused(capsys, monkeypatch, run, tmp_path, "is refused: posix.system" if manifest_too else "its manifest")
    assert not marker.exists()


def test_a_planted_pickle_in_a_shard_runs_nothing(shards, tmp_path, capsys, monkeypatch):
    """An optimiser hyperparameter (a non-tensor entry, which DCP loads with `weights_only=False`) replaced by a
    planted pickle, its metadata and manifest made to match: the resume refuses it, the export (which reads the
    weights only) exports the run's weights; the marker never exists."""
    run = copy_run(shards, tmp_path)
    marker = tmp_path / "ran"
    replace_item(run / "checkpoint" / "sharded", "optim.param_groups.0.lr", saved(Planted(marker)))
    refused(capsys, monkeypatch, run, tmp_path, "cannot resume from", export=False)
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    want = load_file(run / "checkpoint" / "model.safetensors")
    got = load_file(tmp_path / "exported" / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not marker.exists()


def _truncate(run: Path, other: Path) -> None:
    f = run / "checkpoint" / "sharded" / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])


def _foreign_shard(run: Path, other: Path) -> None:
    shutil.copy(other / "checkpoint" / "sharded" / "__1_0.distcp", run / "checkpoint" / "sharded" / "__1_0.distcp")


def _foreign_folder(run: Path, other: Path) -> None:
    shutil.rmtree(run / "checkpoint" / "sharded")
    shutil.copytree(other / "checkpoint" / "sharded", run / "checkpoint" / "sharded")


def _extra_shard(run: Path, other: Path) -> None:
    shutil.copy(other / "checkpoint" / "sharded" / "__1_0.distcp", run / "checkpoint" / "sharded" / "__2_0.distcp")


def _no_manifest(run: Path, other: Path) -> None:
    (run / "checkpoint" / "sharded" / MANIFEST).unlink()


def _nan(run: Path, other: Path) -> None:
    sharded = run / "checkpoint" / "sharded"
    t = tensor_item(sharded, "model.head.proj.weight").clone()
    t.view(-1)[0] = float("nan")
    replace_item(sharded, "model.head.proj.weight", saved(t))


@pytest.mark.parametrize("damage,needle", [
    (_truncate, "truncated"), (_foreign_shard, "checksum"), (_foreign_folder, "belongs to another checkpoint"),
    (_extra_shard, "does not list (__2_0.distcp)"), (_no_manifest, "holds no manifest.json"),
    (_nan, "model.head.proj.weight holds NaN"),
], ids=["truncated", "foreign-shard", "foreign-folder", "extra-shard", "no-manifest", "nan-with-its-manifest"])
def test_damaged_or_mixed_shards_are_refused_on_export_and_resume(shards, tmp_path, capsys, monkeypatch, damage,
                                                                   needle):
    run = copy_run(shards, tmp_path)
    damage(run, shards / "b")
    refused(capsys, monkeypatch, run, tmp_path, needle)


def test_whole_shards_export_and_resume(shards, tmp_path, capsys, monkeypatch):
    """The reference: the untouched checkpoint exports the weights written beside it and resumes to the end."""
    run = copy_run(shards, tmp_path)
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    for name in ("model.safetensors", "ema.safetensors"):
        want, got = load_file(run / "checkpoint" / name), load_file(tmp_path / "exported" / name)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert resume(run, monkeypatch) == 0
    state = torch.load(run / "checkpoint" / "training_state.pt", weights_only=True)
    assert state["step"] == 8 and state["shards"]["step"] == 8
    assert json.loads((run / "checkpoint" / "sharded" / MANIFEST).read_text())["id"] == state["shards"]["id"]


def test_a_plain_run_s_export_with_a_planted_sharded_folder(shards, tmp_path, capsys):
    run = copy_run(shards, tmp_path, "plain")
    marker = tmp_path / "ran"
    shutil.copytree(shards / "a" / "checkpoint" / "sharded", run / "checkpoint" / "sharded")
    (run / "checkpoint" / "sharded" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    before = digest(run)
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 2
    error_line(capsys, "was not written by a sharded run")
    assert digest(run) == before and not marker.exists() and not (tmp_path / "exported").exists()


@pytest.mark.parametrize("d_model,needle", [(32, "does not match its config.json"), (65_536, "GiB")])
def test_export_checks_config_sizes_before_building_a_model(shards, tmp_path, capsys, monkeypatch, d_model, needle):
    """config.json of another width (or of a 65,536-wide model) beside the shards: refused before any model is built
    on a real device (only the meta device's shapes are read)."""
    from loopformer.model import looped
    run = copy_run(shards, tmp_path)
    cfg = json.loads((run / "checkpoint" / "config.json").read_text())
    cfg["d_model"] = d_model
    (run / "checkpoint" / "config.json").write_text(json.dumps(cfg))
    built: list[str] = []
    real = looped.LoopedTransformer.__init__

    def spy(self, *a, **k):
        built.append(torch.empty(0).device.type)
        real(self, *a, **k)

    monkeypatch.setattr(looped.LoopedTransformer, "__init__", spy)
    refused(capsys, monkeypatch, run, tmp_path, needle, resumed=False)
    assert "cpu" not in built


def test_two_processes_stop_together_on_a_shard_only_one_of_them_reads(shards, tmp_path):
    """Under torchrun with 2 processes: a NaN in the part of a weight that rank 1 holds, and a planted `.metadata`
    with its manifest made to match, each stop both processes with the one-line error (no process left waiting in
    a collective), and the marker never exists."""
    run = copy_run(shards, tmp_path)
    sharded = run / "checkpoint" / "sharded"
    t = tensor_item(sharded, "model.head.proj.weight").clone()
    t.view(-1)[-1] = float("inf")
    replace_item(sharded, "model.head.proj.weight", saved(t))
    before = digest(run)
    proc = torchrun(shards, 2, "-m", "loopformer.cli", "train", "--resume", str(run), "--quiet", ok=False)
    assert proc.returncode != 0 and "loopformer: error: cannot resume from" in proc.stderr
    assert "model.head.proj.weight holds NaN or infinite values" in proc.stderr
    assert "Traceback" not in proc.stderr.split("loopformer: error:")[0]          # torchrun's own report comes after
    assert digest(run) == before

    run2 = tmp_path / "planted"
    shutil.copytree(shards / "a", run2)
    marker = tmp_path / "ran"
    (run2 / "checkpoint" / "sharded" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    rewrite_files = json.loads((run2 / "checkpoint" / "sharded" / MANIFEST).read_text())
    raw = (run2 / "checkpoint" / "sharded" / ".metadata").read_bytes()
    rewrite_files["files"][".metadata"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (run2 / "checkpoint" / "sharded" / MANIFEST).write_text(json.dumps(rewrite_files))
    proc = torchrun(shards, 2, "-m", "loopformer.cli", "train", "--resume", str(run2), "--quiet", ok=False)
    assert proc.returncode != 0 and "is refused: posix.system" in proc.stderr
    assert not marker.exists()
