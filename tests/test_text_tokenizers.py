"""Tokenisers: exact round trips, ordinary encoding of special-token text, save/load, dtype choice."""

import numpy as np
import pytest

from loopformer.errors import UserError
from loopformer.text.tokenizers import EOT_TEXT, ByteBPETokenizer, GPT2Tokenizer, load_tokenizer, token_dtype

WORDS = ["the", "king", "queen", "is", "dead", "long", "live", "castle", "sword", "night", "day", "and", "of",
         "Æthelred", "naïve", "café", "世界", "🙂"]


def corpus_lines(n=200, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) + rng.choice([".", "!", "?", ","])
            for _ in range(n)]


@pytest.fixture(scope="module")
def bpe():
    return ByteBPETokenizer.train(corpus_lines(), vocab_size=400)


HARD = ["", "the king is dead", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "naïve café 世界 🙂",
        "unseen zebra quartz", "\x00\x01 control", "<|endoftext|> inside text", "a" * 500]


@pytest.mark.parametrize("text", HARD)
def test_bpe_round_trip(bpe, text):
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text


def test_bpe_learned_merges_and_special_token(bpe):
    assert 257 < bpe.vocab_size <= 400          # merges stop when no pair occurs twice
    assert bpe.eot_id == 0
    # frequent words become single tokens, unseen text falls back to bytes (longer)
    assert len(bpe.encode(" king")) == 1
    assert len(bpe.encode("zebra")) > 1
    # special-token text is ordinary text (like tiktoken's encode_ordinary): never the EOT id
    ids = bpe.encode(EOT_TEXT)
    assert bpe.eot_id not in ids and len(ids) > 1
    assert bpe.decode([bpe.eot_id]) == EOT_TEXT


def test_bpe_batch_equals_single(bpe):
    texts = HARD + corpus_lines(5, seed=1)
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]


def test_bpe_save_load(bpe, tmp_path):
    bpe.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(bpe.spec(), tmp_path)
    texts = corpus_lines(20, seed=2) + HARD
    assert [again.encode(t) for t in texts] == [bpe.encode(t) for t in texts]
    assert again.vocab_size == bpe.vocab_size and again.eot_id == bpe.eot_id


def test_bpe_errors(tmp_path):
    with pytest.raises(UserError):
        ByteBPETokenizer.train(["abc"], vocab_size=100)
    with pytest.raises(UserError, match="not found"):
        ByteBPETokenizer.load(tmp_path / "missing.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read tokenizer"):
        ByteBPETokenizer.load(tmp_path / "tokenizer.json")
    with pytest.raises(UserError, match="unknown tokenizer"):
        load_tokenizer({"kind": "sentencepiece"})


def test_token_dtype():
    assert token_dtype(50257) == "uint16"
    assert token_dtype(2 ** 16) == "uint16"
    assert token_dtype(2 ** 16 + 1) == "uint32"


def _gpt2_or_skip():
    try:
        return GPT2Tokenizer()
    except UserError:
        pytest.skip("GPT-2 BPE files are not cached on this machine (tiktoken needs to download them once)")


@pytest.mark.parametrize("text", HARD)
def test_gpt2_round_trip(text):
    tok = _gpt2_or_skip()
    assert tok.decode(tok.encode(text)) == text


def test_gpt2_known_ids():
    tok = _gpt2_or_skip()
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995]
    assert 50256 not in tok.encode(EOT_TEXT)          # encode_ordinary, as the authors
