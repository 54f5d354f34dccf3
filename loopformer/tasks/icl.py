"""In-context learning of function classes (paper Sec. 5.1.2, App. C.2, Table 3; the setting of Garg et al. 2022
and Yang et al. 2024).

A prompt is (x_1, f(x_1), ..., x_n, f(x_n)) with x_i ~ N(0, I_d) and f drawn from a function class; the model
must predict f(x_i) from the pairs before it. Function classes (`FUNCTION_CLASSES`):

    decision_tree   depth-4 full binary tree (15 inner nodes, 16 leaves): inner nodes hold a coordinate drawn
                    uniformly from all d, leaves a value ~ N(0, 1); evaluate from the root, going right when
                    x[coordinate] > 0                                                   (the paper's task, d = 20)
    linear          f(x) = wᵀx,  w ~ N(0, I_d)
    sparse_linear   as linear with all but `sparsity` (3) random coordinates of w zeroed
    relu2nn         f(x) = sqrt(2 / h) · Σ_j v_j ReLU(u_jᵀx),  u_j ~ N(0, I_d), v_j ~ N(0, 1), h = 100 hidden units

Curriculum (Garg et al.): only the first `dims` coordinates are non-zero (the rest of x is set to 0) and prompts
have `points` pairs; both grow by `inc` every `interval` steps from `start` to `end` (paper: dims 5 → 20 by 1
and points 26 → 101 by 5, every 5000 steps).

The model reads the prompt interleaved as 2n tokens of width d + 1:

    token 2i     [x_i, 0]          (its output predicts y_i — `prediction_positions`)
    token 2i + 1 [0, ..., 0, y_i]

Metric: the squared error at each prompt position divided by d (`squared_error_curve`, a curve over the number
of in-context examples), compared with baselines that see the same prefix: least squares, k-nearest neighbours
and a fitted decision tree (scikit-learn). Shapes: B prompts, n points, d dimensions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from loopformer.errors import UserError

FUNCTION_CLASSES = ("decision_tree", "linear", "sparse_linear", "relu2nn")


@dataclass
class ICLTask:
    """A function class and its sizes; `sample` draws a batch of prompts from a numpy Generator."""

    function_class: str = "decision_tree"
    n_dims: int = 20
    depth: int = 4             # decision_tree
    sparsity: int = 3          # sparse_linear
    hidden: int = 100          # relu2nn
    noise_std: float = 0.0     # Gaussian noise added to the ys

    name = "icl"

    def __post_init__(self) -> None:
        if self.function_class not in FUNCTION_CLASSES:
            raise UserError(f"unknown function class {self.function_class!r} "
                            f"(expected one of: {', '.join(FUNCTION_CLASSES)})")
        for key, lo in (("n_dims", 1), ("depth", 1), ("sparsity", 1), ("hidden", 1)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise UserError(f"option {key} must be an integer >= {lo}, got {v!r}")
        if self.noise_std < 0:
            raise UserError(f"option noise_std must be >= 0, got {self.noise_std}")

    @property
    def token_dim(self) -> int:
        """Width of the interleaved tokens: d + 1."""
        return self.n_dims + 1

    def options(self) -> dict:
        return {k: getattr(self, k) for k in ("function_class", "n_dims", "depth", "sparsity", "hidden",
                                              "noise_std")}

    # ---------------------------------------------------------------------------------------------- sampling
    def sample_xs(self, batch_size: int, rng: np.random.Generator, n_dims_active: int | None, n_points: int):
        d = self.n_dims
        k = d if n_dims_active is None else int(n_dims_active)
        if not 1 <= k <= d:
            raise UserError(f"n_dims_active must be in 1..{d}, got {k}")
        if n_points < 1:
            raise UserError(f"n_points must be >= 1, got {n_points}")
        xs = rng.standard_normal((batch_size, n_points, d))
        xs[:, :, k:] = 0.0
        return xs

    def sample_functions(self, batch_size: int, rng: np.random.Generator, n_dims_active: int | None = None):
        """Parameters of `batch_size` functions (a dict of arrays), for `evaluate`."""
        d = self.n_dims
        k = d if n_dims_active is None else int(n_dims_active)
        if self.function_class == "decision_tree":
            n_nodes = 2 ** (self.depth + 1) - 1
            return {"coords": rng.integers(0, d, size=(batch_size, n_nodes)),
                    "values": rng.standard_normal((batch_size, n_nodes))}
        if self.function_class == "linear":
            return {"w": rng.standard_normal((batch_size, d))}
        if self.function_class == "sparse_linear":
            w = rng.standard_normal((batch_size, d))
            s = min(self.sparsity, k)
            keep = np.argsort(rng.random((batch_size, k)), axis=1)[:, :s]   # s random active coordinates
            mask = np.zeros((batch_size, d), dtype=bool)
            np.put_along_axis(mask, keep, True, axis=1)
            return {"w": np.where(mask, w, 0.0)}
        return {"u": rng.standard_normal((batch_size, d, self.hidden)),
                "v": rng.standard_normal((batch_size, self.hidden))}

    def evaluate(self, params: dict, xs: np.ndarray) -> np.ndarray:
        """ys [B, n] of the functions `params` at xs [B, n, d]."""
        if self.function_class == "decision_tree":
            coords, values = params["coords"], params["values"]
            b, n, _ = xs.shape
            node = np.zeros((b, n), dtype=np.int64)
            rows = np.arange(b)[:, None]
            for _ in range(self.depth):
                c = coords[rows, node]                                        # [B, n] coordinate per point
                right = np.take_along_axis(xs, c[:, :, None], axis=2)[:, :, 0] > 0
                node = 2 * node + 1 + right
            return values[rows, node]
        if self.function_class in ("linear", "sparse_linear"):
            return np.einsum("bnd,bd->bn", xs, params["w"])
        h = np.maximum(np.einsum("bnd,bdh->bnh", xs, params["u"]), 0.0)
        return np.einsum("bnh,bh->bn", h, params["v"]) * math.sqrt(2.0 / self.hidden)

    def sample(self, batch_size: int, rng: np.random.Generator, n_dims_active: int | None = None,
               n_points: int = 41) -> dict[str, np.ndarray]:
        """{'xs': float32 [B, n, d], 'ys': float32 [B, n]} — fresh functions and inputs from `rng`."""
        xs = self.sample_xs(batch_size, rng, n_dims_active, n_points)
        params = self.sample_functions(batch_size, rng, n_dims_active)
        ys = self.evaluate(params, xs)
        if self.noise_std > 0:
            ys = ys + self.noise_std * rng.standard_normal(ys.shape)
        return {"xs": xs.astype(np.float32), "ys": ys.astype(np.float32)}


# ------------------------------------------------------------------------------------------------- curriculum
@dataclass
class Curriculum:
    """Garg et al.'s curriculum over the active dimensions and the number of prompt points."""

    dims_start: int = 5
    dims_end: int = 20
    dims_inc: int = 1
    dims_interval: int = 5000
    points_start: int = 26
    points_end: int = 101
    points_inc: int = 5
    points_interval: int = 5000

    def __post_init__(self) -> None:
        for key in ("dims_start", "dims_end", "points_start", "points_end", "dims_interval", "points_interval"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.dims_inc < 0 or self.points_inc < 0:
            raise ValueError("curriculum increments must be >= 0")
        if self.dims_end < self.dims_start or self.points_end < self.points_start:
            raise ValueError("curriculum end values must be >= their start values")

    def at(self, step: int) -> tuple[int, int]:
        """(active dimensions, points) used at training step `step` (0-based)."""
        dims = min(self.dims_end, self.dims_start + self.dims_inc * (step // self.dims_interval))
        points = min(self.points_end, self.points_start + self.points_inc * (step // self.points_interval))
        return int(dims), int(points)


# ----------------------------------------------------------------------------------------------- model format
def interleave(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(zs [B, 2n, d+1], prediction_positions [n]): x_i then y_i, each padded to d+1 (x in the first d slots,
    y in the last); the output at position 2i predicts y_i. Works for numpy arrays and torch tensors."""
    b, n, d = xs.shape
    if tuple(ys.shape) != (b, n):
        raise ValueError(f"ys has shape {tuple(ys.shape)}, expected {(b, n)}")
    if isinstance(xs, torch.Tensor):
        zs = xs.new_zeros((b, 2 * n, d + 1))
        zs[:, 0::2, :d] = xs
        zs[:, 1::2, d] = ys.to(xs.dtype)
        return zs, torch.arange(0, 2 * n, 2, device=xs.device)
    zs = np.zeros((b, 2 * n, d + 1), dtype=np.result_type(xs.dtype, ys.dtype))
    zs[:, 0::2, :d] = xs
    zs[:, 1::2, d] = ys
    return zs, np.arange(0, 2 * n, 2)


def prediction_positions(n_points: int) -> np.ndarray:
    """Positions of the interleaved sequence whose outputs predict y_1..y_n."""
    return np.arange(0, 2 * n_points, 2)


# ------------------------------------------------------------------------------------------------------ metric
def squared_error_curve(pred: np.ndarray, ys: np.ndarray, n_dims: int) -> np.ndarray:
    """[n]: mean over prompts of (pred − y)² / d at each position (position i has seen i in-context examples)."""
    pred = np.asarray(pred, dtype=np.float64)
    ys = np.asarray(ys, dtype=np.float64)
    if pred.shape != ys.shape:
        raise ValueError(f"pred has shape {pred.shape} but ys have shape {ys.shape}")
    return ((pred - ys) ** 2).mean(axis=0) / n_dims


# --------------------------------------------------------------------------------------------------- baselines
def zero_baseline(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    return np.zeros(ys.shape, dtype=np.float64)


def least_squares_baseline(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """pred [B, n]: at position i, the minimum-norm least-squares fit to pairs 0..i-1 evaluated at x_i (0 at i=0)."""
    xs = np.asarray(xs, dtype=np.float64)
    ys = np.asarray(ys, dtype=np.float64)
    b, n, d = xs.shape
    pred = np.zeros((b, n))
    for i in range(1, n):
        w = np.linalg.pinv(xs[:, :i]) @ ys[:, :i, None]                 # [B, d, 1]
        pred[:, i] = (xs[:, i, None, :] @ w)[:, 0, 0]
    return pred


def knn_baseline(xs: np.ndarray, ys: np.ndarray, k: int = 3) -> np.ndarray:
    """pred [B, n]: at position i, the mean y of the k nearest (Euclidean) among pairs 0..i-1 (0 at i=0)."""
    xs = np.asarray(xs, dtype=np.float64)
    ys = np.asarray(ys, dtype=np.float64)
    b, n, _ = xs.shape
    pred = np.zeros((b, n))
    d2 = ((xs[:, :, None, :] - xs[:, None, :, :]) ** 2).sum(-1)         # [B, n, n]
    for i in range(1, n):
        kk = min(k, i)
        nearest = np.argsort(d2[:, i, :i], axis=1, kind="stable")[:, :kk]
        pred[:, i] = np.take_along_axis(ys[:, :i], nearest, axis=1).mean(axis=1)
    return pred


def decision_tree_baseline(xs: np.ndarray, ys: np.ndarray, max_depth: int | None = 4) -> np.ndarray:
    """pred [B, n]: at position i, a CART regression tree (scikit-learn) fitted on pairs 0..i-1 (0 at i=0)."""
    from sklearn.tree import DecisionTreeRegressor  # heavy (about half a second): imported only for this baseline

    xs = np.asarray(xs, dtype=np.float64)
    ys = np.asarray(ys, dtype=np.float64)
    b, n, _ = xs.shape
    pred = np.zeros((b, n))
    for j in range(b):
        for i in range(1, n):
            tree = DecisionTreeRegressor(max_depth=max_depth, random_state=0).fit(xs[j, :i], ys[j, :i])
            pred[j, i] = tree.predict(xs[j, i:i + 1])[0]
    return pred


BASELINES = {
    "zero": zero_baseline,
    "least_squares": least_squares_baseline,
    "knn": knn_baseline,
    "decision_tree": decision_tree_baseline,
}


def baseline_curves(xs: np.ndarray, ys: np.ndarray, n_dims: int, names=None) -> dict[str, np.ndarray]:
    """{baseline name: squared_error_curve} for the chosen baselines (default: all)."""
    names = list(BASELINES) if names is None else list(names)
    unknown = [m for m in names if m not in BASELINES]
    if unknown:
        raise UserError(f"unknown baseline {unknown[0]!r} (expected one of: {', '.join(BASELINES)})")
    return {m: squared_error_curve(BASELINES[m](xs, ys), ys, n_dims) for m in names}
