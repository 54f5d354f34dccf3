"""The paper's building blocks as exact weights (App. A.3–A.6, App. B): pure functions returning `LoopedNet`s.

    Prop. A.2–A.4   rect, step, impulse from 4/2/4 ReLUs                      Eq. 114–119
    Lemma A.5       quantisation feed-forward layer, width 7d, δ^-1 − 1 loops   Eq. 120–174
    Lemma A.6       hardmax contextual mapping u^T z in N loops (1 head, s=1)   Eq. 175–209
    Cor.  A.7       extended sequence ID 2u^T z − Z_{d,N} (2 heads, width 5)    Eq. 245–282
    Lemma A.9       bit extraction Σ_{l≤k} θ_l with one FF layer of width 9     Eq. 289–361
    Lemma 4.1       label memorisation within the largest neighbour difference  Eq. 18, 362–375
    Theorem 4.2     exact memorisation with per-loop scaling η(t)               Eq. 376–421

Every function takes `printed: bool`.  `printed=True` builds the weights exactly as the paper prints them;
`printed=False` (default) applies the minimal repair documented next to the code ("Repair (Eq. n)") where the
printed construction does not compute what its statement says.  Preconditions of the statements raise
`ValueError`.  Integers like δ^-1 are passed as `delta_inv`; all weights are exact `Fraction`s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from loopformer.theory.exact import (
    Affine,
    Block,
    FeedForward,
    Head,
    LoopedNet,
    block_diag_affine,
    block_diag_ff,
    frac,
    mat,
    vec,
)

F = Fraction
HALF = F(1, 2)   # the default ε of the contextual mapping (a module constant: defaults are evaluated once)


def _e(D: int, i: int, v=1) -> tuple:
    """Unit row of width D with v at position i (0-based)."""
    r = [F(0)] * D
    r[i] = frac(v)
    return tuple(r)


def _check_delta_inv(delta_inv: int) -> None:
    if not isinstance(delta_inv, int) or delta_inv < 2:
        raise ValueError(f"δ^-1 must be an integer >= 2 (got {delta_inv!r})")


# ------------------------------------------------------------------------------------------ Prop. A.2–A.4
def rect_ff(t1, t2, eps) -> FeedForward:
    """Proposition A.2 (Eq. 114–115): rect_{(t1,t2,ε)}(x) = 1 on [t1, t2−ε], 0 on (−∞, t1−ε] ∪ [t2, ∞), with

        σ((x−t1+ε)/ε) − σ((x−t1)/ε) + σ((−x+t2)/ε) − σ((−x+t2−ε)/ε) − 1,      0 < ε < t2 − t1.

    Max weight 1/ε; trifling regions (t1−ε, t1) ∪ (t2−ε, t2) (the printed note's "(t+1−ε, t−1)" is garbled).
    A `FeedForward` R → R of width 4 (no residual)."""
    t1, t2, eps = frac(t1), frac(t2), frac(eps)
    if not 0 < eps < t2 - t1:
        raise ValueError(f"rect needs 0 < ε < t2 − t1 (got ε={eps}, t1={t1}, t2={t2})")
    w1 = mat([[1 / eps], [1 / eps], [-1 / eps], [-1 / eps]])
    b1 = vec([(-t1 + eps) / eps, -t1 / eps, t2 / eps, (t2 - eps) / eps])
    return FeedForward(w1, b1, mat([[1, -1, 1, -1]]), vec([-1]))


def step_ff(eps) -> FeedForward:
    """Proposition A.3 (Eq. 116–117): step_ε(x) = σ(x/ε + 1) − σ(x/ε) — 1 for x ≥ 0, 0 for x ≤ −ε (two ReLUs;
    the statement's "four" over-counts)."""
    eps = frac(eps)
    if eps <= 0:
        raise ValueError(f"step needs ε > 0 (got {eps})")
    return FeedForward(mat([[1 / eps], [1 / eps]]), vec([1, 0]), mat([[1, -1]]), vec([0]))


def impulse_ff(theta: int, M) -> FeedForward:
    """Proposition A.4 (Eq. 118–119): impulse_θ(x, t) = x if t = θ else 0, for |x| ≤ M and integer t:

        σ(x + 2M(t−θ+½)) − 2M σ(t−θ+½) − σ(x + 2M(t−θ−½)) + 2M σ(t−θ−½).

    A `FeedForward` R² → R (input (x, t)) of width 4."""
    M = frac(M)
    if M <= 0:
        raise ValueError(f"impulse needs M > 0 (got {M})")
    th = F(theta)
    w1 = mat([[1, 2 * M], [0, 1], [1, 2 * M], [0, 1]])
    b1 = vec([2 * M * (-th + F(1, 2)), -th + F(1, 2), 2 * M * (-th - F(1, 2)), -th - F(1, 2)])
    return FeedForward(w1, b1, mat([[1, -2 * M, -1, 2 * M]]), vec([0]))


def rect(x, t1, t2, eps) -> Fraction:
    return rect_ff(t1, t2, eps)([frac(x)])[0]


def step(x, eps) -> Fraction:
    return step_ff(eps)([frac(x)])[0]


def impulse(x, t, theta: int, M) -> Fraction:
    return impulse_ff(theta, M)([frac(x), frac(t)])[0]


# ------------------------------------------------------------------------------------------------ Lemma A.5
def quantize_target(x, delta_inv: int) -> int:
    """g(x) = k for x ∈ [kδ, (k+1)δ) (Eq. 120 without the trifling gap); x = 1 belongs to the top cell."""
    k = math.floor(frac(x) * delta_inv)
    return min(max(k, 0), delta_inv - 1)


def trifling_regions(delta_inv: int, eps) -> list[tuple[Fraction, Fraction]]:
    """Eq. 92: the open intervals (kδ − ε, kδ), k = 1..δ^-1, where bounded weights cannot quantise exactly."""
    eps = frac(eps)
    return [(F(k, delta_inv) - eps, F(k, delta_inv)) for k in range(1, delta_inv + 1)]


def quantization(delta_inv: int, eps, d: int = 1, printed: bool = False) -> LoopedNet:
    """Lemma A.5: FF: R^{5d} → R^{5d} of width 7d, max weight 1/ε, affine L1: R^d → R^{5d}, L2: R^{5d} → R^d with

        (L2 ∘ (id + FF)^{δ^-1 − 1} ∘ L1(x))_i = k   if x_i ∈ [kδ, (k+1)δ − ε],  k = 0..δ^-1 − 1      (Eq. 122)

    Per coordinate the state is ξ_k = (kx, k², k, x, Σ_{i<k} h_i(x)) (Eq. 127) and one loop adds
    (x, 2k+1, 1, 0, h_k(x)) with h_k = k·rect_{(kδ,(k+1)δ,ε)} written as ReLUs of (kx, k², k) (Eq. 126).

    Repair (Eq. 123/126 and the FF matrix, rows 5–6): the printed right edge is −x + kδ + 1, i.e. the third
    input coefficient of hidden rows 5/6 is 1/ε and (1−ε)/ε; the rectangle must close at (k+1)δ, so the
    coefficients are δ/ε and (δ−ε)/ε.  As printed, Σ_i h_i(x) = β(β+1)/2 (wrong for β ≥ 2).
    Repair (Eq. 171–173): L1(x) = (0,0,0,x,0) = ξ_0 needs δ^-1 loops to reach ξ_{δ^-1}, not δ^-1 − 1 (the top
    cell reads 0).  Since h_0 ≡ 0, starting at ξ_1 = (x, 1, 1, x, 0) — still affine in x — makes the stated
    δ^-1 − 1 loops exact.
    """
    _check_delta_inv(delta_inv)
    if not isinstance(d, int) or d < 1:
        raise ValueError(f"d must be a positive integer (got {d!r})")
    eps = frac(eps)
    delta = F(1, delta_inv)
    if not 0 < eps < delta:
        raise ValueError(f"Lemma A.5 needs 0 < ε < δ = {delta} (got ε = {eps})")
    c5, c6 = (1 / eps, (1 - eps) / eps) if printed else (delta / eps, (delta - eps) / eps)
    w1 = mat([[0, 0, 0, 1, 0],
              [0, 0, 2, 0, 0],
              [1 / eps, -delta / eps, 1, 0, 0],
              [1 / eps, -delta / eps, 0, 0, 0],
              [-1 / eps, delta / eps, c5, 0, 0],
              [-1 / eps, delta / eps, c6, 0, 0],
              [0, 0, 1, 0, 0]])
    w2 = mat([[1, 0, 0, 0, 0, 0, 0],
              [0, 1, 0, 0, 0, 0, 0],
              [0, 0, 0, 0, 0, 0, 0],
              [0, 0, 0, 0, 0, 0, 0],
              [0, 0, 1, -1, 1, -1, -1]])
    one = FeedForward(w1, vec([0] * 7), w2, vec([0, 1, 1, 0, 0]))
    l1_one = Affine(mat([[0], [0], [0], [1], [0]]), vec([0] * 5)) if printed else \
        Affine(mat([[1], [0], [0], [1], [0]]), vec([0, 1, 1, 0, 0]))
    l2_one = Affine(mat([[0, 0, 0, 0, 1]]), vec([0]))
    ff = block_diag_ff([one] * d)
    l1 = block_diag_affine([l1_one] * d)
    l2 = block_diag_affine([l2_one] * d)
    return LoopedNet(l1, Block(ff), l2, loops=delta_inv - 1, name="Lemma A.5",
                     meta=dict(delta_inv=delta_inv, eps=eps, d=d, printed=printed))


# ------------------------------------------------------------------------------------------ Lemma A.6 / A.7
def sequence_id(z: Sequence[int], base: int) -> int:
    """s(z) = u^T z with z sorted decreasingly, u = (base^{N−1}, …, base, 1) (Eq. 35/175)."""
    zs = sorted(z, reverse=True)
    s = 0
    for v in zs:
        s = s * base + v
    return s


def contextual_mapping(base: int, N: int, eps=HALF, M=None, attention: str = "hardmax",
                       temperature=None, printed: bool = False) -> LoopedNet:
    """Lemma A.6: a Transformer block TF: R^{5×N} → R^{5×N} (one head of size 1, FF width 3) and affine
    L1: R → R^5, L2: R^5 → R with  L2 ∘ TF^N ∘ L1(z^T) = (u^T z)·1_N^T  for every z ∈ 𝕃_δ (distinct token IDs in
    {0..base−1}, base = δ^-d), u = (base^{N−1}, …, 1) (Eq. 175–179).

    Loop k selects the largest remaining ID with the head (query 1, key z^(k), value z; Eq. 186–187), adds it
    to s^(k+1) = base·s^(k) + z_{k+1} (Eq. 185), and marks it by z_i − Mσ(z_i − z_{k+1} + ε) < 0 (Eq. 208–209).
    Preconditions: 0 < ε < 1, M > (base−1)/ε.  Default M: the smallest integer above (base−1)/ε as printed.

    `attention="softmax"` with `temperature=λ` is the softmax version of App. A.2 (Eq. 96).
    Repair (Eq. 107): the softmax error bound assumes every non-selected score is at least 1 below the
    selected one, but a marked token keeps the score z_j − Mε, which is only > −1 when M ≤ base/ε.  With
    `printed=False` the default M is 2·base/ε, so marked scores are ≤ −base and Eq. 107's gap of 1 holds.  With
    the printed default (gap ½) the softmax overshoots the ID in the last loop, so k − k̃ < 0 and the criterion
    0 < k − k̃ < 1 of Eq. 94 / 111 fails at every λ (see `verify.rows_softmax`).
    The hardmax construction works as printed.
    """
    if base < 2 or N < 1:
        raise ValueError(f"need base = δ^-d >= 2 and N >= 1 (got base={base}, N={N})")
    if N > base:
        raise ValueError(f"N={N} distinct token IDs need base >= N (got {base})")
    eps = frac(eps)
    if not 0 < eps < 1:
        raise ValueError(f"Lemma A.6 needs 0 < ε < 1 (got {eps})")
    if M is None:
        M = F(math.floor((base - 1) / eps) + 1) if printed else 2 * base / eps
    M = frac(M)
    if not M > (base - 1) / eps:
        raise ValueError(f"Lemma A.6 needs M > (δ^-d − 1)/ε = {(base - 1) / eps} (got M = {M})")
    D = 5
    head = Head(_e(D, 2), _e(D, 1), _e(D, 0), _e(D, 3))
    w1 = mat([[0, 1, 0, -1, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]])
    w2 = mat([[0, 0, 0], [-M, 0, 0], [0, 0, 0], [0, -1, 0], [0, 1, base - 1]])
    ff = FeedForward(w1, vec([eps, 0, 0]), w2, vec([0] * 5))
    block = Block(ff, (head,), attention, temperature)
    l1 = Affine(mat([[1], [1], [0], [0], [0]]), vec([0, 0, 1, 0, 0]))
    l2 = Affine(mat([[0, 0, 0, 0, 1]]), vec([0]))
    return LoopedNet(l1, block, l2, loops=N, name="Lemma A.6",
                     meta=dict(base=base, N=N, eps=eps, M=M, printed=printed))


def extended_sequence_id(z: Sequence[int], delta_inv: int, d: int) -> int:
    """2 s(z) − Z_{d,N} (Eq. 39/45): Z_{d,N} is the last base-δ^-1 digit of the smallest token ID."""
    return 2 * sequence_id(z, delta_inv ** d) - (min(z) % delta_inv)


def contextual_mapping_ext(delta_inv: int, d: int, N: int, eps=HALF, M=None, attention: str = "hardmax",
                           temperature=None, printed: bool = False) -> LoopedNet:
    """Corollary A.7: TF^(2): R^{8×N} → R^{8×N} (two heads of size 1, FF width 5) and L1: R² → R^8, L2: R^8 → R
    with  L2 ∘ (TF^(2))^N ∘ L1([z^T; Z_{d,:}]) = (2u^T z − Z_{d,N})·1_N^T  for z ∈ 𝕃_δ (Eq. 45, 245–282).
    The per-token input is (z_n, Z_{d,n}) with Z_{d,n} = z_n mod δ^-1 (the token's last quantised coordinate).

    Repairs (head 2 and the FF, Eq. 247 and the 8×5 output matrix; Eq. 282):
      * Eq. 247: head 2 has key = value = Z_{d,:}, so hardmax returns max_n Z_{d,n}, not the digit of the
        smallest token Z_{d,N}.  Key −z (row 1) selects the smallest token: W_K^2 = −e_1.
      * output matrix row 5 subtracts σ(x7) every loop, so s is scaled-and-shifted N times; the evaluated
        vector printed right below it has no such term — drop it (row 5 = (0, 1, δ^-d − 1, 0, 0)).
      * Eq. 282: L2 = 2x5 − x6 reads the token's own digit Z_{d,n}; the sequence-level Z_{d,N} is held in x8:
        L2 = 2x5 − x8.
    """
    _check_delta_inv(delta_inv)
    base = delta_inv ** d
    inner = contextual_mapping(base, N, eps, M, attention, temperature, printed)
    eps, M = inner.meta["eps"], inner.meta["M"]
    D = 8
    h1 = Head(_e(D, 2), _e(D, 1), _e(D, 0), _e(D, 3))
    h2 = Head(_e(D, 2), _e(D, 5) if printed else _e(D, 0, -1), _e(D, 5), _e(D, 6))
    w1 = mat([[0, 1, 0, -1, 0, 0, 0, 0],
              [0, 0, 0, 1, 0, 0, 0, 0],
              [0, 0, 0, 0, 1, 0, 0, 0],
              [0, 0, 0, 0, 0, 0, 1, 0],
              [0, 0, 0, 0, 0, 0, 0, 1]])
    w2 = mat([[0, 0, 0, 0, 0],
              [-M, 0, 0, 0, 0],
              [0, 0, 0, 0, 0],
              [0, -1, 0, 0, 0],
              [0, 1, base - 1, -1 if printed else 0, 0],
              [0, 0, 0, 0, 0],
              [0, 0, 0, -1, 0],
              [0, 0, 0, 1, -1]])
    ff = FeedForward(w1, vec([eps, 0, 0, 0, 0]), w2, vec([0] * 8))
    block = Block(ff, (h1, h2), attention, temperature)
    l1 = Affine(mat([[1, 0], [1, 0], [0, 0], [0, 0], [0, 0], [0, 1], [0, 0], [0, 0]]), vec([0, 0, 1, 0, 0, 0, 0, 0]))
    l2 = Affine(mat([[0, 0, 0, 0, 2, -1, 0, 0]] if printed else [[0, 0, 0, 0, 2, 0, 0, -1]]), vec([0]))
    return LoopedNet(l1, block, l2, loops=N, name="Cor. A.7",
                     meta=dict(delta_inv=delta_inv, d=d, base=base, N=N, eps=eps, M=M, printed=printed))


def softmax_temperature_bound(base: int, N: int) -> float:
    """Eq. 111: λ > log((δ^-d N)·(N δ^-(N−1)d)) = log(N² δ^-Nd) keeps the contextual ID error below 1."""
    return math.log(N * N * float(base) ** N)


# ------------------------------------------------------------------------------------------------ Lemma A.9
def binary_tail(thetas: Sequence[int], l: int) -> Fraction:
    """β_l = bin 0.θ_l θ_{l+1} … θ_r = Σ_{i≥l} θ_i 2^{−(i−l+1)} (Eq. 292; the printed 2^{−i} drops the shift);
    β_0 := 0 and β_{r+1} = 0."""
    if l == 0:
        return F(0)
    return sum((F(t, 2 ** (i - l + 1)) for i, t in enumerate(thetas[l - 1:], start=l)), F(0))


def bit_extraction(thetas: Sequence[int], eps=None, printed: bool = False) -> LoopedNet:
    """Lemma A.9: for θ_1..θ_r ∈ {0,1} a FF: R^6 → R^6 of width 9 and L1: R → R^6, L2: R^6 → R with

        L2 ∘ (id + FF)^r ∘ L1(k) = Σ_{l=1}^{k} θ_l,   k = 1..r   (and 0 for k = 0, as Lemma 4.1 uses)   (Eq. 289)

    State after loop l (Eq. 303, with what the coordinates actually hold):
    ξ_l = (k−l, c_l, β_{l+1}, θ_l, step_ε(k−l), sum(l)), from ξ_0 = (k, 0, β_1, 0, 0, 0).  The loop unrolls
    θ_l = step_ε(β_l − ½), β_{l+1} = 2β_l − θ_l in coordinate 3 (Eq. 293–296) and adds
    σ(θ_l + step_ε(k−l) − 1) = θ_l·[k ≥ l] (Eq. 297–302).  Coordinate 2 is printed as β_l, updated by
    x2 + σ(x2) − σ(x4) = 2x2 − θ for x2 ≥ 0; but it starts at β_0 := 0, and σ(x2) = 0 once x2 ≤ 0, so it runs
    c_0 = c_1 = 0, c_l = −(θ_1 + … + θ_{l−1}) — not β_l.  Nothing else reads coordinate 2, so the output is
    unaffected.  Needs ε ≤ 2^{−r} (the paper: ε < 2^{−r}); bit complexity O(r).

    Repair (the 6×9 output matrix, rows 4–5): the matrix disagrees with the vector it is said to produce
    (printed right below it): row 4 also subtracts σ(step_ε(k−l)) and row 5 has the signs of the two
    step_ε(k−l−1) units flipped, so the stored step_ε(k−l) turns negative after one loop and no θ is ever
    added: as printed the output is 0 for every k and every bit list.  Rows 4–5 follow the evaluated vector:
    (0,−1,0,1,−1,0,0,0,0) and (0,0,0,0,0,−1,1,−1,0).
    Repair (Eq. 361): loop l adds θ_l·[k ≥ l] with the factors precomputed in loop l−1, so r loops from
    ξ_0 = (k, β_0, β_1, 0, 0, 0) add θ_1..θ_{r−1} only; θ_r·[k ≥ r] is left in (x4, x5) = (θ_r, step(k−r))
    after the last loop.  Since θ_r is a constant of the construction, L2(x) = x6 + θ_r·x5 (still affine)
    completes the sum; as printed (L2 = x6) the value at k = r misses θ_r.
    """
    thetas = [int(t) for t in thetas]
    r = len(thetas)
    if r < 1 or any(t not in (0, 1) for t in thetas):
        raise ValueError("Lemma A.9 needs r >= 1 bits θ_l ∈ {0, 1}")
    eps = F(1, 2 ** (r + 1)) if eps is None else frac(eps)
    if not 0 < eps <= F(1, 2 ** r):
        raise ValueError(f"Lemma A.9 needs 0 < ε <= 2^-r = 2^-{r} (got {eps})")
    ie = 1 / eps
    w1 = mat([[0, 1, 0, 0, 0, 0],
              [0, 0, 0, 1, 0, 0],
              [0, 0, 1, 0, 0, 0],
              [0, 0, ie, 0, 0, 0],
              [0, 0, ie, 0, 0, 0],
              [0, 0, 0, 0, 1, 0],
              [ie, 0, 0, 0, 0, 0],
              [ie, 0, 0, 0, 0, 0],
              [0, 0, 0, 1, 1, 0]])
    b1 = vec([0, 0, 0, -ie / 2 + 1, -ie / 2, 0, -ie + 1, -ie, -1])
    if printed:
        row4, row5 = [0, -1, 0, 1, -1, -1, 0, 0, 0], [0, 0, 0, 0, 0, -1, -1, 1, 0]
    else:
        row4, row5 = [0, -1, 0, 1, -1, 0, 0, 0, 0], [0, 0, 0, 0, 0, -1, 1, -1, 0]
    w2 = mat([[0, 0, 0, 0, 0, 0, 0, 0, 0],
              [1, -1, 0, 0, 0, 0, 0, 0, 0],
              [0, 0, 1, -1, 1, 0, 0, 0, 0],
              row4,
              row5,
              [0, 0, 0, 0, 0, 0, 0, 0, 1]])
    ff = FeedForward(w1, b1, w2, vec([-1, 0, 0, 0, 0, 0]))
    l1 = Affine(mat([[1], [0], [0], [0], [0], [0]]), vec([0, binary_tail(thetas, 0), binary_tail(thetas, 1), 0, 0, 0]))
    l2 = Affine(mat([[0, 0, 0, 0, 0, 1]] if printed else [[0, 0, 0, 0, thetas[-1], 1]]), vec([0]))
    return LoopedNet(l1, Block(ff), l2, loops=r, name="Lemma A.9",
                     meta=dict(thetas=tuple(thetas), eps=eps, printed=printed))


# ------------------------------------------------------------------------------------------------ Lemma 4.1
def _labels(y) -> list[list[Fraction]]:
    rows = [[frac(v) for v in (row if isinstance(row, (list, tuple)) else [row])] for row in y]
    if len(rows) < 2:
        raise ValueError("need at least K = 2 labels")
    if len({len(r) for r in rows}) != 1:
        raise ValueError("all labels must have the same dimension d")
    return rows


def neighbour_differences(y) -> list[Fraction]:
    """ε_i = max_k |(y_k − y_{k−1})_i| (the bound of Eq. 18)."""
    rows = _labels(y)
    return [max(abs(rows[k][i] - rows[k - 1][i]) for k in range(1, len(rows))) for i in range(len(rows[0]))]


def memorization(y, eps: Sequence | None = None, printed: bool = False) -> LoopedNet:
    """Lemma 4.1: for y_0..y_{K−1} ∈ R^d with |(y_k − y_{k−1})_i| ≤ ε_i, a FF: R^{12d} → R^{12d} of width 18d and
    L1: R → R^{12d}, L2: R^{12d} → R^d with

        |(L2 ∘ (id + FF)^{K−1} ∘ L1(k) − y_k)_i| ≤ ε_i,   k = 0..K−1                                   (Eq. 18)

    a_k = ⌊y_k/ε⌋, b_k = a_k − a_{k−1} = c_k − d_k ∈ {−1,0,1} (Eq. 362–365); two Lemma A.9 layers count
    Σ c and Σ d; L2 = ε(a_0 + Σ_{i≤k} c_i − Σ_{i≤k} d_i) = ε a_k (Eq. 368–374), so the error is y_k − ε⌊y_k/ε⌋ ∈
    [0, ε).  Inherits the Lemma A.9 repair (Eq. 361) through `printed`.  A coordinate with ε_i = 0 (constant
    labels) is read out by the bias.
    """
    rows = _labels(y)
    K, d = len(rows), len(rows[0])
    nd = neighbour_differences(rows)
    eps = nd if eps is None else [frac(e) for e in eps]
    if len(eps) != d:
        raise ValueError(f"eps has {len(eps)} entries for d = {d}")
    for i in range(d):
        if eps[i] < nd[i]:
            raise ValueError(f"coordinate {i}: ε_i = {eps[i]} is below the largest neighbour difference {nd[i]}")
    step_eps = F(1, 2 ** K)
    ffs, l1s, l2rows, l2bias = [], [], [], []
    for i in range(d):
        e = eps[i]
        if e == 0:
            a = [0] * K
            scale, offset = F(1), rows[0][i]
        else:
            a = [math.floor(rows[k][i] / e) for k in range(K)]
            scale, offset = e, F(0)
        c = [1 if a[k] - a[k - 1] == 1 else 0 for k in range(1, K)]
        dd = [1 if a[k] - a[k - 1] == -1 else 0 for k in range(1, K)]
        nc, ndd = bit_extraction(c, step_eps, printed), bit_extraction(dd, step_eps, printed)
        ffs += [nc.block.ff, ndd.block.ff]
        l1s += [nc.l1, ndd.l1]
        row = [F(0)] * (12 * d)
        for j, v in enumerate(nc.l2.weight[0]):
            row[12 * i + j] += scale * v
        for j, v in enumerate(ndd.l2.weight[0]):
            row[12 * i + 6 + j] -= scale * v
        l2rows.append(row)
        l2bias.append(scale * a[0] + offset)
    ff = block_diag_ff(ffs)
    l1 = block_diag_affine(l1s, shared_input=True)
    l2 = Affine(mat(l2rows), vec(l2bias))
    return LoopedNet(l1, Block(ff), l2, loops=K - 1, name="Lemma 4.1",
                     meta=dict(K=K, d=d, eps=tuple(eps), printed=printed))


# ---------------------------------------------------------------------------------------------- Theorem 4.2
def _shift_for(ys: Sequence[Fraction], rule="nonzero") -> Fraction:
    """Eq. 377: the shift ε added to every label.  rule "nonzero": the smallest shift in {0, 1, 1/2, 1/3, …}
    that makes y_0..y_{K−2} non-zero (what the proof needs with the repaired bias and M); "positive": 0 if every
    label is already > 0, else 1 − min_k y_k (every shifted label ≥ 1); or an explicit number."""
    if rule == "positive":
        lo = min(ys)
        return F(0) if lo > 0 else 1 - lo
    if rule != "nonzero":
        return frac(rule)
    cands = [F(0)] + [F(1, n) for n in range(1, 4 * len(ys) + 4)]
    for c in cands:
        if all(v + c != 0 for v in ys[:-1]):
            return c
    raise AssertionError("unreachable: finitely many labels")


THEOREM_42_REPAIRS = ("bias", "M", "start")


def exact_memorization(y, printed: bool = False, repairs: Sequence[str] | None = None,
                       shift="nonzero") -> LoopedNet:
    """Theorem 4.2: for y_0..y_{K−1} ∈ R^d a FF: R^{4d} → R^{4d} of width 6d, per-loop scalings η(t) ∈ R^{4d}
    (t = 1..K−1) and L1: R → R^{4d}, L2: R^{4d} → R^d with

        L2 ∘ (id + η ⊙ FF)^{K−1} ∘ L1(k) = y_k   exactly, k = 0..K−1                                   (App. B)

    Labels are shifted by ε (Eq. 377; `shift`, see `_shift_for`) so none of y_0..y_{K−2} is zero; the state is
    ξ_l = (k, k−l−1, y_l, s(l)) (Eq. 383); loop l turns y_{l−1} into y_l by η_3(l) = y_l/y_{l−1} − 1 and adds
    η_4(l)·impulse_0(y_{l−1}, k−l) (Prop. A.4), so only loop l = k contributes.

    Three changes to the printed proof, each selectable through `repairs` (default: all three; `printed=True`
    means none):
      * "bias" — hidden bias of unit 2 (printed −1): σ(y) − σ(−y−1) ≠ y for every y < 0, so labels below zero
        are not carried from loop to loop.  Bias 0 gives σ(y) − σ(−y) = y.
      * "M" — impulse bound (printed M > max_k y_k): Prop. A.4 needs |x| ≤ M, so M > max_k |y_k|.
      * "start" — Eq. 421 / Eq. 378: L1(k) = (k, k, y_0, 0) does not equal ξ_0 = (k, k−1, y_0, impulse_0(y_0, k))
        — the counter is one loop late (as printed the net returns y_{k+1}) and [k = 0]·y_0 is not affine in k.
        Start at (k, k−1, y_0, y_0) and add (y_l − y_0)·[k = l] instead: η_4(l) of Eq. 378 changes from
        y_l/y_{l−1} to (y_l − y_0)/y_{l−1}, and the sum telescopes to y_k for every k with the stated K − 1 loops.
    Only "start" is necessary.  Eq. 377 leaves ε free; with `shift="positive"` every shifted label is > 0, and
    then the printed bias (σ(−y−1) = 0) and the printed M (max y = max |y|) are correct: the "bias" and "M"
    changes only widen the allowed ε to any shift that keeps y_0..y_{K−2} non-zero.
    """
    if repairs is None:
        repairs = () if printed else THEOREM_42_REPAIRS
    repairs = tuple(repairs)
    unknown = set(repairs) - set(THEOREM_42_REPAIRS)
    if unknown:
        raise ValueError(f"unknown Theorem 4.2 repairs {sorted(unknown)} (choose from {THEOREM_42_REPAIRS})")
    fix_bias, fix_M, fix_start = ("bias" in repairs), ("M" in repairs), ("start" in repairs)
    rows = _labels(y)
    K, d = len(rows), len(rows[0])
    ffs, l1s, etas, l2rows, l2bias, shifts = [], [], [[] for _ in range(K - 1)], [], [], []
    for i in range(d):
        ys = [rows[k][i] for k in range(K)]
        sh = _shift_for(ys, shift)
        ys = [v + sh for v in ys]
        if any(v == 0 for v in ys[:-1]):
            raise ValueError(f"Theorem 4.2 needs shifted labels y_0..y_(K-2) != 0 (shift {sh} leaves a zero)")
        shifts.append(sh)
        M = (max(abs(v) for v in ys) if fix_M else max(ys)) + 1
        M = max(M, F(1))
        w1 = mat([[0, 0, 1, 0], [0, 0, -1, 0], [0, 2 * M, 1, 0], [0, 2 * M, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0]])
        b1 = vec([0, 0 if fix_bias else -1, M, -M, F(1, 2), -F(1, 2)])
        w2 = mat([[0] * 6, [0] * 6, [1, -1, 0, 0, 0, 0], [0, 0, 1, -1, -2 * M, 2 * M]])
        ffs.append(FeedForward(w1, b1, w2, vec([0, -1, 0, 0])))
        if fix_start:
            l1s.append(Affine(mat([[1], [1], [0], [0]]), vec([0, -1, ys[0], ys[0]])))
        else:
            l1s.append(Affine(mat([[1], [1], [0], [0]]), vec([0, 0, ys[0], 0])))
        for l in range(1, K):
            ratio = ys[l] / ys[l - 1]
            e4 = (ys[l] - ys[0]) / ys[l - 1] if fix_start else ratio
            etas[l - 1] += [F(0), F(1), ratio - 1, e4]
        row = [F(0)] * (4 * d)
        row[4 * i + 3] = F(1)
        l2rows.append(row)
        l2bias.append(-sh)
    ff = block_diag_ff(ffs)
    l1 = block_diag_affine(l1s, shared_input=True)
    l2 = Affine(mat(l2rows), vec(l2bias))
    return LoopedNet(l1, Block(ff), l2, loops=K - 1, eta=tuple(tuple(e) for e in etas), name="Theorem 4.2",
                     meta=dict(K=K, d=d, shifts=tuple(shifts), printed=not repairs, repairs=repairs))
