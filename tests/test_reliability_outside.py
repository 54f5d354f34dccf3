"""Reliability, fourth round: the commands outside training — output folders that hold the user's hidden files,
registry analysis commands, figures, `reproduce --readme`, sizes before allocation and values that overflow — each a
correct result or one line with exit status 2, with nothing the user owns changed."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from test_cli_errors import error_line, train_tiny
from test_convert import ckpt

from loopformer.cli import main
from loopformer.fileio import foreign_entries


def digest(folder: Path) -> str:
    """A hash of every name (hidden ones included), link target and file content under `folder`."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("outside"))


# ------------------------------------------------------------------------------------------------ output folders
def foreign_entries_of(names: list[str], ours: tuple[str, ...]) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        for n in names:
            Path(d, n).write_text("x")
        return foreign_entries(d, ours, "config.json")


def test_hidden_files_that_look_like_temporaries_are_the_user_s():
    ours = ("model.safetensors", "config.json", "*.png")
    assert foreign_entries_of([".config.json.orig", ".model.safetensors.bak", ".config.json.tmp-mine",
                               ".a.png.old", "config.json"], ours) == [".a.png.old", ".config.json.orig",
                                                                       ".config.json.tmp-mine",
                                                                       ".model.safetensors.bak"]
    assert foreign_entries_of([".config.json.tmp-12", ".model.safetensors.tmp-12-ab_c9", ".x.png.old-3",
                               ".config.json.old-broken-4", "config.json"], ours) == []


@pytest.mark.parametrize("hidden", [".config.json.orig", ".model.safetensors.bak"])
def test_convert_and_export_keep_the_user_s_hidden_files(run, tmp_path, capsys, hidden):
    """An earlier conversion (or export) the user keeps notes in: its hidden files are the user's, so the folder is
    refused in one line instead of being replaced whole."""
    torch.save(ckpt("lt"), tmp_path / "ckpt.pt")
    conv = tmp_path / "conv"
    assert main(["convert", str(tmp_path / "ckpt.pt"), "--out", str(conv)]) == 0
    capsys.readouterr()
    (conv / hidden).write_text("the user's")
    before = digest(conv)
    assert main(["convert", str(tmp_path / "ckpt.pt"), "--out", str(conv)]) == 2
    error_line(capsys, hidden)
    assert digest(conv) == before
    sharded = tmp_path / "sharded"                   # a checkpoint with a sharded folder: export checks DIR first
    shutil.copytree(run / "checkpoint", sharded)
    (sharded / "sharded").mkdir()
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / hidden).write_text("the user's")
    before = digest(exported)
    assert main(["export", str(sharded), "--out", str(exported)]) == 2
    error_line(capsys, hidden)
    assert digest(exported) == before
