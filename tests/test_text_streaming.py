"""Corpus preparation in bounded memory: documents streamed one at a time (a large file line by line), the
perturbation block by block, Hugging Face datasets streamed by name — each giving the bytes the in-memory
preparation gave."""

import filecmp
import os
import sys
import types

import numpy as np
import pytest

from loopformer.cli import main
from loopformer.errors import UserError
from loopformer.text import corpus
from loopformer.text.corpus import (
    PrepareOptions,
    RowPart,
    perturb_token_file,
    perturb_tokens,
    prepare_corpus,
    split_documents,
)
from loopformer.text.dataset import SequentialWindows, TokenCorpus
from loopformer.text.tokenizers import ByteBPETokenizer

WORDS = ["the", "king", "queen", "is", "dead", "long", "live", "castle", "<|endoftext|>", "don't", "42", "!!", "é"]
ENDS = ["\n", "\n", "\n", "\r\n", "\r", " \n", "\n\n", "\u2028", "\x85", "\f", "\n   \n"]


def quiet(**kw):
    return dict(progress=False, log=lambda msg: None, **kw)


def tricky_text(n_lines, seed, tail=""):
    """Lines with indentation, blank lines, every line ending str.splitlines knows, the EOT text, non-ASCII."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_lines):
        lead = rng.choice(["", "", "", " ", "  ", "\t"])
        out.append(lead + " ".join(rng.choice(WORDS, size=rng.integers(0, 9))) + rng.choice(ENDS))
    return "".join(out) + tail


def write_folder(root, sizes=(120, 300, 2, 500, 40)):
    """A folder of documents written byte for byte (newline=""), some without a final line ending."""
    root.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(sizes):
        sub = root / ("sub" if i % 2 else "")
        sub.mkdir(exist_ok=True)
        with open(sub / f"doc{i}.txt", "w", encoding="utf-8", newline="") as f:
            f.write(tricky_text(n, i, tail="no final newline" if i % 2 else ""))
    return sorted(f for f in root.rglob("*.txt"))


def previous_split_documents(docs, val_fraction, test_fraction):
    """The split rule as first released (holding every document and piece): the reference for the streamed one."""
    def share(n, fraction):
        if fraction <= 0 or n < 3:
            return 0
        return max(1, int(round(n * fraction)))

    out = {s: [] for s in ("train", "val", "test")}
    for doc in docs:
        lines = doc.splitlines(keepends=True)
        n = len(lines)
        n_val = share(n, val_fraction)
        n_test = share(n, test_fraction)
        n_train = n - n_val - n_test
        cuts = {"train": lines[:n_train], "val": lines[n_train:n_train + n_val], "test": lines[n_train + n_val:]}
        for s, part in cuts.items():
            text = "".join(part)
            if text.strip():
                out[s].append(text)
    return out


def previous_perturb_tokens(tokens, rate, vocab_size, seed, protect=None):
    """The perturbation as first released (the whole array in memory): the reference for the block-wise one."""
    tokens = np.asarray(tokens)
    out = tokens.copy()
    rng = np.random.default_rng(seed)
    eligible = np.flatnonzero(tokens != protect) if protect is not None else np.arange(tokens.size)
    k = int(round(rate * eligible.size))
    if k == 0:
        return out, np.zeros(0, dtype=np.int64)
    pos = np.sort(rng.choice(eligible, size=k, replace=False))
    orig = tokens[pos].astype(np.int64)
    if protect is None:
        r = rng.integers(0, vocab_size - 1, size=k)
        r = r + (r >= orig)
    else:
        lo = np.minimum(orig, protect)
        hi = np.maximum(orig, protect)
        r = rng.integers(0, vocab_size - 2, size=k)
        r = r + (r >= lo)
        r = r + (r >= hi)
    out[pos] = r.astype(tokens.dtype)
    return out, pos


def small_blocks(monkeypatch):
    """Stream every file line by line in tiny reads and cut shares into small parts; perturb in tiny blocks."""
    monkeypatch.setattr(corpus, "_WHOLE_FILE_BYTES", 64)
    monkeypatch.setattr(corpus, "_READ_BYTES", 37)
    monkeypatch.setattr(corpus, "_SEGMENT_CHARS", 200)
    monkeypatch.setattr(corpus, "_PIECE_CHARS", 90)
    monkeypatch.setattr(corpus, "_CHUNK_CHARS", 3000)
    monkeypatch.setattr(corpus, "_TOKEN_CHUNK", 1000)
    monkeypatch.setattr(corpus, "_DRAW_CHUNK", 777)


def same_folders(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    return [n for n in names if not filecmp.cmp(a / n, b / n, shallow=False)]


# ------------------------------------------------------------------------------------------------ documents
def test_split_rule_and_bytes_match_the_previous_implementation(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_PIECE_CHARS", 90)           # long rows reach the tokeniser in parts
    files = write_folder(tmp_path / "docs")
    docs = [f.read_text(encoding="utf-8") for f in files]
    for val, test in ((0.05, 0.05), (0.2, 0.0), (0.0, 0.1), (0.3, 0.3)):
        assert split_documents(docs, val, test) == previous_split_documents(docs, val, test)
    # the prepared corpus: the BPE learned on the previous rule's train pieces, each piece one row + EOT
    out = tmp_path / "c"
    m = prepare_corpus(str(tmp_path / "docs"), out, PrepareOptions(vocab_size=320, val_fraction=0.1), **quiet())
    pieces = previous_split_documents(docs, 0.1, 0.05)
    ref = ByteBPETokenizer.train(pieces["train"], 320)
    assert ByteBPETokenizer.load(out / "tokenizer.json").to_json() == ref.to_json()
    for split in ("train", "val", "test"):
        ids = [i for p in pieces[split] for i in ref.encode(p) + [ref.eot_id]]
        assert (out / f"{split}.bin").read_bytes() == np.asarray(ids, dtype=np.uint16).tobytes()
        assert m["splits"][split]["rows"] == len(pieces[split])


def test_large_files_streamed_line_by_line_give_the_same_corpus(tmp_path, monkeypatch):
    write_folder(tmp_path / "docs")
    opts = PrepareOptions(vocab_size=330, perturb=0.1, seed=2)
    prepare_corpus(str(tmp_path / "docs"), tmp_path / "whole", opts, **quiet())
    small_blocks(monkeypatch)
    read = []
    real = corpus._read_text
    monkeypatch.setattr(corpus, "_read_text", lambda f: (read.append(f), real(f))[1])
    src = corpus.resolve_source(str(tmp_path / "docs"), opts)
    rows = list(src.rows("train"))
    assert [f.name for f in read] == ["doc2.txt"]                           # only the tiny file is read whole
    assert sum(isinstance(r, RowPart) for r in rows) > 10
    prepare_corpus(str(tmp_path / "docs"), tmp_path / "streamed", opts, **quiet())
    assert same_folders(tmp_path / "whole", tmp_path / "streamed") == []     # manifest included


def test_line_blocks_are_read_texts_lines(tmp_path, monkeypatch):
    f = tmp_path / "t.txt"
    raw = tricky_text(300, 9, tail="end\r").encode() + "\r\n\r\r\n x\rñ\u2029".encode()
    f.write_bytes(raw)
    for size in (1, 2, 3, 7, 64, 1 << 20):
        monkeypatch.setattr(corpus, "_READ_BYTES", size)
        lines = [line for block in corpus._line_blocks(f) for line in block]
        assert lines == f.read_text(encoding="utf-8").splitlines(keepends=True)
    # a decoding error names the same byte as when the file is read whole
    f.write_bytes(raw[:500] + b"\xe9t\xe9" + raw[500:])
    with pytest.raises(UserError) as whole:
        corpus._read_text(f)
    for size in (1, 5, 64):
        monkeypatch.setattr(corpus, "_READ_BYTES", size)
        with pytest.raises(UserError) as streamed:
            corpus._count_lines(f)
        assert str(streamed.value) == str(whole.value) == f"{f} is not UTF-8 text (byte 500)"


def test_documents_are_read_one_at_a_time(tmp_path, monkeypatch):
    files = write_folder(tmp_path / "docs", sizes=(50, 60, 70, 80))
    read = []
    real = corpus._read_text
    monkeypatch.setattr(corpus, "_read_text", lambda f: (read.append(f.name), real(f))[1])
    src = corpus.resolve_source(str(tmp_path / "docs"), PrepareOptions())
    assert src.n_rows("train") is None                                       # no pass to count rows
    rows = iter(src.rows("train"))
    next(rows)
    assert read == [files[0].name]
    next(rows)
    assert read == [files[0].name, files[1].name]


def test_cuts_keep_gpt2_tokens(tmp_path, monkeypatch):
    """The parts a streamed share is cut into encode, one after the other, to the tokens of the whole share under
    GPT-2's pre-tokenisation (tiktoken; a small byte-level vocabulary with whitespace merges stands in for GPT-2's
    files, so that a cut through a run of whitespace would show)."""
    tiktoken = pytest.importorskip("tiktoken")
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    ranks = {bytes([i]): i for i in range(256)}
    for piece in (b"\n\n", b"\n ", b"  ", b" \n", b"\t\n", b"th", b"he", b" t", b"in", b"ng"):
        ranks[piece] = len(ranks)
    enc = tiktoken.Encoding("test-gpt2-pattern", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    f = tmp_path / "big.txt"
    f.write_text(tricky_text(2000, 4), encoding="utf-8")
    monkeypatch.setattr(corpus, "_READ_BYTES", 101)
    monkeypatch.setattr(corpus, "_SEGMENT_CHARS", 50)
    n = corpus._count_lines(f)
    rows = list(corpus._stream_share(f, 0, n))
    assert len(rows) > 100 and all(isinstance(r, RowPart) for r in rows[:-1]) and isinstance(rows[-1], str)
    parts = [r.text if isinstance(r, RowPart) else r for r in rows]
    whole = "".join(parts)
    assert whole == f.read_text(encoding="utf-8")
    assert [i for p in parts for i in enc.encode_ordinary(p)] == enc.encode_ordinary(whole)
    # a cut through a run of whitespace would change them (the merges above see it)
    assert enc.encode_ordinary("the\n") + enc.encode_ordinary("  king") != enc.encode_ordinary("the\n  king")


def test_bad_streamed_files_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(corpus, "_WHOLE_FILE_BYTES", 16)
    (tmp_path / "blank.txt").write_text("   \n\n \t \n" * 10)
    assert main(["text", "prepare", str(tmp_path / "blank.txt"), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "blank.txt is empty" in err
    (tmp_path / "latin.txt").write_bytes(b"good line\n" * 20 + b"caf\xe9\n")
    assert main(["text", "prepare", str(tmp_path / "latin.txt"), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "latin.txt is not UTF-8 text (byte 203)" in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ perturbation
@pytest.mark.parametrize("n,rate,protect", [
    (30000, 0.1, 7),        # numpy's tail shuffle (n > 10000, k > n/50)
    (30000, 0.01, 7),       # Floyd's algorithm, then a shuffle of the chosen
    (5000, 0.3, 7),         # small population: Floyd's algorithm
    (25000, 0.25, None),    # every position eligible
    (20001, 0.99998, None),  # every position chosen
])
def test_perturbation_matches_the_previous_implementation(n, rate, protect, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_TOKEN_CHUNK", 1000)
    monkeypatch.setattr(corpus, "_DRAW_CHUNK", 777)
    V = 50
    toks = np.random.default_rng(n).integers(0, V, size=n).astype(np.uint16)
    want, want_pos = previous_perturb_tokens(toks, rate, V, seed=3, protect=protect)
    got, pos = perturb_tokens(toks, rate, V, seed=3, protect=protect)
    assert np.array_equal(got, want) and np.array_equal(pos, want_pos)
    path = tmp_path / "t.bin"
    toks.tofile(path)
    assert perturb_token_file(path, np.uint16, rate, V, seed=3, protect=protect) == len(want_pos)
    assert np.array_equal(np.fromfile(path, dtype=np.uint16), want)
    assert os.listdir(tmp_path) == ["t.bin"]                                # the bitmap is gone


# ------------------------------------------------------------------------------------------------ hf: datasets
class FakeStream:
    """An iterable dataset split: rows as dicts, re-iterable, with the column names streaming exposes."""

    def __init__(self, rows, columns=True):
        self.rows = rows
        self.column_names = list(rows[0]) if columns and rows else None

    def __iter__(self):
        return iter([dict(r) for r in self.rows])


def fake_datasets(monkeypatch, splits, columns=True):
    calls = []

    def load_dataset(path, name=None, split=None, streaming=False, **kw):
        calls.append(dict(path=path, name=name, split=split, streaming=streaming, **kw))
        if path not in splits:
            raise FileNotFoundError(f"Dataset '{path}' doesn't exist on the Hub\nor cannot be accessed.")
        dd = {k: FakeStream(v, columns) for k, v in splits[path].items()}
        return dd if split is None else dd[split]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def rows_of(texts, column="text"):
    return [{column: t, "id": i} for i, t in enumerate(texts)]


WIKI = {"train": [" = Valkyria = \n", "", " Senjō no Valkyria is a game . \n"] * 40,
        "validation": ["", " = Tower = \n", " It was built in 1900 . \n"],
        "test": [" The end . \n", ""]}


def test_hf_source_streams_its_splits(tmp_path, monkeypatch):
    calls = fake_datasets(monkeypatch, {"wikitext": {k: rows_of(v) for k, v in WIKI.items()}})
    out = tmp_path / "wt"
    m = prepare_corpus("hf:wikitext:wikitext-103-raw-v1", out, PrepareOptions(vocab_size=300), **quiet())
    assert calls[0]["streaming"] is True and (calls[0]["path"], calls[0]["name"]) == ("wikitext",
                                                                                     "wikitext-103-raw-v1")
    assert m["source"] == {"name": "hf", "dataset": "wikitext", "config": "wikitext-103-raw-v1", "column": "text",
                           "revision": None}
    tok = TokenCorpus(out).tokenizer()
    for split, name in (("train", "train"), ("val", "validation"), ("test", "test")):
        expected = [i for r in WIKI[name] for i in tok.encode(r) + [tok.eot_id]]       # every row, EOT after each
        assert TokenCorpus(out).tokens(split).tolist() == expected
    calls.clear()                                                            # a re-run does not load anything
    prepare_corpus("hf:wikitext:wikitext-103-raw-v1", out, PrepareOptions(vocab_size=300), **quiet())
    assert calls == []
    # a pinned revision is passed on and recorded; "valid" names the validation split too
    renamed = {"train": WIKI["train"], "valid": WIKI["validation"], "test": WIKI["test"]}
    fake_datasets(monkeypatch, {"org/wiki": {k: rows_of(v, "body") for k, v in renamed.items()}}, columns=False)
    m = prepare_corpus("hf:org/wiki@v1.0", tmp_path / "w2", PrepareOptions(vocab_size=300, text_column="body"),
                       **quiet())
    assert m["source"]["revision"] == "v1.0" and m["source"]["column"] == "body" and m["source"]["config"] is None
    assert m["splits"]["val"]["rows"] == 3


def test_hf_source_without_validation_and_test_carves_them_out_of_train(tmp_path, monkeypatch):
    texts = [f"row {i} says {WORDS[i % len(WORDS)]}\n" for i in range(2300)]
    fake_datasets(monkeypatch, {"lines": {"train": rows_of(texts)}})
    m = prepare_corpus("hf:lines", tmp_path / "c", PrepareOptions(vocab_size=300, val_fraction=0.02,
                                                                  test_fraction=0.01), **quiet())
    block = [i % 1000 for i in range(2300)]
    want = {"train": [t for t, b in zip(texts, block) if b < 970], "val": [t for t, b in zip(texts, block)
                                                                          if 970 <= b < 990],
            "test": [t for t, b in zip(texts, block) if b >= 990]}
    tok = TokenCorpus(tmp_path / "c").tokenizer()
    for split, rows in want.items():
        assert m["splits"][split]["rows"] == len(rows)
        assert TokenCorpus(tmp_path / "c").tokens(split).tolist() == [i for r in rows
                                                                      for i in tok.encode(r) + [tok.eot_id]]
    with pytest.raises(UserError, match="no test split.*test-fraction"):
        prepare_corpus("hf:lines", tmp_path / "d", PrepareOptions(vocab_size=300, test_fraction=0.0), **quiet())


def test_hf_source_bad_inputs_are_one_line(tmp_path, monkeypatch, capsys):
    def run(*args):
        code = main(["text", "prepare", *args, "--out", str(tmp_path / "o"), "--vocab-size", "280", "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("loopformer: error: ") and err.count("\n") == 1, err
        assert not (tmp_path / "o").exists()
        return err

    monkeypatch.setitem(sys.modules, "datasets", None)                       # not installed
    assert "pip install loopformer[text]" in run("hf:wikitext:wikitext-103-raw-v1")
    fake_datasets(monkeypatch, {"wikitext": {k: rows_of(v) for k, v in WIKI.items()},
                                "nolabel": {"validation": rows_of(["a\n"])}})
    assert "cannot load hf:nope from Hugging Face: Dataset 'nope' doesn't exist on the Hub" in run("hf:nope")
    assert "has no column 'body'" in run("hf:wikitext", "--text-column", "body")
    assert "has no train split" in run("hf:nolabel")
    assert "bad Hugging Face source" in run("hf:")
    (tmp_path / "a.txt").write_text("some text\n" * 30)
    assert "text-column applies to Hugging Face sources" in run(str(tmp_path / "a.txt"), "--text-column", "x")
    fake_datasets(monkeypatch, {"nums": {"train": [{"text": 3}] * 5, "validation": [{"text": 4}],
                                         "test": [{"text": 5}]}})
    assert "holds int, not text" in run("hf:nums")


# ------------------------------------------------------------------------------------------------ reading windows
def test_sequential_windows_are_computed_batch_by_batch():
    """The windows of every rank, batch by batch, as listing all the split's starts gives them."""
    for n_tokens in (1, 2, 50, 101):
        toks = np.arange(n_tokens, dtype=np.uint16)
        for T, B, world, drop in ((10, 4, 1, False), (10, 4, 3, False), (7, 2, 2, True), (1, 3, 4, False)):
            n_targets = n_tokens - 1
            full = max(n_targets, 0) // T
            n = full if (drop or n_targets % T == 0) else full + 1
            for rank in range(world):
                sw = SequentialWindows(toks, T, B, rank=rank, world_size=world, drop_last=drop)
                mine = [s * T for s in range(rank, n, world)]
                assert sw.starts().tolist() == mine
                got = [x[:, 0].tolist() for x, _ in sw]
                long = [s for s in mine if s + T < n_tokens]
                want = [long[i:i + B] for i in range(0, len(long), B)] + [[s] for s in mine if s + T >= n_tokens]
                assert got == want and len(sw) == len(want)
