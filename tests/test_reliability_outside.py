"""Reliability, fourth round: the commands outside training — output folders that hold the user's hidden files,
registry analysis commands, figures, `reproduce --readme`, sizes before allocation and values that overflow — each a
correct result or one line with exit status 2, with nothing the user owns changed."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli_errors import error_line, train_tiny
from test_convert import ckpt

from loopformer.cli import main
from loopformer.errors import UserError
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


# ------------------------------------------------------------------------------------------------ sizes first
def test_data_gen_counts_a_row_s_intermediate_states_before_drawing(tmp_path, capsys):
    """The word problem's rows of length 4,096 hold 4,095 intermediate states each: 1,000 of them are refused in
    one line naming the size, at once, before anything is drawn (they asked for 171 GiB)."""
    t0 = time.perf_counter()
    assert main(["data", "gen", "word_problem", "--opt", "length=4096", "--train", "1000", "--test", "100",
                 "--out", str(tmp_path / "d")]) == 2
    error_line(capsys, "4,095 intermediate states")
    assert time.perf_counter() - t0 < 10 and list(tmp_path.iterdir()) == []


def test_a_generator_is_sized_before_it_draws(tmp_path, monkeypatch, capsys):
    """Every draw of a task's rows is sized first (rows × their intermediate states) against the memory available
    (here made small): `eval --lengths` at a long length and `data gen` refuse in one line naming the size."""
    import loopformer.tasks.common as common
    from loopformer.sources import TaskConfig, make_data
    from loopformer.tasks import get_task

    task = get_task("word_problem", length=64)
    assert task.steps == 63 and get_task("word_problem", length=64, scan="doubling").steps == 6
    for n in (1, 2, 3, 5, 8, 9, 33):                     # the closed form of K equals the scan's own
        for scan in ("linear", "doubling"):
            t = get_task("word_problem", length=n, scan=scan)
            assert t.steps == t.states(np.zeros((1, n), dtype=np.int64), t.table).shape[1]
    data = make_data(TaskConfig(name="word_problem", options={"group": "S3", "length": 8}, n_train=16, n_test=8))
    monkeypatch.setattr(common, "available_memory", lambda: 1 << 20)
    drawn = []
    monkeypatch.setattr(type(task), "_draw", lambda self, rng, m: drawn.append(m) or pytest.fail("drew"))
    with pytest.raises(UserError, match=r"generating [\d,]+ rows of word_problem \(64 positions and 63 "
                                        r"intermediate states each\) would take about [\d.]+ GiB"):
        task.generate(100, 0, "test")
    with pytest.raises(UserError, match="length 512: generating"):
        data.at_length(512, 8)
    assert main(["data", "gen", "word_problem", "--opt", "length=64", "--train", "100", "--test", "10",
                 "--out", str(tmp_path / "d")]) == 2
    error_line(capsys, "rows of word_problem")
    assert drawn == [] and list(tmp_path.iterdir()) == []


def test_eval_lengths_checks_the_loops_before_drawing_the_rows(monkeypatch):
    from loopformer.eval.lengths import plan_lengths
    from loopformer.model.config import ModelConfig
    from loopformer.sources import TaskConfig, make_data

    data = make_data(TaskConfig(name="word_problem", options={"group": "S3", "length": 8}, n_train=16, n_test=8))
    monkeypatch.setattr(type(data), "at_length", lambda *a: pytest.fail("drew the rows"))
    cfg = ModelConfig(vocab_size=8, loops=8, loop_rule="linear:1,0", pos="rope")
    with pytest.raises(UserError, match="loops"):
        plan_lengths(data, cfg, [4096])


def _prepare(tmp_path: Path, text: bytes | None, monkeypatch, **sizes) -> int:
    """`text prepare` of the file one.txt holding `text` (None: as it is) with corpus sizes patched; the tokenizer
    library must not be called."""
    import loopformer.text.corpus as corpus
    import loopformer.text.tokenizers as tk

    for name, value in sizes.items():
        monkeypatch.setattr(corpus, name, value)
    monkeypatch.setattr(tk.HFTokenizer, "train_from_iterator", lambda *a, **k: pytest.fail("trained the tokenizer"))
    if text is not None:
        (tmp_path / "one.txt").write_bytes(text)
    return main(["text", "prepare", str(tmp_path / "one.txt"), "--out", str(tmp_path / "c"), "--quiet"])


def test_text_prepare_of_one_long_line_is_refused_at_once(tmp_path, capsys, monkeypatch):
    """A document of fewer than 3 lines has no val or test share: known before the tokenizer learns anything (a
    300 KB line took over a minute, 48 MB reached 9.5 GB of memory)."""
    t0 = time.perf_counter()
    assert _prepare(tmp_path, b"to be or not to be " * 16000, monkeypatch) == 2             # 300 KB, read whole
    error_line(capsys, "the val split of")
    assert _prepare(tmp_path, b"to be or not to be " * 2000, monkeypatch, _WHOLE_FILE_BYTES=1024) == 2  # streamed
    error_line(capsys, "the val split of")
    assert time.perf_counter() - t0 < 10 and sorted(p.name for p in tmp_path.iterdir()) == ["one.txt"]


def test_text_prepare_memory_is_bounded_whatever_a_line_s_length(tmp_path, capsys, monkeypatch):
    """A line of NULs (3 GB ended in a traceback): refused in one line once it outgrows MAX_LINE_CHARS, holding
    no more than about that much — here 64 KiB of a 64 MiB line; what the command holds at its peak is a fraction
    of the line (the checksum reads 4 MiB at a time)."""
    import tracemalloc

    with open(tmp_path / "one.txt", "wb") as fh:
        for _ in range(64):
            fh.write(b"\0" * (1 << 20))
    tracemalloc.start()
    try:
        assert _prepare(tmp_path, None, monkeypatch, _WHOLE_FILE_BYTES=1024, _READ_BYTES=1 << 14,
                        MAX_LINE_CHARS=1 << 16) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    error_line(capsys, "holds a line longer than 65,536 characters")
    assert peak < 16 << 20 and sorted(p.name for p in tmp_path.iterdir()) == ["one.txt"]


# ------------------------------------------------------------------------------------------------ smaller cases
@pytest.mark.parametrize("rule", ["linear:1e300,0", "log:1e300,1", "linear:1,1e300", "linear:5000,0"])
def test_loop_rules_that_would_overflow_are_refused_at_parse(rule):
    import warnings

    from loopformer.configio import load_config
    from loopformer.model.config import ModelConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserError, match=r"loop_rule .*the slope a must be in \(0, 4,096\]"):
            load_config(ModelConfig, overrides=["vocab_size=4", f"loop_rule={rule}"])


@pytest.mark.parametrize("row,needle", [("abc", "give the row number"), ("", "give the row number"),
                                        ("99", "ROW in 1..")])
def test_paper_row_script_refuses_a_bad_row_in_one_line(row, needle):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / "scripts" / "paper_row.sh"), *([row] if row else [])],
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


@pytest.mark.parametrize("lo,hi", [("-1e308", "1e308"), ("-inf", "1"), ("0", "inf")])
def test_theory_modulus_boxes_too_wide_to_draw_from(capsys, lo, hi):
    assert main(["theory", "modulus", "--delta", "0.1", "--N", "2", "--d", "2", "--samples", "8", "--steps", "0",
                 f"--lo={lo}", f"--hi={hi}"]) == 2
    error_line(capsys, "finite")


def test_dynamics_records_of_the_wrong_type_count_as_undefined(run, tmp_path, capsys):
    from loopformer.analysis.dynamics import training_curves

    bad = [{"split": "dynamics", "step": 1, "grad_norm_block": "abc", "gate_attn": 5, "update": ["a", 2.0, None],
            "settle_mean": {}},
           {"split": "dynamics", "step": 2, "grad_norm_block": 1.5, "gate_attn": [1.0, 3.0], "update": [],
            "settle_mean": 4},
           {"split": "dynamics", "step": "3"}]
    curves = training_curves(bad)
    assert curves["step"] == [1, 2] and curves["mean_update"][0] == 2.0 and curves["mean_gate_attn"][1] == 2.0
    assert all(math.isnan(v) for v in (curves["grad_norm_block"][0], curves["mean_gate_attn"][0],
                                       curves["settle_mean"][0], curves["mean_update"][1]))
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    with open(copy / "metrics.jsonl", "a") as fh:
        for rec in bad[:2]:
            fh.write(json.dumps(rec) + "\n")
    assert main(["analyze", "dynamics", str(copy), "--out", str(tmp_path / "dyn"), "-n", "8"]) == 0
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the docs' claim
@pytest.mark.parametrize("scan_every", [False, True])
def test_past_loop_n_a_row_holds_its_state_at_loop_n(scan_every):
    """docs/length-generalisation.md: past loop n a row of size n holds its state at loop n — its final targets,
    and with parity's `scan_every` the prefix parity at every bit (which its final targets leave unsupervised)."""
    from loopformer.tasks import get_task
    from loopformer.tasks.base import IGNORE

    task = get_task("parity", length=8, min_length=2, scan=True, scan_every=scan_every)
    b = task.generate(64, 0, "test")
    for i in range(64):
        n, steps, targets = int(b["size"][i]), b["step_targets"][i], b["targets"][i]
        assert (steps[n - 1:] == steps[n - 1]).all()                               # loops n..K: the state at n
        supervised = targets != IGNORE
        assert (steps[n - 1][supervised] == targets[supervised]).all()
        bits = b["inputs"][i, 1:n + 1] - task.vocab.index["0"]
        prefix = task.vocab.index["0"] + np.cumsum(bits) % 2
        assert (steps[n - 1, 1:n + 1] == prefix).all() == scan_every


def test_a_huge_position_factor_list_is_checked_before_the_config_schema(run, tmp_path, capsys):
    """A checkpoint's config.json holding a 544 KB `pos_factors` list was read element by element through the
    schema before its refusal: plain checks first, then the weights refuse it at once; a model with
    position factors reads back as it was written."""
    from loopformer.model.config import ModelConfig
    from loopformer.model.io import read_config, save_checkpoint
    from loopformer.model.looped import LoopedTransformer

    ck = tmp_path / "ck"
    shutil.copytree(run / "checkpoint", ck)
    cfg = json.loads((ck / "config.json").read_text())
    for factors, needle in [([[i % 9 for i in range(60000)]] * 3, "does not match its config"),
                            ([[0] * 10] * 65, "at most 64 lists"), ([[0.5] * 10], "integers"),
                            ([[True] * 10], "integers"), ([[-1] * 10], "integers"), ("abc", "list")]:
        (ck / "config.json").write_text(json.dumps({**cfg, "pos_factors": factors}))
        assert main(["info", str(ck)]) == 2
        error_line(capsys, needle)
    model = ModelConfig(vocab_size=8, max_len=6, d_model=16, n_heads=2, pos_factors=[[0, 0, 1, 1, 2, 2],
                                                                                     [0, 1, 0, 1, 0, 1]])
    save_checkpoint(tmp_path / "pf", LoopedTransformer(model))
    assert read_config(tmp_path / "pf")[0] == model
