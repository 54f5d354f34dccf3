"""Moduli of continuity (Definitions 3.3–3.5) estimated for any callable, as certified lower bounds.

    ω_f(δ)      = sup ‖f(X) − f(X')‖_p            over ‖X − X'‖_2 ≤ δ                          (Def. 3.3, sequence)
    ω^cont_f(δ) = sup ‖f(X)_{:,n} − f(X')_{:,n}‖_p over ‖X − X'‖_2 ≤ δ, X_{:,n} = X'_{:,n}      (Def. 3.4, contextual)
    ω^tok_f(δ)  = sup ‖f(X)_{:,n} − f(X')_{:,n}‖_p over ‖X_{:,n} − X'_{:,n}‖_2 ≤ δ, rest equal (Def. 3.5, token)

X, X' range over the cube [lo, hi]^{d×N} ([0,1] by default, the domain of Theorem 3.6).  The estimator samples
random pairs on the constraint set and then, when f is differentiable in torch, runs projected gradient ascent
from the best pairs.  Every reported value is attained by an explicit feasible pair (returned), so it is a lower
bound of the supremum; `evaluations` counts calls of f on single sequences.

f: takes a batch [B, d, N] (numpy float64 array, or a torch tensor when `use_grad`) and returns [B, d, N].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from loopformer.errors import UserError

KINDS = ("seq", "cont", "tok")


@dataclass
class ModulusEstimate:
    kind: str
    delta: float
    value: float             # lower bound of the supremum
    evaluations: int
    X: np.ndarray            # [d, N] the attaining pair
    Xp: np.ndarray
    n: int                   # token index (cont/tok)

    def __str__(self) -> str:
        return f"ω^{self.kind}({self.delta:.4g}) ≥ {self.value:.6g}  ({self.evaluations} evaluations)"


def _mask(kind: str, d: int, N: int, n: np.ndarray) -> np.ndarray:
    """[B, d, N] 0/1 mask of the coordinates allowed to move."""
    B = len(n)
    m = np.ones((B, d, N))
    if kind == "cont":
        m[np.arange(B), :, n] = 0.0
    elif kind == "tok":
        m[:] = 0.0
        m[np.arange(B), :, n] = 1.0
    return m


def _gap(kind: str, Y, Yp, n, p: float, xp):
    diff = Y - Yp
    if kind == "seq":
        flat = diff.reshape(diff.shape[0], -1)
    else:
        flat = diff[xp.arange(diff.shape[0]), :, n] if xp is np else diff[xp.arange(diff.shape[0]), :, n]
    if np.isinf(p):
        return abs(flat).max(axis=1) if xp is np else flat.abs().amax(dim=1)
    return (abs(flat) ** p).sum(axis=1) ** (1.0 / p) if xp is np else (flat.abs() ** p).sum(dim=1) ** (1.0 / p)


def _project(X, D, mask, delta, lo, hi, xp):
    """Feasible pair: X in the cube, Δ masked with ‖Δ‖ ≤ δ, X' = clip(X + Δ) (clipping only shrinks Δ)."""
    if xp is np:
        X = np.clip(X, lo, hi)
        D = D * mask
        nrm = np.sqrt((D ** 2).reshape(len(D), -1).sum(1))[:, None, None]
        D = np.where(nrm > delta, D * (delta / np.maximum(nrm, 1e-300)), D)
        return X, np.clip(X + D, lo, hi)
    X = X.clamp(lo, hi)
    D = D * mask
    nrm = D.flatten(1).norm(dim=1)[:, None, None]
    D = torch.where(nrm > delta, D * (delta / nrm.clamp_min(1e-300)), D)
    return X, (X + D).clamp(lo, hi)


def estimate_modulus(f: Callable, delta: float, kind: str, d: int, N: int, p: float = 2.0, samples: int = 4096,
                     steps: int = 200, restarts: int = 16, lr: float = 0.05, seed: int = 0,
                     lo: float = 0.0, hi: float = 1.0, use_grad: bool | None = None,
                     batch: int = 1024) -> ModulusEstimate:
    """Lower-bound ω^kind_f(δ) by sampling `samples` random feasible pairs (Δ of norm δ in random directions)
    and, if f is torch-differentiable (`use_grad` None = try), `steps` of projected gradient ascent from the
    best `restarts` pairs."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} (got {kind!r})")
    if delta < 0:
        raise ValueError("δ must be >= 0")
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi and math.isfinite(hi - lo)):
        raise UserError(f"the box [lo, hi] needs finite edges lo < hi a finite distance apart (got lo={lo:g}, "
                        f"hi={hi:g})")             # numpy cannot draw from a wider one
    rng = np.random.default_rng(seed)
    evals = 0
    best = (-1.0, None, None, 0)
    keep_X, keep_D, keep_n, keep_v = [], [], [], []
    for start in range(0, samples, batch):
        B = min(batch, samples - start)
        X = rng.uniform(lo, hi, size=(B, d, N))
        n = rng.integers(0, N, size=B)
        mask = _mask(kind, d, N, n)
        D = rng.standard_normal((B, d, N)) * mask
        nrm = np.sqrt((D ** 2).reshape(B, -1).sum(1))[:, None, None]
        D = D * (delta / np.maximum(nrm, 1e-300))
        X, Xp = _project(X, D, mask, delta, lo, hi, np)
        v = np.asarray(_gap(kind, np.asarray(f(X)), np.asarray(f(Xp)), n, p, np), dtype=np.float64)
        evals += 2 * B
        i = int(np.argmax(v))
        if v[i] > best[0]:
            best = (float(v[i]), X[i].copy(), Xp[i].copy(), int(n[i]))
        top = np.argsort(-v)[:restarts]
        keep_X.append(X[top])
        keep_D.append((Xp - X)[top])
        keep_n.append(n[top])
        keep_v.append(v[top])
    if steps > 0 and use_grad is not False:
        try:
            Xs, Ds = np.concatenate(keep_X), np.concatenate(keep_D)
            ns, vs = np.concatenate(keep_n), np.concatenate(keep_v)
            top = np.argsort(-vs)[:restarts]
            Xt = torch.tensor(Xs[top], dtype=torch.float64, requires_grad=True)
            Dt = torch.tensor(Ds[top], dtype=torch.float64, requires_grad=True)
            nt = torch.tensor(ns[top])
            mask = torch.tensor(_mask(kind, d, N, ns[top]))
            opt = torch.optim.Adam([Xt, Dt], lr=lr)
            for _ in range(steps):
                Xa, Xb = _project(Xt, Dt, mask, delta, lo, hi, torch)
                g = _gap(kind, f(Xa), f(Xb), nt, p, torch)
                if not isinstance(g, torch.Tensor) or not g.requires_grad:
                    raise TypeError("not differentiable")
                evals += 2 * len(nt)
                j = int(torch.argmax(g.detach()))
                if float(g[j].detach()) > best[0]:
                    best = (float(g[j].detach()), Xa[j].detach().numpy().copy(), Xb[j].detach().numpy().copy(),
                            int(nt[j]))
                opt.zero_grad()
                (-g.sum()).backward()
                opt.step()
        except (TypeError, RuntimeError, AttributeError):
            if use_grad:
                raise
    value, X0, X1, n0 = best
    # the attaining pair is feasible by construction; check it once more and recompute its value in numpy
    diff = X1 - X0
    assert np.sqrt((diff ** 2).sum()) <= delta * (1 + 1e-9) + 1e-15
    if kind == "cont":
        assert np.allclose(diff[:, n0], 0)
    if kind == "tok":
        assert np.allclose(np.delete(diff, n0, axis=1), 0)
    return ModulusEstimate(kind, float(delta), float(value), evals, X0, X1, n0)


def estimate_moduli(f: Callable, delta_tok: float, delta_ctx: float, d: int, N: int, p: float = 2.0,
                    **kw) -> dict[str, ModulusEstimate]:
    """The three moduli Theorem 3.6 needs: ω^tok(δ√d), ω^cont(δ√(Nd)), ω(δ√(Nd)) — pass those radii."""
    return {"tok": estimate_modulus(f, delta_tok, "tok", d, N, p, **kw),
            "cont": estimate_modulus(f, delta_ctx, "cont", d, N, p, **kw),
            "seq": estimate_modulus(f, delta_ctx, "seq", d, N, p, **kw)}


def as_batched(f_single: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """Wrap a one-sequence callable [d, N] -> [d, N] into the batched form the estimators take (no gradients)."""
    def g(X):
        return np.stack([np.asarray(f_single(x), dtype=np.float64) for x in np.asarray(X)])
    return g
