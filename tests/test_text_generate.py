"""Sampling and generation: filters against numpy references, seeded draws, cache == recompute with padding."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from loopformer.errors import UserError
from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.text.generate import SamplingConfig, filter_logits, generate, generate_text, left_pad, sample_next
from loopformer.text.tokenizers import ByteBPETokenizer


def np_top_k(logits, k):
    out = np.full_like(logits, -np.inf)
    for i, row in enumerate(logits):
        keep = np.argsort(-row)[:k]
        out[i, keep] = row[keep]
    return out


def np_top_p(logits, p):
    out = np.full_like(logits, -np.inf)
    for i, row in enumerate(logits):
        probs = np.exp(row - row.max())
        probs /= probs.sum()
        total = 0.0
        for j in np.argsort(-row):      # add tokens, most likely first, until the mass reaches p
            out[i, j] = row[j]
            total += probs[j]
            if total >= p:
                break
    return out


def test_filters_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 30)).astype(np.float64) * 2
    t = torch.as_tensor(logits)
    for k in (1, 3, 30):
        assert np.array_equal(filter_logits(t, top_k=k).numpy(), np_top_k(logits, k))
    for p in (0.05, 0.5, 0.9, 1.0):
        assert np.array_equal(filter_logits(t, top_p=p).numpy(), np_top_p(logits, p))


def test_sampling_is_seeded_and_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(3)
    draws = sample_next(logits, 1.0, generator=g)
    freq = np.bincount(draws.numpy(), minlength=4) / len(draws)
    assert np.allclose(freq, torch.softmax(logits[0], -1).numpy(), atol=0.015)
    again = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(draws, again)
    hot = sample_next(logits, 0.5, generator=g)                 # temperature sharpens: p ∝ exp(2·logit)
    freq = np.bincount(hot.numpy(), minlength=4) / len(hot)
    assert np.allclose(freq, torch.softmax(2 * logits[0], -1).numpy(), atol=0.015)
    assert (sample_next(logits[:5], 0.0) == 0).all()            # greedy
    assert (sample_next(logits[:50], 1.0, top_k=1, generator=g) == 0).all()
    top2 = sample_next(logits, 1.0, top_k=2, generator=g)
    assert set(top2.tolist()) == {0, 1}


def test_left_pad():
    idx, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert idx.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    with pytest.raises(UserError):
        left_pad([[1], []])


VARIANTS = {
    "standard": dict(n_layers=2, loops=1),
    "looped": dict(n_layers=1, loops=3, input_injection=True),
    "tmlt": dict(n_layers=1, loops=3, timestep=True),
}


def tiny(kind, V=40):
    torch.manual_seed(0)
    m = LoopedTransformer(ModelConfig(vocab_size=V, max_len=32, d_model=32, n_heads=2, **VARIANTS[kind]))
    for blk in m.blocks:
        if blk.modulation is not None:
            nn.init.normal_(blk.modulation.weight, 0, 0.3)
    return m.eval()


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_cache_equals_recompute_with_padding(kind):
    m = tiny(kind)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    cfg = SamplingConfig(max_new_tokens=8, temperature=0)
    cached = generate(m, prompts, cfg, return_logits=True)
    full = generate(m, prompts, cfg, use_cache=False, return_logits=True)
    assert cached.tokens == full.tokens
    assert torch.allclose(cached.logits, full.logits, atol=1e-5)
    # each row of the padded batch continues exactly as the prompt alone would
    for i, p in enumerate(prompts):
        alone = generate(m, [p], cfg, return_logits=True)
        assert alone.tokens[0] == cached.tokens[i]
        assert torch.allclose(alone.logits[0], cached.logits[i], atol=1e-5)
    # and the first logits equal a plain forward over the prompt
    with torch.no_grad():
        ref = m(torch.tensor([prompts[1]])).logits[0, -1]
    assert torch.allclose(cached.logits[1, 0], ref, atol=1e-5)


def test_sampled_generation_is_seeded_and_stops_at_eos():
    m = tiny("looped")
    prompts = [[1, 2, 3], [4]]
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    a = generate(m, prompts, cfg)
    b = generate(m, prompts, cfg, use_cache=False)
    assert a.tokens == b.tokens and all(len(t) == 10 for t in a.tokens)
    c = generate(m, prompts, SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=8))
    assert c.tokens != a.tokens
    eos = a.tokens[0][2]                                        # a token row 0 emits at step 3
    d = generate(m, prompts, cfg, eos_id=eos)
    assert d.tokens[0] == a.tokens[0][:3] and d.finished[0]
    row1 = a.tokens[1]
    assert d.tokens[1] == (row1[:row1.index(eos) + 1] if eos in row1 else row1)


def test_generation_errors():
    m = tiny("looped")
    with pytest.raises(UserError, match="exceed the model's context"):
        generate(m, [[1] * 30], SamplingConfig(max_new_tokens=5))
    long = generate(m, [[1] * 30], SamplingConfig(max_new_tokens=5, temperature=0), use_cache=False)
    assert len(long.tokens[0]) == 5                             # without the cache the context is cropped
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(UserError):
            SamplingConfig(**bad)


def test_generate_text_with_bpe():
    lines = ["the king is dead, long live the king.", "the queen is here and the night is long."] * 20
    tok = ByteBPETokenizer.train(lines, vocab_size=300)
    m = tiny("tmlt", V=tok.vocab_size)
    cfg = SamplingConfig(max_new_tokens=6, temperature=0)
    texts = generate_text(m, tok, ["the king", "long"], cfg)
    res = generate(m, [tok.encode("the king"), tok.encode("long")], cfg, eos_id=tok.eot_id, pad_id=tok.eot_id)
    for text, toks in zip(texts, res.tokens):
        assert text == tok.decode([t for t in toks if t != tok.eot_id])
    small = tiny("tmlt", V=10)
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        generate_text(small, tok, ["the king"], cfg)
