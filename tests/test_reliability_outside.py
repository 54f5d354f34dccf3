"""Reliability, fourth round: the commands outside training — output folders that hold the user's hidden files,
registry analysis commands, figures, `reproduce --readme`, sizes before allocation and values that overflow — each a
correct result or one line with exit status 2, with nothing the user owns changed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
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


# ------------------------------------------------------------------------------------------------ registry commands
TINY = ["train.steps=12", "task.n_train=256", "task.n_test=64", "eval.max_loops=4", "model.d_model=16",
        "log.dynamics=false"]
ANALYSIS = '    analysis: {command: [analyze, continuity, "{run}", --data, "{data}/c", --out, "{out}"%s]}\n'


def registry(tmp_path: Path, analysis: str = "", prepare: str = "", seeds: str = "2") -> Path:
    """A registry of one tiny training claim, with an analysis step (extra words after `--out {out}`) or a
    prepare step if given."""
    step = (ANALYSIS % analysis + "    higher_is_better: false\n    metric: analysis.models.*.coefficient\n"
            if analysis is not None else "")
    text = f"""
claims:
  - id: tiny
    statement: a tiny claim
{step}    cpu:
      group: tiny
      config: cpu/demo.yaml
      overrides: {json.dumps(TINY)}
{prepare}      arms:
        - {{name: one loop, overrides: [model.loops=1]}}
        - {{name: two loops, overrides: [model.loops=2]}}
      seeds: {seeds}
    rule: {{kind: paired, a: two loops, b: one loop, margin: 0.0}}
"""
    path = tmp_path / "claims.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("analysis,prepare", [
    (', "--out=/tmp/mine"', None), (', "--out={out}/../../.."', None), (', --ou, /tmp/mine', None),
    (None, '      prepare: [data, gen, lcs, --out, "{data}/p", "--out={data}/../../x"]\n'),
    (None, '      prepare: [data, gen, lcs, --o, "{data}/p"]\n')])
def test_registry_commands_may_not_name_another_out(tmp_path, capsys, analysis, prepare):
    """A second `--out=DIR` (or an abbreviation of the flag) after the checked `--out {out}` would be the folder
    the command writes: refused when the registry is loaded, before any run."""
    reg = registry(tmp_path, analysis, prepare or "")
    assert main(["reproduce", "--registry", str(reg), "--out", str(tmp_path / "o"), "--dry-run"]) == 2
    error_line(capsys, "may name its folder only as `--out DIR`")
    assert not (tmp_path / "o").exists()


def test_an_analysis_folder_that_is_a_link_is_not_written_through(tmp_path, capsys, monkeypatch):
    import subprocess as sp

    import loopformer.experiments.reproduce as rep

    def fake_run_specs(specs, *args, **kwargs):
        for spec in specs:
            spec.out_dir.mkdir(parents=True, exist_ok=True)
            (spec.out_dir / "results.json").write_text(json.dumps({"test": {"accuracy": 0.5}}))

    monkeypatch.setattr(rep, "run_specs", fake_run_specs)
    monkeypatch.setattr(rep.subprocess, "run", lambda cmd, **kw: pytest.fail(f"ran {cmd}") if "loopformer.cli" in cmd
                        else sp.run(cmd, **kw))
    mine = tmp_path / "mine"
    (mine / "continuity").mkdir(parents=True)
    (mine / "continuity" / "continuity.json").write_text('{"models": {"x": {"coefficient": 1.0}}}')
    before = digest(mine)
    run = tmp_path / "o" / "runs" / "tiny" / "one-loop_seed=0"
    run.mkdir(parents=True)
    (run / "analysis").symlink_to(mine)
    assert main(["reproduce", "--registry", str(registry(tmp_path, "")), "--out", str(tmp_path / "o"),
                 "--quiet"]) == 2
    error_line(capsys, "refusing to write through it")
    assert digest(mine) == before


@pytest.mark.parametrize("seeds,needle", [("1000000000", "seeds in 1..100 (got seeds: 1000000000)"),
                                          ("1e9", "cpu.seeds"), ("0", "seeds in 1..100")])
def test_registry_seeds_are_bounded_at_load(tmp_path, capsys, seeds, needle):
    t0 = time.perf_counter()
    assert main(["reproduce", "--registry", str(registry(tmp_path, None, seeds=seeds)), "--out",
                 str(tmp_path / "o"), "--dry-run"]) == 2
    error_line(capsys, needle)
    assert time.perf_counter() - t0 < 5 and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ figures
LENGTHS = {"lengths": [{"length": 4, "metric": 0.5, "loops": 2, "loopwise": [0.2, 0.5]},
                       {"length": 8, "metric": 0.25, "loops": 4, "loopwise": [0.0, 0.1, 0.2, 0.25]}],
           "metric": "accuracy", "formula": "n", "trained_size": 4}


def test_the_lengths_figure_is_atomic_and_replaces_a_link(tmp_path, monkeypatch):
    """`eval --lengths --plot FILE`: a link at FILE is replaced, its target (the user's file) untouched; a failure
    while drawing leaves FILE as it was and no temporary file."""
    import matplotlib.figure

    from loopformer.eval.lengths import lengths_plot

    mine = tmp_path / "mine.png"
    mine.write_bytes(b"the user's")
    fig = tmp_path / "fig.png"
    fig.symlink_to(mine)
    lengths_plot(LENGTHS, str(fig))
    assert mine.read_bytes() == b"the user's"
    assert not fig.is_symlink() and fig.read_bytes()[:4] == b"\x89PNG"
    before = fig.read_bytes()

    def half_written(self, fname, **kw):
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError("No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_written)
    with pytest.raises(OSError):
        lengths_plot(LENGTHS, str(fig))
    assert fig.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["fig.png", "mine.png"]


def test_every_figure_is_written_through_the_atomic_writer():
    """No module saves a matplotlib figure itself: `loopformer.fileio.write_figure` is the one place."""
    root = Path(__file__).resolve().parents[1] / "loopformer"
    direct = [str(p.relative_to(root)) for p in root.rglob("*.py")
              if p.name != "fileio.py" and ".savefig(" in p.read_text(encoding="utf-8")]
    assert direct == []


# ------------------------------------------------------------------------------------------------ reproduce --readme
BEGIN, END = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"


@pytest.mark.parametrize("content,needle", [
    (f"# A\n{END}\nmine\n{BEGIN}\nrest\n".encode(), "marker comes before"),
    (f"# A\n{BEGIN}\n{BEGIN}\n{END}\n".encode(), "holds 2 and 1"),
    (b"# A\nno markers\n", "block to fill"),
    (f"# A \xff\n{BEGIN}\n{END}\n".encode("latin-1"), "not UTF-8"),
    (None, "no such file")])
def test_a_readme_that_cannot_be_filled_is_refused_before_any_run(tmp_path, capsys, monkeypatch, content, needle):
    import loopformer.experiments.reproduce as rep

    monkeypatch.setattr(rep, "run_specs", lambda *a, **k: pytest.fail("trained"))
    readme = tmp_path / "README.md"
    if content is not None:
        readme.write_bytes(content)
    before = digest(tmp_path)
    assert main(["reproduce", "--registry", str(registry(tmp_path, None)), "--out", str(tmp_path / "o"),
                 "--readme", str(readme), "--quiet"]) == 2
    error_line(capsys, needle)
    (tmp_path / "claims.yaml").unlink()
    assert not (tmp_path / "o").exists() and digest(tmp_path) == before


def test_a_readme_is_filled_once_between_its_markers(tmp_path, monkeypatch):
    import loopformer.experiments.reproduce as rep

    readme = tmp_path / "README.md"
    readme.write_bytes(f"# A\r\nbefore\r\n{BEGIN}\nold table\n{END}\r\nafter é\r\n".encode())
    rep.update_readme(readme, [], tmp_path / "o" / "report.md", "loopformer reproduce")
    text = readme.read_bytes().decode()
    assert text.startswith("# A\r\nbefore\r\n" + BEGIN) and text.endswith(END + "\r\nafter é\r\n")
    assert text.count(BEGIN) == 1 and "old table" not in text and "loopformer reproduce" in text


def test_paper_tables_takes_no_other_option(capsys):
    from loopformer.cli import build_parser
    from loopformer.experiments.commands import REPRODUCE_DEFAULTS

    args = vars(build_parser().parse_args(["reproduce"]))
    assert {k: v for k, v in args.items() if k not in ("func", "paper_tables", "command")} == REPRODUCE_DEFAULTS
    assert main(["reproduce", "--paper-tables", "--out", "x", "--quick"]) == 2
    error_line(capsys, "takes no other option (got --quick, --out)")
    assert main(["reproduce", "--paper-tables"]) == 0
