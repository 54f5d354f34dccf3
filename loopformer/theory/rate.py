"""Theorem 3.6 / A.1 measured: the composed construction's L^p error against the loop count, beside the bound.

For each δ^-1 the composed network (`compose.composed_network`, r = δ^-1 + N + 2δ^-(N+1)d loops) is run
exactly once per input cell (its output is constant on a cell outside the trifling regions, which have measure
≤ dNδ^-1ε, Eq. 92); a few extra random points per cell are run exactly to confirm it.  The L^p error
‖f̃ − f‖_Lp = (∫ ‖f̃(X) − f(X)‖_p^p dX)^{1/p} is estimated by Monte Carlo over the cube with f in float64,
separately on the distinct-token region (where Theorem A.1's construction applies) and on all of [0,1]^{d×N}.
The bound is Eq. 19's explicit part with moduli estimated (lower bounds) by `moduli.estimate_modulus`, at the
construction's δ = 1/δ^-1 and at δ(r) of Eq. 17.
"""

from __future__ import annotations

import csv
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction

import numpy as np
import torch
from tqdm import tqdm

from loopformer.fileio import write_figure, write_with
from loopformer.theory.bounds import delta_from_loops, duplicate_measure, radii, theorem_bound, trifling_measure
from loopformer.theory.compose import Composed, composed_network, token_id
from loopformer.theory.exact import evaluate
from loopformer.theory.moduli import estimate_modulus


def default_target(X):
    """A permutation-equivariant target on [0,1]^{d×N}: f(X)_{:,n} = sin(2 x_n + Σ_j x_j) / 2 (numpy or torch)."""
    if isinstance(X, torch.Tensor):
        return torch.sin(2 * X + X.sum(-1, keepdim=True)) / 2
    X = np.asarray(X, dtype=np.float64)
    return np.sin(2 * X + X.sum(-1, keepdims=True)) / 2


@dataclass
class RatePoint:
    delta_inv: int
    N: int
    d: int
    loops: int
    width: int
    ff_width: int
    max_bits: int
    cells_checked: int
    cell_mismatches: int          # exact cell outputs that differ from the Lemma 4.1 prediction (must be 0)
    max_label_error: float        # max_k |ỹ_k − y_k| over realised IDs
    max_neighbour_diff: float     # max_k |y_k − y_{k−1}| (Eq. 62's bound)
    lp_error_distinct: float      # (∫_{distinct} ‖f̃ − f‖_p^p)^{1/p}
    lp_error_all: float           # over the whole cube (duplicates included)
    duplicate_measure: float
    trifling_measure: float
    w_tok: float
    w_cont: float
    w_seq: float
    bound: float                  # Eq. 19 explicit part at δ = 1/δ^-1
    delta_r: float                # δ(r) of Eq. 17
    bound_r: float                # Eq. 19 explicit part at δ(r)
    evaluations: int              # evaluations of f used by the moduli estimates
    samples: int


def _cell_outputs(c: Composed, rng: np.random.Generator, extra_points: int) -> tuple[dict, int, int]:
    m, N, d = c.labels.delta_inv, c.labels.N, c.labels.d
    table, checked, bad = {}, 0, 0
    for cell in itertools.product(range(m), repeat=d * N):
        digits = [list(cell[n * d:(n + 1) * d]) for n in range(N)]
        X = [[Fraction(2 * b + 1, 2 * m) for b in tok] for tok in digits]
        out = evaluate(c.net, X)
        pred = c.predicted(digits)
        checked += 1
        if pred is not None and out != pred:
            bad += 1
        for _ in range(extra_points):   # random interior points (outside the trifling gaps) give the same output
            Xr = [[Fraction(int(b * 1000 + rng.integers(1, 900)), 1000 * m) for b in tok] for tok in digits]
            checked += 1
            if evaluate(c.net, Xr) != out:
                bad += 1
        table[cell] = np.array([[float(v) for v in o] for o in out]).T      # [d, N]
    return table, checked, bad


def measure_point(delta_inv: int, N: int = 2, d: int = 1, f: Callable = default_target, p: float = 2.0,
                  samples: int = 20000, seed: int = 0, extra_points: int = 1, moduli_samples: int = 2048,
                  moduli_steps: int = 60) -> RatePoint:
    rng = np.random.default_rng(seed)
    c = composed_network(f, delta_inv, N, d)
    table, checked, bad = _cell_outputs(c, rng, extra_points)
    m = delta_inv
    # labels vs memorised labels (Lemma 4.1 / Eq. 62)
    errs = [max(abs(float(a - b)) for a, b in zip(c.memo_out(k), c.labels.y[k])) for k in sorted(c.labels.realised)]
    nd = max(float(v) for v in c.labels.max_neighbour_difference())
    # Monte Carlo L^p error
    X = rng.uniform(0.0, 1.0, size=(samples, d, N))
    cells = np.minimum((X * m).astype(int), m - 1)                                  # [S, d, N]
    Y = np.asarray(f(X), dtype=np.float64)
    approx = np.empty_like(Y)
    distinct = np.empty(samples, dtype=bool)
    for s in range(samples):
        key = tuple(int(v) for v in cells[s].T.reshape(-1))
        approx[s] = table[key]
        zs = [token_id(cells[s][:, n], m) for n in range(N)]
        distinct[s] = len(set(zs)) == N
    frac_pos = X * m - np.floor(X * m)
    in_trifling = (frac_pos > 1 - float(c.eps_q) * m).any(axis=(1, 2))
    for s in np.nonzero(in_trifling)[0]:                                             # exact evaluation there
        approx[s] = np.array([[float(v) for v in o] for o in
                              evaluate(c.net, [[Fraction(float(v)) for v in X[s][:, n]] for n in range(N)])]).T
    err_p = (np.abs(approx - Y) ** p).reshape(samples, -1).sum(1)
    lp_distinct = float(np.mean(err_p * distinct) ** (1 / p))
    lp_all = float(np.mean(err_p) ** (1 / p))
    # bound with estimated moduli
    delta = 1.0 / m
    rt, rc = radii(delta, N, d)
    kw = dict(samples=moduli_samples, steps=moduli_steps, seed=seed)
    wt = estimate_modulus(f, rt, "tok", d, N, p, **kw)
    wc = estimate_modulus(f, rc, "cont", d, N, p, **kw)
    ws = estimate_modulus(f, rc, "seq", d, N, p, **kw)
    bound = theorem_bound(wt.value, wc.value, ws.value, N, d, p)
    r = c.net.loops
    dr = delta_from_loops(r, N, d)
    rt2, rc2 = radii(dr, N, d)
    wt2 = estimate_modulus(f, rt2, "tok", d, N, p, **kw)
    wc2 = estimate_modulus(f, rc2, "cont", d, N, p, **kw)
    ws2 = estimate_modulus(f, rc2, "seq", d, N, p, **kw)
    bound_r = theorem_bound(wt2.value, wc2.value, ws2.value, N, d, p)
    evals = sum(e.evaluations for e in (wt, wc, ws, wt2, wc2, ws2))
    return RatePoint(m, N, d, r, c.net.width, c.net.ff_width, c.net.max_bits(), checked, bad, max(errs), nd,
                     lp_distinct, lp_all, duplicate_measure(m, N, d), trifling_measure(m, N, d, float(c.eps_q)),
                     wt.value, wc.value, ws.value, bound, dr, bound_r, evals, samples)


def rate_experiment(delta_invs: Sequence[int] = (2, 3, 4, 5), N: int = 2, d: int = 1, f: Callable = default_target,
                    p: float = 2.0, samples: int = 20000, seed: int = 0, progress: bool = True) -> list[RatePoint]:
    it = tqdm(list(delta_invs), desc="theory rate", unit="δ^-1", disable=not progress)
    return [measure_point(m, N, d, f, p, samples, seed) for m in it]


def write_rate(points: list[RatePoint], out_dir: str) -> tuple[str, str]:
    """rate.csv and rate.png (error and bound vs loops, log-log), written atomically."""
    os.makedirs(out_dir, exist_ok=True)
    csv_path, png_path = os.path.join(out_dir, "rate.csv"), os.path.join(out_dir, "rate.png")
    def write_csv(tmp) -> None:
        with open(tmp, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(asdict(points[0]).keys()))
            w.writeheader()
            for pt in points:
                w.writerow(asdict(pt))

    write_with(csv_path, write_csv)
    import matplotlib  # heavy: imported only when a plot is drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    r = [pt.loops for pt in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(r, [pt.lp_error_distinct for pt in points], "o-", label="measured L^p error (distinct tokens)")
    ax.plot(r, [pt.lp_error_all for pt in points], "s--", label="measured L^p error (whole cube)")
    ax.plot(r, [pt.bound for pt in points], "^-", label="bound Eq. 19 at δ = 1/δ⁻¹")
    ax.plot(r, [pt.bound_r for pt in points], "v:", label="bound Eq. 19 at δ(r) (Eq. 17)")
    for pt in points:
        ax.annotate(f"δ⁻¹={pt.delta_inv}", (pt.loops, pt.lp_error_distinct), textcoords="offset points",
                    xytext=(4, -10), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("loops r")
    ax.set_ylabel("error")
    pt0 = points[0]
    ax.set_title(f"Theorem 3.6, composed construction (N={pt0.N}, d={pt0.d})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_figure(fig, png_path, dpi=120)
    plt.close(fig)
    return csv_path, png_path
