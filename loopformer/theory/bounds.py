"""The approximation-rate bound of Theorem 3.6 / A.1 and the counting formulas around it.

    r = δ^-1 + N + 2δ^-(N+1)d                          loops used by the construction          (Eq. 14, 80)
    δ ≤ ((r − N)/2)^{−1/((N+1)d+1)}                    δ as a function of the loop count       (Eq. 17, 91)
    ‖L2∘TF^r∘L1 − f‖_Lp ≤ (Nd)^{1/p}(ω^tok(δ√d) + ω^cont(δ√(Nd))) + ω(δ√(Nd)) + O(N^{2/p} δ^{d/p})   (Eq. 19)
    measure of inputs with two tokens in one cell   = 1 − Π_{i<N}(1 − iδ^d)  (≤ N(N−1)/2·δ^d, Eq. 31–32)
    measure of the trifling regions                  ≤ dN δ^-1 ε           (Eq. 92)
"""

from __future__ import annotations

import math


def loops_for(delta_inv: int, N: int, d: int) -> int:
    """Eq. 80: r = δ^-1 + N + 2δ^-(N+1)d."""
    return delta_inv + N + 2 * delta_inv ** ((N + 1) * d)


def delta_from_loops(r: int, N: int, d: int) -> float:
    """Eq. 17: δ(r) = ((r − N)/2)^{−1/((N+1)d+1)} (needs r > N + 2)."""
    if r <= N + 2:
        raise ValueError(f"Theorem 3.6 needs r > N + 2 (got r={r}, N={N})")
    return ((r - N) / 2.0) ** (-1.0 / ((N + 1) * d + 1))


def theorem_bound(w_tok: float, w_cont: float, w_seq: float, N: int, d: int, p: float = 2.0) -> float:
    """The explicit part of Eq. 19: (Nd)^{1/p}(ω^tok + ω^cont) + ω (moduli already evaluated at their radii)."""
    return (N * d) ** (1.0 / p) * (w_tok + w_cont) + w_seq


def radii(delta: float, N: int, d: int) -> tuple[float, float]:
    """(δ√d, δ√(Nd)): where Theorem 3.6 evaluates ω^tok and ω^cont / ω."""
    return delta * math.sqrt(d), delta * math.sqrt(N * d)


def duplicate_measure(delta_inv: int, N: int, d: int) -> float:
    """Exact measure of {X : two tokens fall in the same δ-cube} (the O(N²δ^d) set of Eq. 31–32)."""
    cells = delta_inv ** d
    prob_distinct = 1.0
    for i in range(N):
        prob_distinct *= max(0.0, 1.0 - i / cells)
    return 1.0 - prob_distinct


def trifling_measure(delta_inv: int, N: int, d: int, eps: float) -> float:
    """Union bound of Eq. 92: meas(Ω) ≤ dN δ^-1 ε."""
    return d * N * delta_inv * float(eps)
