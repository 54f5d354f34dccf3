"""The fixed-point (deep-equilibrium) mode of the shared block: solve h* = F(h*) instead of unrolling r loops.

With input injection the looped block is the iteration of one map (paper Sec. 2.2, the loop of Eq. 3):

    F(h) = TF(h + e, t*)          e = L1(x) the read-in, t* the loop index the block reads (below)

and the unrolled loop of r loops is r Picard steps h_{t+1} = F(h_t) from h_0 = 0 (the first loop TF(e) is F(0)).
Deep equilibrium models (Bai, Kolter & Koltun 2019) take the limit: the state is a root of g(h) = F(h) − h, found
by a quasi-Newton solver, and the gradient comes from the fixed point alone, so training memory does not grow with
the iterations (the paper's authors name DEQs as closely related). Every switch is a `ModelConfig` field, off by
default (`solver="unroll"`: the unrolled loop, unchanged):

    solver           "unroll" | "anderson" | "broyden": how h* is found (no gradients are kept while solving)
                     anderson  Anderson acceleration (type II, Walker & Ni 2011): the next iterate is the mix
                               x_{k+1} = Σ_i α_i F(x_i) over the last m iterates, α = argmin ‖Σ α_i g(x_i)‖² with
                               Σ α_i = 1, i.e. α = (G Gᵀ + λI)⁻¹1 / 1ᵀ(G Gᵀ + λI)⁻¹1 (rows of G: the residuals
                               g(x_i); λ = ANDERSON_REG × the mean of diag(G Gᵀ)); m = ANDERSON_HISTORY
                     broyden   Broyden's ("good") method on g with a limited memory: an inverse-Jacobian estimate
                               H = −I + Σ u_j v_jᵀ (the last BROYDEN_MEMORY pairs), the step Δx = −H g(x) and the
                               rank-one update H ← H + (Δx − HΔg)(ΔxᵀH) / (ΔxᵀHΔg)
    solver_tol       stop when every row's relative residual ‖F(x) − x‖ / ‖F(x)‖ (over T·D) is at most this
                     (0: run solver_max_iter iterations); the estimate returned is F(x) of each row's
                     lowest-residual iterate, so one iteration is one application of the block
    solver_max_iter  the most applications of F per solve (0: the call's loop count, default `loops`)
    solver_backward  how the gradient reaches the weights and the read-in:
                     "bptt"       backpropagation through every loop: the unrolled loop only
                     "implicit"   implicit differentiation: with J = ∂F/∂h at h*, ∂L/∂θ = (∂F/∂θ)ᵀ g where g solves
                                  the adjoint fixed point g = Jᵀg + ∂L/∂h* — solved by the same solver on
                                  vector-Jacobian products (autograd through one application of F at h*, a backward
                                  hook on its output, after Bai et al.'s implementation). Memory: one application's
                                  activations
                     "phantom:k"  (or "phantom:k:λ") the phantom gradient (Geng et al. 2021): from the detached
                                  solution, k more (damped) steps h ← λF(h) + (1 − λ)h with gradients kept, λ = 1 by
                                  default; k = 1, λ = 1 is the one-step (Jacobian-free) gradient. Memory: k
                                  applications' activations. The steps run at evaluation too, so a model computes
                                  the same function in training and evaluation

The loop index under a solver (TMLT, `timestep=true`): F must be one map, so the block reads one fixed index,
t* = r − 1 (r = `loops`, the trained loop count), the last index the unrolled model trains: a TMLT run past r with
`timestep_past="clamp"` applies exactly this map, so the solver's h* is the limit of the clamped unrolled model
(its state as loops → ∞; with `timestep_past="hold"` the block reads the hold index t* = r, the map every loop past
r applies, and with `"own"` the loops past r's own modulation and injection), and a TMLT trained with a solver reads
one learned modulation (a gain and a gate per branch). The budget-aware time (`timestep_time="normalized"`) has no
such limit and is refused.

How the mode composes (every refusal is one line, a ValueError for config fields, a UserError for calls):
    return_all       at evaluation the solver's estimate after every iteration (its lowest-residual F(x) so far),
                     repeated after the solve stops, so the loop-wise curve is the convergence curve and the last
                     read-out is the solution's; in training refused (per-loop losses need every iterate's gradient)
    exit gate, halting rules, key/value caches, row_loops (a loop count per row)
                     refused: the solver stops by its residual, and these run (or stop) the unrolled loop per loop
    start_state      the solver's initial guess: 0 for "input" and "zeros" (F(0) = TF(e) is the unrolled first loop),
                     or an extension's start (the lab's noise start, in training); a carried `state` is a warm start
    state_noise, dropout
                     refused: they change F between iterations, so there is no fixed point to solve for
    supervision_steps > 1, grad_loops
                     refused: they cut the unrolled loop into parts; the solver already runs to the fixed point
    checkpoint       recomputes each of phantom's k steps in the backward; implicit keeps one application of F for
                     its vector-Jacobian products and has nothing more to save
    torch.compile    the training step stays eager (`loopformer.train.trainer.compiles`): the solver stops on
                     data (a host read of the residual per iteration) and the implicit backward runs a solver inside
                     a backward hook, both graph breaks

The solvers are written here rather than taken from the torchdeq package (0.1.0, the only release, 2023): its
torch requirement is unbounded (torch >= 1.11), its code raises invalid-escape warnings on import under current
Python and calls `.cuda()` in a loss, its configuration is a dict / argparse namespace of untyped keys beside
ModelConfig's validated fields, and its DEQ modules own the state layout and the backward hook (kept on the
calling module); the three pieces used here (Anderson, Broyden, the two backward modes) are short.

The solvers work on any map f: [B, ...] -> [B, ...] (the rows are solved independently: the mixing weights and the
Broyden updates are per row; the solve stops when the worst row meets the tolerance).

Shapes: B batch, T length, D width, N = T·D per row, m history, R loops.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from loopformer.errors import UserError

SOLVERS = ("unroll", "anderson", "broyden")
ANDERSON_HISTORY = 5          # m: iterates mixed by Anderson acceleration
ANDERSON_REG = 1e-4           # λ relative to the mean squared residual norm of the history
BROYDEN_MEMORY = 16           # rank-one updates kept in Broyden's inverse-Jacobian estimate
MAX_ITER = 4096               # upper bound of solver_max_iter and of phantom's k
_TINY = 1e-12

Map = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class SolveInfo:
    """What a solve did, on the output (`LoopOutput.solve`) and on the model (`last_solve`) for logs: the solver,
    the applications of F in the forward solve, its final relative residual (worst row), and — filled in by the
    backward — the adjoint solve's iterations and residual (implicit) or phantom's k steps."""
    solver: str
    iters: int
    residual: float
    backward_iters: int | None = None
    backward_residual: float | None = None

    def record(self) -> dict[str, Any]:
        """The log fields: solver_iters, solver_residual (and solver_backward_iters, solver_backward_residual)."""
        rec: dict[str, Any] = {"solver_iters": self.iters, "solver_residual": self.residual}
        if self.backward_iters is not None:
            rec["solver_backward_iters"] = self.backward_iters
        if self.backward_residual is not None:
            rec["solver_backward_residual"] = self.backward_residual
        return rec


@dataclass(frozen=True)
class Backward:
    """A parsed `solver_backward`: kind "bptt" | "implicit" | "phantom" (steps k, damping λ)."""
    kind: str
    steps: int = 0
    damping: float = 1.0

    @staticmethod
    def parse(text: str) -> Backward:
        """"bptt" | "implicit" | "phantom:k" | "phantom:k:λ" (1 <= k <= MAX_ITER, 0 < λ <= 1); a ValueError naming
        solver_backward otherwise."""
        if text in ("bptt", "implicit"):
            return Backward(text)
        parts = str(text).split(":")
        bad = ValueError(f"solver_backward must be 'bptt', 'implicit', 'phantom:k' or 'phantom:k:λ' with 1 <= k <= "
                         f"{MAX_ITER} and 0 < λ <= 1 (got {text!r})")
        if parts[0] != "phantom" or len(parts) not in (2, 3):
            raise bad
        try:
            k = int(parts[1])
            lam = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise bad from None
        if not (1 <= k <= MAX_ITER and math.isfinite(lam) and 0 < lam <= 1):
            raise bad
        return Backward("phantom", k, lam)


# ------------------------------------------------------------------------------------------------- solvers
class _Best:
    """Each row's lowest-residual estimate F(x) so far, its residual ‖F(x) − x‖ / ‖F(x)‖ [B], and the trajectory
    of these estimates when asked for."""

    def __init__(self, trace: list[torch.Tensor] | None, shape: torch.Size):
        self.f: torch.Tensor | None = None       # [B,N]
        self.res: torch.Tensor | None = None     # [B] float32
        self.trace, self.shape = trace, shape

    def update(self, x: torch.Tensor, fx: torch.Tensor, tol: float) -> bool:
        """Take F(x) where it beats the row's best; True when every row's best residual is within `tol`."""
        d, f = (fx - x).float(), fx.float()
        res = d.norm(dim=1) / f.norm(dim=1).clamp(min=_TINY)                          # [B]
        res = torch.nan_to_num(res, nan=math.inf)
        if self.f is None:
            self.f, self.res = fx.clone(), res
        else:
            better = res < self.res
            self.f = torch.where(better[:, None], fx, self.f)
            self.res = torch.where(better, res, self.res)
        if self.trace is not None:
            self.trace.append(self.f.view(self.shape))
        return self.worst <= tol

    @property
    def worst(self) -> float:
        return float(self.res.max()) if self.res is not None and self.res.numel() else 0.0


def anderson(f: Map, x0: torch.Tensor, *, max_iter: int, tol: float, m: int = ANDERSON_HISTORY,
             lam: float = ANDERSON_REG, trace: list[torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, int, float]:
    """Anderson acceleration of x <- f(x) from x0 [B,...]: (the estimate [B,...], applications of f, the worst row's
    relative residual). At most `max_iter` applications; stops once every row is within `tol`. `trace`: a list the
    estimate after every application is appended to."""
    shape, B = x0.shape, x0.shape[0]
    fl = lambda z: f(z.view(shape)).reshape(B, -1)                                       # [B,N] -> [B,N]
    x = x0.reshape(B, -1)
    X = x.new_zeros(B, m, x.shape[1])                                                     # [B,m,N] iterates
    Fx = torch.zeros_like(X)                                                              # [B,m,N] their images
    best = _Best(trace, shape)
    X[:, 0], Fx[:, 0] = x, fl(x)
    k, done = 1, best.update(X[:, 0], Fx[:, 0], tol)
    while not done and k < max_iter:
        n = min(k, m)
        G = (Fx[:, :n] - X[:, :n]).float()                                                # [B,n,N] residuals
        H = (G @ G.transpose(1, 2)).double()                                              # [B,n,n]
        reg = lam * H.diagonal(dim1=1, dim2=2).mean(1).clamp(min=_TINY)                  # [B]
        H = H + reg[:, None, None] * torch.eye(n, dtype=H.dtype, device=H.device)
        a = torch.linalg.solve(H, torch.ones(B, n, 1, dtype=H.dtype, device=H.device))   # [B,n,1]
        alpha = (a / a.sum(1, keepdim=True)).to(X.dtype)                                  # Σ α = 1
        i = k % m
        X[:, i] = (alpha.transpose(1, 2) @ Fx[:, :n])[:, 0]                               # Σ α_j F(x_j)
        Fx[:, i] = fl(X[:, i])
        k, done = k + 1, best.update(X[:, i], Fx[:, i], tol)
    return best.f.view(shape), k, best.worst


def broyden(f: Map, x0: torch.Tensor, *, max_iter: int, tol: float, memory: int = BROYDEN_MEMORY,
            trace: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, int, float]:
    """Limited-memory ("good") Broyden on g(x) = f(x) − x from x0 [B,...]: as `anderson`. The inverse-Jacobian
    estimate H = −I + Σ_j u_j v_jᵀ (per row) starts at −I (the first step is the plain step x <- f(x))."""
    shape, B = x0.shape, x0.shape[0]
    fl = lambda z: f(z.view(shape)).reshape(B, -1)
    dot = lambda a, b: (a * b).sum(1, keepdim=True)                                      # [B,1]
    us: list[torch.Tensor] = []                                                           # [B,N] each
    vs: list[torch.Tensor] = []

    def h_mul(z: torch.Tensor) -> torch.Tensor:                                           # H z
        return -z + sum((u * dot(v, z) for u, v in zip(us, vs)), torch.zeros_like(z))

    def ht_mul(z: torch.Tensor) -> torch.Tensor:                                          # Hᵀ z
        return -z + sum((v * dot(u, z) for u, v in zip(us, vs)), torch.zeros_like(z))

    best = _Best(trace, shape)
    x = x0.reshape(B, -1)
    fx = fl(x)
    gx = fx - x
    k, done = 1, best.update(x, fx, tol)
    while not done and k < max_iter:
        x_new = x - h_mul(gx)                                                             # Δx = −H g
        fx = fl(x_new)
        g_new = fx - x_new
        k, done = k + 1, best.update(x_new, fx, tol)
        dx, dg = x_new - x, g_new - gx
        vt = ht_mul(dx)                                                                   # (Δxᵀ H)ᵀ
        den = dot(vt, dg)                                                                 # Δxᵀ H Δg
        ok = den.abs() > _TINY
        u = torch.where(ok, (dx - h_mul(dg)) / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(dx))
        us.append(u)
        vs.append(torch.where(ok, vt, torch.zeros_like(vt)))
        if len(us) > memory:
            us.pop(0)
            vs.pop(0)
        x, gx = x_new, g_new
    return best.f.view(shape), k, best.worst


SOLVE: dict[str, Callable[..., tuple[torch.Tensor, int, float]]] = {"anderson": anderson, "broyden": broyden}


# ------------------------------------------------------------------------------------------------- backward modes
def implicit(F: Map, x: torch.Tensor, solver: str, *, max_iter: int, tol: float, info: SolveInfo) -> torch.Tensor:
    """z = F(x) with the implicit gradient: x [B,T,D] the solver's iterate (detached). The backward replaces the
    incoming gradient v = ∂L/∂z by the adjoint g = Jᵀg + v (J = ∂F/∂h at x, by vector-Jacobian products through
    this one application), so the weights and the read-in get (∂F/∂θ)ᵀ g. Records the adjoint solve in `info`."""
    z0 = x.detach().requires_grad_()
    z = F(z0)
    if not z.requires_grad:
        return z

    inside = [False]          # the vector-Jacobian products start at z too: the hook leaves their gradients alone

    def adjoint(v: torch.Tensor) -> torch.Tensor | None:
        if inside[0]:
            return None
        vjp = lambda y: torch.autograd.grad(z, z0, y, retain_graph=True)[0] + v          # Jᵀy + v
        inside[0] = True
        try:
            with torch.no_grad():
                g, n, res = SOLVE[solver](vjp, torch.zeros_like(v), max_iter=max_iter, tol=tol)
        finally:
            inside[0] = False
        info.backward_iters, info.backward_residual = n, res
        return g

    z.register_hook(adjoint)
    return z


def phantom(F: Map, x: torch.Tensor, steps: int, damping: float, ckpt: bool = False) -> torch.Tensor:
    """k = `steps` steps h <- λF(h) + (1 − λ)h from the detached x [B,T,D], with gradients (the phantom gradient);
    `ckpt`: each step's activations recomputed in the backward."""
    h = x.detach()
    for _ in range(steps):
        fh = checkpoint(F, h, use_reentrant=False) if ckpt and torch.is_grad_enabled() else F(h)
        h = fh if damping == 1.0 else damping * fh + (1.0 - damping) * h
    return h


# ------------------------------------------------------------------------------------------------- the model's mode
def loop_map(model, e: torch.Tensor, mask: torch.Tensor | None, rope=None) -> Map:
    """F(h) = TF(h + e, t*) of `model` (a LoopedTransformer) for read-in e [B,T,D]: [B,T,D] -> [B,T,D]; t* = r − 1
    under timestep modulation, r with `timestep_past="hold"` or `"own"` (the loops past r's own modulation; see the
    module's docstring)."""
    t_star = model.config.loops - (model.config.timestep_past not in ("hold", "own"))
    mods = model.modulations(1, e.device, offset=t_star)                                 # [1,k,4,D] | None
    mods_t = None if mods is None else mods[0]
    return lambda h: model.step(h, e, t_star, mods_t, mask, rope=rope, slot=0)   # injects e (past r with "own": β ⊙ e)


def initial_guess(model, e: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """The solver's start [B,T,D]: a carried `state` (a warm start), else the model's start state h_0
    (`LoopedTransformer.start`) — 0 for "input" (F(0) = TF(e), the unrolled first loop) and "zeros", an extension's
    start (the lab's noise start in training) — detached."""
    if state is not None:
        return state.detach()
    h0 = model.start(e)
    return (torch.zeros_like(e) if h0 is None else h0).detach()


def fixed_point(model, e: torch.Tensor, mask: torch.Tensor | None, state: torch.Tensor | None, loops: int,
                return_all: bool, row_loops: torch.Tensor | None, rope=None
                ) -> tuple[torch.Tensor, list[torch.Tensor] | None, SolveInfo]:
    """`LoopedTransformer.forward` under a solver: (h [B,T,D] the solution, with the gradient of `solver_backward`;
    with `return_all` the estimate after each of `loops` iterations; the solve's `SolveInfo`, also kept as
    `model.last_solve`). e: the read-in [B,T,D]; state: a warm start; loops: the call's loop count (the cap on the
    iterations unless solver_max_iter is set)."""
    cfg = model.config
    grad = torch.is_grad_enabled()
    if row_loops is not None:
        raise UserError(f"row_loops (a loop count per row) runs the unrolled loop; this model solves for its fixed "
                        f"point (model.solver={cfg.solver})")
    if return_all and grad:
        raise UserError(f"per-loop read-outs in training need every iteration's gradient; model.solver={cfg.solver} "
                        f"keeps none (train on the final read-out)")
    F = loop_map(model, e, mask, rope)
    max_iter = cfg.solver_max_iter or loops
    trace: list[torch.Tensor] | None = [] if return_all else None
    with torch.no_grad():
        x, n, res = SOLVE[cfg.solver](F, initial_guess(model, e, state), max_iter=max_iter,
                                      tol=cfg.solver_tol, trace=trace)
    info = SolveInfo(cfg.solver, n, res)
    back = Backward.parse(cfg.solver_backward)
    if back.kind == "phantom":
        h = phantom(F, x, back.steps, back.damping, cfg.checkpoint)
        info.backward_iters = back.steps if grad else None
    elif grad:
        h = implicit(F, x, cfg.solver, max_iter=max_iter, tol=cfg.solver_tol, info=info)
    else:
        h = x
    states = None
    if trace is not None:     # the estimate after iteration t = 1..loops (the solution once stopped; last: h)
        states = [trace[t] if t < len(trace) else h for t in range(loops - 1)] + [h]
    model.last_solve = info
    return h, states, info


def require_unroll(cfg, what: str) -> None:
    """A UserError when `what` (halting, a key/value cache) meets a model in the fixed-point mode."""
    if cfg.solver != "unroll":
        raise UserError(f"{what} runs the unrolled loop, one loop index per loop; this model solves for its fixed "
                        f"point (model.solver={cfg.solver})")


def solve_record(model) -> dict[str, Any]:
    """The latest solve's log fields (`SolveInfo.record`), {} for an unrolled model."""
    info = getattr(model, "last_solve", None)
    return info.record() if info is not None else {}


def check(cfg) -> None:
    """The fixed-point fields of a ModelConfig, checked (a ValueError naming the field: a config error)."""
    if cfg.solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS} (got {cfg.solver!r})")
    if not (isinstance(cfg.solver_tol, (int, float)) and math.isfinite(cfg.solver_tol) and 0 <= cfg.solver_tol < 1):
        raise ValueError(f"solver_tol must lie in [0, 1) (got {cfg.solver_tol})")
    if not 0 <= cfg.solver_max_iter <= MAX_ITER:
        raise ValueError(f"solver_max_iter must lie in 0..{MAX_ITER} (0: the call's loops; got {cfg.solver_max_iter})")
    back = Backward.parse(cfg.solver_backward)
    if cfg.solver == "unroll":
        if back.kind != "bptt":
            raise ValueError(f"solver_backward={cfg.solver_backward} needs a solver (solver=anderson or broyden); "
                             "the unrolled loop backpropagates through every loop (bptt)")
        return
    s = f"solver={cfg.solver}"
    refusals = [
        (back.kind == "bptt", f"{s} needs solver_backward=implicit or phantom:k (bptt through the solver's "
                              "iterations would keep every one of them)"),
        (not cfg.input_injection, f"{s} needs input_injection=true (F(h) = TF(h + e) sees the input at every "
                                  "iteration)"),
        (cfg.timestep_time == "normalized", f"{s} reads one loop index (r − 1); timestep_time='normalized' times "
                                            "the loops of a run of R loops, which a solver does not have"),
        (cfg.exit_gate, f"{s} stops by its residual: exit_gate (a learned stop per loop) cannot be combined with it"),
        (cfg.supervision_steps != 1, f"{s} runs to the fixed point: supervision_steps must be 1"),
        (cfg.grad_loops is not None, f"{s} keeps no unrolled loops: grad_loops must be null"),
        (cfg.state_noise > 0, f"{s} needs one map F: state_noise changes it between iterations (use "
                              "extensions.noise_start for a random initial guess)"),
        (cfg.dropout > 0, f"{s} needs one map F: dropout draws a new mask at every iteration (set dropout=0)"),
    ]
    for bad, msg in refusals:
        if bad:
            raise ValueError(msg)
