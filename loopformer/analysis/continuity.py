"""Continuity of a trained model: how far the output embeddings move per unit of input perturbation.

The paper bounds the approximation error of a looped transformer by three moduli of continuity of the target map
f: R^{d×N} -> R^{d×N} (Sec. 3.2, Definitions 3.3-3.5):

    sequence    ω_f(δ)      = sup { ||f(X) - f(X')||            : ||X - X'|| <= δ }
    contextual  ω_f^cont(δ) = sup { ||f(X)_{:,n} - f(X')_{:,n}|| : ||X - X'|| <= δ, X_{:,n} = X'_{:,n} }
    token       ω_f^tok(δ)  = sup { ||f(X)_{:,n} - f(X')_{:,n}|| :
                                    ||X_{:,n} - X'_{:,n}|| <= δ, X_{:,q} = X'_{:,q}, q ≠ n }

and App. D (with the authors' answer to reviewers) measures "continuity coefficients" of language models trained on
a perturbed WikiText-103 (10 % of the tokens replaced, `loopformer.text.corpus.perturb_tokens`): perturb the input
embeddings, measure the change of the output embeddings; timestep encoding cut it from 130.6 to 21.5.

Here X is the model's input embedding sequence (the read-in L1: token + position embedding, which input injection
re-adds at every loop) and f(X) the output embedding sequence (the residual stream after the last loop, before the
final norm and the head; `output="normed"` takes it after the final norm). For sample windows X of a corpus this
estimates the ratios ||Δf|| / ||ΔX|| — lower bounds of ω(δ)/δ at δ = ||ΔX|| — for

    noise          Gaussian noise of relative scale ρ (per-coordinate std ρ·RMS(X)):
                   sequence (every position), token (position n only, read at n),
                   contextual (every position but n = T-1, read at n)
    substitution   one token replaced by another (ΔX = embedding difference at n):
                   token (read at n), contextual (largest change at any other position), sequence (all)
    jacobian       the local Lipschitz constant ||∂f/∂X||_2 at X (power iteration with Jacobian-vector products):
                   the supremum of the sequence ratio as δ -> 0, i.e. the slope of ω_f at 0
    worst case     optional: the three moduli themselves over the box spanned by the sample embeddings, by the
                   estimators of `loopformer.theory.moduli` (certified lower bounds of the suprema)

The raw ratios depend on the scale of f: the pre-norm residual stream of a looped model grows with every loop,
while a TMLT block whose gates γ(t) start at zero (adaLN-Zero) adds little to it, so a smaller raw ratio can be a
smaller output rather than a smoother map.  Beside the raw ratios come scale-invariant ones:

    relative       (‖Δf‖/‖f(X)‖) / (‖ΔX‖/‖X‖) per window (sequence noise at `loopwise_scale`), and the relative
                   local Lipschitz constant ‖∂f/∂X‖₂·‖X‖/‖f(X)‖
    normed         the same two measures for the output after the final norm (what the head reads)
    per loop       raw and relative sequence ratios of the hidden state after every loop t = 1..R, its RMS, and
                   for a TMLT model the mean gate magnitudes |γ1(t)|, |γ2(t)|

Each is reported as mean / median / max over the samples, as a markdown table and a PNG plot.
Shapes: B samples, T window length, D width, V vocabulary, R loops.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from loopformer import fileio
from loopformer.errors import UserError
from loopformer.model.diagnostics import modulation_stats
from loopformer.model.maps import EmbeddingMap, LoopedEmbeddingMap
from loopformer.model.memory import check_fits, estimate
from loopformer.text.corpus import perturb_tokens  # noqa: F401  (the perturbed corpus lives with the corpora)
from loopformer.theory.moduli import estimate_modulus

KINDS = ("sequence", "token", "contextual")


# ------------------------------------------------------------------------------------------------------ measurement
@dataclass
class ContinuityConfig:
    samples: int = 16                      # B windows
    length: int = 128                      # T tokens per window
    scales: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)   # relative noise scales ρ
    power_iters: int = 20                  # Jacobian power iteration steps (0: skip)
    moduli_samples: int = 0                # > 0: also the worst-case moduli of loopformer.theory (random pairs ...)
    moduli_steps: int = 50                 # ... then projected gradient ascent steps), at the smallest scale
    seed: int = 0
    protect: int | None = None          # a token id never substituted in or out (EOT)
    loopwise_scale: float = 1e-2           # relative noise scale ρ of the relative and per-loop measures

    def __post_init__(self) -> None:
        if self.samples < 1 or self.length < 2:
            raise UserError("continuity needs samples >= 1 and length >= 2")
        if not self.scales or not all(0 < s < math.inf for s in [*self.scales, self.loopwise_scale]):
            raise UserError("noise scales must be positive finite numbers")
        if self.power_iters < 0 or self.moduli_samples < 0 or self.moduli_steps < 0:
            raise UserError("power_iters, moduli_samples and moduli_steps must be >= 0")


@dataclass
class Stat:
    mean: float
    median: float
    max: float

    @classmethod
    def of(cls, x: np.ndarray) -> Stat:
        x = np.asarray(x, dtype=np.float64)
        return cls(float(x.mean()), float(np.median(x)), float(x.max()))


@dataclass
class ContinuityReport:
    noise: dict[str, dict[str, Stat]] = field(default_factory=dict)   # "1e-2" -> kind -> Stat
    substitution: dict[str, Stat] = field(default_factory=dict)       # kind -> Stat
    jacobian: Stat | None = None
    moduli: dict[str, float] = field(default_factory=dict)            # kind -> worst-case ω(δ)/δ (theory estimator)
    moduli_delta: float | None = None
    input_rms: float = 0.0
    positions: list[int] = field(default_factory=list)                # the position n of each sample
    samples: int = 0
    length: int = 0
    output_rms: float = 0.0                                           # RMS of f(X) (scale of the raw ratios)
    relative: dict[str, Stat] = field(default_factory=dict)           # "sequence", "jacobian" (scale-invariant)
    normed: dict[str, Stat] = field(default_factory=dict)             # after the final norm: raw/relative/jacobian...
    loopwise: dict[str, list] = field(default_factory=dict)           # per loop t: raw, relative (Stat), rms
    gates: dict[str, list[float]] = field(default_factory=dict)       # TMLT: mean |γ1|, |γ2|, |α1|, |α2| per loop
    loopwise_scale: float = 0.0                                       # the ρ of `relative`, `normed`, `loopwise`
    raw: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def relative_coefficient(self) -> float | None:
        """Scale-invariant headline: the mean relative local Lipschitz constant ‖∂f/∂X‖₂·‖X‖/‖f(X)‖."""
        st = self.relative.get("jacobian")
        return None if st is None else st.mean

    @property
    def coefficient(self) -> float:
        """The headline continuity coefficient: the mean local Lipschitz constant (or, without it, the mean
        sequence ratio at the smallest noise scale)."""
        if self.jacobian is not None:
            return self.jacobian.mean
        first = min(self.noise, key=float)
        return self.noise[first]["sequence"].mean

    def to_dict(self) -> dict:
        d = asdict(self)
        d["per_sample"] = d.pop("raw")
        d["coefficient"] = self.coefficient
        d["relative_coefficient"] = self.relative_coefficient
        return d


def _norm(x: torch.Tensor, dims) -> torch.Tensor:
    return x.double().pow(2).sum(dims).sqrt()


def _scale_key(s: float) -> str:
    return f"{s:g}"


@torch.no_grad()
def noise_ratios(fmap: EmbeddingMap, X: torch.Tensor, rho: float, gen: torch.Generator,
                 positions: torch.Tensor) -> dict[str, np.ndarray]:
    """Ratios [B] for Gaussian noise of per-coordinate std `rho` (absolute) on X [B,T,D]; `positions` [B] = n."""
    B, T, D = X.shape
    ar = torch.arange(B, device=X.device)
    f0 = fmap.apply(X)                                                                # [B,T,D']
    out: dict[str, np.ndarray] = {}
    # sequence: every position
    d = torch.randn(X.shape, generator=gen, device=X.device, dtype=X.dtype) * rho
    df = fmap.apply(X + d) - f0
    out["sequence"] = (_norm(df, (1, 2)) / _norm(d, (1, 2))).cpu().numpy()
    # token: only position n, read at n
    d = torch.zeros_like(X)
    d[ar, positions] = torch.randn(B, D, generator=gen, device=X.device, dtype=X.dtype) * rho
    df = fmap.apply(X + d) - f0
    out["token"] = (_norm(df[ar, positions], (1,)) / _norm(d[ar, positions], (1,))).cpu().numpy()
    # contextual: every position but the last, read at the last
    d = torch.randn(X.shape, generator=gen, device=X.device, dtype=X.dtype) * rho
    d[:, -1] = 0
    df = fmap.apply(X + d) - f0
    out["contextual"] = (_norm(df[:, -1], (1,)) / _norm(d, (1, 2))).cpu().numpy()
    return out


@torch.no_grad()
def substitution_ratios(fmap: EmbeddingMap, idx: torch.Tensor, vocab_size: int, positions: torch.Tensor,
                        rng: np.random.Generator, protect: int | None = None) -> dict[str, np.ndarray]:
    """Replace token n of each row by a different random token; ratios [B] of output change to embedding change."""
    B, T = idx.shape
    ar = torch.arange(B, device=idx.device)
    old = idx[ar, positions].cpu().numpy()
    excluded = [old] + ([np.full_like(old, protect)] if protect is not None else [])
    new = rng.integers(0, vocab_size, size=B)
    bad = np.zeros(B, dtype=bool)
    for e in excluded:
        bad |= new == e
    while bad.any():  # redraw the few collisions (uniform over the allowed tokens)
        new[bad] = rng.integers(0, vocab_size, size=int(bad.sum()))
        bad[:] = False
        for e in excluded:
            bad |= new == e
    idx2 = idx.clone()
    idx2[ar, positions] = torch.as_tensor(new, device=idx.device, dtype=idx.dtype)
    X, X2 = fmap.embed(idx), fmap.embed(idx2)
    dX = _norm((X2 - X)[ar, positions], (1,))                                        # [B]
    df = fmap.apply(X2) - fmap.apply(X)                                              # [B,T,D']
    per_pos = _norm(df, (2,))                                                        # [B,T]
    tok = per_pos[ar, positions]
    others = per_pos.clone()
    others[ar, positions] = 0
    return {"token": (tok / dX).cpu().numpy(),
            "contextual": (others.max(1).values / dX).cpu().numpy(),
            "sequence": (_norm(df, (1, 2)) / dX).cpu().numpy()}


@torch.no_grad()
def scale_free_ratios(fmap: EmbeddingMap, X: torch.Tensor, rho: float, gen: torch.Generator
                      ) -> dict[str, np.ndarray]:
    """Sequence noise of absolute std `rho` on X [B,T,D], read after every loop and after the final norm.

    Returns per-sample arrays: "raw" [R,B] = ‖Δh_t‖/‖ΔX‖, "relative" [R,B] = (‖Δh_t‖/‖h_t‖)/(‖ΔX‖/‖X‖),
    "rms" [R,B] = RMS(h_t), and "normed raw" / "normed relative" [B] for the output after the final norm."""
    base = fmap.apply_all(X)
    d = torch.randn(X.shape, generator=gen, device=X.device, dtype=X.dtype) * rho
    pert = fmap.apply_all(X + d)
    nX, dX = _norm(X, (1, 2)), _norm(d, (1, 2))                                       # [B]
    h0, h1 = base["loops"], pert["loops"]                                             # [R,B,T,D']
    dh, nh = _norm(h1 - h0, (2, 3)), _norm(h0, (2, 3))                                # [R,B]
    out = {"raw": (dh / dX).cpu().numpy(), "relative": ((dh / nh) / (dX / nX)).cpu().numpy(),
           "rms": (nh / math.sqrt(h0.shape[2] * h0.shape[3])).cpu().numpy()}
    if base["normed"] is not None:
        dn, nn_ = _norm(pert["normed"] - base["normed"], (1, 2)), _norm(base["normed"], (1, 2))
        out["normed raw"] = (dn / dX).cpu().numpy()
        out["normed relative"] = ((dn / nn_) / (dX / nX)).cpu().numpy()
    return out


def jacobian_norm(fmap: EmbeddingMap, X: torch.Tensor, iters: int = 20, seed: int = 0) -> np.ndarray:
    """||∂f/∂X||_2 per sample [B] by power iteration on JᵀJ (samples are independent, so J is block diagonal).

    One graph of f at X gives both products: Jᵀu by a backward pass, and J v by differentiating u -> Jᵀu (linear in
    u) once more — the double-backward form of a forward-mode product. Attention runs on the math kernel, which
    supports double backward.
    """

    gen = torch.Generator(device=X.device).manual_seed(seed)
    X = X.detach().clone().requires_grad_(True)
    v = torch.randn(X.shape, generator=gen, device=X.device, dtype=X.dtype)
    v = v / _norm(v, (1, 2)).to(X.dtype)[:, None, None]
    sigma = torch.zeros(X.shape[0], dtype=torch.float64, device=X.device)
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        Y = fmap.apply(X)                                                              # [B,T,D']
        u = torch.zeros_like(Y, requires_grad=True)
        (jt_u,) = torch.autograd.grad(Y, X, grad_outputs=u, create_graph=True)         # Jᵀu, linear in u
        for _ in range(max(1, iters)):
            (jv,) = torch.autograd.grad(jt_u, u, grad_outputs=v, retain_graph=True)    # J v
            sigma = _norm(jv.detach(), (1, 2))                                         # ||J v||, ||v|| = 1
            (w,) = torch.autograd.grad(Y, X, grad_outputs=jv.detach(), retain_graph=True)  # Jᵀ J v
            v = (w / _norm(w, (1, 2)).clamp(min=1e-300).to(X.dtype)[:, None, None]).detach()
    return sigma.cpu().numpy()


def theory_moduli(fmap: EmbeddingMap, X: torch.Tensor, delta: float, samples: int = 256, steps: int = 50,
                  seed: int = 0) -> dict[str, float]:
    """Worst-case moduli ω^kind(δ) over the box spanned by the sample embeddings X [B,T,D], by the estimators of
    `loopformer.theory.moduli` (random feasible pairs, then projected gradient ascent): certified lower bounds of
    the suprema of Definitions 3.3-3.5, reported as ω(δ)/δ. Inputs anywhere in the box, not only real tokens."""

    T, D = X.shape[1], X.shape[2]
    lo, hi = float(X.min()), float(X.max())
    dtype, device = X.dtype, X.device

    def f(Z):  # [B, d, N] (numpy float64 or torch float64) -> [B, d, N]
        if isinstance(Z, np.ndarray):
            with torch.no_grad():
                out = fmap.apply(torch.as_tensor(Z, device=device).transpose(1, 2).to(dtype))
            return out.transpose(1, 2).double().cpu().numpy()
        return fmap.apply(Z.to(device).transpose(1, 2).to(dtype)).transpose(1, 2).double().cpu()

    out = {}
    names = {"seq": "sequence", "tok": "token", "cont": "contextual"}
    for kind, name in names.items():
        est = estimate_modulus(f, delta, kind, D, T, samples=samples, steps=steps, restarts=4, seed=seed, lo=lo,
                               hi=hi, batch=min(samples, 64))
        out[name] = est.value / delta
    return out


def measure_continuity(fmap: EmbeddingMap, idx: torch.Tensor, vocab_size: int,
                       cfg: ContinuityConfig | None = None, progress: bool = True) -> ContinuityReport:
    """All estimates on the sample windows `idx` [B,T]; see the module docstring."""
    cfg = cfg or ContinuityConfig()
    B, T = idx.shape
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator(device=idx.device).manual_seed(int(rng.integers(2 ** 62)))
    positions = torch.as_tensor(rng.integers(0, T, size=B), device=idx.device)
    with torch.no_grad():
        X = fmap.embed(idx).detach()
    rms = float(X.double().pow(2).mean().sqrt())
    rep = ContinuityReport(input_rms=rms, positions=positions.tolist(), samples=B, length=T)
    steps = len(cfg.scales) + 2 + (1 if cfg.power_iters else 0) + (1 if cfg.moduli_samples else 0)
    with tqdm(total=steps, desc="continuity", disable=not progress) as bar:
        for s in cfg.scales:
            r = noise_ratios(fmap, X, s * rms, gen, positions)
            rep.noise[_scale_key(s)] = {k: Stat.of(v) for k, v in r.items()}
            rep.raw.update({f"noise {_scale_key(s)} {k}": v.tolist() for k, v in r.items()})
            bar.update(1)
        r = substitution_ratios(fmap, idx, vocab_size, positions, rng, cfg.protect)
        rep.substitution = {k: Stat.of(v) for k, v in r.items()}
        rep.raw.update({f"substitution {k}": v.tolist() for k, v in r.items()})
        bar.update(1)
        with torch.no_grad():
            f0 = fmap.apply(X)
        rep.output_rms = float(f0.double().pow(2).mean().sqrt())
        size = _norm(X, (1, 2)).cpu().numpy() / _norm(f0, (1, 2)).cpu().numpy()       # ‖X‖/‖f(X)‖ per sample
        rep.loopwise_scale = cfg.loopwise_scale
        r = scale_free_ratios(fmap, X, cfg.loopwise_scale * rms, gen)
        rep.relative["sequence"] = Stat.of(r["relative"][-1])
        rep.loopwise = {"raw": [Stat.of(v) for v in r["raw"]], "relative": [Stat.of(v) for v in r["relative"]],
                        "rms": [float(v.mean()) for v in r["rms"]]}
        rep.raw.update({"loopwise raw": r["raw"].tolist(), "loopwise relative": r["relative"].tolist()})
        if "normed raw" in r:
            rep.normed = {"sequence": Stat.of(r["normed raw"]), "relative": Stat.of(r["normed relative"])}
            rep.raw.update({"normed raw": r["normed raw"].tolist(), "normed relative": r["normed relative"].tolist()})
        bar.update(1)
        if cfg.power_iters:
            j = jacobian_norm(fmap, X, cfg.power_iters, seed=cfg.seed)
            rep.jacobian = Stat.of(j)
            rep.relative["jacobian"] = Stat.of(j * size)
            rep.raw["jacobian"] = j.tolist()
            normed = fmap.normed_map()
            if normed is not None:
                jn = jacobian_norm(normed, X, cfg.power_iters, seed=cfg.seed)
                with torch.no_grad():
                    size_n = _norm(X, (1, 2)).cpu().numpy() / _norm(normed.apply(X), (1, 2)).cpu().numpy()
                rep.normed["jacobian"] = Stat.of(jn)
                rep.normed["relative jacobian"] = Stat.of(jn * size_n)
                rep.raw["normed jacobian"] = jn.tolist()
            bar.update(1)
        if cfg.moduli_samples:
            # δ = the norm of the smallest noise perturbation of a whole window
            rep.moduli_delta = min(cfg.scales) * rms * math.sqrt(T * X.shape[2])
            rep.moduli = theory_moduli(fmap, X, rep.moduli_delta, cfg.moduli_samples, cfg.moduli_steps, cfg.seed)
            bar.update(1)
    return rep


def sample_windows(tokens: np.ndarray, samples: int, length: int, seed: int) -> torch.Tensor:
    """`samples` windows of `length` tokens at seeded random offsets: [B,T] int64."""
    if len(tokens) < length:
        raise UserError(f"the split has {len(tokens)} tokens, fewer than the window length {length}")
    rng = np.random.default_rng([seed, 1])
    starts = rng.integers(0, len(tokens) - length + 1, size=samples)
    return torch.from_numpy(np.stack([np.asarray(tokens[s:s + length], dtype=np.int64) for s in starts]))


# ---------------------------------------------------------------------------------------------------------- reports
def _fmt(x: float) -> str:
    if x == 0 or (1e-3 <= abs(x) < 1e4):
        return f"{x:.4g}"
    return f"{x:.3e}"


def to_markdown(reports: dict[str, ContinuityReport]) -> str:
    """One table: rows are measurements, columns 'mean / max' per model."""
    names = list(reports)
    head = "| measurement | " + " | ".join(f"{n} (mean / max)" for n in names) + " |"
    sep = "|---|" + "---|" * len(names)
    rows = [head, sep]

    def row(label: str, get: Callable[[ContinuityReport], Stat | None]) -> None:
        cells = []
        for n in names:
            st = get(reports[n])
            cells.append("—" if st is None else f"{_fmt(st.mean)} / {_fmt(st.max)}")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")

    first = reports[names[0]]
    rho = _fmt(first_scale(reports))
    row("**local Lipschitz ‖∂f/∂X‖₂** (raw)", lambda r: r.jacobian)
    row("**relative local Lipschitz ‖∂f/∂X‖₂·‖X‖/‖f(X)‖**", lambda r: r.relative.get("jacobian"))
    row(f"relative (‖Δf‖/‖f‖)/(‖ΔX‖/‖X‖), noise ρ={rho} · sequence", lambda r: r.relative.get("sequence"))
    row("after the final norm: local Lipschitz (raw)", lambda r: r.normed.get("jacobian"))
    row("after the final norm: relative local Lipschitz", lambda r: r.normed.get("relative jacobian"))
    row(f"after the final norm: noise ρ={rho} · sequence (raw)", lambda r: r.normed.get("sequence"))
    row(f"after the final norm: noise ρ={rho} · sequence (relative)", lambda r: r.normed.get("relative"))
    for s in first.noise:
        for k in KINDS:
            row(f"noise ρ={s} · {k}", lambda r, s=s, k=k: r.noise.get(s, {}).get(k))
    for k in KINDS:
        row(f"substitution · {k}", lambda r, k=k: r.substitution.get(k))
    if any(r.moduli for r in reports.values()):
        for k in KINDS:
            row(f"worst case ω(δ)/δ · {k}",
                lambda r, k=k: Stat(r.moduli[k], r.moduli[k], r.moduli[k]) if k in r.moduli else None)
    rows.append("")
    rows.append(f"Ratios ‖Δf‖/‖ΔX‖ over {first.samples} windows of {first.length} tokens; X = input embeddings "
                f"(RMS {', '.join(_fmt(reports[n].input_rms) for n in names)}), f = output embeddings; noise std "
                "= ρ·RMS(X). Worst case (if measured): `loopformer.theory.moduli` over the box of the sample "
                "embeddings at δ = smallest ρ·RMS(X)·√(TD). Continuity coefficient (mean local Lipschitz): "
                + ", ".join(f"{n} {_fmt(reports[n].coefficient)}" for n in names) + "; RMS of f(X): "
                + ", ".join(f"{n} {_fmt(reports[n].output_rms)}" for n in names) + ".")
    loop_table = loopwise_markdown(reports)
    return "\n".join(rows) + "\n" + ("\n" + loop_table if loop_table else "")


def first_scale(reports: dict[str, ContinuityReport]) -> float:
    return next(iter(reports.values())).loopwise_scale


def loopwise_markdown(reports: dict[str, ContinuityReport]) -> str:
    """Per loop t: raw and relative sequence ratios (mean) of the hidden state after loop t, its RMS, and the
    TMLT gate magnitudes mean |γ1(t)| / |γ2(t)| (attention / MLP residual), one column group per model."""
    names = [n for n in reports if reports[n].loopwise.get("raw")]
    if not names:
        return ""
    R = max(len(reports[n].loopwise["raw"]) for n in names)
    gated = [n for n in names if reports[n].gates.get("gate_attn")]
    head = "| loop t | " + " | ".join(f"{n} raw | {n} relative | {n} RMS(h_t)" for n in names)
    head += "".join(f" | {n} \\|γ1\\| / \\|γ2\\|" for n in gated) + " |"
    sep = "|---|" + "---|" * (3 * len(names) + len(gated))
    lines = [head, sep]
    for t in range(R):
        cells = []
        for n in names:
            lw = reports[n].loopwise
            if t < len(lw["raw"]):
                cells += [_fmt(lw["raw"][t].mean), _fmt(lw["relative"][t].mean), _fmt(lw["rms"][t])]
            else:
                cells += ["—"] * 3
        for n in gated:
            g = reports[n].gates
            cells.append(f"{_fmt(g['gate_attn'][t])} / {_fmt(g['gate_mlp'][t])}" if t < len(g["gate_attn"]) else "—")
        lines.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Per loop: sequence noise ρ={_fmt(first_scale(reports))} on the input embeddings, read after loop "
                 "t (mean over the windows): raw ‖Δh_t‖/‖ΔX‖, relative (‖Δh_t‖/‖h_t‖)/(‖ΔX‖/‖X‖), RMS of h_t; "
                 "TMLT gates: mean |γ(t)| over the width.")
    return "\n".join(lines) + "\n"


def plot(reports: dict[str, ContinuityReport], path: str | os.PathLike) -> None:
    """Ratio against noise scale, one panel per modulus; substitution as a marker, Lipschitz as a dotted line."""
    import matplotlib  # heavy: imported only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, kind in zip(axes, KINDS):
        for i, (name, rep) in enumerate(reports.items()):
            c = colors[i % len(colors)]
            xs = sorted(rep.noise, key=float)
            ax.plot([float(s) for s in xs], [rep.noise[s][kind].mean for s in xs], "o-", color=c, label=name)
            ax.plot([float(s) for s in xs], [rep.noise[s][kind].max for s in xs], "o:", color=c, alpha=0.4)
            if kind in rep.substitution:
                ax.axhline(rep.substitution[kind].mean, color=c, ls="--", lw=1, alpha=0.7)
            if kind == "sequence" and rep.jacobian is not None:
                ax.axhline(rep.jacobian.mean, color=c, ls=":", lw=1.5)
        ax.set_xscale("log")
        values = [float(y) for line in ax.get_lines() for y in line.get_ydata()]
        if values and all(math.isfinite(y) and y > 0 for y in values):    # a log scale of zeros or NaN fails
            ax.set_yscale("log")
        ax.set_xlabel("relative noise scale ρ")
        ax.set_title(f"{kind} continuity")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("‖Δf‖ / ‖ΔX‖  (solid: mean, dotted: max)")
    axes[0].legend(fontsize=8, title="dashed: substitution; dotted line: ‖J‖₂", title_fontsize=7)
    fig.tight_layout()
    fileio.write_figure(fig, path, dpi=120)
    plt.close(fig)


def write_json(reports: dict[str, ContinuityReport], path: str | os.PathLike, extra: dict | None = None) -> None:
    data = {"models": {n: r.to_dict() for n, r in reports.items()}, **(extra or {})}
    fileio.write_json(path, data, default=lambda o: o if not isinstance(o, float) or math.isfinite(o) else None)


def write_text(text: str, path: str | os.PathLike) -> None:
    fileio.write_text(path, text)


def continuity_of_checkpoint(model, tokens: np.ndarray, vocab_size: int, cfg: ContinuityConfig,
                             loops: int | None = None, output: str = "hidden",
                             progress: bool = True) -> ContinuityReport:
    """Measure a `LoopedTransformer` on windows of a token split."""
    T = min(cfg.length, model.config.max_len) if model.config.pos == "learned" else cfg.length
    device = next(model.parameters()).device
    R, mc = loops or model.config.loops, model.config
    # sized before anything is drawn: every loop's state kept (the loop-wise ratios), the local Lipschitz constant's
    # double backward (a training-sized graph), and the attention probabilities of every loop and layer
    parts = estimate(mc, batch=cfg.samples, seq_len=T, loops=R, training=bool(cfg.power_iters), read_outs=R)
    parts["attention"] = 4 * cfg.samples * R * mc.n_layers * mc.n_heads * T * T * (3 if cfg.power_iters else 1)
    check_fits(parts, device, "the continuity measurement", hint="fewer --samples or a shorter --length")
    idx = sample_windows(tokens, cfg.samples, T, cfg.seed)

    rep = measure_continuity(LoopedEmbeddingMap(model, loops, output), idx.to(device), vocab_size, cfg,
                             progress=progress)
    rep.gates = modulation_stats(model, loops or model.config.loops) or {}
    return rep


__all__ = ["EmbeddingMap", "LoopedEmbeddingMap", "ContinuityConfig", "ContinuityReport", "Stat", "noise_ratios",
           "substitution_ratios", "scale_free_ratios", "jacobian_norm", "theory_moduli", "measure_continuity",
           "sample_windows", "to_markdown", "loopwise_markdown", "plot",
           "write_json", "continuity_of_checkpoint", "perturb_tokens"]
