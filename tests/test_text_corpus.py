"""Corpus preparation (local files, the shipped plays, a WikiText-103 stand-in), the perturbed corpus, and the
memory-mapped window datasets."""

import json
import os
import sys
import types

import numpy as np
import pytest

from loopformer.errors import UserError
from loopformer.text.corpus import (
    MANIFEST,
    PrepareOptions,
    perturb_tokens,
    play_to_text,
    plays_files,
    prepare_corpus,
    read_manifest,
    verify_corpus,
)
from loopformer.text.dataset import RandomWindows, SequentialWindows, TokenCorpus
from loopformer.text.tokenizers import ByteBPETokenizer

WORDS = ["the", "king", "queen", "is", "dead", "long", "live", "castle", "sword", "night", "day", "and", "of"]


def make_text(n_lines, seed):
    rng = np.random.default_rng(seed)
    return "".join(" ".join(rng.choice(WORDS, size=rng.integers(2, 9))) + "\n" for _ in range(n_lines))


def quiet(**kw):
    return dict(progress=False, log=lambda msg: None, **kw)


def reference_pieces(text, val, test):
    """Independent statement of the split rule: first share train, next val, last test (by lines)."""
    lines = text.splitlines(keepends=True)
    n = len(lines)
    nv, nt = max(1, round(n * val)), max(1, round(n * test))
    return {"train": "".join(lines[:n - nv - nt]), "val": "".join(lines[n - nv - nt:n - nt]),
            "test": "".join(lines[n - nt:])}


@pytest.fixture()
def text_file(tmp_path):
    p = tmp_path / "story.txt"
    p.write_text(make_text(200, 0), encoding="utf-8")
    return p


def test_local_file_matches_reencoding(text_file, tmp_path):
    out = tmp_path / "corpus"
    m = prepare_corpus(str(text_file), out, PrepareOptions(vocab_size=300, val_fraction=0.1, test_fraction=0.05),
                       **quiet())
    tok = ByteBPETokenizer.load(out / "tokenizer.json")
    pieces = reference_pieces(text_file.read_text(), 0.1, 0.05)
    corpus = TokenCorpus(out)
    for split in ("train", "val", "test"):
        expected = tok.encode(pieces[split]) + [tok.eot_id]
        got = corpus.tokens(split)
        assert got.dtype == np.uint16
        assert got.tolist() == expected
        assert m["splits"][split]["tokens"] == len(expected)
        assert tok.decode(got[:-1]) == pieces[split]
    assert m["vocab_size"] == tok.vocab_size and m["eot_id"] == tok.eot_id
    assert verify_corpus(out) == []
    assert read_manifest(out) == m
    assert not [f for f in os.listdir(out) if f.startswith(".")]      # no temporary leftovers


def test_rerun_is_noop_and_options_are_checked(text_file, tmp_path):
    out = tmp_path / "c"
    opts = PrepareOptions(vocab_size=300)
    m1 = prepare_corpus(str(text_file), out, opts, **quiet())
    stamp = {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)}
    logged = []
    m2 = prepare_corpus(str(text_file), out, opts, progress=False, log=logged.append)
    assert m2 == m1 and "up to date" in logged[0]
    assert {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)} == stamp
    # other options: refused without --force, rebuilt with it
    with pytest.raises(UserError, match="other options.*vocab_size"):
        prepare_corpus(str(text_file), out, PrepareOptions(vocab_size=280), **quiet())
    m3 = prepare_corpus(str(text_file), out, PrepareOptions(vocab_size=280), force=True, **quiet())
    assert m3["options"]["vocab_size"] == 280 and verify_corpus(out) == []
    # the source changed: the fingerprint differs
    text_file.write_text(make_text(200, 1))
    with pytest.raises(UserError, match="source"):
        prepare_corpus(str(text_file), out, PrepareOptions(vocab_size=280), **quiet())


def test_damaged_files_are_detected(text_file, tmp_path):
    out = tmp_path / "c"
    opts = PrepareOptions(vocab_size=300)
    prepare_corpus(str(text_file), out, opts, **quiet())
    data = bytearray((out / "val.bin").read_bytes())
    data[0] ^= 1
    (out / "val.bin").write_bytes(bytes(data))
    assert verify_corpus(out) == ["val.bin checksum differs from the manifest"]
    with pytest.raises(UserError, match="checksum"):
        prepare_corpus(str(text_file), out, opts, **quiet())
    prepare_corpus(str(text_file), out, opts, force=True, **quiet())
    assert verify_corpus(out) == []


def test_folder_source_and_bad_input(tmp_path):
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text(make_text(60, 2))
    (d / "sub" / "b.md").write_text(make_text(60, 3))
    (d / ".hidden.txt").write_text("ignored\n" * 50)
    (d / "image.png").write_bytes(b"\x89PNG")
    m = prepare_corpus(str(d), tmp_path / "c", PrepareOptions(vocab_size=300), **quiet())
    assert m["source"]["files"] == 2
    assert all(m["splits"][s]["rows"] == 2 for s in ("train", "val", "test"))
    (d / "bad.txt").write_bytes(b"caf\xe9\n" * 10)
    with pytest.raises(UserError, match="bad.txt is not UTF-8"):
        prepare_corpus(str(d), tmp_path / "c2", PrepareOptions(vocab_size=300), **quiet())
    assert not (tmp_path / "c2" / MANIFEST).exists()
    with pytest.raises(UserError, match="no such file or folder"):
        prepare_corpus(str(tmp_path / "nope"), tmp_path / "c3", **quiet())
    assert not (tmp_path / "c3").exists()
    (tmp_path / "tiny.txt").write_text("one line only\n")
    with pytest.raises(UserError, match="empty"):
        prepare_corpus(str(tmp_path / "tiny.txt"), tmp_path / "c4", PrepareOptions(vocab_size=300), **quiet())


def test_play_to_text():
    md = "# Macbeth\n\n## ACT I\n\n### SCENE I. A desert place.\n\n_Thunder and lightning. Enter three Witches_\n\n" \
         "**First Witch**  \nWhen shall we three meet again  \nIn thunder, lightning, or in rain?\n"
    assert play_to_text(md) == ("Macbeth\n\nACT I\n\nSCENE I. A desert place.\n\nThunder and lightning. Enter three "
                                "Witches\n\nFirst Witch:\nWhen shall we three meet again\nIn thunder, lightning, or "
                                "in rain?\n")


def test_shipped_plays(tmp_path):
    files = plays_files()
    assert len(files) == 38 and any(f.stem == "macbeth" for f in files)
    out = tmp_path / "macbeth"
    m = prepare_corpus("plays:macbeth", out, PrepareOptions(vocab_size=320), **quiet())
    assert m["source"]["plays"] == ["macbeth"]
    corpus = TokenCorpus(out)
    tok = corpus.tokenizer()
    text = play_to_text((files[[f.stem for f in files].index("macbeth")]).read_text())
    pieces = reference_pieces(text, 0.05, 0.05)
    for split in ("train", "val", "test"):
        assert corpus.tokens(split).tolist() == tok.encode(pieces[split]) + [tok.eot_id]
    assert "MACBETH:" in tok.decode(corpus.tokens("train")[:20000])
    with pytest.raises(UserError, match="unknown play"):
        prepare_corpus("plays:hamlett", tmp_path / "x", **quiet())


class _FakeSplit:
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, sl):
        return {"text": self.rows[sl]}


def test_wikitext_path_on_a_local_stand_in(tmp_path, monkeypatch):
    rows = {"train": ["", " = Valkyria Chronicles = \n", "", " Senjō no Valkyria is a game . \n"] * 30,
            "validation": ["", " = Tower = \n", " It was built in 1900 . \n"],
            "test": [" The end . \n", ""]}
    calls = []

    def load_dataset(path, name):
        calls.append((path, name))
        return {k: _FakeSplit(v) for k, v in rows.items()}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    out = tmp_path / "wt"
    m = prepare_corpus("wikitext103", out, PrepareOptions(tokenizer="bpe", vocab_size=300), **quiet())
    assert calls[0] == ("wikitext", "wikitext-103-v1")
    tok = TokenCorpus(out).tokenizer()
    for split, name in (("train", "train"), ("val", "validation"), ("test", "test")):
        expected = [i for r in rows[name] for i in tok.encode(r) + [tok.eot_id]]   # every row, EOT after each
        assert TokenCorpus(out).tokens(split).tolist() == expected
        assert m["splits"][split]["rows"] == len(rows[name])
    assert m["source"]["name"] == "wikitext103"
    # re-running does not even load the dataset
    calls.clear()
    prepare_corpus("wikitext103", out, PrepareOptions(tokenizer="bpe", vocab_size=300), **quiet())
    assert calls == []


def test_wikitext_without_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)   # import fails
    with pytest.raises(UserError, match=r"pip install loopformer\[text\]"):
        prepare_corpus("wikitext103", tmp_path / "wt", PrepareOptions(tokenizer="bpe"), **quiet())
    assert not (tmp_path / "wt" / MANIFEST).exists()


def test_perturb_tokens():
    rng = np.random.default_rng(5)
    V, eot = 50, 7
    toks = rng.integers(0, V, size=20000).astype(np.uint16)
    out, pos = perturb_tokens(toks, 0.1, V, seed=3, protect=eot)
    n_eligible = int((toks != eot).sum())
    changed = np.flatnonzero(out != toks)
    assert np.array_equal(changed, pos) and len(pos) == round(0.1 * n_eligible)
    assert (toks[pos] != eot).all() and (out[pos] != eot).all()      # boundaries kept, never inserted
    assert out.dtype == toks.dtype
    again, _ = perturb_tokens(toks, 0.1, V, seed=3, protect=eot)
    assert np.array_equal(again, out)
    other, _ = perturb_tokens(toks, 0.1, V, seed=4, protect=eot)
    assert not np.array_equal(other, out)
    # uniform originals and uniform replacements (!= original, != EOT): the replaced values are uniform over the
    # V - 1 non-EOT values; loose chi-square bound (V - 2 degrees of freedom, mean 48, sd ~10)
    counts = np.bincount(out[pos], minlength=V).astype(float)
    allowed = np.arange(V) != eot
    expected = len(pos) / (V - 1)
    chi2 = (((counts[allowed] - expected) ** 2) / expected).sum()
    assert chi2 < 100
    # without protection, all positions are eligible
    out2, pos2 = perturb_tokens(toks, 0.25, V, seed=0)
    assert len(pos2) == 5000 and (out2[pos2] != toks[pos2]).all()


def test_perturbed_preparation(text_file, tmp_path):
    clean = prepare_corpus(str(text_file), tmp_path / "clean", PrepareOptions(vocab_size=300), **quiet())
    pert = prepare_corpus(str(text_file), tmp_path / "pert", PrepareOptions(vocab_size=300, perturb=0.1, seed=1),
                          **quiet())
    assert pert["perturb"]["rate"] == 0.1
    for split in ("train", "val", "test"):
        a = TokenCorpus(tmp_path / "clean").tokens(split)
        b = TokenCorpus(tmp_path / "pert").tokens(split)
        n_diff = int((a != b).sum())
        assert n_diff == pert["perturb"]["replaced"][split] == round(0.1 * int((a != clean["eot_id"]).sum()))
    assert json.loads((tmp_path / "pert" / MANIFEST).read_text())["splits"]["train"]["sha256"] != \
        clean["splits"]["train"]["sha256"]


def test_random_windows_are_deterministic_and_shifted():
    toks = np.arange(1000, dtype=np.uint16)
    w = RandomWindows(toks, block_size=16, batch_size=4, seed=1, rank=0)
    x, y = w.batch(7)
    assert x.shape == (4, 16) and x.dtype.is_floating_point is False
    assert (y == x + 1).all()                                          # y is x shifted by one token
    x2, _ = RandomWindows(toks, 16, 4, seed=1, rank=0).batch(7)       # a fresh object: same batch
    assert (x2 == x).all()
    assert not (w.batch(8)[0] == x).all()
    assert not (RandomWindows(toks, 16, 4, seed=1, rank=1).batch(7)[0] == x).all()
    starts = np.concatenate([w.offsets(s) for s in range(500)])
    assert starts.min() >= 0 and starts.max() <= 1000 - 17
    with pytest.raises(UserError):
        RandomWindows(toks[:10], 16, 4)


def test_sequential_windows_cover_every_target_once():
    toks = np.arange(103, dtype=np.uint16)
    seen = []
    for world in (1, 3):
        targets = []
        for rank in range(world):
            sw = SequentialWindows(toks, block_size=10, batch_size=4, rank=rank, world_size=world)
            batches = list(sw)
            assert len(batches) == len(sw)
            for x, y in batches:
                assert (y == x + 1).all()
                targets.extend(y.flatten().tolist())
        assert sorted(targets) == list(range(1, 103))
        seen.append(len(targets))
    dropped = [y for _, y in SequentialWindows(toks, 10, 4, drop_last=True)]
    assert sum(y.numel() for y in dropped) == 100
