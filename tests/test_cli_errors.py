"""Bad input to the commands: one line `loopformer: error: ...`, exit status 2, no traceback, nothing half-written."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from loopformer.cli import main

TINY_YAML = """\
task: {name: lcs, options: {length: 3, alphabet_min: 2, alphabet_max: 3}, n_train: 64, n_test: 16}
model: {d_model: 16, n_heads: 2, loops: 2}
train: {steps: 2, batch_size: 8, log_every: 1, eval_every: 1}
eval: {max_loops: 3}
log: {tensorboard: false, progress: false}
"""


def error_line(capsys, needle: str = "") -> str:
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err, cap.err
    err = [line.strip() for line in cap.err.replace("\r", "\n").splitlines() if "loopformer: error: " in line]
    assert len(err) == 1 and cap.err.count("loopformer: error: ") == 1, cap.err
    assert needle in err[0], err[0]
    return err[0]


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def train_tiny(base: Path) -> Path:
    """A finished tiny run (checkpoint, metrics, results): BASE/run."""
    (base / "tiny.yaml").write_text(TINY_YAML)
    assert main(["train", str(base / "tiny.yaml"), f"out_dir={base / 'run'}", "--quiet"]) == 0
    return base / "run"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("cli"))


# ------------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("text,needle", [("- a\n- b\n", "top level"), ("task:\n  - lcs\n", "task must hold"),
                                         ("task: lcs\n", "task must hold")])
def test_yaml_lists_and_values_where_sections_belong(tmp_path, capsys, text, needle):
    (tmp_path / "c.yaml").write_text(text)
    assert main(["train", str(tmp_path / "c.yaml"), f"out_dir={tmp_path / 'r'}"]) == 2
    error_line(capsys, needle)
    assert not (tmp_path / "r").exists()


def test_train_without_a_config_does_not_start_a_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 2
    error_line(capsys, "give a config file")
    assert main(["train", "train.steps=3"]) == 2
    error_line(capsys, "give a config file")
    assert list(tmp_path.iterdir()) == []


def test_resume_override_that_changes_the_model_shape(run, capsys):
    before = listing(run)
    assert main(["train", "--resume", str(run), "model.d_model=32", "train.steps=4", "--quiet"]) == 2
    error_line(capsys, "does not match")
    assert listing(run) == before


# ------------------------------------------------------------------------------------------------ eval
@pytest.mark.parametrize("args,needle", [
    (["--n", "-5"], "test rows"), (["--max-loops", "0"], "max_loops"), (["--max-loops", "-3"], "max_loops"),
    (["--max-loops", "100000"], "max_loops must be in 1..1024"), (["--loops", "0"], "loops"),
    (["--batch-size", "0"], "batch_size"), (["--loops", "x"], "invalid int"), (["--device", "tpu"], "device")])
def test_eval_arguments_out_of_range(run, capsys, args, needle):
    assert main(["eval", str(run), *args]) == 2
    error_line(capsys, needle)


def test_eval_json_into_a_missing_folder_is_refused_before_evaluating(run, tmp_path, capsys):
    assert main(["eval", str(run), "--json", str(tmp_path / "no" / "such" / "r.json")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and "does not exist" in cap.err


def test_disk_full_while_writing_eval_json(run, tmp_path, capsys, monkeypatch):
    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full)
    assert main(["eval", str(run), "--json", str(tmp_path / "r.json"), "--no-loopwise"]) == 2
    error_line(capsys, "no space left")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_while_checkpointing_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    (tmp_path / "tiny.yaml").write_text(TINY_YAML)
    import loopformer.model.io as ckpt_io

    real = ckpt_io.save_model
    calls = {"n": 0}

    def save_model(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(ckpt_io, "save_model", save_model)
    out = tmp_path / "r"
    assert main(["train", str(tmp_path / "tiny.yaml"), f"out_dir={out}", "--quiet"]) == 2
    error_line(capsys, "no space left")
    assert ckpt_io.load_training_state(out / "checkpoint")["step"] == 1
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".lock") == []
    monkeypatch.setattr(ckpt_io, "save_model", real)
    assert main(["train", "--resume", str(out), "--quiet"]) == 0


# ------------------------------------------------------------------------------------------------ checkpoints
def test_malformed_checkpoint_config(run, tmp_path, capsys):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(run / "checkpoint", ck)
    for text in (b"[1, 2]", b"\xff\xfe{", b'{"loops": "many"}'):
        (ck / "config.json").write_bytes(text)
        assert main(["info", str(ck)]) == 2
        error_line(capsys)


# ------------------------------------------------------------------------------------------------ data
@pytest.fixture()
def dataset(tmp_path, capsys) -> Path:
    out = tmp_path / "data"
    assert main(["data", "gen", "lcs", "--out", str(out), "--train", "64", "--test", "16", "--opt", "length=3",
                 "alphabet_max=3"]) == 0
    capsys.readouterr()
    return out


@pytest.mark.parametrize("field,value", [("counts", "x"), ("counts", {"train": "many"}), ("checksums", [1]),
                                         ("arrays", {"train": {"inputs": {"dtype": "<i2", "shape": "x"}}}),
                                         ("arrays", {"train": {"inputs": [1]}}), ("task", 3),
                                         ("arrays", {"train": {"inputs": {"dtype": "nope", "shape": [1]}}})])
def test_malformed_manifest_field(dataset, tmp_path, capsys, field, value):
    m = json.loads((dataset / "manifest.json").read_text())
    m[field] = value
    (dataset / "manifest.json").write_text(json.dumps(m))
    (tmp_path / "c.yaml").write_text(TINY_YAML.replace("n_test: 16}", f"n_test: 16, data_dir: {dataset}}}"))
    assert main(["train", str(tmp_path / "c.yaml"), f"out_dir={tmp_path / 'r'}", "--quiet"]) == 2
    error_line(capsys, "manifest")
    assert main(["data", "show", str(dataset)]) == 2
    error_line(capsys, "manifest")


@pytest.mark.parametrize("content,needle", [(b"quizzes,solutions\n\xff\xfe1,2\n", "not UTF-8"),
                                            (b"quizzes,solutions\n" + b"1" * 200_000 + b",2\n", "malformed CSV")])
def test_sudoku_csv_bad_bytes(tmp_path, capsys, content, needle):
    (tmp_path / "s.csv").write_bytes(content)
    assert main(["data", "import", "kaggle", str(tmp_path / "s.csv"), "--out", str(tmp_path / "o")]) == 2
    error_line(capsys, needle)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ text
@pytest.mark.parametrize("args,needle", [(["--temperature", "nan"], "temperature"),
                                         (["--temperature", "inf"], "temperature"),
                                         (["--device", "tpu"], "device")])
def test_generate_bad_sampling_and_device(tmp_path, capsys, args, needle):
    assert main(["generate", str(tmp_path / "ck"), "--prompt", "x", *args]) == 2
    error_line(capsys, needle)


def test_failed_text_prepare_leaves_no_folder(tmp_path, capsys):
    (tmp_path / "s.txt").write_text("hello world\n")
    assert main(["text", "prepare", str(tmp_path / "s.txt"), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    error_line(capsys, "empty")
    assert not (tmp_path / "out").exists()


def test_bad_command_line_is_one_line(capsys):
    assert main(["eval"]) == 2
    error_line(capsys, "required")
    assert main(["no-such-command"]) == 2
    error_line(capsys, "invalid choice")
