"""Tokenisers for language modelling (paper App. C.3: GPT-2 byte-pair encoding).

Two kinds, one interface (`encode` / `decode` / `eot_id` / `vocab_size`):

    gpt2   GPT-2's BPE through `tiktoken` (50,257 tokens, end-of-text = 50256), exactly as the authors prepared
           WikiText-103: `encode_ordinary` (special-token text is encoded as ordinary text) per row.
           tiktoken fetches its two vocabulary files once and caches them (TIKTOKEN_CACHE_DIR); offline machines
           need them cached already.
    bpe    a byte-level BPE trained locally with Hugging Face `tokenizers` on the training split (GPT-2's
           pre-tokenisation regex, 256 byte symbols, `<|endoftext|>` = id 0), saved beside the data as
           `tokenizer.json`. Byte-level, so every string round-trips exactly.

`load_tokenizer(spec, folder)` rebuilds the tokeniser a prepared corpus was made with (from its manifest entry).

The long calls into the libraries (learning the merges, encoding a batch) run in native code that returns to
Python only when done, and Python handles a signal only in the main thread between its own instructions; they run
in a helper thread while the main thread waits (`interruptible`), so Ctrl-C or SIGTERM ends `text prepare` within
a fraction of a second instead of after the call.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import tiktoken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from loopformer.errors import UserError
from loopformer.fileio import write_with

EOT_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
MAX_BPE_VOCAB = 1 << 20       # the largest byte-level BPE vocabulary `train` learns (the library allocates for it)

T = TypeVar("T")


def interruptible(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, run in a helper thread while the calling (main) thread waits, so that a signal
    handled there (KeyboardInterrupt, `loopformer.commandline.Interrupted`) stops the wait at once. The helper is
    a daemon thread: an interrupted call is abandoned and ends with the process. Outside the main thread `fn` runs
    directly."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:       # handed to the caller
            box["error"] = exc

    helper = threading.Thread(target=run, name=f"loopformer-{getattr(fn, '__name__', 'call')}", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["value"]


class Tokenizer(Protocol):
    """What the corpus, perplexity and generation code need from a tokeniser."""

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def spec(self) -> dict: ...


class GPT2Tokenizer:
    """GPT-2 BPE via tiktoken; `encode` is `encode_ordinary` (no special tokens parsed from text)."""

    name = "gpt2"

    def __init__(self) -> None:
        try:
            self._enc = tiktoken.get_encoding("gpt2")
        except Exception as exc:  # network errors, missing cache, corrupt cache
            raise UserError(
                "the GPT-2 BPE files could not be loaded (tiktoken downloads them once; "
                f"{type(exc).__name__}); put them in TIKTOKEN_CACHE_DIR or use the bpe tokenizer") from None
        self.vocab_size = int(self._enc.n_vocab)   # 50257
        self.eot_id = int(self._enc.eot_token)     # 50256

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return interruptible(self._enc.encode_ordinary_batch, list(texts),
                             num_threads=max(1, min(8, os.cpu_count() or 1)))

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def spec(self) -> dict:
        return {"kind": "gpt2", "vocab_size": self.vocab_size, "eot_id": self.eot_id}


class ByteBPETokenizer:
    """A byte-level BPE (Hugging Face `tokenizers`) stored as `tokenizer.json`."""

    name = "bpe"

    def __init__(self, tok) -> None:  # tok: tokenizers.Tokenizer
        self._tok = tok
        eot = tok.token_to_id(EOT_TEXT)
        if eot is None:
            raise UserError(f"tokenizer has no {EOT_TEXT} token")
        self.eot_id = int(eot)
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> ByteBPETokenizer:
        """Learn merges on `texts` until the vocabulary holds `vocab_size` entries (bytes + merges + EOT)."""
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + 1:
            raise UserError(f"vocab_size must be at least {len(alphabet) + 1} for a byte-level BPE "
                            f"(got {vocab_size})")
        if vocab_size > MAX_BPE_VOCAB:
            raise UserError(f"vocab-size must be at most {MAX_BPE_VOCAB:,} for a byte-level BPE (got {vocab_size:,})")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=[EOT_TEXT], initial_alphabet=alphabet, show_progress=False)
        interruptible(tok.train_from_iterator, _nonempty(texts), trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ByteBPETokenizer:
        if not os.path.isfile(path):
            raise UserError(f"tokenizer file not found: {path}")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as exc:
            raise UserError(f"cannot read tokenizer {path}: {str(exc).splitlines()[0] if str(exc) else exc}") \
                from None

    def save(self, path: str | os.PathLike) -> None:
        """Write `tokenizer.json` atomically."""
        write_with(path, lambda tmp: self._tok.save(str(tmp)))

    def to_json(self) -> str:
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        # special tokens are not split out of text: "<|endoftext|>" in the text is encoded as ordinary bytes,
        # like tiktoken's encode_ordinary
        return self._encode_ordinary([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return interruptible(self._encode_ordinary, list(texts))

    def _encode_ordinary(self, texts: list[str]) -> list[list[int]]:
        # The HF tokenizer matches added tokens before the model; to encode their text as plain bytes we split
        # the input on the special string and join the parts with the byte encoding of the special string.
        out: list[list[int] | None] = [None] * len(texts)
        plain = [i for i, t in enumerate(texts) if EOT_TEXT not in t]
        if plain:
            encs = self._tok.encode_batch([texts[i] for i in plain], add_special_tokens=False)
            for i, e in zip(plain, encs):
                out[i] = list(e.ids)
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self._encode_with_literal_eot(t)
        return out  # type: ignore[return-value]

    def _encode_with_literal_eot(self, text: str) -> list[int]:
        # pre-tokenise the whole string ourselves (regex + byte mapping), then run the BPE model on each piece
        pieces = self._tok.pre_tokenizer.pre_tokenize_str(text)
        ids: list[int] = []
        for piece, _ in pieces:
            ids.extend(t.id for t in self._tok.model.tokenize(piece))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def spec(self) -> dict:
        return {"kind": "bpe", "vocab_size": self.vocab_size, "eot_id": self.eot_id, "file": TOKENIZER_FILE}


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    for t in texts:
        if t:
            yield t


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype holding every id: 'uint16' (GPT-2's 50,257 fit) or 'uint32'."""
    return "uint16" if vocab_size <= 2 ** 16 else "uint32"


def load_tokenizer(spec: dict, folder: str | os.PathLike | None = None) -> Tokenizer:
    """The tokeniser described by a manifest entry `spec` ({'kind': 'gpt2'|'bpe', ...})."""
    kind = spec.get("kind")
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "bpe":
        if folder is None:
            raise UserError("a bpe tokenizer needs the folder holding tokenizer.json")
        return ByteBPETokenizer.load(os.path.join(os.fspath(folder), spec.get("file", TOKENIZER_FILE)))
    raise UserError(f"unknown tokenizer kind {kind!r} (expected 'gpt2' or 'bpe')")


def describe(tok: Tokenizer) -> str:
    return json.dumps(tok.spec(), sort_keys=True)
