"""Theorem A.1 / 3.6 composed: one looped Transformer block of width 17d+9 (two heads of size 1, FF width 49d+25)
with L1/L2 that approximates a permutation-equivariant f: [0,1]^{d×N} → R^{d×N} in r = δ^-1 + N + 2δ^-(N+1)d loops.

State per token (Eq. 66):  [x0 | x1 ∈ R^{5d} | x2 ∈ R^8 | x3 ∈ R^{12d}]
    x0   loop counter (the FF adds 1 every loop)
    x1   Step 1, Lemma A.5 quantisation (loops 1..δ^-1−1)                   -> token ID z = u_(δ^-1)^T β   (Eq. 26)
    x2   Step 2, Cor. A.7 contextual mapping, injected at loop δ^-1, run in loops δ^-1+1..δ^-1+N
                                                                              -> s_valid = 2 s(z) − Z_{d,N} (Eq. 39)
    x3   Step 3, Lemma 4.1 memorisation, injected at loop δ^-1+N+1, run K−1 = 2δ^-(N+1)d − 1 loops
                                                                              -> ỹ_k, k = 2 z δ^-Nd + s_valid (Eq. 46)
Injections use impulse_θ(L(x), x0) (Prop. A.4) inside the same FF (Eq. 67–79).

Repairs beyond those of the components (see `constructions`):
  * Eq. 67–79 ("the offset can be subtracted in advance"): before its injection a sub-state is not idle —
    Cor. A.7's FF marks a zero key (x2 row 2 → −Mε) and Lemma A.9's counter decreases every loop.  The drift is
    input independent; it is simulated exactly and subtracted in the injection maps L', L''.
  * Eq. 40–42 / 51: the printed dummy IDs s_valid + b (b = δ^-1..2δ^-1−1) overlap the next block's valid IDs
    (so Eq. 41 fails), and valid IDs only arise from sorted, distinct token lists, so their union is not
    {0..2δ^-Nd−1} (Eq. 42 fails) and many k ∈ 𝒦 get no label from Eq. 51.  Here every k ∈ {0..K−1} that no
    input cell realises is a dummy, labelled by linear interpolation between its nearest realised neighbours
    (Eq. 53 with the actual gap as denominator; constant beyond the first/last realised ID).

Inputs whose tokens share a quantisation cell (the O(N^{2/p} δ^{d/p}) term) are outside the construction; the
error report keeps them apart.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from loopformer.theory.constructions import (
    contextual_mapping_ext,
    extended_sequence_id,
    memorization,
    neighbour_differences,
    quantization,
)
from loopformer.theory.exact import Affine, Block, FeedForward, Head, LoopedNet, evaluate, frac, run_block

F = Fraction


def composed_loops(delta_inv: int, N: int, d: int) -> int:
    """r = δ^-1 + N + 2δ^-(N+1)d (Eq. 14/80)."""
    return delta_inv + N + 2 * delta_inv ** ((N + 1) * d)


def token_id(digits, delta_inv: int) -> int:
    """z = u_(δ^-1)^T β (Eq. 25–26): β_1 is the most significant digit."""
    z = 0
    for b in digits:
        z = z * delta_inv + int(b)
    return z


def token_digits(z: int, delta_inv: int, d: int) -> list[int]:
    out = []
    for _ in range(d):
        out.append(z % delta_inv)
        z //= delta_inv
    return out[::-1]


@dataclass
class ContextualLabels:
    """The contextual-token-ID design of App. A (Eq. 46–53), repaired: labels for every k ∈ {0..K−1}."""
    delta_inv: int
    N: int
    d: int
    y: list                      # [K][d] Fractions
    realised: dict               # k -> (sorted token IDs, index n of the token)
    K: int = 0

    def max_neighbour_difference(self) -> list[Fraction]:
        return neighbour_differences(self.y)


def contextual_labels(f: Callable[[np.ndarray], np.ndarray], delta_inv: int, N: int, d: int) -> ContextualLabels:
    """y_k = f̄(X̂_B)_{:,n} for realised IDs k = 2 z_n δ^-Nd + s_valid(B) (X̂_B the min-ℓ1 vertex, Eq. 21, 51),
    linear interpolation at dummy IDs.  f maps a float array [d, N] to [d, N]."""
    m, base = delta_inv, delta_inv ** d
    K = 2 * m ** ((N + 1) * d)
    realised: dict[int, tuple] = {}
    vals: dict[int, list] = {}
    for zs in itertools.combinations(range(base - 1, -1, -1), N):      # z_1 > z_2 > … > z_N
        X = np.array([[b / m for b in token_digits(z, m, d)] for z in zs], dtype=np.float64).T   # [d, N]
        Y = np.asarray(f(X), dtype=np.float64).reshape(d, N)
        s = extended_sequence_id(zs, m, d)
        for n, z in enumerate(zs):
            k = 2 * z * m ** (N * d) + s
            realised[k] = (zs, n)
            vals[k] = [frac(v) for v in Y[:, n]]
    keys = sorted(vals)
    if not keys:
        raise ValueError(f"N={N} distinct tokens need δ^-d >= N (got δ^-d = {base})")
    y: list = [None] * K
    for k in keys:
        y[k] = vals[k]
    for k in range(0, keys[0]):
        y[k] = list(vals[keys[0]])
    for k in range(keys[-1] + 1, K):
        y[k] = list(vals[keys[-1]])
    for a, b in zip(keys, keys[1:]):
        gap = b - a
        for j in range(1, gap):
            y[a + j] = [ya + F(j, gap) * (yb - ya) for ya, yb in zip(vals[a], vals[b])]
    return ContextualLabels(delta_inv, N, d, y, realised, K)


def _impulse_rows(D: int, target: list[tuple[list, Fraction]], theta: int, M: Fraction):
    """Hidden/output rows of impulse_θ(L_j(x), x0) for each j: L_j(x) = w_j·x + c_j (Prop. A.4)."""
    w1, b1, outs = [], [], []
    ctr = [F(0)] * D
    ctr[0] = F(1)
    w1 += [ctr, ctr]
    b1 += [-F(theta) + F(1, 2), -F(theta) - F(1, 2)]
    for j, (w, c) in enumerate(target):
        row = [wi + (2 * M if i == 0 else 0) for i, wi in enumerate(w)]
        w1 += [row, row]
        b1 += [c + 2 * M * (-F(theta) + F(1, 2)), c + 2 * M * (-F(theta) - F(1, 2))]
        outs.append(j)
    return w1, b1


@dataclass
class Composed:
    net: LoopedNet
    labels: ContextualLabels
    memo: LoopedNet               # the Lemma 4.1 net alone (ỹ_k)
    eps_q: Fraction
    info: dict = field(default_factory=dict)

    def predicted(self, digits_per_token: list[list[int]]) -> list[list[Fraction]] | None:
        """ỹ for a cell (token digit lists), or None when two tokens share a cell."""
        m, N, d = self.labels.delta_inv, self.labels.N, self.labels.d
        zs = [token_id(b, m) for b in digits_per_token]
        if len(set(zs)) < N:
            return None
        s = extended_sequence_id(zs, m, d)
        return [self.memo_out(2 * z * m ** (N * d) + s) for z in zs]

    def memo_out(self, k: int) -> list[Fraction]:
        cache = self.info.setdefault("_memo", {})
        if k not in cache:
            cache[k] = evaluate(self.memo, [[k]])[0]
        return cache[k]


def _drift(block: Block, loops: int, width: int, tokens: int) -> list:
    """The state of the first token after `loops` loops of `block` from the zero state (`tokens` tokens of `width`):
    the input-independent drift of a sub-state before its injection, simulated exactly."""
    X = [[F(0)] * width for _ in range(tokens)]
    for t in range(loops):
        X = run_block(block, X, t + 1)
    return X[0]


def _contextual_injection(c2: LoopedNet, comp2: list, D: int, o1: int, m: int, d: int) -> list[tuple[list, Fraction]]:
    """L'(x1) = L1^(2)(z(x1), Z_d(x1)) + comp2 as affine functions (w, c) of the full state [D], one per x2 row:
    z = Σ_i δ^-(d-1-i) (x1)_{5i+4}, Z_d = (x1)_{5(d-1)+4}."""
    zrow = [F(0)] * D
    for i in range(d):
        zrow[o1 + 5 * i + 4] = F(m) ** (d - 1 - i)
    Zrow = [F(0)] * D
    Zrow[o1 + 5 * (d - 1) + 4] = F(1)
    tgt2 = []
    for j in range(8):
        w = [c2.l1.weight[j][0] * zrow[i] + c2.l1.weight[j][1] * Zrow[i] for i in range(D)]
        tgt2.append((w, c2.l1.bias[j] + comp2[j]))
    return tgt2


def _memorization_injection(c2: LoopedNet, memo: LoopedNet, comp3: list, D: int, o2: int, m: int, N: int,
                            d: int) -> list[tuple[list, Fraction]]:
    """L''(x2) = L1^(3)(2 z δ^-Nd + L2^(2)(x2)) + comp3 as affine functions (w, c) of the full state [D], one per x3
    row: z = (x2)_1."""
    krow = [F(0)] * D
    krow[o2 + 0] += 2 * F(m) ** (N * d)
    for i, v in enumerate(c2.l2.weight[0]):
        krow[o2 + i] += v
    kbias = c2.l2.bias[0]
    tgt3 = []
    for j in range(12 * d):
        a = memo.l1.weight[j][0]
        tgt3.append(([a * v for v in krow], memo.l1.bias[j] + a * kbias + comp3[j]))
    return tgt3


def _place_ff(ff: FeedForward, off: int, D: int, rows1: list, b1: list, b2: list, cols: list) -> None:
    """Append a component's FF (input/output rows off..off+dim of the state [D]) to the hidden rows `rows1`, their
    biases `b1` and output columns `cols` (output row -> weight, per hidden unit); add its output bias to `b2`."""
    for r, (row, b) in enumerate(zip(ff.w1, ff.b1)):
        full = [F(0)] * D
        for j, v in enumerate(row):
            full[off + j] = v
        rows1.append(full)
        b1.append(b)
        cols.append({off + i: ff.w2[i][r] for i in range(ff.dim) if ff.w2[i][r] != 0})
    for i, b in enumerate(ff.b2):
        b2[off + i] += b


def _place_impulse(tgt: list, theta: int, M: Fraction, off: int, D: int, rows1: list, b1: list, cols: list) -> None:
    """Append impulse_θ(L_j(x), x0) (Prop. A.4) for the targets `tgt` (written to rows off+j): two shared units on the
    counter, −2M / +2M into every target, then two units per target, +1 / −1 into its row."""
    w1_i, b1_i = _impulse_rows(D, tgt, theta, M)
    rows1.extend(w1_i)
    b1.extend(b1_i)
    s_a, s_b = {}, {}
    cols.append(s_a)          # σ(x0 − θ + ½): −2M into every target
    cols.append(s_b)
    for j in range(len(tgt)):
        s_a[off + j] = -2 * M
        s_b[off + j] = 2 * M
        cols.append({off + j: F(1)})
        cols.append({off + j: F(-1)})


def _lift(h: Head, D: int, off: int) -> Head:
    """A head of a sub-state (rows off..) as a head of the full state [D]."""
    def pad(w):
        full = [F(0)] * D
        for j, v in enumerate(w):
            full[off + j] = v
        return tuple(full)
    return Head(pad(h.wq), pad(h.wk), pad(h.wv), pad(h.wo))


def _read_in_out(q1: LoopedNet, memo: LoopedNet, D: int, o1: int, o3: int, d: int) -> tuple[Affine, Affine]:
    """L1: R^d -> the full state, Lemma A.5's L1 into x1 (rows o1..); L2: Lemma 4.1's L2 read from x3 (rows o3..)."""
    l1w = [[F(0)] * d for _ in range(D)]
    l1b = [F(0)] * D
    for i in range(5 * d):
        for j in range(d):
            l1w[o1 + i][j] = q1.l1.weight[i][j]
        l1b[o1 + i] = q1.l1.bias[i]
    l2w = [[F(0)] * D for _ in range(d)]
    for i in range(d):
        for j in range(12 * d):
            l2w[i][o3 + j] = memo.l2.weight[i][j]
    l1 = Affine(tuple(map(tuple, l1w)), tuple(l1b))
    l2 = Affine(tuple(map(tuple, l2w)), tuple(memo.l2.bias))
    return l1, l2


def composed_network(f: Callable[[np.ndarray], np.ndarray], delta_inv: int, N: int, d: int = 1,
                     eps_q=None, printed: bool = False) -> Composed:
    """Theorem A.1: L2 ∘ TF^r ∘ L1 with TF of width 17d+9, two heads of size 1, FF width 49d+25 (hardmax),
    r = δ^-1 + N + 2δ^-(N+1)d.  `eps_q` is Lemma A.5's trifling width (default δ·2^-20); `printed` builds the
    component constructions as printed (then the composition does not approximate f)."""
    if not isinstance(N, int) or N < 1:
        raise ValueError(f"N must be a positive integer (got {N!r})")
    m = delta_inv
    eps_q = F(1, m * 2 ** 20) if eps_q is None else frac(eps_q)
    q1 = quantization(m, eps_q, d, printed)
    c2 = contextual_mapping_ext(m, d, N, printed=printed)
    labels = contextual_labels(f, m, N, d)
    memo = memorization(labels.y, printed=printed)
    K = labels.K
    D = 1 + 5 * d + 8 + 12 * d
    o1, o2, o3 = 1, 1 + 5 * d, 1 + 5 * d + 8
    theta2, theta3 = m - 1, m + N

    # ---- drift of x2 / x3 before their injections (input independent), simulated exactly
    comp2 = [-v for v in _drift(c2.block, theta2 + 1, 8, N)]
    comp3 = [-v for v in _drift(memo.block, theta3 + 1, 12 * d, 1)]

    # ---- injection maps as affine functions of the full state
    tgt2 = _contextual_injection(c2, comp2, D, o1, m, d)
    tgt3 = _memorization_injection(c2, memo, comp3, D, o2, m, N, d)
    Mimp2 = F(m) ** d + 2 + max(abs(v) for v in comp2)
    Mimp3 = 2 * F(K) + 4 + max(abs(v) for v in comp3)

    # ---- FF of width 7d + 5 + 18d + (16 + 2) + (24d + 2) = 49d + 25
    rows1, b1, b2 = [], [], [F(0)] * D
    b2[0] = F(1)                                                                   # counter
    cols = []                                                                      # output column per hidden
    _place_ff(q1.block.ff, o1, D, rows1, b1, b2, cols)
    _place_ff(c2.block.ff, o2, D, rows1, b1, b2, cols)
    _place_ff(memo.block.ff, o3, D, rows1, b1, b2, cols)
    _place_impulse(tgt2, theta2, Mimp2, o2, D, rows1, b1, cols)
    _place_impulse(tgt3, theta3, Mimp3, o3, D, rows1, b1, cols)
    q = len(rows1)
    w2 = [[F(0)] * q for _ in range(D)]
    for h, c in enumerate(cols):
        for i, v in c.items():
            w2[i][h] += v
    ff = FeedForward(tuple(map(tuple, rows1)), tuple(b1), tuple(map(tuple, w2)), tuple(b2))
    block = Block(ff, tuple(_lift(h, D, o2) for h in c2.block.heads))

    l1, l2 = _read_in_out(q1, memo, D, o1, o3, d)
    r = composed_loops(m, N, d)
    net = LoopedNet(l1, block, l2, loops=r, name="Theorem A.1",
                    meta=dict(delta_inv=m, N=N, d=d, K=K, printed=printed))
    assert net.width == 17 * d + 9 and net.ff_width == 49 * d + 25, (net.width, net.ff_width)
    return Composed(net, labels, memo, eps_q, info=dict(comp2=comp2, comp3=comp3, M2=Mimp2, M3=Mimp3))
