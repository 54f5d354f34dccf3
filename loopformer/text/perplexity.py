"""Perplexity over a whole token split, deterministic — and the authors' random-batch estimate, labelled as such.

Table 4 of the paper reports WikiText-103 perplexities from the authors' training script, which estimates the loss
as the mean over a few random batches of random windows (nanoGPT's `estimate_loss`): windows overlap, most tokens are
never scored and the number changes with the seed. `estimate_perplexity` reproduces that protocol for comparison;
`perplexity` is the measurement proper:

    perplexity = exp( (1/(N-1)) · Σ_{j=1}^{N-1} -log p(x_j | x_{b_j} … x_{j-1}) )

over a split x_0 … x_{N-1}, every target x_j scored exactly once. Windows of T = block_size inputs advance by
`stride` S ≤ T:

    window 0:  inputs x[0 : T],        scores targets 1 … T            (the start of the split has no more context)
    window w:  inputs x[t-1-T : t-1],  scores targets s … t-1 only,    s = end of the previous window, t = min(s+S, N)

so with S = T the windows do not overlap (fast; a window's first target sees one token), and with S < T every target
after the first window is predicted from at least T - S + 1 tokens (`min_context`), at T/S times the cost.
The model is any callable `model(idx[B,T]) -> out` with `out.logits` [B,T,V] (or the logits tensor itself).
`loopformer perplexity` measures the same windows through the library's evaluation
(`loopformer.sources.text.SplitWindows`, which adaptive depth runs on too).
Shapes: B batch, T window length, V vocabulary, N split length.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from loopformer.errors import UserError
from loopformer.text.dataset import RandomWindows


@dataclass
class PerplexityResult:
    method: str          # "sliding" | "non-overlapping" | "estimate"
    nll: float           # mean negative log-likelihood per scored token (nats)
    ppl: float           # exp(nll)
    tokens: int          # tokens scored
    windows: int         # forward passes (windows) evaluated
    block_size: int
    stride: int | None = None
    min_context: int | None = None   # tokens visible to every scored token after the first window
    description: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def window_plan(n_tokens: int, block_size: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """The windows as (b, s, t): inputs x[b : t-1], targets x[b+1 : t], of which x[s : t] are scored.

    Every target index 1 … n_tokens-1 lies in exactly one [s, t).
    """
    T = int(block_size)
    S = T if stride is None else int(stride)
    if T < 1:
        raise UserError(f"block size must be positive (got {T})")
    if not 1 <= S <= T:
        raise UserError(f"stride must be in [1, block size = {T}] (got {S})")
    if n_tokens < 2:
        raise UserError(f"need at least 2 tokens to score (got {n_tokens})")
    t = min(1 + T, n_tokens)
    plan = [(0, 1, t)]
    while t < n_tokens:
        s = t
        t = min(s + S, n_tokens)
        plan.append((t - 1 - T, s, t))
    return plan


def _logits(model, x: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
    out = model(x, **model_kwargs)
    return out.logits if hasattr(out, "logits") else out


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def model_block_size(model) -> int | None:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "max_len", None) if cfg is not None else None


class _EvalMode:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.was = getattr(self.model, "training", False)
        if hasattr(self.model, "eval"):
            self.model.eval()

    def __exit__(self, *exc):
        if self.was:
            self.model.train()


@torch.no_grad()
def perplexity(model, tokens: np.ndarray | torch.Tensor, block_size: int | None = None,
               stride: int | None = None, batch_size: int = 8, loops: int | None = None,
               progress: bool = True, desc: str = "perplexity") -> PerplexityResult:
    """Perplexity of `model` over all of `tokens` [N] (see the module docstring). Deterministic."""
    T = block_size or model_block_size(model)
    if not T:
        raise UserError("give block_size (the model does not say its context length)")
    toks = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    plan = window_plan(len(toks), T, stride)
    device = _model_device(model)
    kwargs = {} if loops is None else {"loops": loops}
    total = 0.0
    count = 0
    with _EvalMode(model), tqdm(total=len(toks) - 1, desc=desc, unit="tok", disable=not progress) as bar:
        for group in window_groups(plan, batch_size):
            L = group[0][2] - 1 - group[0][0]                                    # inputs per window
            x = torch.stack([toks[b:t - 1] for b, _, t in group]).to(device)    # [B,L]
            y = torch.stack([toks[b + 1:t] for b, _, t in group]).to(device)    # [B,L]
            logits = _logits(model, x, kwargs)                                  # [B,L,V]
            nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                  reduction="none").view(len(group), L)         # [B,L]
            keep = torch.as_tensor(scored_positions(group), device=device)      # [B,L]
            total += float(nll[keep].double().sum())
            n = int(keep.sum())
            count += n
            bar.update(n)
    assert count == len(toks) - 1, (count, len(toks))
    return split_result(total, count, plan, T, stride)


def split_result(total: float, count: int, plan: list[tuple[int, int, int]], block_size: int,
                 stride: int | None) -> PerplexityResult:
    """The perplexity of a split from the summed negative log-likelihood `total` of its `count` targets, scored in
    the windows `plan` (`window_plan(…, block_size, stride)`)."""
    T = int(block_size)
    S = T if stride is None else int(stride)
    mean = total / count
    overlapping = S < T and len(plan) > 1
    method = "sliding" if overlapping else "non-overlapping"
    desc_text = (f"all {count:,} tokens scored once; windows of {T} advancing by {S}"
                 + (f"; every token after the first window sees >= {T - S + 1} tokens" if overlapping else ""))
    return PerplexityResult(method=method, nll=mean, ppl=math.exp(mean), tokens=count, windows=len(plan),
                            block_size=T, stride=S, min_context=(T - S + 1) if len(plan) > 1 else 1,
                            description=desc_text)


def scored_positions(group: list[tuple[int, int, int]]) -> np.ndarray:
    """Which inputs of a group of equal-length windows (b, s, t) predict a scored target [B,L] bool: x[s : t]."""
    L = group[0][2] - 1 - group[0][0]
    keep = np.zeros((len(group), L), dtype=bool)
    for i, (b, s, _t) in enumerate(group):
        keep[i, s - 1 - b:] = True
    return keep


def window_groups(plan: list[tuple[int, int, int]], batch_size: int) -> Iterator[list[tuple[int, int, int]]]:
    """Group consecutive windows of equal input length (all but possibly a lone short first window)."""
    group: list[tuple[int, int, int]] = []
    for w in plan:
        if group and (len(group) == batch_size or (w[2] - 1 - w[0]) != (group[0][2] - 1 - group[0][0])):
            yield group
            group = []
        group.append(w)
    if group:
        yield group


@torch.no_grad()
def estimate_perplexity(model, tokens: np.ndarray, block_size: int | None = None, batch_size: int = 8,
                        iters: int = 200, seed: int = 0, loops: int | None = None,
                        progress: bool = True) -> PerplexityResult:
    """The authors' estimate: exp of the mean loss over `iters` batches of random windows (seeded).

    Not a perplexity of the split: windows overlap, most tokens are never scored, and every window's early
    tokens see little context. Reported for comparison with published numbers only.
    """
    T = block_size or model_block_size(model)
    if not T:
        raise UserError("give block_size (the model does not say its context length)")
    T = min(T, len(tokens) - 1)
    windows = RandomWindows(tokens, T, batch_size, seed=seed)
    device = _model_device(model)
    kwargs = {} if loops is None else {"loops": loops}
    losses = []
    with _EvalMode(model):
        for k in tqdm(range(iters), desc="estimate (random batches)", disable=not progress):
            x, y = windows.batch(k)
            logits = _logits(model, x.to(device), kwargs)
            losses.append(float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                y.to(device).reshape(-1))))
    mean = float(np.mean(losses))
    return PerplexityResult(method="estimate", nll=mean, ppl=math.exp(mean), tokens=iters * batch_size * T,
                            windows=iters * batch_size, block_size=T,
                            description=(f"authors' protocol: mean loss over {iters} random batches of "
                                         f"{batch_size}x{T} windows (seed {seed}); overlapping, not every token "
                                         "scored — an estimate, not the split's perplexity"))
