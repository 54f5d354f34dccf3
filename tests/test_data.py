"""Dataset folders: determinism across workers, train/test disjointness, loading errors, sharding, the CLI."""

import json
import os

import numpy as np
import pytest

from loopformer.cli import main
from loopformer.data import open_dataset, read_manifest, row_hashes, shard_indices, write_dataset
from loopformer.errors import UserError
from loopformer.tasks import get_task

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


def _files(path):
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path)] = fh.read()
    return out


@pytest.mark.parametrize("name,options", [("lcs", {"length": 6, "alphabet_max": 4}),
                                          ("addition", {"length": 10, "min_length": 1})])
def test_same_bytes_for_any_worker_count(tmp_path, name, options):
    task = get_task(name, **options)
    write_dataset(tmp_path / "w1", task, 3000, 500, seed=11, workers=1, chunk_size=700, progress=False)
    write_dataset(tmp_path / "w2", task, 3000, 500, seed=11, workers=2, chunk_size=700, progress=False)
    a, b = _files(tmp_path / "w1"), _files(tmp_path / "w2")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    write_dataset(tmp_path / "s2", task, 3000, 500, seed=12, workers=1, chunk_size=700, progress=False)
    assert _files(tmp_path / "s2")["train/inputs.npy"] != a["train/inputs.npy"]


def test_train_test_disjoint_and_deduplicated(tmp_path):
    # a small space (ED with 4 letters from a 3-letter alphabet) where duplicates are frequent
    task = get_task("edit_distance", length=4, alphabet_min=3, alphabet_max=3)
    raw = task.generate(4000, seed=0)
    assert len(set(row_hashes(raw["inputs"]))) < 4000          # the generator alone repeats rows
    write_dataset(tmp_path / "d", task, 2000, 300, seed=0, chunk_size=500, progress=False)
    task2, splits = open_dataset(tmp_path / "d", verify=True)
    tr = {r.tobytes() for r in np.asarray(splits["train"]["inputs"])}
    te = [r.tobytes() for r in np.asarray(splits["test"]["inputs"])]
    assert len(tr) == 2000 and len(set(te)) == 300 and not tr & set(te)
    assert task2 == task


def test_too_small_space_is_a_user_error(tmp_path):
    task = get_task("lcs", length=2, alphabet_min=1, alphabet_max=1)
    with pytest.raises(UserError, match="too few distinct samples"):
        write_dataset(tmp_path / "x", task, 500, 0, seed=0, chunk_size=100, progress=False)
    assert not os.path.exists(tmp_path / "x")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]


def test_roundtrip_arrays_and_manifest(tmp_path):
    task = get_task("countdown", max_number=30, max_value=1000)
    man = write_dataset(tmp_path / "c", task, 400, 50, seed=3, progress=False)
    assert man["counts"] == {"train": 400, "test": 50} and man["task"] == "countdown"
    assert man["options"]["max_value"] == 1000 and man["format_version"] == 1
    t2, splits = open_dataset(tmp_path / "c")
    tr = splits["train"]
    assert isinstance(tr["inputs"], np.memmap) and tr["inputs"].dtype == np.int16
    fresh = task.generate(10, 0)
    assert set(tr) == set(fresh)
    assert t2.validity(tr["inputs"], tr) == 1.0
    assert np.isin(splits["test"]["target"], t2.test_targets).all()
    assert (np.asarray(tr["targets"])[:, :4] == -100).all()


def test_open_dataset_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        open_dataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no manifest.json"):
        open_dataset(tmp_path / "empty")
    task = get_task("edit_distance", length=5)
    write_dataset(tmp_path / "ok", task, 30, 10, seed=0, progress=False)
    mpath = tmp_path / "ok" / "manifest.json"
    good = mpath.read_text()
    mpath.write_text(good[:-10])
    with pytest.raises(UserError, match="malformed manifest"):
        open_dataset(tmp_path / "ok")
    m = json.loads(good)
    m["format_version"] = 99
    mpath.write_text(json.dumps(m))
    with pytest.raises(UserError, match="format version"):
        open_dataset(tmp_path / "ok")
    m = json.loads(good)
    m["options"]["bogus"] = 1
    mpath.write_text(json.dumps(m))
    with pytest.raises(UserError, match="unknown option 'bogus'"):
        open_dataset(tmp_path / "ok")
    mpath.write_text(good)
    os.remove(tmp_path / "ok" / "test" / "answer.npy")
    with pytest.raises(UserError, match="missing array file test/answer.npy"):
        open_dataset(tmp_path / "ok")
    with pytest.raises(UserError, match="not empty"):
        write_dataset(tmp_path / "ok", task, 30, 10, seed=0, progress=False)


def test_checksum_verification(tmp_path):
    task = get_task("lcs", length=5)
    write_dataset(tmp_path / "d", task, 40, 10, seed=0, progress=False)
    path = tmp_path / "d" / "train" / "answer.npy"
    arr = np.load(path)
    arr[0] += 1
    np.save(path, arr)
    open_dataset(tmp_path / "d")                       # shapes still agree
    with pytest.raises(UserError, match="checksum mismatch for train/answer.npy"):
        open_dataset(tmp_path / "d", verify=True)


@pytest.mark.parametrize("n,world", [(10, 3), (9, 3), (7, 4), (1, 2), (0, 2)])
def test_shard_indices(n, world):
    shards = [shard_indices(n, r, world) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    allidx = np.concatenate(shards)
    assert set(allidx.tolist()) == set(range(n))
    assert len(shards[0]) == -(-n // world)
    dropped = [shard_indices(n, r, world, drop_last=True) for r in range(world)]
    flat = np.concatenate(dropped)
    assert len(flat) == (n // world) * world == len(set(flat.tolist()))
    with pytest.raises(ValueError):
        shard_indices(n, world, world)


# ----------------------------------------------------------------------------------------------------------- CLI
def test_cli_gen_and_show(tmp_path, capsys):
    out = tmp_path / "ed"
    code = main(["data", "gen", "edit_distance", "--out", str(out), "--train", "200", "--test", "20",
                 "--seed", "1", "--quiet", "--opt", "length=6", "alphabet_max=5"])
    assert code == 0
    man = read_manifest(out)
    assert man["options"]["length"] == 6 and man["options"]["alphabet_max"] == 5
    capsys.readouterr()
    assert main(["data", "show", str(out), "-n", "3", "--verify"]) == 0
    text = capsys.readouterr().out
    assert "task edit_distance" in text and text.count("--- test[") == 3 and "->" in text


def test_cli_user_errors(tmp_path, capsys):
    code = main(["data", "gen", "lcs", "--out", str(tmp_path / "x"), "--train", "5", "--test", "1",
                 "--opt", "lenght=5"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("loopformer: error: unknown option 'lenght'") and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "x")
    assert main(["data", "show", str(tmp_path / "nothing")]) == 2
    assert "dataset folder not found" in capsys.readouterr().err
    code = main(["data", "gen", "sudoku", "--out", str(tmp_path / "s"), "--train", "1", "--test", "1",
                 "--opt", "blanks=99"])
    assert code == 2 and "blanks must be <= 64" in capsys.readouterr().err


@pytest.mark.parametrize("layout,n", [("radcliffe", 12), ("extreme", 10), ("kaggle", 8)])
def test_cli_import(tmp_path, capsys, layout, n):
    out = tmp_path / layout
    code = main(["data", "import", layout, os.path.join(FIX, f"sudoku_{layout}.csv"), "--out", str(out),
                 "--test", "3", "--seed", "0"])
    assert code == 0
    task, splits = open_dataset(out, verify=True)
    assert task.name == "sudoku"
    assert len(splits["test"]["inputs"]) == 3 and len(splits["train"]["inputs"]) == n - 3
    pred = np.asarray(splits["train"]["targets"])
    assert task.metrics(pred, {k: np.asarray(v) for k, v in splits["train"].items()})["accuracy"] == 1.0


def test_cli_import_difficulty_and_malformed(tmp_path, capsys):
    src = os.path.join(FIX, "sudoku_radcliffe.csv")
    out = tmp_path / "hard"
    assert main(["data", "import", "radcliffe", src, "--out", str(out), "--test", "1",
                 "--min-difficulty", "1.5"]) == 0
    _, splits = open_dataset(out)
    assert (np.asarray(splits["train"]["difficulty"]) >= 1.5).all()
    lines = open(src).read().splitlines()
    lines[7] = lines[7].replace(",", ";", 1)
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["data", "import", "radcliffe", str(bad), "--out", str(tmp_path / "never")]) == 2
    assert "bad.csv:8:" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "never")


def test_cli_import_with_a_test_file(tmp_path):
    src = os.path.join(FIX, "sudoku_extreme.csv")
    lines = open(src).read().splitlines()
    test_file = tmp_path / "test.csv"
    test_file.write_text("\n".join([lines[0], *lines[1:4]]) + "\n")       # 3 puzzles, also in the training file
    out = tmp_path / "extreme"
    assert main(["data", "import", "extreme", src, "--test-csv", str(test_file), "--out", str(out),
                 "--train", "5"]) == 0
    _, splits = open_dataset(out, verify=True)
    test = {bytes(np.asarray(r)) for r in splits["test"]["inputs"]}
    assert len(test) == 3 and len(splits["train"]["inputs"]) == 5
    assert not test & {bytes(np.asarray(r)) for r in splits["train"]["inputs"]}   # no test puzzle in training
