"""A transformers fast tokenizer from loopformer's tokenizers (`loopformer.text.tokenizers`):

    bpe    the corpus's byte-level BPE: its tokenizer.json as it is
    gpt2   GPT-2's BPE, read through tiktoken (its vocabulary files cached, TIKTOKEN_CACHE_DIR) and written as a
           byte-level BPE: the same ids for every text

End-of-text (`<|endoftext|>`) is the tokenizer's eos and pad token, as in loopformer's generation (which pads with
it). One difference: loopformer encodes the text "<|endoftext|>" inside a string as ordinary bytes, a transformers
tokenizer as the special token.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from loopformer.errors import UserError
from loopformer.text.tokenizers import EOT_TEXT, ByteBPETokenizer, GPT2Tokenizer


def byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (the alphabet of byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def bpe_from_ranks(ranks: dict[bytes, int], pattern: str, special: dict[str, int]) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` encoding as tiktoken does with these mergeable ranks (token bytes ->
    id, the id also the merge's rank), pre-tokenisation regex and special tokens (text -> id)."""
    sym = byte_symbols()
    text = lambda b: "".join(sym[x] for x in b)                     # noqa: E731
    vocab, merges = {text(tok): rank for tok, rank in ranks.items()}, []
    for tok, rank in ranks.items():
        pairs = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in pairs]
    merges.sort()
    bpe = Tokenizer(BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], fuse_unk=False, ignore_merges=True))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    for name, idx in sorted(special.items(), key=lambda kv: kv[1]):
        if bpe.get_vocab_size(with_added_tokens=True) != idx:
            raise UserError(f"special token {name!r} has id {idx}, not the next free id of the vocabulary")
        bpe.add_special_tokens([AddedToken(name, normalized=False, special=True)])
    return bpe


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2's BPE (through tiktoken's cached vocabulary files) as a `tokenizers.Tokenizer`."""
    GPT2Tokenizer()                          # a one-line error where tiktoken cannot load the files
    from tiktoken_ext.openai_public import gpt2
    spec = gpt2()
    return bpe_from_ranks(spec["mergeable_ranks"], spec["pat_str"], spec["special_tokens"])


def fast_tokenizer(tokenizer, max_len: int | None = None) -> PreTrainedTokenizerFast:
    """The transformers tokenizer of a loopformer tokenizer (`ByteBPETokenizer` or `GPT2Tokenizer`);
    `max_len`: the model's context (learned positions), its `model_max_length`."""
    if isinstance(tokenizer, ByteBPETokenizer):
        backend = Tokenizer.from_str(tokenizer.to_json())
    elif isinstance(tokenizer, GPT2Tokenizer):
        backend = gpt2_tokenizer()
    else:
        raise UserError(f"no transformers tokenizer for a {type(tokenizer).__name__}")
    extra = {} if max_len is None else {"model_max_length": max_len}
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOT_TEXT, pad_token=EOT_TEXT, **extra)


__all__ = ["fast_tokenizer", "bpe_from_ranks", "byte_symbols"]
