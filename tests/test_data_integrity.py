"""Data opened for training or evaluation is checked: SHA-256 against the manifest (once per file and modification)
and token ids against the vocabulary; a corrupt file is one line and exit 2."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from loopformer import checksums
from loopformer.cli import main

TINY_YAML = """\
task: {{name: lcs, data_dir: {data}}}
model: {{d_model: 16, n_heads: 2, loops: 2}}
train: {{steps: 2, batch_size: 8, log_every: 1}}
eval: {{max_loops: 3}}
log: {{tensorboard: false, progress: false}}
"""


def error_line(capsys, needle: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("loopformer: error: ") == 1, err
    line = next(x for x in err.replace("\r", "\n").splitlines() if "loopformer: error: " in x)
    assert needle in line, line
    return line


def age(path: Path, seconds: float = 60) -> None:
    """Set a file's modification time into the past (as for a dataset written a while ago)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture()
def dataset(tmp_path, capsys) -> Path:
    out = tmp_path / "data"
    assert main(["data", "gen", "lcs", "--out", str(out), "--train", "64", "--test", "16", "--opt", "length=3",
                 "alphabet_max=3"]) == 0
    (tmp_path / "c.yaml").write_text(TINY_YAML.format(data=out))
    capsys.readouterr()
    return out


def test_flipped_byte_in_a_dataset_stops_train_and_eval(dataset, tmp_path, capsys):
    cfg = str(tmp_path / "c.yaml")
    assert main(["train", cfg, f"out_dir={tmp_path / 'ok'}", "--quiet"]) == 0
    flip_byte(dataset / "test" / "targets.npy")
    assert main(["train", cfg, f"out_dir={tmp_path / 'r'}", "--quiet"]) == 2
    error_line(capsys, "checksum mismatch for test/targets.npy")
    assert main(["eval", str(tmp_path / "ok")]) == 2
    error_line(capsys, "checksum mismatch")


def test_verification_is_cached_by_size_and_mtime(dataset, monkeypatch, tmp_path):
    from loopformer.data import open_dataset

    monkeypatch.setenv("LOOPFORMER_CACHE_DIR", str(tmp_path / "cache"))   # not shared with parallel workers

    for f in dataset.rglob("*.npy"):
        age(f)
    calls = []
    real = checksums.sha256_file
    monkeypatch.setattr(checksums, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    open_dataset(dataset, verify=True)
    n_files = len(list(dataset.rglob("*.npy")))
    assert len(calls) == n_files
    checksums.forget()                                   # a new process: the record on disk is used
    open_dataset(dataset, verify=True)
    assert len(calls) == n_files
    f = dataset / "train" / "inputs.npy"
    flip_byte(f, offset=-2)                               # same size, new modification time
    with pytest.raises(Exception, match="checksum mismatch for train/inputs.npy"):
        open_dataset(dataset, verify=True)


def test_a_file_changed_within_the_timestamp_granularity_is_still_caught(dataset):
    """A record made right after the file was written is not trusted (the change could share its mtime)."""
    from loopformer.data import open_dataset

    f = dataset / "train" / "targets.npy"
    open_dataset(dataset, verify=True)
    st = f.stat()
    flip_byte(f, offset=-3)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))     # same size and mtime as when it was verified
    with pytest.raises(Exception, match="checksum mismatch"):
        open_dataset(dataset, verify=True)


def _rewrite_with_checksum(folder: Path, rel: str, arr: np.ndarray) -> None:
    """Write an array and fix its manifest checksum (a consistent dataset with bad content)."""
    np.save(folder / rel, arr, allow_pickle=False)
    m = json.loads((folder / "manifest.json").read_text())
    m["checksums"][rel] = hashlib.sha256((folder / rel).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("key,value", [("inputs", 999), ("targets", -5), ("inputs", -100)])
def test_out_of_vocabulary_ids_in_a_dataset(dataset, tmp_path, capsys, key, value):
    arr = np.load(dataset / "train" / f"{key}.npy")
    arr[3, 1] = value
    _rewrite_with_checksum(dataset, f"train/{key}.npy", arr)
    assert main(["train", str(tmp_path / "c.yaml"), f"out_dir={tmp_path / 'r'}", "--quiet"]) == 2
    error_line(capsys, "outside the task's vocabulary")


# ---------------------------------------------------------------------------------------------------- text corpora
@pytest.fixture()
def corpus(tmp_path, capsys) -> Path:
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question"]
    (tmp_path / "t.txt").write_text("".join(" ".join(rng.choice(words, 7)) + "\n" for _ in range(150)))
    assert main(["text", "prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "corpus"), "--vocab-size",
                 "280", "--quiet"]) == 0
    capsys.readouterr()
    return tmp_path / "corpus"


def _text_train(tmp_path: Path, corpus: Path) -> list[str]:
    (tmp_path / "lm.yaml").write_text(
        f"task: {{name: text, data_dir: {corpus}, block_size: 16, eval_windows: 2}}\n"
        "model: {d_model: 16, n_heads: 2, loops: 2}\ntrain: {steps: 1, batch_size: 2}\n"
        "eval: {loopwise: false}\nlog: {tensorboard: false, progress: false}\n")
    return ["train", str(tmp_path / "lm.yaml"), f"out_dir={tmp_path / 'lm'}", "--quiet"]


def test_flipped_byte_in_a_corpus(corpus, tmp_path, capsys):
    flip_byte(corpus / "val.bin", offset=10)
    assert main(_text_train(tmp_path, corpus)) == 2
    error_line(capsys, "checksum mismatch for val.bin")


def test_out_of_vocabulary_id_in_a_corpus(corpus, tmp_path, capsys):
    m = json.loads((corpus / "manifest.json").read_text())
    arr = np.fromfile(corpus / "train.bin", dtype=m["dtype"])
    arr[5] = m["vocab_size"] + 3
    arr.tofile(corpus / "train.bin")
    m["splits"]["train"]["sha256"] = hashlib.sha256((corpus / "train.bin").read_bytes()).hexdigest()
    (corpus / "manifest.json").write_text(json.dumps(m))
    assert main(_text_train(tmp_path, corpus)) == 2
    error_line(capsys, "outside the vocabulary")
