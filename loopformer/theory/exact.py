"""Exact weights and an exact evaluator for the paper's constructions (App. A–B).

A construction is a `LoopedNet`:  L2 ∘ TF^r ∘ L1  (paper Eq. 3 / Theorem 3.6) with

    TF(X)      = X' + η(t) ⊙ FF(X'),   X' = X + Σ_h Attn_h(X)          (η ≡ 1 unless per-loop scaling, Sec. 4.1)
    FF(x)      = W2 σ_R(W1 x + b1) + b2                               (token-wise, ReLU)
    Attn_h(X)  = w_O · Σ_j a_ij (w_V·x_j),  a_i = hardmax_j or softmax_j(λ (w_Q·x_i)(w_K·x_j))   (head size 1)

Weights are `fractions.Fraction`s and the evaluator does rational arithmetic, so a hardmax network is run with
no rounding at all — necessary because the bit complexity of the constructions grows like 2·δ^-(N+1)d bits
(Theorem 3.6), far past float64.  Softmax attention (Eq. 96) needs `exp`; it is evaluated with `mpmath` at a
working precision chosen by the caller (`precision` bits), everything else stays exact.

Shapes: a sequence is a list of N tokens, each a list of D numbers (D = width of the block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import mpmath

Num = Fraction
Vec = tuple  # tuple of Fraction
Mat = tuple  # tuple of rows


def frac(x) -> Fraction:
    """Exact conversion: ints, Fractions, decimal strings and floats (a float's exact binary value)."""
    if isinstance(x, Fraction):
        return x
    if isinstance(x, (int, str)):
        return Fraction(x)
    return Fraction(float(x))


def vec(xs: Sequence) -> Vec:
    return tuple(frac(x) for x in xs)


def mat(rows: Sequence[Sequence]) -> Mat:
    return tuple(vec(r) for r in rows)


def zeros(n: int, m: int | None = None):
    if m is None:
        return [Fraction(0)] * n
    return [[Fraction(0)] * m for _ in range(n)]


def _sparse(m: Mat) -> tuple:
    return tuple(tuple((j, v) for j, v in enumerate(row) if v != 0) for row in m)


def relu(x):
    return x if x > 0 else x * 0


@dataclass(frozen=True)
class Affine:
    """x ↦ W x + b   (W: [out][in])."""
    weight: Mat
    bias: Vec

    def __post_init__(self):
        if len(self.weight) != len(self.bias):
            raise ValueError(f"affine: {len(self.weight)} rows but {len(self.bias)} biases")
        object.__setattr__(self, "_sp", _sparse(self.weight))

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.weight), (len(self.weight[0]) if self.weight else 0)

    def __call__(self, x: Sequence) -> list:
        return [b + sum((v * x[j] for j, v in row), Fraction(0)) for row, b in zip(self._sp, self.bias)]


@dataclass(frozen=True)
class FeedForward:
    """x ↦ W2 σ_R(W1 x + b1) + b2 — width q = rows of W1; input/output width D."""
    w1: Mat
    b1: Vec
    w2: Mat
    b2: Vec

    def __post_init__(self):
        q, D = len(self.w1), len(self.w2)
        din = len(self.w1[0]) if q else 0
        if len(self.b1) != q or len(self.b2) != D or any(len(r) != q for r in self.w2) \
                or any(len(r) != din for r in self.w1):
            raise ValueError(f"feed-forward shapes do not match: W1 {q}x{din}, W2 {D}x?")
        object.__setattr__(self, "_l1", Affine(self.w1, self.b1))
        object.__setattr__(self, "_l2", Affine(self.w2, self.b2))

    @property
    def width(self) -> int:
        return len(self.w1)

    @property
    def dim(self) -> int:
        return len(self.w2)

    @property
    def in_dim(self) -> int:
        return len(self.w1[0]) if self.w1 else 0

    def hidden(self, x: Sequence) -> list:
        return [relu(h) for h in self._l1(x)]

    def __call__(self, x: Sequence) -> list:
        return self._l2(self.hidden(x))


@dataclass(frozen=True)
class Head:
    """One attention head of size 1: query w_Q·x, key w_K·x, value w_V·x, output w_O (a column)."""
    wq: Vec
    wk: Vec
    wv: Vec
    wo: Vec


@dataclass(frozen=True)
class Block:
    """One looped Transformer block: residual attention (hardmax or softmax at temperature λ) then residual FF."""
    ff: FeedForward
    heads: tuple = ()
    attention: str = "hardmax"          # "hardmax" | "softmax"
    temperature: float | None = None  # λ of Eq. 96 (softmax only)

    def __post_init__(self):
        if self.attention not in ("hardmax", "softmax"):
            raise ValueError(f"attention must be 'hardmax' or 'softmax' (got {self.attention!r})")
        if self.attention == "softmax" and (self.temperature is None or self.temperature <= 0):
            raise ValueError("softmax attention needs a temperature λ > 0")
        if self.ff.in_dim != self.ff.dim:
            raise ValueError("a looped block needs a square feed-forward layer (D -> D)")
        for h in self.heads:
            if not (len(h.wq) == len(h.wk) == len(h.wv) == len(h.wo) == self.ff.dim):
                raise ValueError("attention head widths do not match the block width")

    @property
    def dim(self) -> int:
        return self.ff.dim


@dataclass(frozen=True)
class LoopedNet:
    """L2 ∘ TF^loops ∘ L1, token-wise L1/L2; `eta[t-1]` scales the FF output in loop t (Theorem 4.2)."""
    l1: Affine
    block: Block
    l2: Affine
    loops: int
    eta: tuple | None = None
    name: str = ""
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.loops < 0:
            raise ValueError("loops must be >= 0")
        if self.l1.shape[0] != self.block.dim or self.l2.shape[1] != self.block.dim:
            raise ValueError(f"L1/L2 widths {self.l1.shape}/{self.l2.shape} do not match block width "
                             f"{self.block.dim}")
        if self.eta is not None and len(self.eta) < self.loops:
            raise ValueError(f"eta has {len(self.eta)} entries for {self.loops} loops")

    @property
    def width(self) -> int:
        return self.block.dim

    @property
    def ff_width(self) -> int:
        return self.block.ff.width

    @property
    def n_heads(self) -> int:
        return len(self.block.heads)

    def max_weight(self) -> Fraction:
        """Largest |weight| of the block (the M of Theorem 3.6's O(((Mδ)^-1 dN)^{1/p}) term)."""
        b = self.block
        vals = [abs(v) for m in (b.ff.w1, b.ff.w2) for r in m for v in r]
        vals += [abs(v) for v in (*b.ff.b1, *b.ff.b2)]
        vals += [abs(v) for h in b.heads for w in (h.wq, h.wk, h.wv, h.wo) for v in w]
        return max(vals) if vals else Fraction(0)

    def max_bits(self) -> int:
        """Bit complexity: the most bits (numerator + denominator) of any block weight or η entry."""
        b = self.block
        vals = [v for m in (b.ff.w1, b.ff.w2) for r in m for v in r] + [*b.ff.b1, *b.ff.b2]
        vals += [v for h in b.heads for w in (h.wq, h.wk, h.wv, h.wo) for v in w]
        if self.eta is not None:
            vals += [v for e in self.eta for v in e]
        return max((abs(v.numerator).bit_length() + v.denominator.bit_length() for v in vals), default=0)


# ---------------------------------------------------------------------------------------------- evaluation
def _attend(block: Block, X: list, ctx) -> list:
    """Σ_h Attn_h(X) for every token; X: [N][D] -> [N][D]."""
    N, D = len(X), block.dim
    out = [[Fraction(0)] * D for _ in range(N)]
    for h in block.heads:
        q = [sum((a * b for a, b in zip(h.wq, x) if a), Fraction(0)) for x in X]
        k = [sum((a * b for a, b in zip(h.wk, x) if a), Fraction(0)) for x in X]
        v = [sum((a * b for a, b in zip(h.wv, x) if a), Fraction(0)) for x in X]
        for i in range(N):
            s = [q[i] * kj for kj in k]
            if block.attention == "hardmax":
                m = max(s)
                arg = [j for j in range(N) if s[j] == m]
                val = sum((v[j] for j in arg), Fraction(0)) / len(arg)   # ties share the weight equally
            else:
                lam = _mpf(ctx, block.temperature)
                m = max(s)
                w = [ctx.exp(lam * _mpf(ctx, sj - m)) for sj in s]      # exp of a non-positive number
                z = ctx.fsum(w)
                val = ctx.fsum(wj * _mpf(ctx, vj) for wj, vj in zip(w, v)) / z
            val = _to_exact(val, ctx)
            for r, o in enumerate(h.wo):
                if o:
                    out[i][r] += o * val
    return out


def _mpf(ctx, x):
    x = frac(x)
    return ctx.mpf(x.numerator) / ctx.mpf(x.denominator)


def _to_exact(x, ctx):
    """Softmax states are mpf; bring them back to an exact rational of the current precision."""
    if ctx is None or isinstance(x, Fraction):
        return x
    m, e = ctx.mpf(x).man_exp
    return Fraction(int(m)) * (Fraction(2) ** int(e))


def run_block(block: Block, X: list, t: int = 1, eta: Sequence | None = None, ctx=None) -> list:
    """One application TF(X, t) (loop index t counts from 1). X: [N][D] exact numbers."""
    A = _attend(block, X, ctx) if block.heads else None
    Xp = X if A is None else [[xi + ai for xi, ai in zip(x, a)] for x, a in zip(X, A)]
    out = []
    for x in Xp:
        f = block.ff(x)
        if eta is not None:
            f = [e * fi for e, fi in zip(eta, f)]
        out.append([xi + fi for xi, fi in zip(x, f)])
    return out


def evaluate(net: LoopedNet, X: Sequence[Sequence], loops: int | None = None, precision: int = 256,
             trace: Callable[[int, list], None] | None = None) -> list:
    """Exactly compute L2 ∘ TF^loops ∘ L1 on one sequence X ([N][d_in]); returns [N][d_out] Fractions.

    Softmax blocks are evaluated with `precision` bits of working precision (mpmath); a hardmax network is exact.
    `trace(t, state)` is called after every loop with the full [N][D] state (for inspection/tests).
    """
    r = net.loops if loops is None else loops
    H = [net.l1([frac(v) for v in x]) for x in X]
    ctx = None
    if net.block.attention == "softmax":
        ctx = mpmath.MPContext()
        ctx.prec = precision
    for t in range(1, r + 1):
        eta = None if net.eta is None else net.eta[t - 1]
        H = run_block(net.block, H, t, eta, ctx)
        if trace is not None:
            trace(t, H)
    return [net.l2(h) for h in H]


def block_diag_ff(parts: Sequence[FeedForward]) -> FeedForward:
    """Side-by-side feed-forward layers acting on consecutive coordinate slices (paper: "d times more")."""
    D = sum(p.dim for p in parts)
    q = sum(p.width for p in parts)
    w1, w2 = zeros(q, D), zeros(D, q)
    b1, b2 = [], []
    r0 = c0 = 0
    for p in parts:
        for i, row in enumerate(p.w1):
            for j, v in enumerate(row):
                w1[r0 + i][c0 + j] = v
        for i, row in enumerate(p.w2):
            for j, v in enumerate(row):
                w2[c0 + i][r0 + j] = v
        b1 += list(p.b1)
        b2 += list(p.b2)
        r0 += p.width
        c0 += p.dim
    return FeedForward(mat(w1), vec(b1), mat(w2), vec(b2))


def block_diag_affine(parts: Sequence[Affine], shared_input: bool = False) -> Affine:
    """Stack affines. shared_input: all read the same input (outputs concatenated); else block-diagonal."""
    out = sum(p.shape[0] for p in parts)
    inp = parts[0].shape[1] if shared_input else sum(p.shape[1] for p in parts)
    W = zeros(out, inp)
    b = []
    r0 = c0 = 0
    for p in parts:
        for i, row in enumerate(p.weight):
            for j, v in enumerate(row):
                W[r0 + i][(0 if shared_input else c0) + j] = v
        b += list(p.bias)
        r0 += p.shape[0]
        c0 += p.shape[1]
    return Affine(mat(W), vec(b))
