"""A sequence-to-sequence map whose token and contextual moduli of continuity are dialled separately.

Theorem 3.6 bounds a looped transformer's error by the target's modulus of continuity ω_f and two moduli only the
looped architecture pays, the contextual ω^cont_f and the token ω^tok_f (Definitions 3.3-3.5). This task's target
has one dial for each of the latter two. On reals u ∈ [0, 1]^N (d = 1, N = `width`):

    f(u)_i = tri(α·u_i + β·s_i),    s_i = Σ_{j≠i} u_j / √(N-1),    tri(z) = 1 - |(z mod 2) - 1|

with α = `token_lipschitz` and β = `context_lipschitz`. tri is the triangle wave of period 2 (0 at even z, 1 at
odd z, slope ±1), so f maps into [0, 1], and s_i is a scaled mean of the other tokens whose ℓ2-Lipschitz constant
in (u_j)_{j≠i} is exactly 1. The moduli it implies (p = 2, on the cube [0, 1]^N, for δ small enough that the
pair stays on one slope of tri and inside the cube):

    ω^tok_f(δ)  = min(α·δ, 1)                      only u_i moves, read at i           (Def. 3.5)
    ω^cont_f(δ) = min(β·δ, 1)                      u_i fixed, the others move          (Def. 3.4)
    ω_f(δ)      ≤ min((α + β·√(N-1))·δ, √N)        everything moves (the top singular value of the map's
                                                   Jacobian, α·I + β/√(N-1)·(11ᵀ - I))  (Def. 3.3)

so α moves the token modulus and nothing else, β the contextual modulus and nothing else. α = 0 is a map of the
context alone, β = 0 a position-wise map (ω^cont = 0).

The token task (bidirectional, T = N) quantises both sides. Inputs are `levels` tokens x = 0..Q-1, the reals
u = x / (Q-1) (the grid of Lemma A.5's quantisation); outputs are `bins` tokens, the bin
b_i = min(B-1, ⌊B·f(u)_i + 10⁻⁹⌋) (a value on a bin edge belongs to the upper bin however it was rounded), so the
model classifies every position into one of B bins:

    inputs   x_1 … x_N        (input tokens "x0" … "x{Q-1}")
    targets  b_1 … b_N        (output tokens "y0" … "y{B-1}"), one at every position

Splits are disjoint by a hash of the input row. Metrics: accuracy (the whole row right), token_accuracy,
bin_error (mean |b̂ - b| in bins; a prediction that is not a bin counts as B - 1).

`DialMapTask.function` is f itself on arrays [..., d, N] (numpy, or torch with gradients), the form
`loopformer.theory.moduli` and `loopformer theory modulus` take; `DialMapTask.quantised_function` is the task's
own map seen as a function of reals (inputs rounded to the grid, outputs the bins' centres (b + 1/2)/B).
`target(**options)` builds either from the task's options (`quantised=true` for the second):

    loopformer theory modulus --target "loopformer.tasks.dial_map:target(token_lipschitz=4)" --N 6 --delta 0.1
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loopformer.errors import UserError
from loopformer.tasks.base import TokenTask, Vocab
from loopformer.tasks.common import check_range, dataclass_options, draw_in_split, exact_match, make_rng, token_accuracy

EDGE = 1e-9     # added before the floor of B·f: a value on a bin edge lands in the upper bin whatever its rounding


def triangle(z):
    """tri(z) = 1 - |(z mod 2) - 1|: 0 at even z, 1 at odd z, slope ±1 (numpy or torch)."""
    if isinstance(z, torch.Tensor):
        return 1 - (torch.remainder(z, 2.0) - 1).abs()
    return 1 - np.abs(np.mod(z, 2.0) - 1)


@dataclass
class DialMapTask(TokenTask):
    """Every position's bin of tri(α·u_i + β·Σ_{j≠i} u_j / √(N-1)) over quantised inputs u = x / (Q-1)."""

    width: int = 6                   # N: positions (>= 2: the context of a position is the others)
    levels: int = 16                 # Q: input tokens, the reals 0, 1/(Q-1), …, 1
    bins: int = 8                    # B: output tokens, the bins of [0, 1]
    token_lipschitz: float = 1.0     # α (a dial): ω^tok(δ) = min(αδ, 1)
    context_lipschitz: float = 1.0   # β (a dial): ω^cont(δ) = min(βδ, 1)

    name = "dial_map"
    causal = False

    def __post_init__(self) -> None:
        check_range("width", self.width, 2, 1024)
        check_range("levels", self.levels, 2, 4096)
        check_range("bins", self.bins, 2, 4096)
        check_range("token_lipschitz", self.token_lipschitz, 0, 1e6, integer=False)
        check_range("context_lipschitz", self.context_lipschitz, 0, 1e6, integer=False)
        self.token_lipschitz, self.context_lipschitz = float(self.token_lipschitz), float(self.context_lipschitz)
        self.vocab = Vocab(["<pad>"] + [f"x{i}" for i in range(self.levels)] + [f"y{b}" for b in range(self.bins)])
        self.first_bin = 1 + self.levels                 # token id of bin 0 (input level x is id 1 + x)
        self.seq_len = self.width

    def options(self) -> dict:
        return dataclass_options(self)

    # ---------------------------------------------------------------- the target as a function of reals
    def function(self, X):
        """f on X [..., d, N] (numpy float64, or a torch tensor: differentiable), the same shape out; N is X's last
        axis (>= 2), each of the d rows a sequence of its own."""
        N = X.shape[-1]
        if N < 2:
            raise ValueError(f"the dial map needs N >= 2 positions (got {N})")
        if isinstance(X, torch.Tensor):
            s = (X.sum(-1, keepdim=True) - X) / math.sqrt(N - 1)
        else:
            X = np.asarray(X, dtype=np.float64)
            s = (X.sum(-1, keepdims=True) - X) / math.sqrt(N - 1)
        return triangle(self.token_lipschitz * X + self.context_lipschitz * s)

    def quantised_function(self, X):
        """The token task's own map on reals: X rounded to the Q-level grid (clipped to [0, 1]), f's bins, each bin
        b read as its centre (b + 1/2) / B. Piecewise constant (no gradients: a torch input gets a torch output
        without them)."""
        tensor = isinstance(X, torch.Tensor)
        Z = X.detach().cpu().numpy() if tensor else np.asarray(X, dtype=np.float64)
        x = np.rint(np.clip(Z, 0.0, 1.0) * (self.levels - 1))
        out = (self.bin_of(self.function(x / (self.levels - 1))) + 0.5) / self.bins
        return torch.as_tensor(out) if tensor else out

    def bin_of(self, f: np.ndarray) -> np.ndarray:
        """The output bin (0..B-1) of values f in [0, 1]."""
        return np.minimum(np.floor(np.asarray(f) * self.bins + EDGE), self.bins - 1).astype(np.int64)

    def solve(self, x: np.ndarray) -> np.ndarray:
        """[n, N] the bins of input levels x [n, N] (0..Q-1)."""
        return self.bin_of(self.function(np.asarray(x, dtype=np.float64) / (self.levels - 1)))

    # ---------------------------------------------------------------- the token task
    def _draw(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        x = rng.integers(0, self.levels, size=(n, self.width))
        return {"inputs": (x + 1).astype(np.int32), "targets": (self.solve(x) + self.first_bin).astype(np.int32)}

    def generate(self, n: int, seed: int, split: str = "train") -> dict[str, np.ndarray]:
        return draw_in_split(self._draw, n, make_rng(seed, split), split)

    def metrics(self, pred: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """accuracy: every position's bin right; token_accuracy; bin_error: mean |b̂ - b| in bins."""
        targets = np.asarray(batch["targets"])
        if not len(pred):
            return {"accuracy": float("nan"), "token_accuracy": float("nan"), "bin_error": float("nan")}
        b = targets.astype(np.int64) - self.first_bin
        p = np.asarray(pred, dtype=np.int64) - self.first_bin
        err = np.where((p >= 0) & (p < self.bins), np.abs(p - b), self.bins - 1)
        return {"accuracy": float(exact_match(pred, targets).mean()), "token_accuracy": token_accuracy(pred, targets),
                "bin_error": float(err.mean())}

    def decode_row(self, batch: dict[str, np.ndarray], i: int) -> str:
        x = " ".join(str(int(v) - 1) for v in batch["inputs"][i])
        y = " ".join(str(int(v) - self.first_bin) for v in batch["targets"][i])
        return (f"x {x}  -> bins {y}   (of {self.levels} levels -> {self.bins} bins; α = {self.token_lipschitz:g}, "
                f"β = {self.context_lipschitz:g})")


def target(quantised: bool = False, **options: Any) -> Callable:
    """The dial map of the task `options` as a target of `loopformer.theory` ([..., d, N] → the same shape): f
    itself, or with `quantised` the token task's own map (`DialMapTask.quantised_function`)."""
    known = {f.name for f in dataclasses.fields(DialMapTask) if f.init}
    for key in options:
        if key not in known:
            raise UserError(f"unknown option {key!r} for task dial_map (options: {', '.join(sorted(known))})")
    if not isinstance(quantised, bool):
        raise UserError(f"option quantised must be true or false, got {quantised!r}")
    task = DialMapTask(**options)
    return task.quantised_function if quantised else task.function
