"""Target functions f: [0,1]^{d×N} → R^{d×N} for the moduli estimators and the rate experiment (Sec. 3.2, Thm 3.6):
built-in ones, a user's callable named `package.module:function` (or returned by a factory called with literal
keyword arguments, `package.module:factory(key=value, ...)`), or a trained checkpoint.

A target maps an array [..., d, N] to an array of the same shape: numpy float64 always, and a torch float64
tensor too when it should be differentiable (then the estimators add projected gradient ascent).
Shapes: B batch, d token dimension, N sequence length, D model width.
"""

from __future__ import annotations

import ast
import importlib
import os
from collections.abc import Callable

import numpy as np
import torch

from loopformer.errors import UserError
from loopformer.model.io import load
from loopformer.model.maps import LoopedEmbeddingMap
from loopformer.theory.rate import default_target


def _xp(X):
    return torch if isinstance(X, torch.Tensor) else np


def identity_target(X):
    """f(X) = X: ω(δ) = ω^tok(δ) = δ, ω^cont(δ) = 0."""
    return X * 1.0


def sum_target(X):
    """f(X)_{:,n} = Σ_j X_{:,j}: ω^tok(δ) = δ, ω^cont(δ) = √(N−1)·δ, ω(δ) = N·δ (p = 2)."""
    if _xp(X) is np:
        X = np.asarray(X, dtype=np.float64)
        return np.broadcast_to(X.sum(-1, keepdims=True), X.shape).copy()
    return X.sum(-1, keepdim=True).expand_as(X) * 1.0


BUILTIN: dict[str, Callable] = {"default": default_target, "identity": identity_target, "sum": sum_target}


def _call_options(spec: str, text: str) -> dict:
    """The keyword arguments `key=value, ...` of a factory call in a target spec (values: Python literals)."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        if call.args or any(kw.arg is None for kw in call.keywords):
            raise ValueError("only key=value arguments")
        return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError) as exc:
        raise UserError(f"target {spec!r}: the arguments ({text}) must be key=value pairs of literals "
                        f"({type(exc).__name__}: {exc})") from None


def load_target(spec: str) -> Callable:
    """A built-in name (`BUILTIN`), `package.module:function` (attribute paths allowed: `mod:Class.method`), or a
    factory called with literal keyword arguments, `package.module:factory(key=value, ...)`, which returns the
    target (e.g. `loopformer.tasks.dial_map:target(token_lipschitz=4)`)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    mod_name, sep, attr = spec.partition(":")
    call = None
    if sep and attr.endswith(")") and "(" in attr:
        attr, call = attr[:-1].split("(", 1)
        attr = attr.strip()
    if not sep or not mod_name or not attr:
        raise UserError(f"target {spec!r}: expected one of {', '.join(BUILTIN)}, package.module:function or "
                        "package.module:factory(key=value, ...)")
    try:
        obj = importlib.import_module(mod_name)
    except Exception as exc:   # ImportError, or any error raised while importing the user's module
        raise UserError(f"target {spec!r}: cannot import {mod_name!r} ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"target {spec!r}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if call is not None:
        options = _call_options(spec, call)
        if not callable(obj):
            raise UserError(f"target {spec!r}: {attr!r} is not callable")
        try:
            obj = obj(**options)
        except UserError as exc:
            raise UserError(f"target {spec!r}: {exc}") from None
        except Exception as exc:
            raise UserError(f"target {spec!r}: {attr}({call}) failed ({type(exc).__name__}: {exc})") from None
    if not callable(obj):
        raise UserError(f"target {spec!r} is not callable")
    return obj


def check_target(f: Callable, d: int, N: int, spec: str = "target") -> None:
    """Call f on a batch [2, d, N] and on one sequence [d, N]; an exception, a wrong shape or a non-finite value
    is a `UserError` naming the target."""
    rng = np.random.default_rng(0)
    for shape in ((2, d, N), (d, N)):
        X = rng.uniform(0.0, 1.0, size=shape)
        try:
            Y = np.asarray(f(X), dtype=np.float64)
        except Exception as exc:
            raise UserError(f"{spec} failed on an input of shape {list(shape)}: {type(exc).__name__}: {exc}") \
                from None
        if Y.shape != shape:
            raise UserError(f"{spec} must map an array of shape {list(shape)} to the same shape "
                            f"(got {list(Y.shape)})")
        if not np.isfinite(Y).all():
            raise UserError(f"{spec} returned a non-finite value on an input of shape {list(shape)}")


def checkpoint_target(path: str, N: int, loops: int | None = None, device: str = "cpu"
                      ) -> tuple[Callable, int, float, float]:
    """A trained checkpoint as a target: X [B, D, N] input embeddings (the read-in's output) → the residual stream
    after the last loop [B, D, N], in float64.  Returns (f, d = D, lo, hi) with [lo, hi] the range of the model's
    token + position embeddings at positions 0..N−1 (the box the estimators search)."""
    if not os.path.isdir(path):
        raise UserError(f"checkpoint not found: {path}")
    model = load(path, device=device).double()
    cfg = model.config
    if cfg.input_dim > 0:
        raise UserError(f"{path}: a model with a vector read-in (input_dim={cfg.input_dim}) has no token "
                        "embeddings to perturb")
    if N > cfg.max_len:
        raise UserError(f"N={N} exceeds the model's max_len={cfg.max_len}")
    if loops is not None and loops < 1:
        raise UserError(f"loops must be >= 1 (got {loops})")
    fmap = LoopedEmbeddingMap(model, loops)
    with torch.no_grad():
        idx = torch.arange(cfg.vocab_size, device=device)[:, None].expand(cfg.vocab_size, N)
        E = fmap.embed(idx)
    lo, hi = float(E.min()), float(E.max())

    def f(X):
        if isinstance(X, torch.Tensor):
            Z = X.to(device=device, dtype=torch.float64)
            squeeze = Z.dim() == 2
            Z = Z[None] if squeeze else Z
            out = fmap.apply(Z.transpose(1, 2)).transpose(1, 2).cpu()
            return out[0] if squeeze else out
        Z = np.asarray(X, dtype=np.float64)
        squeeze = Z.ndim == 2
        Z = Z[None] if squeeze else Z
        with torch.no_grad():
            out = fmap.apply(torch.as_tensor(Z, device=device).transpose(1, 2)).transpose(1, 2).cpu().numpy()
        return out[0] if squeeze else out

    return f, cfg.d_model, lo, hi

