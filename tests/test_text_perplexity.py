"""Perplexity: every target scored exactly once, with the stated context, equal to hand computations."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from loopformer.errors import UserError
from loopformer.model import LoopedTransformer, ModelConfig
from loopformer.text.dataset import SequentialWindows
from loopformer.text.perplexity import estimate_perplexity, perplexity, window_plan


class Bigram(nn.Module):
    """logits[b, i] = table[idx[b, i]]: p(x_j | past) depends on x_{j-1} only, so any windowing gives one value."""

    def __init__(self, table):
        super().__init__()
        self.table = nn.Parameter(torch.as_tensor(table, dtype=torch.float32))

    def forward(self, idx):
        return self.table[idx]


@pytest.mark.parametrize("n,T,S", [(2, 4, 4), (5, 4, 4), (50, 8, 8), (50, 8, 3), (50, 8, 1), (9, 8, 2), (10, 8, 8)])
def test_window_plan_scores_each_target_once(n, T, S):
    plan = window_plan(n, T, S)
    targets = [j for _, s, t in plan for j in range(s, t)]
    assert targets == list(range(1, n))
    for k, (b, s, t) in enumerate(plan):
        assert b >= 0 and t - 1 - b <= T                       # inputs x[b:t-1] fit the window
        if k > 0:
            assert t - 1 - b == T                               # later windows are full
            assert s - b >= T - S + 1                           # every scored target sees >= T-S+1 tokens


def test_window_plan_errors():
    with pytest.raises(UserError):
        window_plan(10, 4, 5)
    with pytest.raises(UserError):
        window_plan(1, 4)


def test_bigram_perplexity_equals_hand_computation():
    rng = np.random.default_rng(0)
    V = 11
    table = rng.normal(size=(V, V))
    toks = rng.integers(0, V, size=301)
    logp = table - np.log(np.exp(table).sum(1, keepdims=True))
    nll = -np.mean([logp[toks[j - 1], toks[j]] for j in range(1, len(toks))])     # by hand, in float64
    model = Bigram(table)
    for stride in (None, 16, 5, 1):
        res = perplexity(model, toks, block_size=16, stride=stride, batch_size=3, progress=False)
        assert res.tokens == 300
        assert res.nll == pytest.approx(nll, rel=1e-6)
        assert res.ppl == pytest.approx(math.exp(nll), rel=1e-6)
    assert perplexity(model, toks, 16, progress=False).method == "non-overlapping"
    assert perplexity(model, toks, 16, 4, progress=False).method == "sliding"


def reference_context_start(j, T, S, n):
    """Where the context of target j starts under the documented rule, derived separately from the code:
    targets 1..T come from the first window x[0:T]; after that windows end every S targets (the last one at n-1)
    and each sees the T tokens before its last target."""
    if j <= T:
        return 0
    last = min(T + S * math.ceil((j - T) / S), n - 1)           # the last target of j's window
    return last - T


@pytest.mark.parametrize("stride", [8, 3])
def test_model_perplexity_equals_one_target_at_a_time(stride):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, max_len=8, d_model=16, n_heads=2, loops=3, timestep=True)
    model = LoopedTransformer(cfg).eval()
    for blk in model.blocks:  # leave the identity initialisation, so the loops and modulation matter
        nn.init.normal_(blk.modulation.weight, 0, 0.3)
    toks = np.random.default_rng(1).integers(0, 23, size=41)
    T = 8
    total = 0.0
    with torch.no_grad():
        for j in range(1, len(toks)):
            b = reference_context_start(j, T, stride, len(toks))
            ctx = torch.as_tensor(toks[b:j])[None]
            logits = model(ctx).logits[0, -1].double()
            total -= float(torch.log_softmax(logits, -1)[toks[j]])
    res = perplexity(model, toks, block_size=T, stride=stride, batch_size=2, progress=False)
    assert res.nll == pytest.approx(total / (len(toks) - 1), rel=1e-5)
    assert res.tokens == len(toks) - 1
    # the non-overlapping case equals the mean loss over the evaluation windows of SequentialWindows
    if stride == T:
        losses, count = 0.0, 0
        with torch.no_grad():
            for x, y in SequentialWindows(toks, T, batch_size=3):
                losses += float(nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(),
                                                            reduction="sum"))
                count += y.numel()
        assert res.nll == pytest.approx(losses / count, rel=1e-5)
    # deterministic and the model is left as it was
    model.train()
    again = perplexity(model, toks, block_size=T, stride=stride, batch_size=5, progress=False)
    assert again.nll == pytest.approx(res.nll, rel=1e-6) and model.training


def test_estimate_is_labelled_and_seeded():
    rng = np.random.default_rng(0)
    model = Bigram(rng.normal(size=(7, 7)))
    toks = rng.integers(0, 7, size=500)
    a = estimate_perplexity(model, toks, block_size=16, batch_size=4, iters=5, seed=1, progress=False)
    b = estimate_perplexity(model, toks, block_size=16, batch_size=4, iters=5, seed=1, progress=False)
    c = estimate_perplexity(model, toks, block_size=16, batch_size=4, iters=5, seed=2, progress=False)
    assert a.method == "estimate" and "estimate" in a.description
    assert a.nll == b.nll and a.nll != c.nll
    exact = perplexity(model, toks, block_size=16, progress=False)
    assert abs(a.nll - exact.nll) < 0.5                          # same model, same data: close but not equal
